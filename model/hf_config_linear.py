"""Strict parsing of the linear-attention hybrids' ``config.json`` into a :class:`ModelConfig`.

HF model_types (transformers 5.24): ``qwen3_next`` (Qwen3NextConfig); the Qwen3.5 text models
``qwen3_5_text`` / ``qwen3_5_moe_text`` (Qwen3_5TextConfig / Qwen3_5MoeTextConfig, what
``Qwen3_5*ForCausalLM.save_pretrained`` writes) and the published multimodal files ``qwen3_5`` /
``qwen3_5_moe`` that nest one under ``text_config``; ``kimi_linear`` (KimiLinearConfig).

Called by :func:`dayzero.model.hf_config.parse_hf_config`, with its contract: every key is used,
deliberately ignored (the reason is next to it), or checked against the one value HF's modeling
code computes with; anything else is refused naming the key. Keys a file leaves out (or nulls)
take HF's field defaults. Where HF silently prefers one of two spellings that disagree (Kimi's
attribute_map aliases, ``layer_types`` beside ``full_attention_interval`` or
``linear_attn_config``), this parser refuses the pair instead.

What the families compute, as HF's modeling code does it:

- Qwen3-Next / Qwen3.5: Gated DeltaNet layers where ``layer_types`` says ``linear_attention``
  (else every ``full_attention_interval``-th layer, default 4, is full attention); full
  attention with an output gate from q_proj, per-head q/k RMSNorm and partial RoPE (default
  0.25 of head_dim); zero-centred RMSNorm weights (scale 1 + w, ``norm_weight_offset``).
  Qwen3-Next's MoE layers follow ``decoder_sparse_step`` / ``mlp_only_layers`` (softmax top-k,
  renormalised iff ``norm_topk_prob``); Qwen3.5-MoE's are every layer, always renormalised;
  both add a shared SwiGLU of ``shared_expert_intermediate_size`` scaled by sigmoid(x . w).
- Kimi-Linear: Kimi Delta Attention layers and latent attention (MLA) without RoPE, DeepSeek-V3
  routing (sigmoid scores, selection bias, groups, routed scaling, shared experts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dayzero.model.config import (
    AttentionKind, ConfigError, Family, LinearAttnConfig, LinearKind, ModelConfig, MoEConfig, RopeConfig,
    RouterScore,
)
from dayzero.model.hf_config import (
    _MOE_TRAINING_ONLY, _REQUIRED_VALUES, _Reader, _Traits, _parse_mla, _parse_rope, _qwen_moe_layers, _token_ids,
    fold_aliases, fp8_block_size,
)
from dayzero.model.hf_config_vision import QWEN3_5_MROPE, parse_composite, split_mrope

# Text model_type -> family; the multimodal wrappers' model_type -> their text model_type.
_QWEN_TEXT = {"qwen3_next": Family.QWEN3_NEXT, "qwen3_5_text": Family.QWEN3_5, "qwen3_5_moe_text": Family.QWEN3_5_MOE}
_MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LINEAR_MODEL_TYPES = frozenset({*_QWEN_TEXT, *_MULTIMODAL, "kimi_linear"})

_LINEAR, _FULL = "linear_attention", "full_attention"

# ---- Qwen3-Next / Qwen3.5 --------------------------------------------------------------------

# HF's field defaults (Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig).
_GDN_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                 "linear_num_key_heads": 16, "linear_num_value_heads": 32, "head_dim": 256, "rms_norm_eps": 1e-6,
                 "max_position_embeddings": 32768}
_QWEN_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.QWEN3_NEXT: {**_GDN_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                        "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                        "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True},
    Family.QWEN3_5: {**_GDN_DEFAULTS, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                     "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4},
    Family.QWEN3_5_MOE: {**_GDN_DEFAULTS, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                         "num_attention_heads": 16, "num_key_value_heads": 2, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256},
}

# Keys HF's modeling code does not read, accepted only at the value describing what it computes.
_QWEN_FIXED: dict[str, tuple[Any, str]] = {
    # q/k/v/o would get biases, and q_proj's bias would hold the output gate's too (no such leaf).
    "attention_bias": (False, "dayzero's gated attention has no q/k/v/o biases"),
    "attn_output_gate": (True, "HF's attention always gates its output with the second half of q_proj"),
    # Published Qwen3.5 files: the linear layers' output norm multiplies by silu(z) (swish).
    "output_gate_type": ("swish", "HF's gated output norm multiplies by silu(z)"),
    "mamba_ssm_dtype": ("float32", "dayzero keeps the linear layers' recurrent state in float32"),
    "use_sliding_window": (False, "HF's attention layers attend over all tokens"),
}
# Qwen3.5-MoE: HF builds a sparse block in every layer and always renormalises the top-k weights.
_QWEN35_MOE_FIXED: dict[str, Any] = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}

_QWEN_IGNORED = {
    "mtp_use_dedicated_embeddings": "concerns the multi-token-prediction module (mtp.*), which decoding never runs",
    # Read only with sliding-window attention, which _QWEN_FIXED refuses.
    "max_window_layers": "HF's hybrids never slide a window",
}

# partial_rotary_factor defaults to 0.25 of head_dim (HF: kwargs.setdefault in __post_init__).
_QWEN_ROPE = _Traits(partial_rotary=True, rotary_fraction=0.25)

# M-RoPE (Qwen3.5, text and multimodal files alike): rope_parameters' mrope_section says how the
# rotary frequencies are shared between the temporal, height and width position axes, kept in
# RopeConfig (hf_config_vision.split_mrope). A text token has the same position on all three
# axes (HF expands position_ids to 3 x the same), where this is plain RoPE. Qwen3-Next has none:
# such keys are refused there as unknown RoPE parameters.


def parse_linear_config(raw: dict[str, Any]) -> ModelConfig:
    """Build the :class:`ModelConfig` of a qwen3_next, qwen3_5(_moe)(_text) or kimi_linear config
    dict, refusing anything HF's implementation would compute differently (module docstring)."""
    model_type = raw.get("model_type")
    if model_type in _MULTIMODAL:
        return _parse_multimodal(raw)
    if model_type == "kimi_linear":
        return _parse_kimi(raw)
    if model_type in _QWEN_TEXT:
        return _parse_qwen_text(raw, _QWEN_TEXT[model_type], standalone=True)
    raise ConfigError(f"model_type={model_type!r} is not a linear-attention hybrid; "
                      f"those are {', '.join(sorted(LINEAR_MODEL_TYPES))}")


