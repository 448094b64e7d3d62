"""Latent attention over a cache whose positions are split across devices.

The MLA latent cache has no head axis to split, so tensor parallelism splits its positions
(``latent_seq``) instead: each device stores S / tp rows of every layer. Left to XLA, attention
over it gathers the whole cache onto every device at every step (measured in the decode HLO: an
all-gather of each layer's [B,S,C] cache). Here each device instead computes the cached block's
softmax statistics (``dayzero.model.mla.block_stats``) over its own rows inside
``jax.shard_map``, and only per-query statistics cross devices, as in blockwise ("flash")
attention:

    m = max over all devices of the local score maxima          (pmax, [B,T*N])
    l = sum over devices of sum_s exp(score_s - m)               (psum, [B,T*N])
    o = sum over devices of sum_s exp(score_s - m) latent_s      (psum, [B,T*N,C])

and the new tokens' block (a few rows, replicated) is merged in outside, exactly as
``dayzero.model.mla.attend_latent`` merges it. The only data moved per layer is the queries
(gathered from their head split) and o: O(T*N*C), not O(S*C).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from dayzero.model.mla import attend_latent, block_stats, merge_blocks, normalised
from dayzero.model.parallel import Parallel


def _local_stats(qf, cache, mask, *, axis: str, heads: int):
    """shard_map body: this device's rows of the cache -> the cached block's statistics over all
    devices (the maximum shared before the exponentials, so the sums just add up)."""
    m, l, o = block_stats(qf, cache, mask, heads, reduce_max=lambda m: jax.lax.pmax(m, axis))
    return m, jax.lax.psum(l, axis), jax.lax.psum(o, axis)


def attend_latent_split(par: Parallel, q: jax.Array, cache: jax.Array | None, new: jax.Array,
                        masks: tuple[jax.Array | None, jax.Array]) -> jax.Array:
    """``attend_latent`` (same arguments) with the cache's positions split over the mesh."""
    axis = par.mesh_axis("latent_seq")
    if cache is None or axis is None or cache.shape[1] % par.size("latent_seq"):
        return attend_latent(q, cache, new, masks)  # nothing split to work around
    B, T, N, C = q.shape
    qf = q.reshape(B, T * N, C)
    mask_cached, mask_new = masks
    batch = par.placement.sharding(("batch",), (B,)).spec[0]  # rows may be split over ``data``
    cached = jax.shard_map(
        functools.partial(_local_stats, axis=axis, heads=N), mesh=par.shard_mesh(),
        in_specs=(P(batch), P(batch, axis), P(batch, None, axis)), out_specs=P(batch),
    )(qf, cache, mask_cached)
    return normalised(merge_blocks(cached, block_stats(qf, new, mask_new, N)), q.shape, q.dtype)
