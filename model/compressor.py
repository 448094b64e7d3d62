"""DeepSeek-V4's compressors (HCA, CSA and the CSA indexer's own) and the indexer's top-k.

A compressor of ratio r and width C projects each token x [D] to kv = x @ w.kv and
gate = x @ w.gate, each [m*C] (m = 2 for CSA's overlapping windows, 1 for HCA's). Window w
covers positions [w*r, (w+1)*r); once all of its tokens have been seen it yields one entry,

    entry_w = RMSNorm(sum_slots softmax_slots(gate + position_bias) * kv)   (per channel, fp32 softmax)

over its r slots (HCA), or over 2r slots with ``overlap``: the first C features (Ca) of window
w-1's rows, then the last C features (Cb) of window w's own rows (window 0 has no Ca rows). The
entry is then rotated on its trailing R dims at position w*r with the compress rope. That is
HF's ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` / ``DeepseekV4Indexer``.

One fixed-shape function, :func:`compress`, serves prefill, chunked prefill and decode, with rows
of a batch at different positions (``starts`` [B], ``num_new`` [B]; tokens t >= num_new[b] are
padding). Between calls each row carries a :class:`CompressorState`: a ring of its last m*r
projected rows (slot = position % (m*r)), which is every row a window closing later can still
need. A call lays out, per row, a grid of the windows that can close in it and gathers each
window's slots from the ring (positions before ``starts``) or from the new rows; windows whose
last token is not real and new in this call come back with id -1.

:func:`index_select` is the lightning indexer's scoring and top-k over the cached and new index
keys (:func:`compress` at width J makes the keys; there is no second compressor).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model.cache import write_quantized
from dayzero.model.config import ModelConfig
from dayzero.model.quant import QuantizedArray, dequantized
from dayzero.model.rope import apply_rope_trailing, rope_cos_sin
from dayzero.model.compressed_weights import CompressedIndexerWeights, CompressorWeights
from dayzero.model.weights import Init, ParamSpec, map_specs


@struct.dataclass
class CompressorState:
    """One compressor's carried rows for each batch row: ``kv`` and ``gate`` [B, m*r, m*C], the
    projections of the row's last m*r positions at slot = position % (m*r), in the model dtype,
    gates raw (no position bias). Zeros for a fresh row (positions < 0 never count)."""

    kv: jax.Array
    gate: jax.Array


def _overlap_factor(overlap: bool) -> int:
    return 2 if overlap else 1


def state_spec(batch: int, width: int, ratio: int, overlap: bool) -> CompressorState:
    """The state declared abstractly (zero-initialised ``ParamSpec`` leaves in the model dtype,
    axes ("batch", None, None)), for a cache's spec tree; ``width`` is C (H for the attention's
    compressors, J for the indexer's), ``ratio`` r."""
    m = _overlap_factor(overlap)
    leaf = ParamSpec((batch, m * ratio, m * width), ("batch", None, None), Init.ZEROS)
    return CompressorState(kv=leaf, gate=leaf)


def empty_state(batch: int, width: int, ratio: int, overlap: bool, dtype=jnp.float32) -> CompressorState:
    """The state of ``batch`` fresh rows (zeros), as :func:`state_spec` declares it."""
    return map_specs(lambda s: jnp.zeros(s.shape, dtype), state_spec(batch, width, ratio, overlap))


def ring_positions(starts: jax.Array, size: int) -> jax.Array:
    """The absolute position each slot of a ring of ``size`` slots (slot = position % size) holds
    before a call at ``starts`` [B]: the one position p in [starts - size, starts) with
    p % size == slot, [B, size] int32; negative means the slot is empty (before position 0)."""
    slots = jnp.arange(size, dtype=jnp.int32)[None, :]
    starts = starts.astype(jnp.int32)[:, None]
    return starts - size + (slots - starts) % size


