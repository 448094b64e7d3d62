"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) in the absorbed form.

Each token is cached as one latent row of C = L + R values (``kv_lora_rank`` after its RMSNorm,
then the rotated rope key shared by all heads), not as N per-head keys and values. Per head n,
HF expands the latent c into a key ``[k_up[n] c, k_rope]`` and a value ``v_up[n] c``. Attention
is linear in both, so the up-projections move to the query and output sides:

    q_n . k_n = (k_up[n]^T q_nope_n) . c + q_rope_n . k_rope = [q_latent_n, q_rope_n] . latent
    sum_s p_s v_n(s) = v_up[n] (sum_s p_s c_s)

so every head attends over the cached latent rows themselves (one [C]-wide dot product per key)
and nothing per head is ever materialised for the cache. Prefill uses the same absorbed form as
decode: one implementation, and a prefill never builds per-head keys for S positions. (The
expanded form does fewer FLOPs per score, P + R against L + R, which a long-prompt prefill on an
accelerator may want back one day; it would be a second implementation of the same block.)

With DeepSeek Sparse Attention (``config.dsa``, DeepSeek-V3.2) each query attends only to the
tokens the indexer of ``dayzero.model.dsa`` picks. A call with few queries (decode) gathers
those k rows per query from the cache, so its work no longer grows with the context; a call with
many queries (prefill) narrows the dense masks instead, where scanning all keys is cheaper than
gathering T*k rows. Both compute the same softmax over the same tokens. GLM-5's "shared" layers
(``DSAConfig.shared``, no indexer weights) run no indexer: they attend to the tokens the last
full layer picked, which ``mla_block`` takes and returns as its ``picks``.

The block returns the new latent rows (and indexer keys); ``cache.append_to_cache`` writes them,
keeping ``forward``'s read and the cache's in-place write in separate jits (see ``model/cache.py``).
With a quantized cache, the new rows are read as the cache will store them (``quant.as_stored``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dayzero.kernels import tiles
from dayzero.model import dsa
from dayzero.model.cache import fold_blocks, read_block
from dayzero.model.config import ModelConfig, RopeType
from dayzero.model.norm import rms_norm
from dayzero.model.kernel_attention import KernelLayer
from dayzero.model.quant import as_stored, dequantized, take_along_axis
from dayzero.model.rope import yarn_mscale, apply_rope, deinterleave
from dayzero.model.weights import MLAWeights

# HF builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(P+R), times mscale^2 when the RoPE scaling sets ``mscale_all_dim`` (as HF and
    DeepSeek do: the YaRN entropy correction goes into the logits, not only into cos/sin)."""
    m, rope = config.mla, config.rope
    scale = (m.nope_dim + m.rope_dim) ** -0.5
    if rope.type is not RopeType.DEFAULT and rope.mscale_all_dim:
        mscale = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= mscale * mscale
    return scale


def _queries(w: MLAWeights, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Per-head queries [B,T,N,P+R] and the q LoRA latent [B,T,Q] they come from (None without
    a q LoRA; the sparse-attention indexer reads it too)."""
    if w.q is not None:
        return jnp.einsum("btd,dnh->btnh", x, dequantized(w.q, x.dtype)), None
    q_latent = rms_norm(x @ dequantized(w.q_a, x.dtype), w.q_a_norm, LORA_NORM_EPS)
    return jnp.einsum("btq,qnh->btnh", q_latent, dequantized(w.q_b, x.dtype)), q_latent


