"""Strict parsing of a Hugging Face ``config.json`` into a :class:`ModelConfig`.

Every key of the source config is either used, explicitly ignored (it does not change what the
network computes at inference), or checked against the one value we support. Anything else is an
error that lists the offending keys: a silently ignored key is how a port ends up subtly wrong.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dayzero.model.config import (
    AttentionKind,
    ConfigError,
    Family,
    MoEConfig,
    ModelConfig,
    RopeConfig,
    RopeType,
)
# The DeepSeek / MiniMax-M2 / gpt-oss / MLA / DSA parts; _DEEPSEEK_TRAINING_ONLY and _parse_mla are
# also imported from here by hf_config_v4 and hf_config_linear.
from dayzero.model.hf_config_families import (  # noqa: F401
    _DEEPSEEK_TRAINING_ONLY, _deepseek_moe, _gpt_oss_checks, _gpt_oss_defaults, _gpt_oss_moe, _minimax_checks,
    _minimax_moe, _minimax_mtp_layers, _parse_dsa, _parse_mla,
)


@dataclasses.dataclass(frozen=True)
class _Traits:
    """What sets a family apart from plain Llama, as HF's implementation of it behaves."""

    qkv_bias: bool = False  # q/k/v biases even when attention_bias is false (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head (Qwen3)
    qk_norm_key: bool = False  # q/k norms iff the config's use_qk_norm (GLM-4.5)
    o_bias_key: bool = True  # attention_bias also gives o_proj a bias (not in GLM-4.5)
    slides_by_default: bool = False  # sliding_window applies without use_sliding_window (Mistral)
    windows_from_layer_0: bool = False  # a window applies to every layer; max_window_layers is not read
    moe: bool = False  # sparse Mixture-of-Experts blocks (see MoEConfig)
    mla: bool = False  # multi-head latent attention (see MLAConfig)
    dsa: bool = False  # a lightning indexer picks the tokens latent attention reads (see DSAConfig)
    deepseek_moe: bool = False  # DeepSeek-V3 routing: sigmoid, selection bias, groups, shared experts
    # HF's defaults for keys a config.json may leave out, where they differ from the generic ones
    # this parser assumes (HF writes them only when they differ from its own defaults).
    defaults: tuple[tuple[str, Any], ...] = ()
    # partial_rotary_factor is applied (HF's attention rotates only part of each head), and its
    # value where neither the config nor its RoPE parameters set it.
    partial_rotary: bool = False
    rotary_fraction: float = 1.0
    # MiniMax-M2: one q (k) RMSNorm over all heads of a token ("per_layer"), sigmoid routing with a
    # selection bias in every layer (no groups, scaling or shared experts), full attention in
    # every layer, partial RoPE also given as ``rotary_dim``, MTP modules as num_mtp_modules.
    minimax: bool = False
    # gpt-oss: attention sinks, q/k/v/o biases, alternating sliding/full layers by default, YaRN
    # by default; softmax routing with a router bias, expert biases and the clamped SwiGLU.
    gpt_oss: bool = False