def ring_write(ring: jax.Array | QuantizedArray, rows: jax.Array, starts: jax.Array,
               num_new: jax.Array) -> jax.Array | QuantizedArray:
    """``ring`` [B,S,...] with ``rows`` [B,T,...] (token t of row b at position starts[b] + t)
    written at slot = position % S. Only each row's last S real tokens are written (earlier ones
    would be overwritten anyway, and writing them too would make the scatter's order matter);
    padding (t >= num_new[b]) is dropped. A quantized ring is written through
    ``cache.write_quantized`` (rows quantized like it)."""
    B, S = ring.shape[:2]
    if rows.shape[0] != B or rows.shape[2:] != ring.shape[2:]:
        raise ValueError(f"ring_write: rows {rows.shape} do not fit ring {ring.shape}; give rows [B,T,...] "
                         "with the ring's batch and trailing shape")
    T = rows.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    num_new = num_new.astype(jnp.int32)[:, None]
    keep = (t < num_new) & (t >= num_new - S)
    slots = jnp.where(keep, (starts.astype(jnp.int32)[:, None] + t) % S, S)  # S: out of range, dropped
    b = jnp.arange(B)[:, None]
    return write_quantized(ring, rows, lambda buf, r: buf.at[b, slots].set(r, mode="drop"))


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF ``DeepseekV4RMSNorm``: fp32 math, the weight multiplied in fp32, one cast at the end
    (unlike ``norm.rms_norm``, which casts before the weight)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


def _compressed_config(config: ModelConfig, what: str):
    if config.compressed is None:
        raise ValueError(f"{what} needs a DeepSeek-V4 config (config.compressed is None for family "
                         f"{config.family.value}); pass the model's ModelConfig")
    return config.compressed


def _check_compress(w: CompressorWeights, x: jax.Array, state: CompressorState | None, ratio: int,
                    width: int, m: int) -> None:
    D = x.shape[-1]
    expect = {"kv": (D, m * width), "gate": (D, m * width), "position_bias": (ratio, m * width), "norm": (width,)}
    for name, shape in expect.items():
        got = tuple(getattr(w, name).shape)
        if got != shape:
            raise ValueError(f"compress: weight {name} is {got}, expected {shape} for hidden size {D}, "
                             f"width={width}, ratio={ratio}, overlap={m == 2}; pass the matching compressor")
    if state is not None and tuple(state.kv.shape) != (x.shape[0], m * ratio, m * width):
        raise ValueError(f"compress: state {tuple(state.kv.shape)} is not [B, m*r, m*C] = "
                         f"{(x.shape[0], m * ratio, m * width)}; "
                         "make it with empty_state(batch, width, ratio, overlap)")


