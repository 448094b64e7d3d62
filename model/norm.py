"""RMSNorm, shared by the decoder layers, the q/k norms and the latent-attention block; LayerNorm,
shared by DeepSeek-V3.2's indexer keys and the Qwen vision tower."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axes: int | tuple[int, ...] = -1,
             offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in fp32, scaled by ``weight`` in the input dtype (as HF Llama does).

    ``offset`` (``ModelConfig.norm_weight_offset``): a zero-centred weight, the scale being
    ``offset + weight`` taken in fp32 before the cast back (as HF Qwen3-Next does: storing
    1 + w in bf16 instead would round the scale).

    ``axes``: the trailing axes one RMS is taken over (``(-2, -1)``: over all heads of a token
    [..., N, H] together, with a weight [N, H], as MiniMax-M2's q/k norms). On a mesh whose heads
    are split the mean is over the whole logical array, so XLA sums the squares across devices:
    one RMS per token, never one per shard.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    if offset:
        return ((offset + weight.astype(jnp.float32)) * normed).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last axis (mean removed, unit variance, then ``weight`` and ``bias``),
    computed in fp32 and cast back to ``x``'s dtype. ``eps`` 1e-6: what HF builds for the
    DeepSeek-V3.2 indexer key's norm and every norm of the Qwen3-VL / Qwen3.5 vision tower."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * weight + bias).astype(x.dtype)