_TRAITS = {
    Family.LLAMA: _Traits(),
    Family.MISTRAL: _Traits(slides_by_default=True, windows_from_layer_0=True),
    Family.QWEN2: _Traits(qkv_bias=True),
    Family.QWEN3: _Traits(qk_norm=True),
    Family.MIXTRAL: _Traits(slides_by_default=True, windows_from_layer_0=True, moe=True),
    Family.QWEN3_MOE: _Traits(qk_norm=True, windows_from_layer_0=True, moe=True),
    Family.DEEPSEEK_V3: _Traits(moe=True, mla=True, deepseek_moe=True),
    Family.KIMI_K2: _Traits(moe=True, mla=True, deepseek_moe=True),
    Family.DEEPSEEK_V32: _Traits(moe=True, mla=True, dsa=True, deepseek_moe=True),
    # HF GlmMoeDsaConfig (a DeepseekV32Config): its defaults where they differ from the generic ones.
    Family.GLM_MOE_DSA: _Traits(moe=True, mla=True, dsa=True, deepseek_moe=True,
                                defaults=(("norm_topk_prob", True), ("n_shared_experts", 1),
                                          ("first_k_dense_replace", 3), ("routed_scaling_factor", 2.5),
                                          ("rms_norm_eps", 1e-5), ("index_n_heads", 32),
                                          ("max_position_embeddings", 202752))),
    # HF Glm4MoeConfig: half of each head rotated, renormalised top-k, one shared expert, one
    # dense layer and one MTP module unless the config says otherwise.
    Family.GLM4_MOE: _Traits(qk_norm_key=True, o_bias_key=False, moe=True, deepseek_moe=True,
                             partial_rotary=True, rotary_fraction=0.5,
                             defaults=(("norm_topk_prob", True), ("n_shared_experts", 1),
                                       ("first_k_dense_replace", 1), ("num_nextn_predict_layers", 1))),
    # HF MiniMaxM2Config: its defaults where the generic ones differ (head_dim is not D/N there).
    Family.MINIMAX_M2: _Traits(qk_norm=True, moe=True, partial_rotary=True, minimax=True,
                               defaults=(("head_dim", 128), ("rope_theta", 5000000.0),
                                         ("num_local_experts", 256), ("num_experts_per_tok", 8),
                                         ("max_position_embeddings", 196608))),
    # HF GptOssConfig: its defaults where the generic ones differ (layer_types and the RoPE
    # parameters are filled by _gpt_oss_defaults, as they depend on other keys).
    Family.GPT_OSS: _Traits(moe=True, gpt_oss=True,
                            defaults=(("head_dim", 64), ("num_key_value_heads", 8), ("attention_bias", True),
                                      ("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072),
                                      ("sliding_window", 128), ("num_local_experts", 128),
                                      ("num_experts_per_tok", 4), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0))),
}


# Keys that do not change what the network computes at inference time (the logits of a token
# sequence). Besides this set, ``_ignored`` accepts two families of keys by their names.
_IGNORED_KEYS = frozenset(
    {
        # Provenance: which classes / code / library version wrote the file. dayzero picks its
        # implementation from model_type alone and never runs the hub's remote code (auto_map).
        "architectures", "transformers_version", "auto_map",
        # Storage dtype of the published weights: the converter reads each tensor's own dtype.
        "torch_dtype", "dtype",
        # Training only: weight init, dropout (a no-op at inference), checkpointing, TF-era loss.
        "initializer_range", "attention_dropout", "gradient_checkpointing", "tf_legacy_loss",
        # Runtime switches of HF's forward: what it returns and whether it keeps a KV cache, not
        # what it computes. pretraining_tp splits matmuls into slices with the same sum.
        "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
        "pretraining_tp", "chunk_size_feed_forward", "keys_to_ignore_at_inference", "use_bfloat16",
        # Encoder-decoder plumbing; the structure keys that could matter are _REQUIRED_VALUES.
        "is_decoder", "tie_encoder_decoder", "cross_attention_hidden_size",
        # Classification-head and fine-tuning metadata (no such head in a causal LM).
        "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix",
        # Tokenizer / processor / exporter bookkeeping: how text becomes ids, or hints for other
        # runtimes (transformers.js's KV-cache dtypes); nanotron's marker that the file is Llama.
        "tokenizer_class", "processor_class", "transformers.js_config", "is_llama_config",
    }
)

# Generation defaults (keys of transformers' GenerationConfig that older transformers also wrote
# into config.json): they choose the next token from the logits, or stop, never the logits.
_GENERATION_KEYS = frozenset(
    {
        "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
        "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "force_words_ids",
        "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "renormalize_logits",
        "remove_invalid_values", "exponential_decay_length_penalty", "guidance_scale",
        "max_length", "min_length", "max_new_tokens", "min_new_tokens", "max_time", "stop_strings",
        "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "penalty_alpha",
        "num_return_sequences", "output_scores", "output_logits", "return_dict_in_generate",
        "cache_implementation", "low_memory",
    }
)

