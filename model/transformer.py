"""The decoder forward pass: pure functions over (weights, tokens, cache).

One implementation serves prefill and decode. ``forward`` runs ``tokens`` [B, T] as the
continuation of each row of the KV cache (at that row's current length): the new queries attend
to the cached keys plus the new keys, and it returns logits and the new keys/values.
``append_to_cache`` then writes those into the cache. Rows may have different lengths
(``num_new`` says how many of the T tokens of each row are real; the rest is bucket padding,
written past the row's length and never attended to).

Multi-head latent attention (``config.attention`` MLA, ``dayzero.model.mla``) caches one latent
row per token instead (:class:`LatentCache`); ``forward`` then returns :class:`NewLatent`. With
sparse attention (``config.dsa``) each token also caches its indexer key beside the latent row.

Why two functions: when one XLA:CPU computation both reads a cache buffer and updates it in
place, XLA copies the whole buffer (measured: 60 x [1,3,8192,64] buffers, 0.3 ms for the update
alone, 228 ms with a read beside it). Jitted separately, with the cache donated to the update,
the read and the in-place write stay copy-free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model.config import AttentionKind, ModelConfig
from dayzero.model.mla import mla_block
from dayzero.model.moe import moe, swiglu
from dayzero.model.norm import rms_norm
from dayzero.model.quant import KV_FORMATS, KVQuant, QuantizedArray, dequantized, empty_quantized, quantize_like
from dayzero.model.rope import apply_rope, rope_cos_sin
from dayzero.model.weights import AttentionWeights, LayerWeights, MLPWeights, MoEWeights, Weights


@struct.dataclass
class KVCache:
    """Per-layer keys [B, K, H, S], values [B, K, S, H] and per-row valid lengths [B].

    These are the layouts XLA:CPU contracts fastest for decode (measured on [1,3,8192,64] with
    9 query heads: q.k 0.28 ms with keys [B,K,H,S] against 0.57 ms with [B,K,S,H]; p.v 0.14 ms
    with values [B,K,S,H] against 1.46 ms with [B,K,H,S]).

    ``rope_len`` is the longest sequence seen so far (a scalar), which dynamic-NTK RoPE needs.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    rope_len: jax.Array

    @property
    def max_len(self) -> int:
        """S, the number of positions each row can hold."""
        return self.v[0].shape[2]

    def layer(self, i: int) -> tuple[jax.Array, ...]:
        """Layer ``i``'s cached arrays, as its attention block takes them."""
        return self.k[i], self.v[i]