def _gather_half(ring: jax.Array, new: jax.Array, pos: jax.Array, starts: jax.Array,
                 num_new: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows at positions ``pos`` [B,M,n] from the ring [B,S,F] (pos < starts) or the new rows
    [B,T,F] (starts <= pos < starts + num_new) -> ([B,M,n,F], whether each exists [B,M,n])."""
    B, M, n = pos.shape
    S, T = ring.shape[1], new.shape[1]
    starts, num_new = starts[:, None, None], num_new[:, None, None]
    in_ring = (pos >= 0) & (pos < starts)
    in_new = (pos >= starts) & (pos < starts + num_new)
    flat = lambda a: a.reshape(B, M * n, 1)  # noqa: E731
    from_ring = jnp.take_along_axis(ring, flat(pos % S), axis=1)
    from_new = jnp.take_along_axis(new, flat(jnp.clip(pos - starts, 0, T - 1)), axis=1)
    rows = jnp.where(flat(in_ring), from_ring, from_new).reshape(B, M, n, -1)
    return rows, in_ring | in_new


def _masked_softmax(logits: jax.Array, exists: jax.Array, axis: int) -> jax.Array:
    """Softmax over ``axis`` where missing slots get weight 0, as HF's -inf gates; a window with
    no slot at all (never emitted) gets zeros rather than NaN."""
    logits = jnp.where(exists, logits, -jnp.inf)
    top = jnp.max(logits, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(exists, jnp.exp(logits - top), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=axis, keepdims=True), jnp.finfo(e.dtype).tiny)


def compress(w: CompressorWeights, config: ModelConfig, x: jax.Array, state: CompressorState | None,
             starts: jax.Array, num_new: jax.Array, ratio: int, width: int,
             overlap: bool) -> tuple[jax.Array, jax.Array, CompressorState]:
    """The entries of the windows that close in this call, and the state to carry on.

    ``x`` [B,T,D] (token t of row b at position starts[b] + t, real iff t < num_new[b]);
    ``state`` the row's carried :class:`CompressorState` (None: fresh rows, which must then
    start at position 0); ``ratio`` r, ``width`` C, ``overlap`` CSA-style 2r-slot windows.

    Returns entries [B,M,C] (M = T // r + 1, enough for every window that can close in T
    tokens), entry_ids [B,M] int32 (the window index w of an entry whose window's last token is
    real and in this call, else -1 and the row is zeros, never to be read) and the new state.
    Entries are normed and rotated (compress rope, trailing R dims, at w*r) as HF stores them.
    """
    cc = _compressed_config(config, "compress")
    m, C = _overlap_factor(overlap), width
    _check_compress(w, x, state, ratio, width, m)
    B, T, _ = x.shape
    if state is None:
        state = empty_state(B, width, ratio, overlap, x.dtype)
    starts, num_new = starts.astype(jnp.int32), num_new.astype(jnp.int32)
    kv = jnp.einsum("btd,dc->btc", x, w.kv.astype(x.dtype))
    gate = jnp.einsum("btd,dc->btc", x, w.gate.astype(x.dtype))

    # Window grid: the first window that can close is the one holding position starts.
    M = T // ratio + 1
    windows = starts[:, None] // ratio + jnp.arange(M, dtype=jnp.int32)[None, :]  # [B,M]
    closed = (windows + 1) * ratio <= (starts + num_new)[:, None]
    j = jnp.arange(ratio, dtype=jnp.int32)
    kv_parts, gate_parts, exist_parts = [], [], []
    # Half i of the 2r slots (overlap) is window w-1+i's rows, features [i*C, (i+1)*C).
    for i in range(m):
        pos = (windows[:, :, None] - (m - 1) + i) * ratio + j  # [B,M,r]
        feats = slice(i * C, (i + 1) * C)
        rows_kv, exists = _gather_half(state.kv[..., feats].astype(x.dtype), kv[..., feats], pos, starts, num_new)
        rows_gate, _ = _gather_half(state.gate[..., feats].astype(x.dtype), gate[..., feats], pos, starts, num_new)
        kv_parts.append(rows_kv)
        # HF adds the fp32 bias to the model-dtype gate, so the softmax logits are fp32.
        gate_parts.append(rows_gate.astype(jnp.float32) + w.position_bias[:, feats].astype(jnp.float32))
        exist_parts.append(exists)
    rows_kv = jnp.concatenate(kv_parts, axis=2)  # [B,M,m*r,C]
    exists = jnp.concatenate(exist_parts, axis=2)[..., None]
    weights = _masked_softmax(jnp.concatenate(gate_parts, axis=2), exists, axis=2).astype(x.dtype)
    entries = _rms_norm(jnp.sum(rows_kv * weights, axis=2), w.norm, config.rms_norm_eps)

    cos, sin = rope_cos_sin(cc.compress_rope, config.head_dim, config.max_position_embeddings, windows * ratio)
    entries = apply_rope_trailing(entries[:, :, None, :], cos, sin)[:, :, 0, :]
    entries = jnp.where(closed[..., None], entries, jnp.zeros((), entries.dtype))
    new_state = CompressorState(kv=ring_write(state.kv, kv, starts, num_new),
                                gate=ring_write(state.gate, gate, starts, num_new))
    return entries, jnp.where(closed, windows, -1), new_state


def index_keys(w: CompressedIndexerWeights, config: ModelConfig, x: jax.Array, state: CompressorState | None,
               starts: jax.Array, num_new: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array, CompressorState]:
    """The indexer's new keys [B,M,J], their window ids [B,M] and its new state: :func:`compress`
    with the indexer's own compressor at width J, overlapping (CSA-style) windows."""
    J = _compressed_config(config, "index_keys").index_head_dim
    return compress(w.compressor, config, x, state, starts, num_new, ratio, J, overlap=True)


def _check_index(w: CompressedIndexerWeights, config: ModelConfig, x: jax.Array, q_latent: jax.Array,
                 cached_keys, new_keys: jax.Array, new_ids: jax.Array) -> None:
    cc = _compressed_config(config, "index_select")
    I, J = cc.index_heads, cc.index_head_dim
    expect = {"q_b": (q_latent.shape[-1], I, J), "head_weights": (x.shape[-1], I)}
    for name, shape in expect.items():
        if tuple(getattr(w, name).shape) != shape:
            raise ValueError(f"index_select: weight {name} is {tuple(getattr(w, name).shape)}, expected {shape} "
                             f"(index_heads={I}, index_head_dim={J}); pass the layer's indexer weights")
    for name, keys in (("cached_keys", cached_keys), ("new_keys", new_keys)):
        if keys is not None and (keys.shape[-1] != J or keys.shape[0] != x.shape[0]):
            raise ValueError(f"index_select: {name} {tuple(keys.shape)} is not [B, *, {J}] for batch {x.shape[0]}")
    if tuple(new_ids.shape) != tuple(new_keys.shape[:2]):
        raise ValueError(f"index_select: new_ids {tuple(new_ids.shape)} do not match new_keys {tuple(new_keys.shape)}")


