"""DeepSeek-V4 attention: a sliding window of one key=value head plus compressed entries.

Every layer (``CompressedConfig``) attends with N query heads over rows of one shared head of
width H, read both as keys and as values:

- the **window**: the key rows of the last W positions (the query's own included), held by a
  cache in a ring of W slots (``dayzero.model.compressor.ring_write``);
- the **compressed entries** of CSA/HCA layers: one row per ``ratio`` tokens, made by the
  layer's compressor (``dayzero.model.compressor.compress``) once its window of tokens closes.
  A query at position p sees entry w iff w < (p+1) // ratio. HCA layers read every visible
  entry; CSA layers only those their indexer picks (``compressor.index_select``);
- a learned **sink** per head in the softmax's denominator (``tiles.masked_softmax``).

Values carry their RoPE rotation (keys and values are the same rows), so the output's rotary
dims are rotated back at the query's position before the grouped output projection
(``o_a`` per group of heads, then ``o_b``). This is the reference path: one softmax per call over
[window ring | new rows | entries], masked; it runs prefill, chunked prefill and decode alike.
The entries are read one of two ways, the same softmax over the same keys either way:

- densely: every cached and new entry, masked (HCA's visible ones; CSA's narrowed to the
  indexer's picks), where scanning them all costs no more than gathering (prefill);
- gathered (CSA only, :func:`_gathers`): each query's k picked entry rows, so that a decode
  step's attention follows ``index_topk``, not the context (the indexer's own scoring still reads
  every index key).

A kernel path does not exist yet (the runtime refuses kernels for this attention).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.kernels.tiles import masked_softmax
from dayzero.model import compressor
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.norm import rms_norm
from dayzero.model.paged_rows import PagedRows, stored_like, whole
from dayzero.model.quant import as_stored, dequantized, take_along_axis
from dayzero.model.rope import apply_rope_trailing
from dayzero.model.compressed_weights import CompressedAttnWeights


class CompressedFrame(NamedTuple):
    """What a V4 layer's attention needs beyond the usual arguments: its kind, and each row's
    start [B] and number of real new tokens [B] (it builds its own masks from them)."""

    kind: CompressKind
    starts: jax.Array
    num_new: jax.Array


@struct.dataclass
class CompressedLayer:
    """One layer's cached state (``dayzero.model.compressed_cache`` declares and writes it):
    ``window`` [B,W,H], the key rows of the last W positions (slot = position % W); ``entries``
    [B,E,H] (CSA/HCA: entry w at row w, the first lengths // ratio valid) and the compressor's
    ``state``; CSA also ``index_keys`` [B,E,J] and the indexer compressor's ``index_state``."""

    window: jax.Array
    entries: jax.Array | None = None
    state: compressor.CompressorState | None = None
    index_keys: jax.Array | None = None
    index_state: compressor.CompressorState | None = None


@struct.dataclass
class NewCompressedLayer:
    """What one call adds to a layer's cache: the new key rows [B,T,H]; on CSA/HCA layers the
    entries closed in this call [B,M,H] with their entry indices [B,M] (-1: none) and the
    compressor's state after the call; on CSA layers the indexer's likewise."""

    rows: jax.Array
    entries: jax.Array | None = None
    entry_ids: jax.Array | None = None
    state: compressor.CompressorState | None = None
    index_keys: jax.Array | None = None
    index_ids: jax.Array | None = None
    index_state: compressor.CompressorState | None = None


def _queries(w: CompressedAttnWeights, config: ModelConfig, x: jax.Array,
             cos_sin: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Rotated queries [B,T,N,H] and the q LoRA latent [B,T,Q] the indexer also reads."""
    eps = config.rms_norm_eps
    q_latent = rms_norm(x @ dequantized(w.q_a, x.dtype), w.q_a_norm, eps)
    q = jnp.einsum("btq,qnh->btnh", q_latent, dequantized(w.q_b, x.dtype))
    # One RMS per head with no weight (HF's DeepseekV4UnweightedRMSNorm).
    q32 = q.astype(jnp.float32)
    q = (q32 * jax.lax.rsqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return apply_rope_trailing(q, *cos_sin), q_latent


def key_rows(w: CompressedAttnWeights, config: ModelConfig, x: jax.Array,
             cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """The one key=value row of each token of ``x`` [B,T,D] -> [B,T,H], normed and rotated."""
    kv = rms_norm(x @ dequantized(w.kv, x.dtype), w.kv_norm, config.rms_norm_eps)
    return apply_rope_trailing(kv[:, :, None], *cos_sin)[:, :, 0]


def _window_masks(starts: jax.Array, num_new: jax.Array, T: int, window: int,
                  ring: jax.Array | None) -> tuple[jax.Array | None, jax.Array]:
    """Visibility [B,T,W] of the ring's rows and [B,T,T] of the new rows to each new query:
    a real, causal key less than ``window`` positions back."""
    q_pos = starts[:, None] + jnp.arange(T)[None, :]  # [B,T]
    j = jnp.arange(T)
    new = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] < num_new[:, None, None])
    new &= j[None, :, None] - j[None, None, :] < window
    if ring is None:
        return None, new
    held = compressor.ring_positions(starts, ring.shape[1])  # [B,W], negative: empty
    cached = (held[:, None, :] >= 0) & (q_pos[:, :, None] - held[:, None, :] < window)
    return cached, new


def _entries_visible(starts: jax.Array, T: int, ratio: int, ids: jax.Array,
                     cached: jax.Array | bool) -> jax.Array:
    """Whether the entries of window ``ids`` (broadcastable to [B,T,n]; -1: none) are visible to
    each new query [B,T,n]: one held in the cache (``cached``, broadcastable likewise) iff it
    closed before this call (id < starts // ratio, below every new query's limit); one closed in
    this call iff id < (p+1) // ratio at the query's position p (its window has closed by then)."""
    before = (starts // ratio)[:, None, None]
    limit = ((starts[:, None] + jnp.arange(T)[None, :] + 1) // ratio)[:, :, None]  # [B,T,1]
    return (ids >= 0) & (ids < jnp.where(cached, before, limit))


def _entry_masks(starts: jax.Array, T: int, ratio: int, cached: jax.Array | None,
                 new_ids: jax.Array) -> tuple[jax.Array | None, jax.Array]:
    """Visibility [B,T,E] of the cached entries (entry e at row e) and [B,T,M] of the entries
    closed in this call (window ids ``new_ids`` [B,M])."""
    new = _entries_visible(starts, T, ratio, new_ids[:, None, :], False)
    if cached is None:
        return None, new
    e = jnp.arange(cached.shape[1])[None, None, :]
    return jnp.broadcast_to(_entries_visible(starts, T, ratio, e, True), (starts.shape[0], T, e.size)), new


def _chosen(indices: jax.Array, valid: jax.Array, size: int) -> jax.Array:
    """The indexer's picks [B,T,k] (``valid`` ones) as a mask [B,T,size] over the entries."""
    B, T, _ = indices.shape
    chosen = jnp.zeros((B, T, size), bool)
    return chosen.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], indices].max(valid)


def _gathers(T: int, k: int, entries: int) -> bool:
    """Whether a CSA call of T queries reads its k picks per query by gathering them rather than
    by the dense pass over all ``entries`` (cached E plus the call's M), decided on static shapes.

    The dense pass reads every entry row once for all T queries (and builds a [B,T,E+M] mask);
    the gather copies T*k rows, one [k] block per query. Gather when that copies fewer rows than
    the dense pass reads: every decode step once more than k entries are cached (at 1M tokens,
    T=1 reads 512 rows for 262144), and short prefill chunks over a long cache (16 tokens: 8192),
    never a first prefill (T*k > T/4 + 1). The scores' work follows the same count (N*H per row).
    ``mla._sparse_attention`` makes the same choice for DeepSeek-V3.2's picked tokens."""
    return T * k < entries


def _picked_entries(cached, new_entries: jax.Array, new_ids: jax.Array, indices: jax.Array,
                    valid: jax.Array, starts: jax.Array, ratio: int, dtype) -> tuple[jax.Array, jax.Array]:
    """The entry rows [B,T,k,H] the indexer picked for each query (``indices`` [B,T,k] into
    [cached E ; new M], ``valid`` [B,T,k]) and which of them count [B,T,k] (a valid pick of a
    visible entry). Only the picked cached rows are read (a quantized cache gathers its stored
    rows, then dequantizes those; a paged one, :class:`~dayzero.model.paged_rows.PagedRows`,
    reads them straight from their pages); rows that do not count are zeroed, so that a stale or empty
    slot cannot leak in through 0 * inf."""
    B, T, k = indices.shape
    E, M = (0 if cached is None else cached.shape[1]), new_entries.shape[1]
    from_cached = indices < E
    flat = lambda a: a.reshape(B, T * k, 1)  # noqa: E731
    in_new = jnp.clip(indices - E, 0, M - 1)
    rows = jnp.take_along_axis(new_entries, flat(in_new), axis=1)
    ids = jnp.take_along_axis(new_ids, in_new.reshape(B, T * k), axis=1).reshape(B, T, k)
    if cached is not None:
        at = flat(jnp.where(from_cached, indices, 0))
        held = cached.take(at) if isinstance(cached, PagedRows) else take_along_axis(cached, at, axis=1)
        held = dequantized(held, dtype)
        rows = jnp.where(flat(from_cached), held, rows)
        ids = jnp.where(from_cached, indices, ids)
    counts = valid & _entries_visible(starts, T, ratio, ids, from_cached)
    return jnp.where(counts[..., None], rows.reshape(B, T, k, -1), jnp.zeros((), dtype)), counts


def _attend(q: jax.Array, keys: jax.Array, mask: jax.Array, sinks: jax.Array,
            picked: tuple[jax.Array, jax.Array] | None) -> jax.Array:
    """Softmax attention of ``q`` [B,T,N,H] (scaled) over ``keys`` [B,S,H] shared by the queries
    (``mask`` [B,T,S]) and, when given, ``picked`` = (rows [B,T,k,H], mask [B,T,k]) of each
    query's own, in one softmax with the per-head ``sinks`` [N] -> [B,T,N,H]."""
    scores = jnp.einsum("btnh,bsh->bnts", q, keys, preferred_element_type=jnp.float32)
    if picked is not None:
        rows, picked_mask = picked
        scores = jnp.concatenate(
            [scores, jnp.einsum("btnh,btkh->bntk", q, rows, preferred_element_type=jnp.float32)], axis=-1)
        mask = jnp.concatenate([mask, picked_mask], axis=-1)
    probs = masked_softmax(scores, mask[:, None], sinks.astype(jnp.float32)[None, :, None]).astype(keys.dtype)
    S = keys.shape[1]
    out = jnp.einsum("bnts,bsh->btnh", probs[..., :S], keys, preferred_element_type=jnp.float32)
    if picked is not None:
        out += jnp.einsum("bntk,btkh->btnh", probs[..., S:], picked[0], preferred_element_type=jnp.float32)
    return out.astype(keys.dtype)


def compressed_block(w: CompressedAttnWeights, config: ModelConfig, kind: CompressKind, x: jax.Array,
                     cos_sin: tuple[jax.Array, jax.Array], layer_cache: CompressedLayer | None,
                     starts: jax.Array, num_new: jax.Array,
                     gather: bool | None = None) -> tuple[jax.Array, NewCompressedLayer]:
    """V4 attention of ``x`` [B,T,D] (rows at ``starts`` [B], ``num_new`` [B] of the T real) over
    the layer's cache (None: a first prefill). ``cos_sin``: the tables of the layer's kind
    (compress RoPE on CSA/HCA layers, the main one on sliding layers) at the new positions.
    ``gather``: on CSA layers, whether the picked entries are gathered (None: as :func:`_gathers`
    decides from the shapes; the tests force either way). Returns the output [B,T,D] and what the
    call adds to the cache."""
    cc = config.compressed
    B, T, _ = x.shape
    q, q_latent = _queries(w, config, x, cos_sin)
    rows = key_rows(w, config, x, cos_sin)
    ring = None if layer_cache is None else layer_cache.window
    keys, masks = [], []
    ring_mask, new_mask = _window_masks(starts, num_new, T, cc.window, ring)
    if ring is not None:
        keys.append(dequantized(ring, x.dtype))
        masks.append(ring_mask)
    keys.append(as_stored(rows, ring))  # the new rows as the cache will hold them (quantized round trip)
    masks.append(new_mask)
    new, picked = NewCompressedLayer(rows=rows), None
    if kind is not CompressKind.SLIDING:
        ratio = cc.ratio_of(kind)
        state = None if layer_cache is None else layer_cache.state
        entries, ids, state = compressor.compress(w.compressor, config, x, state, starts, num_new, ratio,
                                                  config.head_dim, kind is CompressKind.CSA)
        new = new.replace(entries=entries, entry_ids=ids, state=state)
        cached = None if layer_cache is None else layer_cache.entries
        stored = as_stored(entries, stored_like(cached))
        cached_mask, entry_mask = _entry_masks(starts, T, ratio, cached, ids)
        entry_keys = [stored] if cached is None else [dequantized(whole(cached), x.dtype), stored]
        entry_masks = [entry_mask] if cached is None else [cached_mask, entry_mask]
        if kind is CompressKind.CSA:
            new, (indices, valid) = _index(w, config, x, q_latent, layer_cache, starts, num_new, ratio, new)
            E, M = (0 if cached is None else cached.shape[1]), entries.shape[1]
            if _gathers(T, indices.shape[-1], E + M) if gather is None else gather:
                picked = _picked_entries(cached, stored, ids, indices, valid, starts, ratio, x.dtype)
                entry_keys, entry_masks = [], []  # the entries are read through the picks only
            else:
                chosen = _chosen(indices, valid, E + M)
                narrowed = [chosen] if cached is None else [chosen[..., :E], chosen[..., E:]]
                entry_masks = [m & c for m, c in zip(entry_masks, narrowed)]
        keys += entry_keys
        masks += entry_masks
    keys, mask = jnp.concatenate(keys, axis=1), jnp.concatenate(masks, axis=-1)  # [B,S,H], [B,T,S]
    out = _attend(q * config.head_dim**-0.5, keys, mask, w.sinks, picked)
    cos, sin = cos_sin
    out = apply_rope_trailing(out, cos, -sin)  # values carried their rotation: undo it at the query
    return _grouped_output(w, config, out), new


def _index(w: CompressedAttnWeights, config: ModelConfig, x: jax.Array, q_latent: jax.Array,
           layer_cache: CompressedLayer | None, starts: jax.Array, num_new: jax.Array, ratio: int,
           new: NewCompressedLayer) -> tuple[NewCompressedLayer, tuple[jax.Array, jax.Array]]:
    """CSA's indexer: its keys for the windows closed in this call, and each query's picks
    (indices [B,T,k] into [cached entries ; new entries], valid [B,T,k]; ``index_select``'s)."""
    T = x.shape[1]
    state = None if layer_cache is None else layer_cache.index_state
    keys, ids, state = compressor.index_keys(w.indexer, config, x, state, starts, num_new, ratio)
    cached = None if layer_cache is None else layer_cache.index_keys
    positions = starts[:, None] + jnp.arange(T)[None, :]
    read = as_stored(keys, stored_like(cached))
    cached = None if cached is None else dequantized(whole(cached), x.dtype)
    picks = compressor.index_select(w.indexer, config, x, q_latent, positions, cached, starts // ratio,
                                    read, ids, ratio)
    return new.replace(index_keys=keys, index_ids=ids, index_state=state), picks


def _grouped_output(w: CompressedAttnWeights, config: ModelConfig, out: jax.Array) -> jax.Array:
    """The grouped low-rank output: heads [B,T,N,H] in g groups, each through its own ``o_a``
    block to d_g, then ``o_b`` over the g*d_g concatenation -> [B,T,D]."""
    B, T, N, H = out.shape
    g = config.compressed.o_groups
    grouped = out.reshape(B, T, g, N * H // g)
    low = jnp.einsum("btgi,gio->btgo", grouped, dequantized(w.o_a, out.dtype))
    return low.reshape(B, T, -1) @ dequantized(w.o_b, out.dtype)