@struct.dataclass
class LatentCache:
    """Multi-head latent attention's cache: per layer one row per position [B, S, L+R] (the
    normed kv latent, then the rotated rope key), per-row lengths [B] and ``rope_len``.

    One array serves as both keys and values of the absorbed form (see ``dayzero.model.mla``),
    so it has one layout, [B,S,C]: the value product reads it as XLA:CPU's fast [B,S,H] value
    layout; the score product reads it as keys in the slower of the two layouts measured for
    ``KVCache`` (a copy in the other layout would double the cache).

    ``index_keys``: with sparse attention (DeepSeek-V3.2), per layer the indexer key of each
    position [B, S, J] (J = ``index_head_dim``); None otherwise.
    """

    latent: tuple[jax.Array, ...]
    lengths: jax.Array
    rope_len: jax.Array
    index_keys: tuple[jax.Array, ...] | None = None

    @property
    def max_len(self) -> int:
        """S, the number of positions each row can hold."""
        return self.latent[0].shape[1]

    def layer(self, i: int) -> tuple[jax.Array, ...]:
        """Layer ``i``'s cached arrays, as its attention block takes them."""
        return (self.latent[i],) if self.index_keys is None else (self.latent[i], self.index_keys[i])


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               kv_quant: KVQuant = KVQuant.NONE) -> KVCache | LatentCache:
    """An empty cache holding ``max_len`` positions for each of ``batch`` rows (latent rows for
    multi-head latent attention, per-head keys and values otherwise).

    With ``kv_quant`` each buffer is a :class:`QuantizedArray` with one scale per token and head
    (per token for latent rows and indexer keys); it is quantized on write, dequantized on read.
    """
    def zeros(shape: tuple[int, ...], head_axis: int):
        if kv_quant is KVQuant.NONE:
            return jnp.zeros(shape, dtype)
        return empty_quantized(shape, KV_FORMATS[kv_quant], (head_axis,))

    if config.mla is not None:
        width = config.mla.kv_lora_rank + config.mla.rope_dim
        keys = None
        if config.dsa is not None:
            keys = tuple(zeros((batch, max_len, config.dsa.head_dim), 2) for _ in range(config.num_layers))
        return LatentCache(
            latent=tuple(zeros((batch, max_len, width), 2) for _ in range(config.num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
            rope_len=jnp.zeros((), jnp.int32),
            index_keys=keys,
        )
    k_shape = (batch, config.num_kv_heads, config.head_dim, max_len)
    v_shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(
        k=tuple(zeros(k_shape, 2) for _ in range(config.num_layers)),
        v=tuple(zeros(v_shape, 3) for _ in range(config.num_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
        rope_len=jnp.zeros((), jnp.int32),
    )


def mlp(w: MLPWeights, x: jax.Array) -> jax.Array:
    """The dense SwiGLU MLP: down(silu(gate x) * up x)."""
    return swiglu(x, w.gate, w.up, w.down)


def attention_masks(
    starts: jax.Array, num_new: jax.Array, T: int, max_len: int | None, window: int | None
) -> tuple[jax.Array | None, jax.Array]:
    """Visibility of cached keys [B,T,S] and of the T new keys [B,T,T] to each new query.

    With ``max_len`` None there is no cache to read and the first mask is None.

    A cached slot is visible if it was written before this call (slot < start); a new key j is
    visible to new query i if it is real (j < num_new) and causal (j <= i). Sliding-window
    layers also require query position - key position < window.
    """
    B = starts.shape[0]
    i = jnp.arange(T)[None, :, None]
    j = jnp.arange(T)[None, None, :]
    new = (j <= i) & (j < num_new[:, None, None])
    if window is not None:
        new &= i - j < window
    new = jnp.broadcast_to(new, (B, T, T))
    if max_len is None:
        return None, new
    slots = jnp.arange(max_len)[None, None, :]
    cached = slots < starts[:, None, None]
    if window is not None:
        cached &= starts[:, None, None] + i - slots < window
    return jnp.broadcast_to(cached, (B, T, max_len)), new


def attend(
    q: jax.Array,
    k_cache: jax.Array | None,
    v_cache: jax.Array | None,
    k_new: jax.Array,
    v_new: jax.Array,
    masks: tuple[jax.Array | None, jax.Array],
) -> jax.Array:
    """Grouped-query softmax attention of the new queries over cached and new keys -> [B,T,N,H].

    q, k_new, v_new [B,T,*,H]; k_cache [B,K,H,S], v_cache [B,K,S,H] (the cache layouts): the
    cache as it was before this call (None: nothing cached), the new keys and values beside it.
    """
    B, T, N, H = q.shape
    K = k_new.shape[2]
    G = N // K
    # Queries as [B, K, G*T, H]: the cache matmuls then have the canonical batched form
    # (batch B,K; rows G*T), which XLA:CPU runs without relayouting the cache.
    qg = (q * (H**-0.5)).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    mask_cached, mask_new = masks  # [B, T, S], [B, T, T]
    scores = jnp.einsum("bkmh,bjkh->bkmj", qg, k_new, preferred_element_type=jnp.float32)
    mask = mask_new
    if k_cache is not None:
        s_cached = jnp.einsum("bkmh,bkhs->bkms", qg, k_cache, preferred_element_type=jnp.float32)
        scores = jnp.concatenate([s_cached, scores], axis=-1)
        mask = jnp.concatenate([mask_cached, mask_new], axis=-1)
    # Broadcast the [B, T, keys] mask over K and G, in the [B, K, G*T, keys] order of scores.
    mask = jnp.broadcast_to(mask[:, None, None], (B, 1, G) + mask.shape[1:]).reshape(B, 1, G * T, -1)
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A query with no visible key (padding of an empty row) would be NaN; make it zero.
    probs = jnp.where(mask, probs, 0.0).astype(v_new.dtype)
    S = 0 if v_cache is None else v_cache.shape[2]
    out = jnp.einsum("bkmj,bjkh->bkmh", probs[..., S:], v_new)
    if v_cache is not None:
        out += jnp.einsum("bkms,bksh->bkmh", probs[..., :S], v_cache.astype(v_new.dtype))
    return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def attention_block(
    w: AttentionWeights,
    config: ModelConfig,
    x: jax.Array,
    cos_sin: tuple[jax.Array, jax.Array],
    k_cache: jax.Array | None,
    v_cache: jax.Array | None,
    masks: tuple[jax.Array | None, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Self-attention of ``x`` [B,T,D] over the cache; returns output and the new keys/values."""
    q = jnp.einsum("btd,dnh->btnh", x, dequantized(w.q, x.dtype))
    k = jnp.einsum("btd,dkh->btkh", x, dequantized(w.k, x.dtype))
    v = jnp.einsum("btd,dkh->btkh", x, dequantized(w.v, x.dtype))
    if w.q_bias is not None:
        q, k, v = q + w.q_bias, k + w.k_bias, v + w.v_bias
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, config.rms_norm_eps)
        k = rms_norm(k, w.k_norm, config.rms_norm_eps)
    cos, sin = cos_sin
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if k_cache is not None:
        k_cache, v_cache = dequantized(k_cache, q.dtype), dequantized(v_cache, q.dtype)
    out = attend(q, k_cache, v_cache, k, v, masks)
    # Contract over the flattened N*H axis: a reshape of w.o is free, an einsum over (n, h)
    # makes XLA:CPU transpose w.o on every call.
    B, T, N, H = out.shape
    out = jnp.einsum("bte,ed->btd", out.reshape(B, T, N * H), dequantized(w.o, x.dtype).reshape(N * H, -1))
    if w.o_bias is not None:
        out = out + w.o_bias
    return out, k, v


def decoder_layer(
    w: LayerWeights,
    config: ModelConfig,
    x: jax.Array,
    cos_sin: tuple[jax.Array, jax.Array],
    layer_cache: tuple[jax.Array, ...] | None,
    masks: tuple[jax.Array | None, jax.Array],
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Pre-norm residual block: attention then SwiGLU MLP or MoE.

    ``layer_cache`` is the layer's cached arrays (``cache.layer(i)``, None when nothing is
    cached); also returns what the layer adds to the cache: (keys, values), or (latent rows,)
    for multi-head latent attention, (latent rows, indexer keys) with sparse attention.
    """
    h = rms_norm(x, w.attn_norm, config.rms_norm_eps)
    if config.attention is AttentionKind.MLA:
        attn_out, new = mla_block(w.attn, config, h, cos_sin, layer_cache, masks)
    else:
        k_cache, v_cache = (None, None) if layer_cache is None else layer_cache
        attn_out, k, v = attention_block(w.attn, config, h, cos_sin, k_cache, v_cache, masks)
        new = (k, v)
    x = x + attn_out
    h = rms_norm(x, w.mlp_norm, config.rms_norm_eps)
    # The weight tree's type per layer follows config.moe.layers (see weights._layer_specs).
    x = x + (moe(w.mlp, config.moe, h) if isinstance(w.mlp, MoEWeights) else mlp(w.mlp, h))
    return x, new


def output_logits(weights: Weights, x: jax.Array) -> jax.Array:
    """Project hidden states [B,T,D] to fp32 vocabulary logits [B,T,V]."""
    if weights.lm_head is None:
        return jnp.einsum("btd,vd->btv", x, weights.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", x, weights.lm_head, preferred_element_type=jnp.float32)


@struct.dataclass
class NewKV:
    """What one ``forward`` call adds to the cache: per-layer keys/values [B,T,K,H]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    num_new: jax.Array  # [B] real tokens per row
    rope_len: jax.Array  # the cache's new ``rope_len``


@struct.dataclass
class NewLatent:
    """What one ``forward`` call adds to a :class:`LatentCache`: per-layer latent rows [B,T,L+R]
    (and indexer keys [B,T,J] with sparse attention)."""

    latent: tuple[jax.Array, ...]
    num_new: jax.Array  # [B] real tokens per row
    rope_len: jax.Array  # the cache's new ``rope_len``
    index_keys: tuple[jax.Array, ...] | None = None


def forward(
    weights: Weights,
    config: ModelConfig,
    tokens: jax.Array,
    cache: KVCache | LatentCache | None = None,
    num_new: jax.Array | None = None,
    all_logits: bool = False,
    hidden_out: list | None = None,
) -> tuple[jax.Array, NewKV | NewLatent]:
    """Run ``tokens`` [B,T] as the continuation of each cached row (from scratch if no cache).

    ``num_new`` [B] is how many of the T tokens of each row are real (default: all T).
    Returns fp32 logits [B,T,V] if ``all_logits`` else the logits of each row's last real token
    [B,V], and the new keys/values to pass to :func:`append_to_cache`. ``hidden_out``, when
    given a list, receives each decoder layer's output (for layer-by-layer comparison).
    A first prefill should pass ``cache=None`` rather than an empty cache: reading an empty
    cache costs as much attention work as a full one.
    """
    B, T = tokens.shape
    if num_new is None:
        num_new = jnp.full((B,), T, jnp.int32)
    if cache is None:
        starts, rope_len, max_len = jnp.zeros((B,), jnp.int32), jnp.max(num_new), None
    else:
        starts, max_len = cache.lengths, cache.max_len
        rope_len = jnp.maximum(cache.rope_len, jnp.max(starts + num_new))
    positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    cos_sin = rope_cos_sin(config.rope, config.head_dim, config.max_position_embeddings, positions, rope_len)
    masks = {
        window: attention_masks(starts, num_new, T, max_len, window)
        for window in set(config.sliding_windows)
    }
    x = jnp.take(weights.embed, tokens, axis=0)
    new = []  # per layer, what it adds to the cache
    for i, layer in enumerate(weights.layers):
        layer_masks = masks[config.sliding_windows[i]]
        x, added = decoder_layer(layer, config, x, cos_sin, None if cache is None else cache.layer(i), layer_masks)
        new.append(added)
        if hidden_out is not None:
            hidden_out.append(x)
    x = rms_norm(x, weights.final_norm, config.rms_norm_eps)
    if not all_logits:
        last = jnp.clip(num_new - 1, 0, T - 1)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)
    logits = output_logits(weights, x)
    if not all_logits:
        logits = logits[:, 0, :]
    if config.mla is not None:
        keys = None if config.dsa is None else tuple(n[1] for n in new)
        return logits, NewLatent(latent=tuple(n[0] for n in new), num_new=num_new, rope_len=rope_len, index_keys=keys)
    return logits, NewKV(k=tuple(n[0] for n in new), v=tuple(n[1] for n in new), num_new=num_new, rope_len=rope_len)


def _write_rows(buffer: jax.Array, new: jax.Array, starts: jax.Array, seq_axis: int) -> jax.Array:
    """Write ``new`` (already in the buffer's layout) into ``buffer`` at per-row start positions
    (quantized first, values and scales written alike, when the buffer is quantized)."""
    if isinstance(buffer, QuantizedArray):
        q = quantize_like(new, buffer)
        return buffer.replace(values=_write_rows(buffer.values, q.values, starts, seq_axis),
                              scale=_write_rows(buffer.scale, q.scale, starts, seq_axis))
    new = new.astype(buffer.dtype)
    if buffer.shape[0] == 1:  # a plain in-place update; the batched form lowers to a scatter
        return jax.lax.dynamic_update_slice_in_dim(buffer, new, starts[0], axis=seq_axis)

    def write_one(buf, x, start):
        return jax.lax.dynamic_update_slice_in_dim(buf, x, start, axis=seq_axis - 1)

    return jax.vmap(write_one)(buffer, new, starts)


def append_to_cache(cache: KVCache | LatentCache, new: NewKV | NewLatent) -> KVCache | LatentCache:
    """Write the keys/values (or latent rows) of one ``forward`` call at each row's length and
    advance lengths.

    Jit it with the cache donated (and apart from ``forward``, see the module docstring). The
    cache must have room: ``max(lengths) + T <= max_len``, or the write would be clamped.
    """
    starts = cache.lengths
    if isinstance(cache, LatentCache):
        latent = tuple(_write_rows(c, n, starts, 1) for c, n in zip(cache.latent, new.latent))
        keys = None
        if cache.index_keys is not None:
            keys = tuple(_write_rows(c, n, starts, 1) for c, n in zip(cache.index_keys, new.index_keys))
        return LatentCache(latent=latent, lengths=starts + new.num_new, rope_len=new.rope_len, index_keys=keys)
    k = tuple(_write_rows(c, n.transpose(0, 2, 3, 1), starts, 3) for c, n in zip(cache.k, new.k))
    v = tuple(_write_rows(c, n.transpose(0, 2, 1, 3), starts, 2) for c, n in zip(cache.v, new.v))
    return KVCache(k=k, v=v, lengths=starts + new.num_new, rope_len=new.rope_len)