def _check_common(r: _Reader, model_type: str, standalone: bool) -> None:
    """The keys every family shares: single-value ones and (at a file's top level) the FP8 scheme."""
    for key, allowed in _REQUIRED_VALUES.items():
        if r.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{key}={r.raw[key]!r} is not supported for {model_type}; supported: {allowed}")
    if standalone:
        _check_quantization(r)


def _check_quantization(r: _Reader) -> None:
    """Block-FP8 (DeepSeek's scheme, e.g. Qwen3-Next-80B-A3B-Instruct-FP8) is validated here and
    read by the converter; any other scheme is refused by :func:`fp8_block_size`."""
    r.seen.add("quantization_config")
    q = r.raw.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
        raise ConfigError(f"quantization_config quant_method 'mxfp4' is read for gpt_oss checkpoints only, not "
                          f"{r.raw.get('model_type')}; convert a float or FP8 checkpoint of this model")
    fp8_block_size(r.raw)


def _check_fixed(r: _Reader, fixed: dict[str, tuple[Any, str]], model_type: str) -> None:
    for key, (allowed, why) in fixed.items():
        if r.get(key, allowed) != allowed:
            raise ConfigError(f"{key}={r.raw[key]!r} is not supported for {model_type} ({why}); set it to {allowed!r} "
                              "or remove it")


def _qwen_layer_flags(r: _Reader, num_layers: int) -> tuple[bool, ...]:
    """Per layer, True where it is a Gated DeltaNet layer: ``layer_types``, else layer i is full
    attention iff (i + 1) % ``full_attention_interval`` == 0 (HF's default interval 4)."""
    types, interval = r.get("layer_types"), r.get("full_attention_interval")
    if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 1):
        raise ConfigError(f"full_attention_interval={interval!r} must be a positive integer")
    derived = [bool((i + 1) % (interval or 4)) for i in range(num_layers)]
    if types is None:
        flags = derived
    else:
        if not isinstance(types, list) or len(types) != num_layers or set(types) - {_LINEAR, _FULL}:
            raise ConfigError(f"layer_types={types!r} must give '{_LINEAR}' or '{_FULL}' for each of the "
                              f"{num_layers} layers (num_hidden_layers)")
        flags = [t == _LINEAR for t in types]
        if interval is not None and flags != derived:
            raise ConfigError(f"layer_types and full_attention_interval={interval} disagree (HF would read "
                              "layer_types only); keep one of them")
    if all(flags):
        raise ConfigError(f"{r.raw.get('model_type')} config has no '{_FULL}' layer among its {num_layers}; "
                          "dayzero runs hybrids with at least one full-attention layer")
    return tuple(flags)


