"""Helpers shared by the conversion tests (tests/test_convert*.py), imported as ``tests.convert_helpers``.

The expected layouts are restated here independently of dayzero.convert (HF Linear weights are
[out, in]; ours keep the input dimension first).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    Qwen3Config, Qwen3ForCausalLM,
)

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.model.transformer import forward
from dayzero.model.cache import init_cache
from dayzero.model.weights import named_leaves

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
             initializer_range=0.1)  # logits O(1), so comparing them means something
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama_bias": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, attention_bias=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=32)),
}


def small_hf_model(family: str = "llama", **overrides):
    """A tiny random HF model in fp32 with non-trivial norms and biases."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SMALL, **extra, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)  # HF inits these to constants
    return model


def save_hf(model, path: Path, **kwargs) -> Path:
    """``save_pretrained`` as safetensors."""
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def hf_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of an HF directory as fp32 numpy, by HF name."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def expected_leaves(sd: dict[str, np.ndarray], hf_config) -> dict[str, np.ndarray]:
    """The dayzero weight tree an HF state dict should become, written out by hand."""
    D, N, K = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    H = getattr(hf_config, "head_dim", None) or D // N
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not hf_config.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    for i in range(hf_config.num_hidden_layers):
        p, t = f"model.layers.{i}.", f"layers/{i}/"
        out[t + "attn_norm"] = sd[p + "input_layernorm.weight"]
        out[t + "mlp_norm"] = sd[p + "post_attention_layernorm.weight"]
        out[t + "attn/q"] = sd[p + "self_attn.q_proj.weight"].T.reshape(D, N, H)
        out[t + "attn/k"] = sd[p + "self_attn.k_proj.weight"].T.reshape(D, K, H)
        out[t + "attn/v"] = sd[p + "self_attn.v_proj.weight"].T.reshape(D, K, H)
        out[t + "attn/o"] = sd[p + "self_attn.o_proj.weight"].T.reshape(N, H, D)
        for name in ("gate", "up", "down"):
            out[t + f"mlp/{name}"] = sd[p + f"mlp.{name}_proj.weight"].T
        for name, n in (("q", N), ("k", K), ("v", K)):
            if p + f"self_attn.{name}_proj.bias" in sd:
                out[t + f"attn/{name}_bias"] = sd[p + f"self_attn.{name}_proj.bias"].reshape(n, H)
        if p + "self_attn.o_proj.bias" in sd:
            out[t + "attn/o_bias"] = sd[p + "self_attn.o_proj.bias"]
        for name in ("q_norm", "k_norm"):
            if p + f"self_attn.{name}.weight" in sd:
                out[t + f"attn/{name}"] = sd[p + f"self_attn.{name}.weight"]
    return out


def assert_leaves_equal(weights, expected: dict[str, np.ndarray], exact: bool = True) -> None:
    """``weights`` has exactly the leaves of ``expected`` (by name), with their shapes and values
    (bit for bit, or within 1e-6 when not ``exact``)."""
    got = {k: np.asarray(v) for k, v in named_leaves(weights).items()}
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape, name
        if exact:
            np.testing.assert_array_equal(got[name], want, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6, err_msg=name)


def our_logits(dst: Path, ids: np.ndarray) -> np.ndarray:
    """All-position logits of ``ids`` [1, T] from the converted checkpoint ``dst``, as stored."""
    config, weights = load_checkpoint(dst)
    logits, _ = forward(weights, config, jnp.asarray(ids), init_cache(config, 1, ids.shape[1]), all_logits=True)
    return np.asarray(logits)


def convert(src, dst, **kwargs) -> Path:
    """``convert_checkpoint`` without the progress bar."""
    return convert_checkpoint(src, dst, progress=False, **kwargs)


def assert_fails(src: Path, dst: Path, *needles: str, **kwargs) -> str:
    """Conversion raises ConvertError mentioning every needle and leaves nothing behind."""
    with pytest.raises(ConvertError) as info:
        convert(src, dst, **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert not dst.exists()
    assert not list(dst.parent.glob(dst.name + ".partial"))  # an error before the first group keeps nothing
    return message