def index_scores(w: CompressedIndexerWeights, config: ModelConfig, x: jax.Array, q_latent: jax.Array,
                 q_positions: jax.Array, keys: jax.Array, key_ids: jax.Array, ratio: int) -> jax.Array:
    """fp32 indexer scores [B,T,S] of the queries (``x`` [B,T,D], q LoRA latent ``q_latent``
    [B,T,Q] at ``q_positions`` [B,T]) against ``keys`` [B,S,J] whose window ids are
    ``key_ids`` [B,S] (-1: no entry), -inf where the query may not see the entry:

        score = sum_h (x @ head_weights)_h * I^-1/2 * relu(q_h . key) * J^-1/2

    with q = q_latent @ q_b rotated (compress rope, trailing R dims) at the query's position
    (HF ``DeepseekV4IndexerScorer``). A query at p sees window w iff w < (p+1) // ratio.
    """
    cc = _compressed_config(config, "index_scores")
    I, J = cc.index_heads, cc.index_head_dim
    cos, sin = rope_cos_sin(cc.compress_rope, config.head_dim, config.max_position_embeddings, q_positions)
    q = apply_rope_trailing(jnp.einsum("btq,qij->btij", q_latent, w.q_b.astype(q_latent.dtype)), cos, sin)
    B, T = q.shape[:2]
    # Queries flattened to [B, T*I, J] make the key product one batched matmul (as dsa.index_scores).
    per_head = jnp.einsum("bmj,bsj->bms", q.reshape(B, T * I, J), keys.astype(q.dtype),
                          preferred_element_type=jnp.float32)
    per_head = (jax.nn.relu(per_head) * J**-0.5).reshape(B, T, I, -1)
    # HF projects the head weights in the model dtype, then scores in fp32.
    head_w = jnp.einsum("btd,di->bti", x, w.head_weights.astype(x.dtype)).astype(jnp.float32) * I**-0.5
    scores = jnp.einsum("bti,btis->bts", head_w, per_head)
    limit = (q_positions.astype(jnp.int32) + 1) // ratio
    visible = (key_ids[:, None, :] >= 0) & (key_ids[:, None, :] < limit[:, :, None])
    return jnp.where(visible, scores, -jnp.inf)


def index_select(w: CompressedIndexerWeights, config: ModelConfig, x: jax.Array, q_latent: jax.Array,
                 q_positions: jax.Array, cached_keys: jax.Array | QuantizedArray | None, cached_count: jax.Array | None,
                 new_keys: jax.Array, new_ids: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array]:
    """Each query's top-k compressed entries, HF ``DeepseekV4Indexer``'s picks.

    Keys are [cached E ; new M] along one axis: cached key e (``cached_keys`` [B,E,J], None: E=0)
    is window e, present iff e < ``cached_count`` [B]; new key k (``new_keys`` [B,M,J]) is window
    ``new_ids`` [B,M] (-1: absent), as :func:`compress` returns them. The caller must not list a
    window both cached and new.

    Returns (indices [B,T,k] into that concatenated E+M axis, valid [B,T,k]), k = min(index_topk,
    E+M): with fewer than k visible entries every visible one is picked and the rest are marked
    invalid (HF returns -1 for them). ``take_along_axis(ids, indices)`` gives the window ids.
    """
    _check_index(w, config, x, q_latent, cached_keys, new_keys, new_ids)
    dtype = q_latent.dtype
    keys, ids = new_keys.astype(dtype), new_ids.astype(jnp.int32)
    if cached_keys is not None:
        E = cached_keys.shape[1]
        e = jnp.arange(E, dtype=jnp.int32)[None, :]
        cached_ids = jnp.where(e < cached_count.astype(jnp.int32)[:, None], e, -1)
        keys = jnp.concatenate([dequantized(cached_keys, dtype), keys], axis=1)
        ids = jnp.concatenate([cached_ids, ids], axis=1)
    scores = index_scores(w, config, x, q_latent, q_positions, keys, ids, ratio)
    k = min(_compressed_config(config, "index_select").index_topk, scores.shape[-1])
    top, indices = jax.lax.top_k(scores, k)
    return indices, jnp.isfinite(top)
