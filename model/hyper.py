"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): a residual of n parallel streams.

The residual is ``streams`` [B,T,n,D] instead of [B,T,D] (n = ``HyperConfig.mult``):

- :func:`expand`: the embedding, copied to every stream.
- :func:`mix`, before each attention or MLP block: from the flattened streams [n*D] (RMS-normed,
  no weight) one projection gives n ``pre`` gates, n ``post`` gates and an n x n ``comb`` matrix,
  projected by Sinkhorn normalisation onto (nearly) doubly-stochastic matrices. The block's input
  is the ``pre``-weighted sum of the streams.
- :func:`merge`, after the block: stream k becomes post_k * block output + sum_j comb[j,k] *
  stream_j (comb transposed: it is not symmetric, so the direction matters).
- :func:`head`: the final collapse of the streams into one [B,T,D] before the final norm.

Semantics of HF ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` and their use in
``DeepseekV4DecoderLayer.forward`` / ``DeepseekV4Model.forward``. The gates are computed in fp32
from fp32 weights (:class:`HyperWeights`); the block input and the merged streams come back in
the streams' dtype, as HF casts. Everything is fixed-shape. The Sinkhorn iterations are a
``fori_loop``: unrolled, HF's 20 iterations took XLA:CPU 2.6 s to compile per mix (0.24 s as a
loop; measured here, and there are two mixes per layer), for 1.5x less run time on CPU. On a GPU
the loop costs a launch or two per iteration on a [B,T,n,n] array; not measured yet.

Cost per token: one product of the flattened streams [n*D] with ``fn`` [(2+n)n, n*D] (24 x 16K
for V4's n=4, D=4096), the rest is O(n*D). It runs at fp32 ``HIGHEST`` precision: it is a small
fraction of a layer's work, and the gates feed a sigmoid, a softmax and 2 x iters divisions, so a
TF32/bf16-pass product (the GPU/TPU default for fp32) would put its ~1e-3 error into every gate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dayzero.model.config import HyperConfig
from dayzero.model.compressed_weights import HyperWeights


def expand(x: jax.Array, config: HyperConfig) -> jax.Array:
    """The residual streams [B,T,n,D] at the start of the network: the embedding ``x`` [B,T,D]
    copied to each of the n streams."""
    B, T, D = x.shape
    return jnp.broadcast_to(x[:, :, None, :], (B, T, config.mult, D))


def _projected(fn: jax.Array, streams: jax.Array, norm_eps: float) -> jax.Array:
    """The flattened streams [B,T,n*D], RMS-normed without weight (fp32, eps ``norm_eps``),
    times ``fn``.T -> [B,T,outputs] fp32. The one large product of the module."""
    B, T, n, D = streams.shape
    if fn.shape[-1] != n * D:
        raise ValueError(f"hyper-connection fn {fn.shape} does not take {n} streams of {D} (n*D = {n * D}); "
                         f"check hc_mult and the weights")
    flat = streams.reshape(B, T, n * D).astype(jnp.float32)
    normed = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    return jnp.einsum("btk,ok->bto", normed, fn.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _collapse(pre: jax.Array, streams: jax.Array) -> jax.Array:
    """sum_i pre_i * stream_i [B,T,D]: summed in fp32 (``pre`` [B,T,n] is fp32, as in HF, where the
    product promotes), returned in the streams' dtype."""
    return jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST).astype(streams.dtype)


def sinkhorn(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """HF's Sinkhorn normalisation of positive matrices ``comb`` [..., n, n]: columns first, then
    ``iters`` - 1 times rows then columns; every division is x / (sum + ``eps``)."""
    def rows_then_columns(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    # A loop, not unrolled: see the module docstring for the compile time.
    return jax.lax.fori_loop(0, iters - 1, rows_then_columns, comb)


def mix(w: HyperWeights, config: HyperConfig, streams: jax.Array, norm_eps: float
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The mix before a block: ``streams`` [B,T,n,D] -> (block input [B,T,D] in the streams' dtype,
    post [B,T,n] fp32, comb [B,T,n,n] fp32), for :func:`merge` after the block.

    ``w``: fn [(2+n)n, n*D], base [(2+n)n], scale [3] (pre, post, comb). pre = sigmoid + eps,
    post = 2 sigmoid, comb = softmax over its last axis + eps, then :func:`sinkhorn`. ``norm_eps``:
    the model's ``rms_norm_eps`` (the unweighted RMS of the flattened streams).
    """
    n = config.mult
    if streams.shape[2] != n or w.fn.shape[0] != (2 + n) * n:
        raise ValueError(f"hyper-connection streams {streams.shape} / fn {w.fn.shape} do not fit hc_mult={n} "
                         f"(want [B,T,{n},D] and fn [{(2 + n) * n}, {n}*D])")
    f = _projected(w.fn, streams, norm_eps)
    base, scale = w.base.astype(jnp.float32), w.scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(f[..., :n] * scale[0] + base[:n]) + config.eps
    post = 2 * jax.nn.sigmoid(f[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = f[..., 2 * n:] * scale[2] + base[2 * n:]
    comb = jax.nn.softmax(logits.reshape(*logits.shape[:-1], n, n), axis=-1) + config.eps
    comb = sinkhorn(comb, config.sinkhorn_iters, config.eps)
    return _collapse(pre, streams), post, comb


def merge(streams: jax.Array, block_out: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """The streams after a block: stream k = post_k * ``block_out`` + sum_j comb[j,k] * stream_j.

    ``streams`` [B,T,n,D] (the ones :func:`mix` read), ``block_out`` [B,T,D], ``post`` [B,T,n] and
    ``comb`` [B,T,n,n] from :func:`mix`; computed in the streams' dtype (post and comb cast to it,
    as HF does) -> [B,T,n,D].
    """
    dtype = streams.dtype
    spread = post.astype(dtype)[..., None] * block_out.astype(dtype)[..., None, :]
    return spread + jnp.einsum("btjk,btjd->btkd", comb.astype(dtype), streams)


def head(w: HyperWeights, config: HyperConfig, streams: jax.Array, norm_eps: float) -> jax.Array:
    """The final collapse of ``streams`` [B,T,n,D] -> [B,T,D] (streams' dtype), before the final
    norm: weights sigmoid(mixes * scale + base) + eps, with fn [n, n*D], base [n], scale [1]."""
    n = config.mult
    if streams.shape[2] != n or w.fn.shape[0] != n:
        raise ValueError(f"hyper-connection head streams {streams.shape} / fn {w.fn.shape} do not fit hc_mult={n} "
                         f"(want [B,T,{n},D] and fn [{n}, {n}*D])")
    f = _projected(w.fn, streams, norm_eps)
    pre = jax.nn.sigmoid(f * w.scale.astype(jnp.float32)[0] + w.base.astype(jnp.float32)) + config.eps
    return _collapse(pre, streams)
