"""An HF-style ``config.json`` dict built from a GGUF file's metadata.

The dict goes through ``dayzero.model.config.parse_hf_config`` like any HF config, so GGUF and
HF sources obey the same strict rules. GGUF keys in the architecture's namespace that we do not
translate are an error (listing them), for the same reason config keys are: a silently dropped
key is how a port goes subtly wrong. ``general.*`` and ``split.*`` keys are descriptive and
ignored; the ``tokenizer.*`` keys are read by :mod:`dayzero.convert.tokenizer_export`.
"""

from __future__ import annotations

from typing import Any, Callable

from dayzero.convert.errors import ConvertError
from dayzero.convert.gguf_config_mla import deepseek2_shape, deepseek2_yarn

# llama.cpp architecture -> (HF model_type, HF class). Mistral is written as "llama".
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "minimax-m2": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),  # DeepSeek-V3 / Kimi-K2 (sigmoid routing)
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# Mixture-of-experts keys; for a dense architecture they may only be absent or zero.
_MOE_KEYS = ("expert_count", "expert_used_count")

# llama.cpp's gating function ids (gguf.ExpertGatingFuncType): qwen3moe and qwen2moe route with a
# softmax, minimax-m2 with a sigmoid (plus the selection bias ``exp_probs_b``).
_GATING = {"qwen3moe": (1, "softmax"), "qwen2moe": (1, "softmax"), "minimax-m2": (2, "sigmoid")}