def _rope(x: jax.Array, config: ModelConfig, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate the rope part [B,T,heads,R], from DeepSeek's interleaved pairs if the model uses them
    (left as it is without positions: Kimi-Linear's ``nope``)."""
    if config.mla.nope:
        return x
    if config.mla.rope_interleave:
        x = deinterleave(x)
    return apply_rope(x, *cos_sin)


def latent_rows(w: MLAWeights, config: ModelConfig, x: jax.Array,
                cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """What the cache stores for tokens ``x`` [B,T,D]: [normed latent, rotated rope key] [B,T,L+R]."""
    L = config.mla.kv_lora_rank
    kv = x @ dequantized(w.kv_a, x.dtype)
    latent = rms_norm(kv[..., :L], w.kv_a_norm, LORA_NORM_EPS)
    k_rope = _rope(kv[..., None, L:], config, cos_sin)[:, :, 0]
    return jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    # A query with no visible key (padding of an empty row) would be NaN; make it zero.
    return jnp.where(mask, probs, 0.0)


def _per_head(mask: jax.Array, N: int) -> jax.Array:
    """A [B,T,keys] mask repeated for each head, in the (t, n) row order of flattened queries."""
    B, T, K = mask.shape
    return jnp.broadcast_to(mask[:, :, None], (B, T, N, K)).reshape(B, T * N, K)


# One block of keys as softmax statistics per flattened query (``dayzero.kernels.tiles.Stats``):
# m [B,M], l [B,M], o [B,M,C]. Blocks merge exactly (``merge_blocks``), so attention over several
# blocks never concatenates their scores, and a block split across devices merges with pmax/psum
# (``dayzero.model.mla_parallel``).
Stats = tiles.Stats
merge_blocks = tiles.merge_stats


def block_stats(qf: jax.Array, rows: jax.Array, mask: jax.Array, heads: int,
                reduce_max: Callable[[jax.Array], jax.Array] = lambda m: m) -> Stats:
    """Softmax statistics of queries ``qf`` [B,M,C] (M = T*heads) over ``rows`` [B,S,C] under
    ``mask`` [B,T,S]. ``reduce_max`` makes the maximum a shared one (e.g. across devices)
    before the exponentials are taken."""
    rows = dequantized(rows, qf.dtype)  # a quantized cache is read back here, per block
    scores = jnp.einsum("bmc,bsc->bms", qf, rows, preferred_element_type=jnp.float32)

    def values(p):
        return jnp.einsum("bms,bsc->bmc", p.astype(qf.dtype), rows, preferred_element_type=jnp.float32)

    return tiles.masked_stats(scores, _per_head(mask, heads), values, reduce_max)


def normalised(stats: Stats, shape: tuple[int, ...], dtype) -> jax.Array:
    """The attention output o / l reshaped to ``shape``; zero for a query with no visible key."""
    return tiles.finish_stats(stats).astype(dtype).reshape(shape)


def attend_latent(q: jax.Array, cache: jax.Array | None, new: jax.Array,
                  masks: tuple[jax.Array | None, jax.Array]) -> jax.Array:
    """Softmax attention of absorbed queries ``q`` [B,T,N,C] over latent rows -> [B,T,N,C].

    ``cache`` [B,S,C] (the rows written before this call, or None) and ``new`` [B,T,C]; masks as
    ``transformer.attention_masks`` makes them ([B,T,S], [B,T,T]). Queries are flattened to
    [B, T*N, C] (a free reshape), so both products are plain batched matmuls over the cache.
    The value product runs over all C columns and drops the rope ones afterwards: slicing the
    cache first would copy it, and the R extra columns cost only R/L more work.

    The cached and the new keys are blocks (``block_stats``) merged before one normalisation,
    so the cache's scores are never copied into a concatenation with the new ones. The cache is
    read in blocks, only those holding a visible row (``cache.fold_blocks``): a decode step's
    work follows the rows written, not the positions allocated. ``dayzero.model.mla_parallel``
    computes the cached block split across devices.
    """
    B, T, N, C = q.shape
    qf = q.reshape(B, T * N, C)
    mask_cached, mask_new = masks
    stats = block_stats(qf, new, mask_new, N)
    if cache is not None:
        def cached_block(start, size, mask):  # the rows [start, start + size) and their mask
            rows = dequantized(read_block(cache, start, size, 1), qf.dtype)
            # Rows no query sees get weight 0, but 0 * NaN is NaN: zero whatever they hold.
            return block_stats(qf, jnp.where(jnp.any(mask, axis=1)[..., None], rows, 0), mask, N)

        empty = (jnp.full(qf.shape[:2], -jnp.inf), jnp.zeros(qf.shape[:2]), jnp.zeros(qf.shape, jnp.float32))
        stats = merge_blocks(fold_blocks(mask_cached, cached_block, empty), stats)
    return normalised(stats, q.shape, q.dtype)


def attend_gathered(q: jax.Array, cache: jax.Array, new: jax.Array, mask_new: jax.Array,
                    indices: jax.Array, visible: jax.Array) -> jax.Array:
    """Sparse attention of ``q`` [B,T,N,C] over the rows ``indices`` [B,T,k] picks from the
    cached rows [B,S,C] then the new ones [B,T,C] (``dsa.select``'s output) -> [B,T,N,C].

    Only the k picked cache rows per query are read (a gather), never the whole cache; the T
    new rows are attended to directly, masked to the picked ones.
    """
    B, T, N, C = q.shape
    S = cache.shape[1]
    from_cache = indices < S
    rows = dequantized(take_along_axis(cache, jnp.where(from_cache, indices, 0).reshape(B, -1, 1), axis=1), q.dtype)
    mask_picked = visible & from_cache  # [B,T,k]
    # Zero the rows of picks that are not visible cached ones (they read slot 0 or stale slots),
    # so that whatever those slots hold cannot leak in through 0 * inf.
    rows = jnp.where(mask_picked[..., None], rows.reshape(B, T, -1, C), 0).astype(q.dtype)  # [B,T,k,C]
    picked_new = (indices[..., None] == S + jnp.arange(T)) & visible[..., None]  # [B,T,k,T]
    mask_new = mask_new & picked_new.any(axis=2)  # [B,T,T]
    s_picked = jnp.einsum("btnc,btkc->btnk", q, rows, preferred_element_type=jnp.float32)
    s_new = jnp.einsum("btnc,bjc->btnj", q, new, preferred_element_type=jnp.float32)
    scores = jnp.concatenate([s_picked, s_new], axis=-1)
    mask = jnp.concatenate([mask_picked, mask_new], axis=-1)[:, :, None]  # the same for every head
    probs = _masked_softmax(scores, mask).astype(q.dtype)
    k = rows.shape[2]
    return (jnp.einsum("btnk,btkc->btnc", probs[..., :k], rows)
            + jnp.einsum("btnj,bjc->btnc", probs[..., k:], new.astype(q.dtype)))


# The indexer's picks of one forward call: (indices [B,T,k], visible [B,T,k]) as ``dsa.select``
# returns them, which GLM-5's shared layers reuse.
Picks = tuple[jax.Array, jax.Array]


def _sparse_attention(q_cat: jax.Array, select: Callable[[jax.Array | None], Picks],
                      layer_cache: tuple[jax.Array, jax.Array] | None, new: jax.Array, masks,
                      attend: Callable) -> jax.Array:
    """DSA: ``select`` (given the cached indexer keys) picks each query's tokens, latent attention
    reads only those (``attend``: the dense latent attention, used with narrowed masks when
    scanning beats gathering)."""
    latent_cache, key_cache = (None, None) if layer_cache is None else layer_cache
    indices, visible = select(key_cache)
    T, k = indices.shape[1], indices.shape[2]
    S = 0 if latent_cache is None else latent_cache.shape[1]
    # Gather when T*k picked rows are fewer than the S+T rows a dense scan reads (decode past
    # the first k tokens); else narrow the dense masks (prefill, or a context of <= k tokens).
    if latent_cache is not None and T * k < S + T:
        return attend_gathered(q_cat, latent_cache, new, masks[1], indices, visible)
    return attend(q_cat, latent_cache, new, dsa.selection_masks(indices, visible, masks))


def mla_block(
    w: MLAWeights,
    config: ModelConfig,
    x: jax.Array,
    cos_sin: tuple[jax.Array, jax.Array],
    layer_cache: tuple[jax.Array, ...] | None,
    masks: tuple[jax.Array | None, jax.Array],
    attend: Callable = attend_latent,
    picks: Picks | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], Picks | None]:
    """Latent self-attention of ``x`` [B,T,D] over the layer's cache (None: nothing cached):
    ``(latent rows [B,S,L+R],)``, plus the indexer keys [B,S,J] with sparse attention.

    Returns the output [B,T,D] and what ``append_to_cache`` adds, in the same order: the new
    latent rows [B,T,L+R] (and indexer keys [B,T,J]). A kernel layer
    (``dayzero.model.kernel_attention``) attends on the kernels instead: over the new rows only (a
    first prefill), or over its pages, the new rows written first, the written pages then
    returned in their place. ``attend``: dense latent attention with
    ``attend_latent``'s signature (``dayzero.model.mla_parallel`` swaps in a version for a
    cache split over devices); sparse attention uses it where it scans the cache densely.

    ``picks``: the last full sparse layer's picks in this call, returned as they are by a
    shared layer (GLM-5; one with no indexer weights), which attends to them instead of its own;
    a full sparse layer returns its own picks, a dense one None.
    """
    m = config.mla
    q, q_lora = _queries(w, x)
    q_nope, q_rope = q[..., : m.nope_dim], _rope(q[..., m.nope_dim :], config, cos_sin)
    q_latent = jnp.einsum("btnp,lnp->btnl", q_nope, dequantized(w.k_up, x.dtype))  # k_up folded into the query
    q_cat = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1) * softmax_scale(config)
    new = latent_rows(w, config, x, cos_sin)
    on_kernels = isinstance(layer_cache, KernelLayer)
    if config.dsa is None and on_kernels:
        attended, added = layer_cache.attend_latent(q_cat, new, m.kv_lora_rank)
    elif config.dsa is None:
        added = (new,)
        cache = None if layer_cache is None else layer_cache[0]
        attended = attend(q_cat, cache, as_stored(new, cache), masks)  # new rows read as the cache holds them
    else:
        if w.indexer is None:  # a shared layer: no indexer, its cache's key slot stays zero and unread
            if picks is None:
                raise ValueError("a shared sparse-attention layer needs the picks of a full layer before it")
            new_keys = jnp.zeros(x.shape[:2] + (config.dsa.head_dim,), x.dtype)
            given = picks

            def select(key_cache):
                return given
        else:
            new_keys = dsa.index_keys(w.indexer, config, x, cos_sin)

            def select(key_cache):  # the kernel layer calls it with the cached indexer keys it holds
                nonlocal picks  # called once per block, in this trace: the next shared layers reuse it
                picks = dsa.select(w.indexer, config, x, q_lora, cos_sin, key_cache, new_keys, masks)
                return picks
        if on_kernels:
            attended, added = layer_cache.attend_sparse(q_cat, new, new_keys, select, m.kv_lora_rank)
        else:
            added = (new, new_keys)
            stored = new if layer_cache is None else as_stored(new, layer_cache[0])
            attended = _sparse_attention(q_cat, select, layer_cache, stored, masks, attend)
    out_latent = attended[..., : m.kv_lora_rank]
    out = jnp.einsum("btnl,lnv->btnv", out_latent, dequantized(w.v_up, x.dtype))  # v_up applied after attention
    B, T, N, V = out.shape
    # A flattened N*V contraction, as in transformer.attention_block (an einsum over (n, v)
    # made XLA:CPU transpose the o weight on every call).
    out = jnp.einsum("bte,ed->btd", out.reshape(B, T, N * V), dequantized(w.o, x.dtype).reshape(N * V, -1))
    return out, added, picks
