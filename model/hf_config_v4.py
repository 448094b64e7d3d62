"""Strict parsing of a DeepSeek-V4 ``config.json`` (HF ``model_type`` ``deepseek_v4``).

Called by :func:`dayzero.model.hf_config.parse_hf_config`, with the same contract: every key is
used, deliberately ignored (with the reason next to it), or checked against the one value HF's
``deepseek_v4`` computes with; anything else is refused naming the key.

It follows HF ``DeepseekV4Config.__post_init__`` (transformers 5.24): keys a file leaves out (or
sets to null) take HF's defaults, which are V4-Flash's sizes, and the legacy spellings of the
published config.json fold in as HF folds them:

- layer kinds: ``layer_types``, else ``compress_ratios`` (0 / 4 / 128 per layer; the published
  list has one more entry per MTP layer, which is dropped), else HF's default (two HCA layers,
  then HCA / CSA alternating from HCA);
- compression rates: ``compress_rates`` {csa, hca}, with ``compress_rate_csa`` / ``_hca``;
- hash-routed layers: ``mlp_layer_types``, else the first ``num_hash_layers`` (default 3);
- RoPE: ``rope_parameters`` nested as {"main", "compress"}, or the flat published form:
  ``rope_theta`` for the main rope, ``compress_rope_theta`` plus the top-level ``rope_scaling``
  (YaRN, factor 16 over 65536 positions) for the compress rope, whose YaRN ``attention_factor``
  defaults to 1.0 (HF: the reference does not scale cos/sin by YaRN's mscale); the rotated part
  of each head is ``partial_rotary_factor`` or the legacy ``qk_rope_head_dim`` / ``head_dim``.

Where HF silently prefers one of two keys that disagree, this parser refuses the pair instead.
"""

from __future__ import annotations

from typing import Any

from dayzero.model.config import (
    AttentionKind, CompressedConfig, CompressKind, ConfigError, Family, HyperConfig, ModelConfig, MoEConfig,
    RopeConfig, RouterScore,
)
from dayzero.model.hf_config import (
    _DEEPSEEK_TRAINING_ONLY, _MOE_TRAINING_ONLY, _REQUIRED_VALUES, _Reader, _Traits, _parse_rope, _token_ids,
    fold_aliases, fp8_block_size,
)

_CSA, _HCA = CompressKind.CSA.value, CompressKind.HCA.value

# HF DeepseekV4Config's field defaults (the V4-Flash sizes), for keys a file leaves out or nulls.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
}
_DEFAULT_RATES = {_CSA: 4, _HCA: 128}  # HF default_compress_rates
_DEFAULT_HASH_LAYERS = 3  # HF default_num_hash_layers
_DEFAULT_ROTARY_FRACTION = 64 / 512  # HF default_partial_rotary_factor (whatever head_dim is)
# compress_ratios values as HF maps them (_COMPRESS_RATIO_TO_LAYER_TYPE); any other is a KeyError there.
_RATIO_KINDS = {0: CompressKind.SLIDING, 4: CompressKind.CSA, 128: CompressKind.HCA}
# HF attribute_map: the first name sets the second (HF applies it after the fields, so it wins).
_ALIASES = (("intermediate_size", "moe_intermediate_size"), ("num_local_experts", "n_routed_experts"))

# Keys HF's deepseek_v4 never reads, each with why ignoring it cannot change the logits.
_IGNORED_V4 = {
    "norm_topk_prob": "HF always renormalises the chosen experts' weights (DeepseekV4TopKRouter / HashRouter)",
    "topk_method": "HF always takes the top-k of score + e_score_correction_bias (DeepSeek's noaux_tc)",
    "topk_group": "groups are refused above one (n_group), so there is a single group to pick from",
    "first_k_dense_replace": "every V4 layer is a MoE block in HF; there are no dense layers",
    "qk_nope_head_dim": "a V4 head is [nope | rope] of head_dim; the nope part is head_dim minus the rotary dims",
    "kv_lora_rank": "a DeepSeek-V3 key: V4's single key=value head is projected straight to head_dim",
    "rope_interleave": "V4 always rotates adjacent pairs of each head's trailing dims (apply_rotary_pos_emb)",
    "expert_dtype": "how the published experts are stored (fp4): the converter reads them (dayzero.convert."
                    "mxfp4.RowFp4Reader); the model they make is the same",
}

