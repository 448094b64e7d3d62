"""Latent attention over a cache whose positions are split across devices.

The MLA latent cache has no head axis to split, so tensor parallelism splits its positions
(``latent_seq``) instead: each device stores S / tp rows of every layer. Left to XLA, attention
over it gathers the whole cache onto every device at every step (measured in the decode HLO: an
all-gather of each layer's [B,S,C] cache). Here each device instead attends over its own rows
inside ``jax.shard_map`` and only per-query statistics cross devices, as in blockwise
("flash") attention:

    m = max over all devices of the local score maxima          (pmax, [B,T*N])
    l = sum over devices of sum_s exp(score_s - m)               (psum, [B,T*N])
    o = sum over devices of sum_s exp(score_s - m) latent_s      (psum, [B,T*N,C])

and the new tokens' keys (a few rows, replicated) are merged into (m, l, o) outside. The only
data moved per layer is the queries (gathered from their head split) and o: O(T*N*C), not O(S*C).
Same softmax as ``dayzero.model.mla.attend_latent``, up to summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dayzero.model.mla import attend_latent
from dayzero.model.parallel import Parallel


def _rows_mask(mask: jax.Array, N: int) -> jax.Array:
    """A [B,T,K] key mask repeated for each head, in the (t, n) row order of flattened queries."""
    B, T, K = mask.shape
    return jnp.broadcast_to(mask[:, :, None], (B, T, N, K)).reshape(B, T * N, K)


def _safe(m: jax.Array) -> jax.Array:
    # A query with no visible key has max -inf; shifting by 0 instead keeps exp() at 0, not NaN.
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _local_stats(qf, cache, mask, *, axis: str, heads: int):
    """shard_map body: this device's rows of the cache -> the merged (m, l, o) of all devices."""
    scores = jnp.einsum("bmc,bsc->bms", qf, cache.astype(qf.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(_rows_mask(mask, heads), scores, -jnp.inf)
    m = jax.lax.pmax(jnp.max(scores, axis=-1), axis)
    p = jnp.exp(scores - _safe(m)[..., None])
    l = jax.lax.psum(jnp.sum(p, axis=-1), axis)
    o = jax.lax.psum(jnp.einsum("bms,bsc->bmc", p.astype(qf.dtype), cache.astype(qf.dtype)), axis)
    return m, l, o


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
    m, l, o = jax.shard_map(
        functools.partial(_local_stats, axis=axis, heads=N), mesh=par.placement.mesh,
        in_specs=(P(batch), P(batch, axis), P(batch, None, axis)), out_specs=P(batch),
    )(qf, cache, mask_cached)
    # Merge the new tokens' keys (few rows, on every device) into the cache's statistics.
    s_new = jnp.einsum("bmc,bjc->bmj", qf, new, preferred_element_type=jnp.float32)
    s_new = jnp.where(_rows_mask(mask_new, N), s_new, -jnp.inf)
    top = _safe(jnp.maximum(m, jnp.max(s_new, axis=-1)))
    old = jnp.exp(m - top)  # rescales the cache's part (0 where it had no visible key)
    p_new = jnp.exp(s_new - top[..., None])
    total = l * old + jnp.sum(p_new, axis=-1)
    out = o * old[..., None] + jnp.einsum("bmj,bjc->bmc", p_new.astype(q.dtype), new)
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return out.astype(q.dtype).reshape(B, T, N, C)
