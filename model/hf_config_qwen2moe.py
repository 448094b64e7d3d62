"""Strict parsing of a Qwen2-MoE ``config.json`` (HF ``qwen2_moe``, Qwen2MoeConfig in transformers 5.24).

Called by :func:`dayzero.model.hf_config.parse_hf_config`, with its contract: every key is used,
deliberately ignored (the reason is next to it), or checked against the one value HF's modeling
code computes with; anything else is refused naming the key. Keys a file leaves out (or nulls)
take Qwen2MoeConfig's field defaults (:data:`_DEFAULTS`).

What HF's qwen2_moe computes: Qwen2's attention (q/k/v biases iff ``qkv_bias``, no o bias, whole
heads rotated, ``head_dim`` when the file gives one, else hidden_size / heads); layer i has a MoE
block iff ``num_experts`` > 0, (i + 1) % ``decoder_sparse_step`` == 0 and i is not in
``mlp_only_layers`` (else a dense SwiGLU of ``intermediate_size``). A MoE block: softmax over all
experts, the top ``num_experts_per_tok`` probabilities (renormalised iff ``norm_topk_prob``)
weight their experts of ``moe_intermediate_size``, plus a shared SwiGLU of
``shared_expert_intermediate_size`` scaled per token by sigmoid(x . ``shared_expert_gate``).
Sliding windows: ``layer_types`` when given, else HF's own pattern (even layers below
``max_window_layers``) when ``use_sliding_window``.
"""

from __future__ import annotations

from typing import Any

from dayzero.model.config import ConfigError, Family, ModelConfig, MoEConfig
from dayzero.model.hf_config import (
    _MOE_TRAINING_ONLY, _REQUIRED_VALUES, _Reader, _Traits, _parse_rope, _qwen_moe_layers, _token_ids, fp8_block_size,
)
from dayzero.model.hf_config_linear import gated_shared_moe

# Qwen2MoeConfig's field defaults (num_key_value_heads is 16 there, not num_attention_heads).
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "mlp_only_layers": [], "qkv_bias": True,
}


def parse_qwen2moe_config(raw: dict[str, Any]) -> ModelConfig:
    """Build the :class:`ModelConfig` of a ``qwen2_moe`` config dict (module docstring)."""
    filled = {k: v for k, v in _DEFAULTS.items() if raw.get(k) is None}
    r = _Reader({**raw, **filled})
    r.seen.update(filled)  # HF's defaults, not the file's keys
    r.seen.add("model_type")
    r.seen.update(_MOE_TRAINING_ONLY)
    for key, allowed in _REQUIRED_VALUES.items():
        if r.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{key}={raw[key]!r} is not supported for qwen2_moe; supported: {allowed}")
    r.seen.add("quantization_config")
    fp8_block_size(raw)  # block-FP8 is read by the converter; any other scheme is refused here
    hidden, heads = int(r.get("hidden_size")), int(r.get("num_attention_heads"))
    layers = int(r.get("num_hidden_layers"))
    head_dim = int(r.get("head_dim", hidden // heads))
    max_pos = int(r.get("max_position_embeddings"))
    return _finish(r, ModelConfig(
        family=Family.QWEN2_MOE,
        vocab_size=int(r.get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(r.get("intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(r.get("num_key_value_heads")),
        head_dim=head_dim,
        rms_norm_eps=float(r.get("rms_norm_eps")),
        max_position_embeddings=max_pos,
        rope=_parse_rope(r, head_dim, max_pos, _Traits()),
        tie_word_embeddings=bool(r.get("tie_word_embeddings")),
        qkv_bias=bool(r.get("qkv_bias")),
        sliding_windows=_windows(r, layers),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        moe=_moe(r, layers),
    ))


def _finish(r: _Reader, config: ModelConfig) -> ModelConfig:
    leftover = r.leftover()
    if leftover:
        raise ConfigError(
            f"config.json has keys dayzero does not handle for model_type='qwen2_moe': {', '.join(leftover)}; "
            "support them in dayzero.model.hf_config_qwen2moe before converting"
        )
    return config


def _windows(r: _Reader, num_layers: int) -> tuple[int | None, ...]:
    """Per layer: None (full attention) or the window. HF's default ``layer_types`` slide the
    even layers below ``max_window_layers`` when ``use_sliding_window``; HF zeroes the window
    when ``use_sliding_window`` is false, so a sliding layer then is refused."""
    use, window, below = bool(r.get("use_sliding_window")), r.get("sliding_window"), r.get("max_window_layers")
    kinds = r.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if use and i % 2 == 0 and i < below else "full_attention"
                 for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"layer_types={kinds!r} must give 'full_attention' or 'sliding_attention' for each of "
                          f"{num_layers} layers")
    sliding = "sliding_attention" in kinds
    if sliding and not (use and isinstance(window, int) and window > 0):
        raise ConfigError(f"layer_types has 'sliding_attention' but use_sliding_window={use} and sliding_window="
                          f"{window!r} (HF then slides no window); set use_sliding_window and a positive window")
    return tuple(int(window) if k == "sliding_attention" else None for k in kinds)


def _moe(r: _Reader, num_layers: int) -> MoEConfig | None:
    """The sparse layers and their experts (None when no layer is sparse, as HF with num_experts 0)."""
    layers = _qwen_moe_layers(r, num_layers)
    num_experts, top_k = int(r.get("num_experts")), int(r.get("num_experts_per_tok"))
    width, shared = int(r.get("moe_intermediate_size")), int(r.get("shared_expert_intermediate_size"))
    return gated_shared_moe(num_experts, top_k, width, layers, bool(r.get("norm_topk_prob")), shared)