# Keys whose only value HF's deepseek_v4 computes with (refused otherwise, naming the key).
_FIXED = {
    "num_key_value_heads": (1, "its attention has one key=value head; HF never reads the key"),
    "n_shared_experts": (1, "HF always adds exactly one shared expert of width moe_intermediate_size"),
    "scoring_func": ("sqrtsoftplus", "dayzero runs V4's sqrt(softplus) router scores only"),
    "attention_bias": (False, "HF's V4 attention has no biases"),
}

_ROPE_TRAITS = _Traits(partial_rotary=True)


def parse_v4_config(raw: dict[str, Any]) -> ModelConfig:
    """Build the :class:`ModelConfig` of a ``deepseek_v4`` config dict, refusing anything that
    HF's implementation would compute differently from what the file says (module docstring)."""
    raw = fold_aliases(raw, _ALIASES)
    filled = {k: v for k, v in _DEFAULTS.items() if raw.get(k) is None}
    r = _Reader({**raw, **filled})
    r.seen.update(filled)  # HF's defaults, not the file's keys
    r.seen.update({"model_type", *_IGNORED_V4, *_MOE_TRAINING_ONLY, *_DEEPSEEK_TRAINING_ONLY})
    for key, allowed in _REQUIRED_VALUES.items():
        if r.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{key}={raw[key]!r} is not supported for deepseek_v4; supported: {allowed}")
    _check_fixed(r)
    _check_quantization(r, raw)
    r.seen.add("auto_map")  # code pointers of a hub remote implementation, never run

    L, H, N = int(r.require("num_hidden_layers")), int(r.require("head_dim")), int(r.require("num_attention_heads"))
    max_pos = int(r.require("max_position_embeddings"))
    main, compress_rope = _ropes(r, raw, H, max_pos)
    compressed = _compressed(r, L, compress_rope)
    _check_sizes(r, compressed, N, H)
    window = int(r.require("sliding_window"))
    config = ModelConfig(
        family=Family.DEEPSEEK_V4,
        vocab_size=int(r.require("vocab_size")),
        hidden_size=int(r.require("hidden_size")),
        intermediate_size=int(r.require("moe_intermediate_size")),  # the shared expert's width
        num_layers=L, num_heads=N, num_kv_heads=1, head_dim=H,
        rms_norm_eps=float(r.require("rms_norm_eps")),
        max_position_embeddings=max_pos,
        rope=main,
        tie_word_embeddings=bool(r.get("tie_word_embeddings")),
        sliding_windows=(window,) * L,  # every kind of layer attends over the window
        attention_sinks=True,
        bos_token_id=r.get("bos_token_id"),
        eos_token_ids=_token_ids(r.get("eos_token_id")),
        moe=_moe(r, L),
        attention=AttentionKind.COMPRESSED,
        mtp_layers=int(r.get("num_nextn_predict_layers")),
        compressed=compressed,
        hyper=HyperConfig(int(r.require("hc_mult")), int(r.require("hc_sinkhorn_iters")), float(r.require("hc_eps"))),
    )
    leftover = r.leftover()
    if leftover:
        raise ConfigError(
            f"config.json has keys dayzero does not handle for model_type='deepseek_v4': {', '.join(leftover)}; "
            "support them in dayzero.model.hf_config_v4 before converting"
        )
    return config




def _check_fixed(r: _Reader) -> None:
    """Refuse the keys of :data:`_FIXED` off their value, and grouped routing (``n_group`` > 1)."""
    for key, (allowed, why) in _FIXED.items():
        if r.get(key) != allowed:
            raise ConfigError(f"{key}={r.raw[key]!r} is not supported for deepseek_v4 ({why}); set it to {allowed!r}")
    if r.get("n_group", 1) > 1:
        raise ConfigError(f"n_group={r.raw['n_group']!r} is not supported for deepseek_v4 (HF's V4 router has no "
                          "expert groups); set it to 1 or remove it")


def _check_quantization(r: _Reader, raw: dict[str, Any]) -> None:
    """The published checkpoints' ``quantization_config`` (FP8 e4m3, ue8m0 [128, 128] block
    scales, and in V4.1 ``expert_dtype`` fp4 inside it) is accepted as DeepSeek-V3's block FP8 is
    (:func:`fp8_block_size`): it says how files store weights, not what the model computes. The
    converter decides what it can read (``dayzero.convert.name_map_v4.refusal``)."""
    r.seen.add("quantization_config")
    q = raw.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict) or q.get("quant_method") == "mxfp4":
        raise ConfigError(f"quantization_config {q!r} is not supported for deepseek_v4; only block-wise FP8 "
                          "(quant_method 'fp8') is")
    fp8_block_size({"quantization_config": {k: v for k, v in q.items() if k != "expert_dtype"}})