def _gated_delta(r: _Reader, flags: tuple[bool, ...]) -> LinearAttnConfig:
    return LinearAttnConfig(
        kind=LinearKind.GATED_DELTA, layers=flags,
        num_k_heads=int(r.require("linear_num_key_heads")), num_v_heads=int(r.require("linear_num_value_heads")),
        k_head_dim=int(r.require("linear_key_head_dim")), v_head_dim=int(r.require("linear_value_head_dim")),
        conv_kernel=int(r.require("linear_conv_kernel_dim")),
    )


def _qwen_moe(r: _Reader, family: Family, num_layers: int) -> MoEConfig | None:
    """The experts: Qwen3-Next's layers per decoder_sparse_step / mlp_only_layers (none when
    num_experts is 0, as HF), Qwen3.5-MoE's every layer; a gated shared expert in each."""
    if family is Family.QWEN3_5:
        return None
    r.seen.update(_MOE_TRAINING_ONLY)
    num_experts = int(r.require("num_experts"))
    if family is Family.QWEN3_NEXT:
        layers = _qwen_moe_layers(r, num_layers)
        renormalize = bool(r.require("norm_topk_prob"))
    else:
        for key, allowed in _QWEN35_MOE_FIXED.items():
            if r.get(key, allowed) != allowed:
                raise ConfigError(f"{key}={r.raw[key]!r} is not supported for qwen3_5_moe, whose HF implementation "
                                  f"computes {key}={allowed!r} (every layer sparse, top-k renormalised)")
        layers, renormalize = (True,) * num_layers, True
    top_k, width = int(r.require("num_experts_per_tok")), int(r.require("moe_intermediate_size"))
    return gated_shared_moe(num_experts, top_k, width, layers, renormalize,
                            int(r.require("shared_expert_intermediate_size")))


def gated_shared_moe(num_experts: int, top_k: int, width: int, layers: tuple[bool, ...], renormalize: bool,
                     shared: int) -> MoEConfig | None:
    """Qwen's MoE (Qwen3-Next, Qwen3.5, Qwen2-MoE): softmax top-k experts beside one shared expert
    of width ``shared`` behind a sigmoid gate; None when no layer is sparse (HF with 0 experts)."""
    if num_experts == 0 or not any(layers):
        return None
    if shared < 1:
        raise ConfigError(f"shared_expert_intermediate_size={shared} is not supported: HF builds a shared expert of "
                          "that width in every sparse layer; give a positive width")
    return MoEConfig(num_experts, top_k, width, layers, renormalize=renormalize, shared_experts=1,
                     shared_intermediate_size=shared, shared_gate=True)