# Name rules. A leading underscore marks what transformers or the hub stamp on a file they save
# (_name_or_path, _model_name_or_path, _commit_hash, _attn_implementation: which kernel, same
# math). Token ids (bos/eos/pad/unk/sep/decoder_start_token_id, ...) steer tokenization and
# generation; the ones dayzero uses (bos, eos) are read separately by parse_hf_config.
_IGNORED_PREFIXES = ("_",)
_IGNORED_SUFFIXES = ("_token_id", "_token_ids")


def _ignored(key: str) -> bool:
    """Whether ``key`` cannot change what the network computes (see the sets and rules above)."""
    return (key in _IGNORED_KEYS or key in _GENERATION_KEYS or key.startswith(_IGNORED_PREFIXES)
            or key.endswith(_IGNORED_SUFFIXES))


# Keys whose only supported value is the given one (the default in HF).
_REQUIRED_VALUES = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "is_encoder_decoder": (False,),
    "add_cross_attention": (False,),  # true would add cross-attention blocks to every layer
    "use_mrope": (False,),  # Qwen2.5 configs: multimodal (3-D) RoPE is Qwen2-VL's, not Qwen2's
    # nanotron's spelling (SmolLM2): HF's Llama rotates half-split pairs, i.e. not interleaved.
    "rope_interleaved": (False,),
}


