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
(``o_a`` per group of heads, then ``o_b``). This is the reference path: one dense softmax over
[window ring | new rows | cached entries | new entries] per call, masked; it runs prefill,
chunked prefill and decode alike. A kernel path does not exist yet (the runtime refuses kernels
for this attention).
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
from dayzero.model.quant import as_stored, dequantized
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


def _entry_masks(starts: jax.Array, T: int, ratio: int, cached: jax.Array | None,
                 new_ids: jax.Array) -> tuple[jax.Array | None, jax.Array]:
    """Visibility [B,T,E] of the cached entries and [B,T,M] of the entries closed in this call:
    entry w is visible to position p iff w < (p+1) // ratio (its window has closed by then)."""
    limit = (starts[:, None] + jnp.arange(T)[None, :] + 1) // ratio  # [B,T]
    new = (new_ids[:, None, :] >= 0) & (new_ids[:, None, :] < limit[:, :, None])
    if cached is None:
        return None, new
    e = jnp.arange(cached.shape[1])
    # Entries closed before this call: all of them lie below every new query's limit.
    return jnp.broadcast_to(e[None, None, :] < (starts // ratio)[:, None, None], (starts.shape[0], T, e.size)), new


def _chosen(indices: jax.Array, valid: jax.Array, size: int) -> jax.Array:
    """The indexer's picks [B,T,k] (``valid`` ones) as a mask [B,T,size] over the entries."""
    B, T, _ = indices.shape
    chosen = jnp.zeros((B, T, size), bool)
    return chosen.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], indices].max(valid)


def compressed_block(w: CompressedAttnWeights, config: ModelConfig, kind: CompressKind, x: jax.Array,
                     cos_sin: tuple[jax.Array, jax.Array], layer_cache: CompressedLayer | None,
                     starts: jax.Array, num_new: jax.Array) -> tuple[jax.Array, NewCompressedLayer]:
    """V4 attention of ``x`` [B,T,D] (rows at ``starts`` [B], ``num_new`` [B] of the T real) over
    the layer's cache (None: a first prefill). ``cos_sin``: the tables of the layer's kind
    (compress RoPE on CSA/HCA layers, the main one on sliding layers) at the new positions.
    Returns the output [B,T,D] and what the call adds to the cache."""
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
    new = NewCompressedLayer(rows=rows)
    if kind is not CompressKind.SLIDING:
        ratio = cc.ratio_of(kind)
        state = None if layer_cache is None else layer_cache.state
        entries, ids, state = compressor.compress(w.compressor, config, x, state, starts, num_new, ratio,
                                                  config.head_dim, kind is CompressKind.CSA)
        cached = None if layer_cache is None else layer_cache.entries
        cached_mask, entry_mask = _entry_masks(starts, T, ratio, cached, ids)
        entry_keys = [entries] if cached is None else [dequantized(cached, x.dtype), as_stored(entries, cached)]
        entry_masks = [entry_mask] if cached is None else [cached_mask, entry_mask]
        new = new.replace(entries=entries, entry_ids=ids, state=state)
        if kind is CompressKind.CSA:
            new, picked = _index(w, config, x, q_latent, layer_cache, starts, num_new, ratio, new)
            entry_masks = [m & p for m, p in zip(entry_masks, picked)]
        keys += entry_keys
        masks += entry_masks
    keys, mask = jnp.concatenate(keys, axis=1), jnp.concatenate(masks, axis=-1)  # [B,S,H], [B,T,S]
    scores = jnp.einsum("btnh,bsh->bnts", q * config.head_dim**-0.5, keys, preferred_element_type=jnp.float32)
    probs = masked_softmax(scores, mask[:, None], w.sinks.astype(jnp.float32)[None, :, None])
    out = jnp.einsum("bnts,bsh->btnh", probs.astype(keys.dtype), keys)
    cos, sin = cos_sin
    out = apply_rope_trailing(out, cos, -sin)  # values carried their rotation: undo it at the query
    return _grouped_output(w, config, out), new


def _index(w: CompressedAttnWeights, config: ModelConfig, x: jax.Array, q_latent: jax.Array,
           layer_cache: CompressedLayer | None, starts: jax.Array, num_new: jax.Array, ratio: int,
           new: NewCompressedLayer) -> tuple[NewCompressedLayer, list[jax.Array]]:
    """CSA's indexer: its keys for the windows closed in this call, and each query's picks as
    masks over [cached entries, new entries] (in the order of ``_entry_masks``)."""
    T = x.shape[1]
    state = None if layer_cache is None else layer_cache.index_state
    keys, ids, state = compressor.index_keys(w.indexer, config, x, state, starts, num_new, ratio)
    cached = None if layer_cache is None else layer_cache.index_keys
    positions = starts[:, None] + jnp.arange(T)[None, :]
    read = as_stored(keys, cached)
    cached = None if cached is None else dequantized(cached, x.dtype)
    indices, valid = compressor.index_select(w.indexer, config, x, q_latent, positions, cached, starts // ratio,
                                             read, ids, ratio)
    E = 0 if cached is None else cached.shape[1]
    chosen = _chosen(indices, valid, E + keys.shape[1])
    picked = [chosen] if cached is None else [chosen[..., :E], chosen[..., E:]]
    return new.replace(index_keys=keys, index_ids=ids, index_state=state), picked


def _grouped_output(w: CompressedAttnWeights, config: ModelConfig, out: jax.Array) -> jax.Array:
    """The grouped low-rank output: heads [B,T,N,H] in g groups, each through its own ``o_a``
    block to d_g, then ``o_b`` over the g*d_g concatenation -> [B,T,D]."""
    B, T, N, H = out.shape
    g = config.compressed.o_groups
    grouped = out.reshape(B, T, g, N * H // g)
    low = jnp.einsum("btgi,gio->btgo", grouped, dequantized(w.o_a, out.dtype))
    return low.reshape(B, T, -1) @ dequantized(w.o_b, out.dtype)