def _parse_qwen_text(raw: dict[str, Any], family: Family, standalone: bool) -> ModelConfig:
    """A Qwen3-Next or Qwen3.5 text config (``standalone``: the file's top level, which also holds
    the quantization_config)."""
    model_type = raw["model_type"]
    filled = {k: v for k, v in _QWEN_DEFAULTS[family].items() if raw.get(k) is None}
    stripped, mrope = (raw, {}) if family is Family.QWEN3_NEXT else split_mrope(raw, QWEN3_5_MROPE)
    r = _Reader({**stripped, **filled})
    r.seen.update({"model_type", *filled, *_QWEN_IGNORED})
    _check_common(r, model_type, standalone)
    _check_fixed(r, _QWEN_FIXED, model_type)
    if r.get("sliding_window") is not None:
        raise ConfigError(f"sliding_window={r.raw['sliding_window']!r} is not supported for {model_type} "
                          "(HF's attention layers attend over all tokens); set it to null")
    num_layers, head_dim = int(r.require("num_hidden_layers")), int(r.require("head_dim"))
    max_pos = int(r.require("max_position_embeddings"))
    moe = _qwen_moe(r, family, num_layers)
    # Qwen3.5-MoE has no dense MLP (every layer is sparse): its experts' width stands in.
    dense_key = "moe_intermediate_size" if family is Family.QWEN3_5_MOE else "intermediate_size"
    config = ModelConfig(
        family=family,
        vocab_size=int(r.require("vocab_size")),
        hidden_size=int(r.require("hidden_size")),
        intermediate_size=int(r.require(dense_key)),
        num_layers=num_layers,
        num_heads=int(r.require("num_attention_heads")),
        num_kv_heads=int(r.require("num_key_value_heads")),
        head_dim=head_dim,
        rms_norm_eps=float(r.require("rms_norm_eps")),
        max_position_embeddings=max_pos,
        rope=dataclasses.replace(_parse_rope(r, head_dim, max_pos, _QWEN_ROPE), **mrope),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        qk_norm=True,
        bos_token_id=r.get("bos_token_id"),
        eos_token_ids=_token_ids(r.get("eos_token_id")),
        moe=moe,
        attention=AttentionKind.GQA,
        # The multi-token-prediction module (mtp.*): counted, skipped by the converter as by HF.
        mtp_layers=int(r.get("mtp_num_hidden_layers", 0)),
        linear=_gated_delta(r, _qwen_layer_flags(r, num_layers)),
        norm_weight_offset=1.0,
        attn_output_gate=True,
    )
    _refuse_leftover(r, model_type)
    return config


def _refuse_leftover(r: _Reader, model_type: str) -> None:
    leftover = r.leftover()
    if leftover:
        raise ConfigError(f"config.json has keys dayzero does not handle for model_type={model_type!r}: "
                          f"{', '.join(leftover)}; support them in dayzero.model.hf_config_linear before converting")


# ---- the multimodal Qwen3.5 files --------------------------------------------------------------


def _parse_multimodal(raw: dict[str, Any]) -> ModelConfig:
    """A ``qwen3_5`` / ``qwen3_5_moe`` file (``dayzero.model.hf_config_vision.parse_composite``):
    its ``text_config`` parsed as the text model, its ``vision_config`` as the vision tower."""
    text_type = _MULTIMODAL[raw["model_type"]]
    return parse_composite(raw, text_type, lambda text: _parse_qwen_text(text, _QWEN_TEXT[text_type],
                                                                         standalone=False))


# ---- Kimi-Linear --------------------------------------------------------------------------------

# HF KimiLinearConfig.attribute_map, (standard name, the attribute it sets): the second is what
# HF's to_dict() and the published config.json write. A file may use either.
_KIMI_ALIASES = (("max_position_embeddings", "model_max_length"), ("norm_topk_prob", "moe_renormalize"),
                 ("n_group", "num_expert_group"), ("num_local_experts", "num_experts"),
                 ("num_experts_per_tok", "num_experts_per_token"), ("n_shared_experts", "num_shared_experts"))

# HF KimiLinearConfig's field defaults (first_k_dense_replace: its __post_init__'s kwargs default).
_KIMI_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "num_expert_group": 1,
    "topk_group": 1, "num_experts_per_token": 8, "moe_renormalize": True, "model_max_length": 1048576,
    "rms_norm_eps": 1e-5, "num_experts": 256, "linear_head_dim": 128, "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1,
}

_KIMI_FIXED: dict[str, tuple[Any, str]] = {
    "mla_use_nope": (True, "HF's latent attention applies no RoPE"),
    "moe_router_activation_func": ("sigmoid", "HF's router always scores with a sigmoid"),
    "use_grouped_topk": (True, "HF's router always picks within the best topk_group expert groups"),
    # DeepSeek's code and HF disagree on it; only 1, where both build the same layers, is accepted.
    "moe_layer_freq": (1, "HF ignores it and makes every layer from first_k_dense_replace on sparse"),
    "num_nextn_predict_layers": (0, "HF's kimi_linear has no multi-token-prediction layers"),
}

_KIMI_IGNORED = {
    # The published file has 72, a leftover: HF keeps whatever the file says as an attribute, but its
    # modeling code never reads config.head_dim (the latent attention's sizes are qk_*_head_dim).
    "head_dim": "never read by HF's kimi_linear modeling code",
    "rope_theta": "Kimi-Linear's latent attention applies no RoPE (mla_use_nope)",
}