def _ropes(r: _Reader, raw: dict[str, Any], head_dim: int, max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) RoPE as HF DeepseekV4Config builds ``rope_parameters`` (module docstring)."""
    params, legacy = raw.get("rope_parameters"), raw.get("rope_scaling")
    r.seen.update({"rope_parameters", "rope_scaling", "rope_theta", "compress_rope_theta", "partial_rotary_factor",
                   "qk_rope_head_dim"})
    if params and legacy and params != legacy:
        raise ConfigError("config.json has both rope_parameters and rope_scaling (HF would read rope_scaling only); "
                          "keep one of them")
    rp = dict(legacy or params or {})
    if isinstance(rp.get("main"), dict) or isinstance(rp.get("compress"), dict):
        dicts = _nested_ropes(rp, raw)
    else:
        dicts = _flat_ropes(rp, r, raw, head_dim)
    qk_rope = raw.get("qk_rope_head_dim")
    out = []
    for label, d in zip(("main", "compress"), dicts):
        rope = _one_rope(d, label, head_dim, max_pos)
        if qk_rope is not None and rope.rotary_dim(head_dim) != qk_rope:
            raise ConfigError(f"qk_rope_head_dim={qk_rope} disagrees with the {label} rope's partial_rotary_factor="
                              f"{rope.partial_rotary_factor} (head_dim {head_dim}); keep one of them")
        out.append(rope)
    return out[0], out[1]


def _flat_ropes(rp: dict[str, Any], r: _Reader, raw: dict[str, Any], head_dim: int) -> tuple[dict, dict]:
    """The published form: a default main rope at ``rope_theta``; the compress rope is the flat
    ``rope_scaling`` / ``rope_parameters`` at ``compress_rope_theta``, YaRN's attention factor 1.0
    unless given (HF ``__post_init__``)."""
    theta, compress_theta = float(r.get("rope_theta")), float(r.get("compress_rope_theta"))
    partial, qk_rope = raw.get("partial_rotary_factor"), raw.get("qk_rope_head_dim")
    if partial is None:  # HF: the legacy qk_rope_head_dim / head_dim, else 64 / 512
        partial = qk_rope / head_dim if qk_rope is not None else _DEFAULT_ROTARY_FRACTION
    # HF overwrites these two in the compress rope and never reads them for the main one.
    for key, used in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if rp.get(key) is not None and rp[key] != used:
            raise ConfigError(f"the rope parameters' {key}={rp[key]!r} disagrees with the {used!r} HF's deepseek_v4 "
                              f"uses (the top-level {key} and its default); keep one of them")
    main = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    compress = {**rp, "rope_theta": compress_theta, "partial_rotary_factor": partial}
    kind = compress.pop("rope_type", None) or compress.pop("type", None) or "default"
    compress.pop("type", None)
    compress["rope_type"] = kind
    if kind == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _nested_ropes(rp: dict[str, Any], raw: dict[str, Any]) -> tuple[dict, dict]:
    """``rope_parameters`` = {"main": ..., "compress": ...}, taken as they are (HF); a missing
    ``rope_theta`` / ``partial_rotary_factor`` in one comes from the top-level key as HF fills it.
    A top-level key HF would then ignore must agree with what it is ignored for."""
    if not (isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)):
        raise ConfigError("rope_parameters must give both 'main' and 'compress' (or neither, in the flat form)")
    extra = sorted(set(rp) - {"main", "compress", "rope_type", "type"})
    if extra:
        raise ConfigError(f"rope_parameters has {', '.join(extra)} beside 'main' and 'compress' (HF drops them); "
                          "move them into 'main' or 'compress'")
    top_theta = raw.get("rope_theta", _DEFAULTS["rope_theta"])
    top_partial = raw.get("partial_rotary_factor")
    out = []
    for label, theta_key in (("main", "rope_theta"), ("compress", "compress_rope_theta")):
        d = dict(rp[label])
        d.setdefault("rope_theta", top_theta)  # HF fills both from rope_theta, never compress_rope_theta
        if raw.get(theta_key) is not None and raw[theta_key] != d["rope_theta"]:
            raise ConfigError(f"{theta_key}={raw[theta_key]!r} disagrees with rope_parameters['{label}'] theta "
                              f"{d['rope_theta']!r}, which HF's deepseek_v4 uses; keep one of them")
        if d.get("partial_rotary_factor") is None:
            if top_partial is None:
                raise ConfigError(f"rope_parameters['{label}'] has no partial_rotary_factor and config.json none "
                                  "either: HF would rotate whole heads; give partial_rotary_factor")
            d["partial_rotary_factor"] = top_partial
        elif top_partial is not None and top_partial != d["partial_rotary_factor"]:
            raise ConfigError(f"partial_rotary_factor={top_partial!r} disagrees with rope_parameters['{label}'] "
                              f"({d['partial_rotary_factor']!r}), which HF's deepseek_v4 uses; keep one of them")
        out.append(d)
    return out[0], out[1]


def _one_rope(d: dict[str, Any], label: str, head_dim: int, max_pos: int) -> RopeConfig:
    """One of the two ropes, parsed as any family's rope parameters are (``_parse_rope``)."""
    d = dict(d)
    # HF's YaRN reads truncate from the top of config.rope_parameters, which for V4 holds only
    # "main" and "compress": it always truncates, whatever a nested dict says.
    if d.pop("truncate", True) is not True:
        raise ConfigError(f"rope_parameters['{label}'] truncate=false is not applied by HF's deepseek_v4 "
                          "(it always truncates); remove it")
    try:
        return _parse_rope(_Reader({"model_type": "deepseek_v4", "rope_parameters": d}), head_dim, max_pos,
                           _ROPE_TRAITS)
    except ConfigError as e:
        raise ConfigError(f"the {label} rope: {e}") from None


