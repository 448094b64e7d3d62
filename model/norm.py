"""RMSNorm, shared by the decoder layers, the q/k norms and the latent-attention block."""

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