# linear_attn_config's keys (HF reads exactly these) and the top-level fields they override.
_KIMI_LINEAR_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                     "short_conv_kernel_size": "linear_conv_kernel_dim", "kda_layers": None, "full_attn_layers": None}




def _kimi_linear_sizes(r: _Reader, lac: dict[str, Any], given: dict[str, Any]) -> tuple[int, int, int]:
    """(heads, head dim, conv taps): linear_attn_config's values override the top-level fields
    (``given``: the file's own keys, without HF's defaults)."""
    unknown = sorted(set(lac) - set(_KIMI_LINEAR_KEYS))
    if unknown:
        raise ConfigError(f"linear_attn_config has {', '.join(unknown)}, which HF's kimi_linear does not read; "
                          "support them in dayzero.model.hf_config_linear before converting")
    sizes = []
    for key, field in _KIMI_LINEAR_KEYS.items():
        if field is None:
            continue
        top, inner = r.raw.get(field), lac.get(key)
        r.seen.add(field)
        if inner is not None and given.get(field) is not None and top != inner:
            raise ConfigError(f"{field}={top!r} disagrees with linear_attn_config's {key}={inner!r}, which HF uses; "
                              "keep one of them")
        sizes.append(int(inner if inner is not None else top))
    return sizes[0], sizes[1], sizes[2]


def _one_based_layers(lac: dict[str, Any], num_layers: int) -> list[bool] | None:
    """Per layer, True for KDA, from linear_attn_config's 1-based ``kda_layers`` /
    ``full_attn_layers`` (None when neither is given; HF needs both and ignores one alone)."""
    kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
    if kda is None and full is None:
        return None
    if kda is None or full is None:
        raise ConfigError("linear_attn_config gives only one of kda_layers and full_attn_layers; HF ignores one "
                          "alone (it would fall back to its default pattern): give both")
    for name, layers in (("kda_layers", kda), ("full_attn_layers", full)):
        if not isinstance(layers, list) or any(not isinstance(i, int) or not 1 <= i <= num_layers for i in layers):
            raise ConfigError(f"linear_attn_config {name}={layers!r} must list layer numbers 1..{num_layers} "
                              "(1-based, as HF reads them)")
    if set(kda) & set(full) or len(set(kda) | set(full)) != num_layers:
        raise ConfigError(f"linear_attn_config's kda_layers and full_attn_layers must split layers 1..{num_layers} "
                          "between them, each layer in exactly one")
    return [i + 1 in set(kda) for i in range(num_layers)]


