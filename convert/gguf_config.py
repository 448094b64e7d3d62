"""An HF-style ``config.json`` dict built from a GGUF file's metadata.

The dict goes through ``dayzero.model.config.parse_hf_config`` like any HF config, so GGUF and
HF sources obey the same strict rules. GGUF keys in the architecture's namespace that we do not
translate are an error (listing them), for the same reason config keys are: a silently dropped
key is how a port goes subtly wrong. ``general.*`` keys are descriptive and ignored; the
``tokenizer.*`` keys are read by :mod:`dayzero.convert.tokenizer_export`.
"""

from __future__ import annotations

from typing import Any, Callable

from dayzero.convert.errors import ConvertError

SUPPORTED_ARCHITECTURES = ("llama",)

# Keys whose value only matters if it is non-trivial (mixture of experts).
_ZERO_OK = ("expert_count", "expert_used_count")


def _rope_scaling(get: Callable[[str], Any], context: int) -> dict[str, Any]:
    """HF rope parameters from ``<arch>.rope.scaling.*`` (empty for no scaling)."""
    kind = get("rope.scaling.type") or "none"
    factor = get("rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    if kind == "yarn":
        original = get("rope.scaling.original_context_length") or context
        return {"rope_scaling": {"rope_type": "yarn", "factor": float(factor),
                                 "original_max_position_embeddings": int(original)}}
    raise ConvertError(f"GGUF rope.scaling.type={kind!r} is not supported; supported: none, linear, yarn")


def hf_config_from_gguf(metadata: Callable[[str], Any], keys: list[str], num_tokens: int,
                        has_output: bool) -> dict[str, Any]:
    """The HF config dict a GGUF file describes.

    ``metadata(key)`` returns a value or None, ``keys`` lists all metadata keys, ``num_tokens``
    is the tokenizer vocabulary length (a fallback for ``<arch>.vocab_size``), and ``has_output``
    says whether the file holds an ``output.weight`` (the model is tied iff it does not).
    """
    arch = metadata("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConvertError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
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
    head_dim = int(get("attention.key_length") or hidden // heads)
    if int(get("attention.value_length") or head_dim) != head_dim:
        raise ConvertError("GGUF attention.value_length differs from key_length; dayzero needs them equal")
    if int(get("rope.dimension_count") or head_dim) != head_dim:
        raise ConvertError(
            f"GGUF rope.dimension_count={get('rope.dimension_count')} is not the head size {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    for key in _ZERO_OK:
        if get(key):
            raise ConvertError(f"GGUF {arch}.{key}={get(key)}: mixture-of-experts llama files are not supported")
    context = int(require("context_length"))
    config = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(require("feed_forward_length")),
        "num_hidden_layers": int(require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(require("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base") or 10000.0),
        "max_position_embeddings": context,
        "vocab_size": int(get("vocab_size") or num_tokens),
        "tie_word_embeddings": not has_output,
        "bos_token_id": metadata("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata("tokenizer.ggml.eos_token_id"),
        **_rope_scaling(get, context),
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