class _Reader:
    """Pops keys from an HF config dict and remembers which ones were looked at."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw
        self.seen: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        self.seen.add(key)
        if self.raw.get(key) is None:
            raise ConfigError(f"config.json has no '{key}', which a {self.raw.get('model_type')} model needs")
        return self.raw[key]

    def leftover(self) -> list[str]:
        """The keys neither read nor ignorable by ``_ignored``: what the parser does not handle."""
        return sorted(k for k in set(self.raw) - self.seen if not _ignored(k))


def _parse_rope(r: _Reader, head_dim: int, max_pos: int, traits: _Traits) -> RopeConfig:
    """RoPE from either the transformers-5 ``rope_parameters`` or the older ``rope_scaling``."""
    params = dict(r.get("rope_parameters", {}) or {})
    legacy = dict(r.get("rope_scaling", {}) or {})
    params = {**legacy, **params}
    theta = params.pop("rope_theta", None) or r.get("rope_theta", 10000.0)
    type_name = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    top_level = r.get("partial_rotary_factor")
    partial = params.pop("partial_rotary_factor", None)
    if None not in (top_level, partial) and top_level != partial:
        raise ConfigError(
            f"partial_rotary_factor={top_level} and rope_parameters' partial_rotary_factor={partial} "
            "disagree; keep one of them"
        )
    partial = partial if partial is not None else top_level
    rotary_dim = r.get("rotary_dim") if traits.minimax else None
    if rotary_dim is not None:  # MiniMax-M2's legacy spelling of the same fraction (as HF reads it)
        if partial is not None and partial * head_dim != rotary_dim:
            raise ConfigError(
                f"rotary_dim={rotary_dim} and partial_rotary_factor={partial} disagree for head_dim="
                f"{head_dim}; keep one of them"
            )
        partial = rotary_dim / head_dim
    partial = float(partial if partial is not None else traits.rotary_fraction)
    if partial != 1.0 and not traits.partial_rotary:
        raise ConfigError(
            f"partial_rotary_factor={partial} is not supported for model_type={r.raw.get('model_type')!r}, "
            "whose HF implementation rotates whole heads; remove the key"
        )
    try:
        rope_type = RopeType(type_name)
    except ValueError:
        supported = ", ".join(t.value for t in RopeType)
        raise ConfigError(f"unsupported rope_type '{type_name}'; supported: {supported}") from None
    fields = {f.name for f in dataclasses.fields(RopeConfig)}
    renamed = {"original_max_position_embeddings": "original_max_position"}
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        name = renamed.get(key, key)
        # M-RoPE's keys are read by the Qwen multimodal parsers only (hf_config_linear, hf_config_vision).
        if name not in fields or name in ("type", "theta", "mrope_section", "mrope_interleaved"):
            raise ConfigError(f"unknown RoPE parameter '{key}' for rope_type '{type_name}'")
        kwargs[name] = value
    if rope_type in (RopeType.LLAMA3, RopeType.YARN):
        kwargs.setdefault(
            "original_max_position", r.get("original_max_position_embeddings", max_pos)
        )
    if rope_type is RopeType.YARN and kwargs.get("factor") is None:
        kwargs["factor"] = max_pos / kwargs["original_max_position"]
    if rope_type is not RopeType.DEFAULT and "factor" not in kwargs:
        raise ConfigError(f"rope_type '{type_name}' needs a 'factor'")
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("attention_factor", "mscale", "mscale_all_dim")}
    return RopeConfig(type=rope_type, theta=float(theta), partial_rotary_factor=partial, **kwargs)


def _sliding_windows(r: _Reader, family: Family, num_layers: int) -> tuple[int | None, ...]:
    traits = _TRAITS[family]
    window = r.get("sliding_window")
    layer_types = r.get("layer_types")
    use_sliding = r.get("use_sliding_window", traits.slides_by_default)
    # Read (so never reported as unhandled) even where HF ignores it: see windows_from_layer_0.
    max_window_layers = r.get("max_window_layers", num_layers)
    first_sliding = 0 if traits.windows_from_layer_0 else max_window_layers
    if layer_types is None:
        layer_types = [
            "sliding_attention" if use_sliding and window and i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    windows = []
    for kind in layer_types:
        if kind == "full_attention" or (kind == "indexed_attention" and traits.dsa):
            windows.append(None)  # DeepSeek-V3.2's indexed layers attend causally over all tokens
        elif kind == "sliding_attention":
            if not window:
                raise ConfigError("layer_types has 'sliding_attention' but sliding_window is not set")
            windows.append(int(window))
        else:
            raise ConfigError(f"unsupported layer type '{kind}' in layer_types")
    return tuple(windows)


# MoE keys that only matter for training; reading them changes nothing at inference.
_MOE_TRAINING_ONLY = {
    "router_aux_loss_coef": "weight of the load-balancing loss",
    "output_router_logits": "returns router logits for that loss; the tokens' logits are unchanged",
    "router_jitter_noise": "multiplicative noise HF applies to the router input in training mode only",
}


def _num_experts(r: _Reader) -> int:
    """E: Mixtral's ``num_local_experts``; Qwen's ``num_experts`` (transformers 5 writes the former)."""
    local, named = r.get("num_local_experts"), r.get("num_experts")
    if local is not None and named is not None and local != named:
        raise ConfigError(f"num_local_experts={local} and num_experts={named} disagree; keep one of them")
    value = local if local is not None else named
    if value is None:
        raise ConfigError("config.json has neither 'num_local_experts' nor 'num_experts', which a MoE model needs")
    return int(value)


def _qwen_moe_layers(r: _Reader, num_layers: int) -> tuple[bool, ...]:
    """HF Qwen3-MoE: layer i is sparse iff (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers.

    Stricter than HF, which divides by a zero step and silently skips out-of-range indices.
    """
    step = r.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step={step!r} must be a positive integer")
    dense = r.get("mlp_only_layers", [])
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"mlp_only_layers has {bad}, not layer indices of a {num_layers}-layer model")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def fp8_block_size(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The [out, in] block of a fine-grained FP8 checkpoint's ``quantization_config`` (None: none).

    Only DeepSeek's scheme is accepted: float8_e4m3fn weights with one ``weight_scale_inv`` per
    block; dynamic activation scales concern FP8 matmuls, not the dequantized weights.
    """
    q = raw.get("quantization_config")
    if q is None or q.get("quant_method") == "mxfp4":  # MXFP4: checked and read by convert.mxfp4
        return None
    q = {k: v for k, v in q.items() if k != "modules_to_not_convert"}  # the converter sees which are FP8
    # DeepSeek-V3.1+ / V3.2: scale_fmt says how its FP8 kernels round activation scales (powers of
    # two); the weights dequantize from the stored weight_scale_inv either way.
    if q.get("scale_fmt") in (None, "ue8m0"):
        q.pop("scale_fmt", None)
    block = q.pop("weight_block_size", None)
    # MiniMax-M2 spells DeepSeek's "e4m3" as the dtype's name: the same float8_e4m3fn values.
    if q.get("fmt") == "float8_e4m3fn":
        q["fmt"] = "e4m3"
    expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if any(q.get(k, v) != v for k, v in expected.items()) or set(q) - set(expected) or not (
            isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(
            f"quantization_config {raw['quantization_config']!r} is not supported; only block-wise FP8 "
            "(quant_method 'fp8', fmt 'e4m3', weight_block_size [out, in]) is"
        )
    return int(block[0]), int(block[1])


def _parse_moe(r: _Reader, family: Family, num_layers: int) -> MoEConfig | None:
    """The experts of a MoE family (None for dense families, whose configs may not use these keys)."""
    if not _TRAITS[family].moe:
        return None
    r.seen.update(_MOE_TRAINING_ONLY)
    if _TRAITS[family].deepseek_moe:
        return _deepseek_moe(r, num_layers)
    if _TRAITS[family].minimax:
        return _minimax_moe(r, num_layers)
    if _TRAITS[family].gpt_oss:
        return _gpt_oss_moe(r, num_layers)
    num_experts = _num_experts(r)
    top_k = int(r.require("num_experts_per_tok"))
    if family is Family.MIXTRAL:  # every layer sparse, experts as wide as intermediate_size
        return MoEConfig(num_experts, top_k, int(r.require("intermediate_size")), (True,) * num_layers)
    return MoEConfig(
        num_experts, top_k, int(r.require("moe_intermediate_size")), _qwen_moe_layers(r, num_layers),
        renormalize=bool(r.get("norm_topk_prob", False)),
    )


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def fold_aliases(raw: dict[str, Any], aliases: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """``raw`` with each (alias, name) of HF's ``attribute_map`` folded into the name the parser
    reads: an alias set to null is dropped, one that disagrees with its name is refused."""
    raw = dict(raw)
    for alias, name in aliases:
        if raw.get(alias) is None:
            raw.pop(alias, None)
            continue
        if raw.get(name) is not None and raw[name] != raw[alias]:
            raise ConfigError(f"{alias}={raw[alias]!r} and {name}={raw[name]!r} disagree (HF reads the first as the "
                              "second); keep one of them")
        raw[name] = raw.pop(alias)
    return raw


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from an HF config dict, refusing anything it would get wrong."""
    model_type = raw.get("model_type")
    # Linear-attention hybrids (Qwen3-Next, Qwen3.5 and its text model_types, Kimi-Linear): their module.
    from dayzero.model.hf_config_linear import LINEAR_MODEL_TYPES, parse_linear_config

    if model_type in LINEAR_MODEL_TYPES:
        return parse_linear_config(raw)
    from dayzero.model.hf_config_vision import QWEN_VL_TEXT, parse_qwen_vl_config

    if model_type in QWEN_VL_TEXT:  # Qwen3-VL(-MoE): a vision tower before Qwen3(-MoE) with M-RoPE
        return parse_qwen_vl_config(raw)
    if model_type == "kimi_k25":  # Kimi-K2.5: MoonViT before the DeepSeek-V3 text model
        from dayzero.model.hf_config_vision_kimi import parse_kimi_k25_config

        return parse_kimi_k25_config(raw)
    try:
        family = Family(model_type)
    except ValueError:
        supported = ", ".join(f.value for f in Family)
        raise ConfigError(
            f"unsupported architecture model_type={model_type!r}; supported: {supported}"
        ) from None
    if family is Family.DEEPSEEK_V4:  # its own module: compressed attention, hyper-connections, legacy keys
        from dayzero.model.hf_config_v4 import parse_v4_config

        return parse_v4_config(raw)
    if family is Family.QWEN2_MOE:  # its own module: HF's qwen2_moe keys and defaults
        from dayzero.model.hf_config_qwen2moe import parse_qwen2moe_config

        return parse_qwen2moe_config(raw)
    traits = _TRAITS[family]
    # A family's HF defaults fill only the keys the file leaves out (or sets to null).
    filled = {k: v for k, v in traits.defaults if raw.get(k) is None}
    if traits.gpt_oss:
        filled.update(_gpt_oss_defaults(raw))
    r = _Reader({**raw, **filled})
    r.seen.update(filled)  # not the file's keys: never reported as unhandled, even where unread
    r.seen.add("model_type")
    for key, allowed in _REQUIRED_VALUES.items():
        if r.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{key}={raw[key]!r} is not supported; supported: {allowed}")
    hidden = int(r.require("hidden_size"))
    num_heads = int(r.require("num_attention_heads"))
    num_layers = int(r.require("num_hidden_layers"))
    mla = _parse_mla(r, num_heads) if traits.mla else None
    # RoPE covers the whole head, or with latent attention only its rotary part.
    head_dim = mla.rope_dim if mla else int(r.get("head_dim", hidden // num_heads))
    max_pos = int(r.get("max_position_embeddings", 2048))
    attention_bias = bool(r.get("attention_bias", False))
    r.seen.add("quantization_config")
    if (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4" and not traits.gpt_oss:
        raise ConfigError(f"quantization_config quant_method 'mxfp4' is read for gpt_oss checkpoints only, not "
                          f"{family.value}; convert a float or FP8 checkpoint of this model")
    # Validated here, applied by the converter's reader (MXFP4's keys: by convert.mxfp4's).
    fp8_block_size(raw)
    if traits.minimax:
        _minimax_checks(r, num_layers)
    if traits.mla:
        # Code pointers of the hub's remote implementation, which dayzero never runs.
        r.seen.add("auto_map")
    config = ModelConfig(
        family=family,
        vocab_size=int(r.require("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(r.require("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(r.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(r.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope=_parse_rope(r, head_dim, max_pos, traits),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or traits.qkv_bias,
        o_bias=attention_bias and traits.o_bias_key,
        qk_norm=traits.qk_norm or (traits.qk_norm_key and bool(r.get("use_qk_norm", False))),
        qk_norm_all_heads=traits.minimax,
        sliding_windows=(None,) * num_layers if traits.minimax else _sliding_windows(r, family, num_layers),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        moe=_parse_moe(r, family, num_layers),
        attention=AttentionKind.MLA if mla else AttentionKind.GQA,
        mla=mla,
        dsa=_parse_dsa(r, num_layers) if traits.dsa else None,
        mtp_layers=_minimax_mtp_layers(r) if traits.minimax else
        int(r.get("num_nextn_predict_layers", r.get("num_mtp_layers", 0))) if traits.deepseek_moe else 0,
        attention_sinks=traits.gpt_oss,
    )
    if traits.gpt_oss:
        _gpt_oss_checks(r, config.moe, config.rope)
    leftover = r.leftover()
    if leftover:
        raise ConfigError(
            f"config.json has keys dayzero does not handle for model_type={model_type!r}: "
            f"{', '.join(leftover)}; support them in dayzero.model.hf_config before converting"
        )
    return config


def load_hf_config(path: str | Path, overrides: dict | None = None) -> ModelConfig:
    """Parse an HF ``config.json`` file (or the ``config.json`` inside a directory), with
    ``overrides`` of its keys (e.g. ``{"num_hidden_layers": 4}`` for a slice of a model)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}; pass an HF model directory") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    return parse_hf_config({**raw, **(overrides or {})})