def _compressed(r: _Reader, num_layers: int, compress_rope: RopeConfig) -> CompressedConfig:
    """The attention settings: per-layer kinds, rates, q LoRA, grouped output, the indexer."""
    csa, hca = _compress_rates(r)
    return CompressedConfig(
        kinds=_layer_kinds(r, num_layers, {CompressKind.CSA: csa, CompressKind.HCA: hca}),
        window=int(r.require("sliding_window")),
        compress_rope=compress_rope,
        q_lora_rank=int(r.require("q_lora_rank")),
        o_groups=int(r.require("o_groups")),
        o_lora_rank=int(r.require("o_lora_rank")),
        index_topk=int(r.require("index_topk")),
        index_heads=int(r.require("index_n_heads")),
        index_head_dim=int(r.require("index_head_dim")),
        csa_ratio=csa,
        hca_ratio=hca,
    )


def _compress_rates(r: _Reader) -> tuple[int, int]:
    """(CSA, HCA) tokens per compressed entry: ``compress_rates``, the legacy scalar keys folded in."""
    given = r.get("compress_rates")
    rates = dict(_DEFAULT_RATES if given is None else given)
    if set(rates) != set(_DEFAULT_RATES):
        raise ConfigError(f"compress_rates={given!r} must give exactly {_CSA!r} and {_HCA!r}")
    for key, kind in (("compress_rate_csa", _CSA), ("compress_rate_hca", _HCA)):
        legacy = r.get(key)
        if legacy is None:
            continue
        if given is not None and given[kind] != legacy:
            raise ConfigError(f"{key}={legacy!r} disagrees with compress_rates[{kind!r}]={given[kind]!r}; keep one")
        rates[kind] = legacy
    for kind, rate in rates.items():
        if not isinstance(rate, int) or rate < 1:
            raise ConfigError(f"compress_rates[{kind!r}]={rate!r} must be a positive integer")
    return rates[_CSA], rates[_HCA]


def _layer_kinds(r: _Reader, num_layers: int, rates: dict[CompressKind, int]) -> tuple[CompressKind, ...]:
    """``layer_types``, else the legacy ``compress_ratios``, else HF's default (module docstring)."""
    types, ratios = r.get("layer_types"), r.get("compress_ratios")
    from_ratios = None if ratios is None else _kinds_from_ratios(ratios, num_layers, rates)
    if types is None:
        if from_ratios is not None:
            return from_ratios
        rest = [CompressKind.CSA if i % 2 else CompressKind.HCA for i in range(max(num_layers - 2, 0))]
        return tuple([CompressKind.HCA] * min(num_layers, 2) + rest)
    allowed = ", ".join(k.value for k in CompressKind)
    if not isinstance(types, list) or any(t not in {k.value for k in CompressKind} for t in types):
        raise ConfigError(f"layer_types={types!r} has a kind DeepSeek-V4 does not have; each must be one of {allowed}")
    if len(types) != num_layers:
        raise ConfigError(f"layer_types gives {len(types)} kinds for num_hidden_layers={num_layers}; "
                          "give one per layer")
    kinds = tuple(CompressKind(t) for t in types)
    if from_ratios is not None and from_ratios != kinds:
        raise ConfigError("layer_types and compress_ratios disagree (HF would read layer_types only); keep one of them")
    return kinds