def _rope_scaling(arch: str, get: Callable[[str], Any], context: int) -> dict[str, Any]:
    """HF rope parameters from ``<arch>.rope.scaling.*`` (empty for no scaling)."""
    kind = get("rope.scaling.type") or "none"
    factor = get("rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    if kind == "yarn":
        original = get("rope.scaling.original_context_length") or context
        yarn = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
        if arch == "deepseek2":
            yarn.update(deepseek2_yarn(get))
        return {"rope_scaling": yarn}
    raise ConvertError(f"GGUF rope.scaling.type={kind!r} is not supported; supported: none, linear, yarn")


def _experts(arch: str, get: Callable[[str], Any], require: Callable[[str], Any]) -> dict[str, Any]:
    """HF MoE keys for ``qwen3moe``, ``qwen2moe`` and ``minimax-m2`` (every layer sparse, as
    llama.cpp builds them; top-k weights renormalised for qwen3moe and minimax-m2, not for
    qwen2moe, whose shared expert is ``expert_shared_feed_forward_length`` wide, else
    ``feed_forward_length`` as llama.cpp falls back); for a dense architecture, a check that the
    file has no experts."""
    if arch not in _GATING:
        for key in _MOE_KEYS:
            if get(key):
                raise ConvertError(f"GGUF {arch}.{key}={get(key)}: mixture-of-experts {arch} files are not supported")
        return {}
    gating, name = _GATING[arch]
    if get("expert_gating_func") not in (None, gating):
        raise ConvertError(
            f"GGUF {arch}.expert_gating_func={get('expert_gating_func')} is not supported; "
            f"{arch} routes with {name} ({gating})"
        )
    count, used = int(require("expert_count")), int(require("expert_used_count"))
    if arch == "qwen2moe" and get("expert_feed_forward_length") is None:
        # Files written before the key existed (Qwen1.5-MoE): llama.cpp takes n_ff / n_expert_used.
        width = int(require("feed_forward_length")) // used
    else:
        width = int(require("expert_feed_forward_length"))
    if arch == "minimax-m2":  # HF's MiniMaxM2Config: experts intermediate_size wide, no dense MLP
        return {"num_local_experts": count, "num_experts_per_tok": used, "intermediate_size": width}
    if arch == "qwen2moe":
        shared = get("expert_shared_feed_forward_length") or require("feed_forward_length")
        return {"num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": width,
                "shared_expert_intermediate_size": int(shared), "norm_topk_prob": False}
    return {"num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": width,
            "norm_topk_prob": True}


def _rotary(arch: str, get: Callable[[str], Any], head_dim: int) -> dict[str, Any]:
    """``rotary_dim`` for minimax-m2 (which rotates part of each head); elsewhere a check that
    ``rope.dimension_count`` is the whole head."""
    dims = int(get("rope.dimension_count") or head_dim)
    if arch == "minimax-m2":
        return {"rotary_dim": dims}
    if dims != head_dim:
        raise ConvertError(
            f"GGUF rope.dimension_count={dims} is not the head size {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    return {}


def _gqa_shape(arch: str, get: Callable[[str], Any], require: Callable[[str], Any], hidden: int,
               heads: int) -> dict[str, Any]:
    """Head sizes, MLP widths and experts of the grouped-query architectures."""
    head_dim = int(get("attention.key_length") or hidden // heads)
    if int(get("attention.value_length") or head_dim) != head_dim:
        raise ConvertError("GGUF attention.value_length differs from key_length; dayzero needs them equal")
    experts = _experts(arch, get, require)
    # A MoE file's dense width is unused when every layer is sparse (llama.cpp's qwen3moe).
    ffn = get("feed_forward_length") if experts else require("feed_forward_length")
    if arch == "minimax-m2" and ffn is not None and int(ffn) != experts["intermediate_size"]:
        raise ConvertError(f"GGUF {arch}.feed_forward_length={ffn} differs from expert_feed_forward_length; "
                           "minimax-m2 has no dense MLP of another width")
    return {"intermediate_size": int(ffn or experts.get("moe_intermediate_size", 0)), **_rotary(arch, get, head_dim),
            "num_key_value_heads": int(get("attention.head_count_kv") or heads), "head_dim": head_dim, **experts}


def _check_arch(arch: Any) -> tuple[str, str]:
    if arch not in ARCHITECTURES:
        raise ConvertError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return ARCHITECTURES[arch]


def hf_config_from_gguf(metadata: Callable[[str], Any], keys: list[str], num_tokens: int,
                        has_output: bool) -> dict[str, Any]:
    """The HF config dict a GGUF file describes.

    ``metadata(key)`` returns a value or None, ``keys`` lists all metadata keys, ``num_tokens``
    is the tokenizer vocabulary length (a fallback for ``<arch>.vocab_size``), and ``has_output``
    says whether the file holds an ``output.weight`` (the model is tied iff it does not).
    """
    arch = metadata("general.architecture")
    model_type, hf_class = _check_arch(arch)
    seen: set[str] = set()

    def get(key: str) -> Any:
        seen.add(key)
        return metadata(f"{arch}.{key}")

    def require(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ConvertError(f"GGUF metadata has no '{arch}.{key}'; the file is incomplete")
        return value

    hidden, heads = int(require("embedding_length")), int(require("attention.head_count"))
    layers = int(require("block_count"))
    shape = deepseek2_shape(get, require, heads, layers) if arch == "deepseek2" else _gqa_shape(
        arch, get, require, hidden, heads)
    context = int(require("context_length"))
    config = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        **shape,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "rms_norm_eps": float(require("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base") or 10000.0),
        "max_position_embeddings": context,
        "vocab_size": int(get("vocab_size") or num_tokens),
        "tie_word_embeddings": not has_output,
        "bos_token_id": metadata("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata("tokenizer.ggml.eos_token_id"),
        **_rope_scaling(arch, get, context),
    }
    for key in ("rope.scaling.original_context_length", "rope.scaling.finetuned"):
        seen.add(key)  # covered by the rope scaling translation (finetuned is provenance only)
    unknown = sorted(k for k in keys if k.startswith(f"{arch}.") and k[len(arch) + 1:] not in seen)
    if unknown:
        raise ConvertError(
            f"GGUF metadata has keys dayzero does not translate: {', '.join(unknown)}; "
            "support them in dayzero.convert.gguf_config before converting"
        )
    return {k: v for k, v in config.items() if v is not None}