def _kimi_layer_flags(r: _Reader, lac: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Per layer, True for KDA: ``layer_types``, else linear_attn_config's lists, else HF's default
    (full attention at layers 4, 8, ... counting from 0)."""
    types, from_lists = r.get("layer_types"), _one_based_layers(lac, num_layers)
    if types is None:
        flags = from_lists or [not (i and i % 4 == 0) for i in range(num_layers)]
    else:
        if not isinstance(types, list) or len(types) != num_layers or set(types) - {_LINEAR, _FULL}:
            raise ConfigError(f"layer_types={types!r} must give '{_LINEAR}' or '{_FULL}' for each of the "
                              f"{num_layers} layers")
        flags = [t == _LINEAR for t in types]
        if from_lists is not None and from_lists != flags:
            raise ConfigError("layer_types and linear_attn_config's kda_layers / full_attn_layers disagree (HF would "
                              "read layer_types only); keep one of them")
    if all(flags):
        raise ConfigError(f"kimi_linear config has no full-attention layer among its {num_layers}; dayzero runs "
                          "hybrids with at least one")
    return tuple(flags)


def _kimi_moe_layers(r: _Reader, num_layers: int, given: dict[str, Any]) -> tuple[bool, ...]:
    """``mlp_layer_types`` ("dense"/"sparse"), else the first ``first_k_dense_replace`` layers dense."""
    kinds, first = r.get("mlp_layer_types"), r.get("first_k_dense_replace")
    if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first <= num_layers:
        raise ConfigError(f"first_k_dense_replace={first!r} must be between 0 and num_hidden_layers={num_layers}")
    derived = ["dense" if i < first else "sparse" for i in range(num_layers)]
    if kinds is None:
        return tuple(k == "sparse" for k in derived)
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types={kinds!r} must give 'dense' or 'sparse' for each of {num_layers} layers")
    if given.get("first_k_dense_replace") is not None and kinds != derived:
        raise ConfigError(f"mlp_layer_types and first_k_dense_replace={first} disagree (HF would read mlp_layer_types "
                          "only); keep one of them")
    return tuple(k == "sparse" for k in kinds)


def _kimi_rope(r: _Reader) -> RopeConfig:
    """No RoPE is applied (mla_use_nope); a RoPE scaling would be silently dropped by HF, so only an
    unscaled one is accepted. The theta is kept for the record."""
    for key in ("rope_scaling", "rope_parameters"):
        value = r.get(key)
        kind = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
        if kind not in (None, "default"):
            raise ConfigError(f"{key}={value!r} is not supported for kimi_linear: its latent attention applies no "
                              "RoPE, so HF would ignore the scaling; remove it")
    params = r.raw.get("rope_parameters") or {}
    return RopeConfig(theta=float(params.get("rope_theta") or r.get("rope_theta") or 10000.0))


def _kimi_moe(r: _Reader, num_layers: int, given: dict[str, Any]) -> MoEConfig:
    """DeepSeek-V3 routing as HF KimiLinearTopkRouter computes it; shared experts of
    num_shared_experts x moe_intermediate_size (HF always builds them)."""
    r.seen.update(_MOE_TRAINING_ONLY)
    shared = int(r.require("num_shared_experts"))
    if shared < 1:
        raise ConfigError(f"num_shared_experts={shared} is not supported: HF builds a shared MLP of that many experts' "
                          "width in every sparse layer; give at least 1")
    return MoEConfig(
        int(r.require("num_experts")), int(r.require("num_experts_per_token")),
        int(r.require("moe_intermediate_size")), _kimi_moe_layers(r, num_layers, given),
        score=RouterScore.SIGMOID, renormalize=bool(r.require("moe_renormalize")), score_bias=True,
        num_groups=int(r.require("num_expert_group")), groups_per_token=int(r.require("topk_group")),
        routed_scaling=float(r.require("routed_scaling_factor")), shared_experts=shared,
    )


def _parse_kimi(raw: dict[str, Any]) -> ModelConfig:
    """A ``kimi_linear`` config: KDA layers, latent attention without RoPE, DeepSeek-V3 MoE."""
    raw = fold_aliases(raw, _KIMI_ALIASES)
    filled = {k: v for k, v in _KIMI_DEFAULTS.items() if raw.get(k) is None}
    # head_dim is left out of the reader so that _parse_mla's check of it cannot fire (_KIMI_IGNORED).
    r = _Reader({**{k: v for k, v in raw.items() if k != "head_dim"}, **filled})
    r.seen.update({"model_type", *filled, *_KIMI_IGNORED})
    _check_common(r, "kimi_linear", standalone=True)
    _check_fixed(r, _KIMI_FIXED, "kimi_linear")
    lac = r.get("linear_attn_config", {})
    if not isinstance(lac, dict):
        raise ConfigError(f"linear_attn_config={lac!r} must be an object")
    num_layers, num_heads = int(r.require("num_hidden_layers")), int(r.require("num_attention_heads"))
    heads, head_dim, conv = _kimi_linear_sizes(r, lac, raw)
    mla = dataclasses.replace(_parse_mla(r, num_heads), nope=True)
    config = ModelConfig(
        family=Family.KIMI_LINEAR,
        vocab_size=int(r.require("vocab_size")),
        hidden_size=int(r.require("hidden_size")),
        intermediate_size=int(r.require("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=mla.rope_dim,
        rms_norm_eps=float(r.require("rms_norm_eps")),
        max_position_embeddings=int(r.require("model_max_length")),
        rope=_kimi_rope(r),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        bos_token_id=r.get("bos_token_id"),
        eos_token_ids=_token_ids(r.get("eos_token_id")),
        moe=_kimi_moe(r, num_layers, raw),
        attention=AttentionKind.MLA,
        mla=mla,
        linear=LinearAttnConfig(LinearKind.KIMI_DELTA, _kimi_layer_flags(r, lac, num_layers), heads, heads,
                                head_dim, head_dim, conv),
    )
    _refuse_leftover(r, "kimi_linear")
    return config