def _kinds_from_ratios(ratios: Any, num_layers: int, rates: dict[CompressKind, int]) -> tuple[CompressKind, ...]:
    """HF's legacy mapping 0 -> sliding, 4 -> CSA, 128 -> HCA; entries past the layers are the MTP
    layers' and are dropped. A nonzero entry also names its rate: it must be the kind's rate."""
    if not isinstance(ratios, list) or any(x not in _RATIO_KINDS for x in ratios) or len(ratios) < num_layers:
        raise ConfigError(f"compress_ratios={ratios!r} must give 0, 4 or 128 for each of the {num_layers} layers "
                          "(entries past them, the MTP layers', are dropped)")
    kinds = tuple(_RATIO_KINDS[x] for x in ratios[:num_layers])
    for x, kind in zip(ratios, kinds):
        if x and x != rates[kind]:
            raise ConfigError(f"compress_ratios has {x} for {kind.value} layers, whose rate is {rates[kind]} "
                              "(compress_rates); make them agree")
    return kinds


def _hash_layers(r: _Reader, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether it routes by the token-id table: ``mlp_layer_types``, else the first
    ``num_hash_layers`` (default 3) layers."""
    kinds, count = r.get("mlp_layer_types"), r.get("num_hash_layers")
    if count is not None and (not isinstance(count, int) or count < 0):
        raise ConfigError(f"num_hash_layers={count!r} must be a non-negative integer")
    n = _DEFAULT_HASH_LAYERS if count is None else count
    derived = ["hash_moe"] * min(num_layers, n) + ["moe"] * max(0, num_layers - n)
    if kinds is None:
        kinds = derived
    elif not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"hash_moe", "moe"}:
        raise ConfigError(f"mlp_layer_types={kinds!r} must give 'hash_moe' or 'moe' for each of {num_layers} layers")
    elif count is not None and kinds != derived:
        raise ConfigError(f"mlp_layer_types and num_hash_layers={count} disagree (HF would read mlp_layer_types "
                          "only); keep one of them")
    return tuple(k == "hash_moe" for k in kinds)


def _moe(r: _Reader, num_layers: int) -> MoEConfig:
    """Every layer sparse (HF DeepseekV4SparseMoeBlock): sqrt(softplus) scores, top-k of score +
    bias (or the hash table), renormalised, scaled, one shared expert; experts and the shared
    one both clamp at ``swiglu_limit``."""
    return MoEConfig(
        int(r.require("n_routed_experts")), int(r.require("num_experts_per_tok")),
        int(r.require("moe_intermediate_size")), (True,) * num_layers,
        score=RouterScore.SQRTSOFTPLUS, renormalize=True, score_bias=True,
        routed_scaling=float(r.require("routed_scaling_factor")), shared_experts=1,
        swiglu_limit=float(r.require("swiglu_limit")), hash_layers=_hash_layers(r, num_layers),
    )


def _check_sizes(r: _Reader, c: CompressedConfig, num_heads: int, head_dim: int) -> None:
    """Sizes HF's modules need to fit together (it would fail on a reshape instead)."""
    if (num_heads * head_dim) % c.o_groups:
        raise ConfigError(f"o_groups={c.o_groups} must divide num_attention_heads x head_dim = "
                          f"{num_heads * head_dim} (each group projects an equal share of the heads)")
    rotary = c.compress_rope.rotary_dim(head_dim)
    if c.index_head_dim < rotary:
        raise ConfigError(f"index_head_dim={c.index_head_dim} must hold the {rotary} rotated dims of the compress rope")
    if not 0 < c.compress_rope.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2:
        raise ConfigError(f"the compress rope rotates {rotary} of head_dim={head_dim} dims; it must rotate an even "
                          "number >= 2 of them (partial_rotary_factor in (0, 1])")
