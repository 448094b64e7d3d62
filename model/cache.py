"""The caches, in one room: what each kind holds, how it is declared, made and written.

- :class:`KVCache` (per-head keys and values) and :class:`LatentCache` (multi-head latent
  attention's latent rows, plus DeepSeek sparse attention's indexer keys): the contiguous caches
  ``Engine`` decodes over, declared once by :func:`cache_specs` (shapes and logical axes, from
  which ``init_cache`` and the shardings on a mesh follow) and written by
  :func:`append_to_cache`;
- what one ``forward`` call adds to a cache (:class:`NewKV`, :class:`NewLatent`);
- the page writes a paged cache shares with the kernels' in-place steps (:func:`page_slots`,
  :func:`write_rows`, :func:`write_head_rows`); the paged caches themselves are in
  ``dayzero.model.paged_cache``;
- :func:`write_quantized`, the one way a row write quantizes into a quantized buffer (one scale
  per row and head), used by the contiguous and the paged writes alike;
- :class:`CacheView`, the interface ``transformer.forward`` reads a cache through, which every
  cache (contiguous, paged, the kernels' paged view) has;
- :func:`fold_blocks` and :func:`read_block`: how the reference attention reads a cache, one
  block of ``KEY_BLOCK`` positions at a time and only the blocks holding a visible position, so
  a decode step reads the positions written so far, not every position allocated.

Why the write is its own function, apart from ``forward``: when one XLA:CPU computation both
reads a cache buffer and updates it in place, XLA copies the whole buffer (measured: 60 x
[1,3,8192,64] buffers, 0.3 ms for the update alone, 228 ms with a read beside it; an
``optimization_barrier`` between the reads and the writes did not stop the copies). Jitted
separately, with the cache donated to the update, the read and the in-place write stay copy-free.
The exception is :class:`InPlaceKVCache`: there one native call per layer both writes and reads
the layer's buffer (its result aliases the buffer), so nothing else reads it and the step that
donates the cache writes it without a copy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.kernels.tiles import Stats, merge_stats
from dayzero.model.config import ModelConfig
from dayzero.model.quant import KV_FORMATS, KVQuant, QuantizedArray, quantize_like, scale_shape
from dayzero.model.weights import Init, ParamSpec, map_specs


class CacheView(Protocol):
    """What ``transformer.forward`` reads of a cache: each row's length [B] before this call, the
    ``rope_len`` dynamic-NTK RoPE needs, the positions a row can hold (``max_len``), whether
    ``layer(i)``'s keys are token-major ([B,K,S,H], a paged view) rather than [B,K,H,S], and
    ``layer(i, after)``: the layer's cached arrays as its attention block takes them (``after``,
    the layer's input, lets a cache that builds them do so only once it exists)."""

    lengths: jax.Array
    rope_len: jax.Array
    keys_token_major: bool

    @property
    def max_len(self) -> int: ...

    def layer(self, i: int, after: jax.Array | None = None): ...


# Positions per block when attention reads a cache (``fold_blocks``). Measured on SmolLM2-135M
# decode (fp32, XLA:CPU, 2 threads): see NOTES.md (decode attention in blocks).
KEY_BLOCK = 512


def read_block(buffer: jax.Array | QuantizedArray, start: jax.Array, size: int,
               axis: int) -> jax.Array | QuantizedArray:
    """Positions [start, start + size) of a cache buffer along its position ``axis`` (a quantized
    buffer stays quantized: values and their scales sliced alike, dequantized by the reader)."""
    def cut(x):
        if isinstance(start, int) and start == 0 and size == x.shape[axis]:
            return x  # the whole axis: no slice op for XLA to materialise
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)

    if isinstance(buffer, QuantizedArray):
        return buffer.replace(values=cut(buffer.values), scale=cut(buffer.scale))
    return cut(buffer)


def fold_blocks(mask: jax.Array, block_stats: Callable[[jax.Array, int, jax.Array], Stats], init: Stats,
                size: int = KEY_BLOCK) -> Stats:
    """Softmax statistics over the cache positions ``mask`` [B,T,S] lets any query see, merged
    block by block: ``block_stats(start, size, block_mask)`` gives those of positions
    [start, start + size) under ``block_mask`` [B,T,size].

    Only blocks from the first to the last visible position (of any row) are read, in a loop
    whose trip count is computed at run time: a decode step reads the positions written so far
    (and a sliding window only the blocks it reaches), not the whole allocated cache. A cache
    of at most ``size`` positions is read whole, without a loop. ``S`` needs no multiple of
    ``size``: the last block is shifted back to end at S, and positions a block before it
    already covered are masked out of it.
    """
    S = mask.shape[-1]
    if S <= size:  # one block: no loop to run (its overhead is a few microseconds per trip)
        return merge_stats(init, block_stats(0, S, mask))
    seen = jnp.any(mask, axis=(0, 1))  # [S]: one reduction, shared by every layer reading this mask
    first, last = jnp.argmax(seen), S - 1 - jnp.argmax(seen[::-1])
    lo = jnp.where(seen[first], first // size, 0)
    hi = jnp.where(seen[first], last // size + 1, 0)
    offsets = jnp.arange(size)

    def body(j, stats):
        start = jnp.minimum(j * size, S - size)
        block_mask = jax.lax.dynamic_slice_in_dim(mask, start, size, axis=2) & (start + offsets >= j * size)
        return merge_stats(stats, block_stats(start, size, block_mask))

    return jax.lax.fori_loop(lo, hi, body, init)


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

    # ``layer(i)``'s keys are [B,K,H,S] (a paged cache's view is token-major [B,K,S,H]).
    keys_token_major = False

    @property
    def max_len(self) -> int:
        """S, the number of positions each row can hold."""
        return self.v[0].shape[2]

    def layer(self, i: int, after: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """Layer ``i``'s cached arrays, as its attention block takes them.

        ``after``: the layer's input activations. A cache that builds the arrays (the paged
        cache gathers them) builds them only once ``after`` exists, so that the views of all
        layers are not live at once; this one ignores it.
        """
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

    keys_token_major = False  # no per-head keys: the latent blocks read ``layer(i)`` as it is

    @property
    def max_len(self) -> int:
        """S, the number of positions each row can hold."""
        return self.latent[0].shape[1]

    def layer(self, i: int, after: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """Layer ``i``'s cached arrays, as its attention block takes them (``after`` as
        :meth:`KVCache.layer`'s, ignored here)."""
        return (self.latent[i],) if self.index_keys is None else (self.latent[i], self.index_keys[i])


@struct.dataclass
class InPlaceLayer:
    """One layer's float32 cache for a step that writes its new keys in place as it attends
    (:class:`InPlaceKVCache`): keys [B,K,H,S], values [B,K,S,H], each row's ``starts`` [B] and
    ``num_new`` [B], and the layer's sliding ``window`` (None: none)."""

    k: jax.Array
    v: jax.Array
    starts: jax.Array
    num_new: jax.Array
    window: int | None = struct.field(pytree_node=False, default=None)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
               sinks: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of q [B,T,N,H] over the cache and the new k, v [B,T,K,H], written into it
        first -> (output [B,T,N,H], the written (keys, values)), as ``transformer.attend`` with
        ``append_to_cache`` after it gives them."""
        from dayzero.kernels import cpu_attention

        out, keys, values = cpu_attention.attend_in_place(q, k, v, self.k, self.v, self.starts, self.num_new,
                                                          self.window, sinks)
        return out.astype(q.dtype), (keys, values)


@struct.dataclass
class InPlaceKVCache:
    """A :class:`KVCache` as ``transformer.forward`` reads it in a step that writes it in place:
    each attention layer writes its new keys and values into the cache and attends over them in
    one native call (``kernels.cpu_attention.attend_in_place``), and ``forward`` returns the cache
    written, lengths advanced, in place of the keys and values to append.

    Why: on single-device CPU a decode step otherwise ran the new keys' softmax, the merge with
    the cache's statistics and the finish as a dozen small XLA ops per layer, then a second
    program for the write. The step that reads this view must donate the cache (``Engine`` does,
    where :meth:`applies`): a cache both read and written in one XLA computation is otherwise
    copied whole (see the module docstring).
    """

    cache: KVCache
    num_new: jax.Array
    windows: tuple[int | None, ...] = struct.field(pytree_node=False)

    keys_token_major = False

    @staticmethod
    def applies(cache, T: int) -> bool:
        """Whether a step of ``T`` tokens per row over ``cache`` can write it in place: a plain
        float32 :class:`KVCache` where the native kernel serves (``cpu_attention.in_place_applies``)."""
        from dayzero.kernels import cpu_attention

        return isinstance(cache, KVCache) and cpu_attention.in_place_applies(cache.k[0], cache.v[0], T)

    @property
    def lengths(self) -> jax.Array:
        """Each row's length [B] before this step."""
        return self.cache.lengths

    @property
    def rope_len(self) -> jax.Array:
        """The longest sequence seen before this step."""
        return self.cache.rope_len

    @property
    def max_len(self) -> int:
        """S, the positions each row can hold."""
        return self.cache.max_len

    def layer(self, i: int, after: jax.Array | None = None) -> InPlaceLayer:
        """Layer ``i``'s cache for its attention block (``after`` is not needed)."""
        return InPlaceLayer(self.cache.k[i], self.cache.v[i], self.cache.lengths, self.num_new, self.windows[i])

    def written(self, new: list[tuple[jax.Array, jax.Array]], rope_len: jax.Array) -> KVCache:
        """The cache with every layer's (keys, values) as its block wrote them, lengths advanced."""
        return KVCache(k=tuple(n[0] for n in new), v=tuple(n[1] for n in new),
                       lengths=self.cache.lengths + self.num_new, rope_len=rope_len)


def cache_specs(config: ModelConfig, batch: int, max_len: int,
                kv_quant: KVQuant = KVQuant.NONE) -> KVCache | LatentCache:
    """The cache declared abstractly: a :class:`ParamSpec` (shape, logical axes) at every leaf.

    Like ``abstract_weights`` for the weights, this one tree gives the cache's shapes
    (:func:`init_cache`) and its shardings (``dayzero.sharding.rules.weight_shardings``). The
    latent cache has no head axis, so its positions carry their own logical axis
    (``latent_seq``) that a strategy may split where per-head caches keep ``cache_seq`` whole.
    With ``kv_quant`` each buffer is a :class:`QuantizedArray` of stored values and one fp32
    scale per token and head (per token for latent rows and indexer keys): quantized on write,
    dequantized on read.
    """
    def buffer(shape: tuple[int, ...], axes: tuple[str | None, ...], channel_axis: int):
        return buffer_spec(shape, axes, channel_axis, kv_quant)

    if config.compressed is not None:  # DeepSeek-V4's window rings, entries and compressor states
        from dayzero.model import compressed_cache

        return compressed_cache.cache_specs(config, batch, max_len, kv_quant)
    if config.linear is not None:  # a hybrid: KV rows for the attention layers, states for the linear ones
        from dayzero.model.linear_cache import attention_config, hybrid_specs

        return hybrid_specs(config, cache_specs(attention_config(config), batch, max_len, kv_quant), batch)
    lengths = ParamSpec((batch,), ("batch",), Init.ZEROS, jnp.dtype(jnp.int32))
    rope_len = ParamSpec((), (), Init.ZEROS, jnp.dtype(jnp.int32))
    layers = range(config.num_layers)
    if config.mla is not None:
        width = config.mla.kv_lora_rank + config.mla.rope_dim
        latent = buffer((batch, max_len, width), ("batch", "latent_seq", None), 2)
        keys = None
        if config.dsa is not None:
            key = buffer((batch, max_len, config.dsa.head_dim), ("batch", "latent_seq", None), 2)
            keys = tuple(key for _ in layers)
        return LatentCache(latent=tuple(latent for _ in layers), lengths=lengths, rope_len=rope_len, index_keys=keys)
    K, H = config.num_kv_heads, config.head_dim
    k = buffer((batch, K, H, max_len), ("batch", "kv_heads", "head_dim", "cache_seq"), 2)
    v = buffer((batch, K, max_len, H), ("batch", "kv_heads", "cache_seq", "head_dim"), 3)
    return KVCache(k=tuple(k for _ in layers), v=tuple(v for _ in layers), lengths=lengths, rope_len=rope_len)


def buffer_spec(shape: tuple[int, ...], axes: tuple[str | None, ...], channel_axis: int,
                kv_quant: KVQuant) -> ParamSpec | QuantizedArray:
    """One cache buffer declared: a zero-initialised ``ParamSpec``, or with ``kv_quant`` a
    ``QuantizedArray`` of its stored values and one fp32 scale per position outside
    ``channel_axis`` (the scale keeps the values' other logical axes, so it splits with them).
    The one declaration of a buffer, contiguous or paged."""
    spec = ParamSpec(shape, axes, Init.ZEROS)
    if kv_quant is KVQuant.NONE:
        return spec
    fmt = KV_FORMATS[kv_quant]
    scale_axes = tuple(None if i == channel_axis else a for i, a in enumerate(axes))
    scale = ParamSpec(scale_shape(shape, (channel_axis,), None), scale_axes, Init.ONES, jnp.dtype(jnp.float32))
    return QuantizedArray(dataclasses.replace(spec, dtype=fmt.dtype), scale, fmt, (channel_axis,), None)


def empty_from_specs(make_specs: Callable[..., Any], *args, shardings=None) -> Any:
    """The tree ``make_specs(*args, dtype)`` declares (its last argument is the float dtype),
    made empty (zeros, ones where the spec says), placed by ``shardings`` when given: made in
    place on each device, with no host copy and no cross-process transfer. One jitted maker per
    (specs function, sharding tree), so a second cache of the same shape does not compile."""
    if shardings is None:
        return _empty(make_specs, *args)
    return _sharded_maker(make_specs, shardings, len(args))(*args)


def _empty(make_specs, *args):
    *spec_args, dtype = args

    def empty(s: ParamSpec) -> jax.Array:
        fill = jnp.ones if s.init is Init.ONES else jnp.zeros
        return fill(s.shape, s.dtype or dtype)

    return map_specs(empty, make_specs(*spec_args))


@functools.lru_cache(maxsize=64)
def _sharded_maker(make_specs, shardings, num_args: int):
    return jax.jit(functools.partial(_empty, make_specs), static_argnums=tuple(range(num_args)),
                   out_shardings=shardings)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               kv_quant: KVQuant = KVQuant.NONE, shardings=None) -> KVCache | LatentCache:
    """An empty cache holding ``max_len`` positions for each of ``batch`` rows (latent rows for
    multi-head latent attention, per-head keys and values otherwise; quantized with
    ``kv_quant``), placed by ``shardings`` (a matching tree of shardings, e.g. from
    :func:`cache_specs`) when given."""
    return empty_from_specs(cache_specs, config, batch, max_len, kv_quant, jnp.dtype(dtype), shardings=shardings)


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


def write_quantized(buffer: jax.Array | QuantizedArray, rows: jax.Array,
                    write: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array | QuantizedArray:
    """``write(buffer, rows)`` for a plain buffer (rows cast to its dtype); into a quantized one,
    ``rows`` (already in the buffer's layout) are quantized like it first, one scale per row (and
    head), and values and scales written alike. The one quantized write of every cache."""
    if isinstance(buffer, QuantizedArray):
        q = quantize_like(rows, buffer)
        return buffer.replace(values=write(buffer.values, q.values), scale=write(buffer.scale, q.scale))
    return write(buffer, rows.astype(buffer.dtype))


def _write_rows(buffer: jax.Array | QuantizedArray, new: jax.Array, starts: jax.Array,
                seq_axis: int) -> jax.Array | QuantizedArray:
    """Write ``new`` (already in the buffer's layout) into ``buffer`` at per-row start positions."""
    def write(buf, x):
        if buf.shape[0] == 1:  # a plain in-place update; the batched form lowers to a scatter
            return jax.lax.dynamic_update_slice_in_dim(buf, x, starts[0], axis=seq_axis)
        return jax.vmap(lambda b, r, s: jax.lax.dynamic_update_slice_in_dim(b, r, s, axis=seq_axis - 1))(
            buf, x, starts)

    return write_quantized(buffer, new, write)


def append_to_cache(cache: KVCache | LatentCache, new: NewKV | NewLatent) -> KVCache | LatentCache:
    """Write the keys/values (or latent rows) of one ``forward`` call at each row's length and
    advance lengths.

    Jit it with the cache donated (and apart from ``forward``, see the module docstring). The
    cache must have room: ``max(lengths) + T <= max_len``, or the write would be clamped.
    """
    if not isinstance(cache, (KVCache, LatentCache)):
        from dayzero.model import compressed_cache, linear_cache

        if isinstance(cache, linear_cache.HybridCache):
            return linear_cache.append_states(cache, new, append_to_cache(cache.attn, new.attn))
        return compressed_cache.append(cache, new)  # DeepSeek-V4's CompressedCache
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


def page_slots(block_tables: jax.Array, lengths: jax.Array, num_new: jax.Array, T: int,
               page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """Where each of T new tokens per row goes: (page [B,T], slot in page [B,T]).

    Token t of row b is at position ``lengths[b] + t``. Padding tokens (t >= num_new[b]) and
    positions past the table get page ``num_pages``, out of the pool, so a write with
    ``mode="drop"`` skips them (they must not land in a page another row owns).
    """
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    pages = page_of(block_tables, positions, page_size)
    real = (jnp.arange(T)[None, :] < num_new[:, None]) & (positions // page_size < block_tables.shape[1])
    return jnp.where(real, pages, num_pages), positions % page_size


def page_of(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """The page holding each position of ``positions`` [B, ...] in its row's table [B,W]
    (positions past the table read its last entry; callers mask them)."""
    B, W = block_tables.shape
    index = jnp.minimum(positions // page_size, W - 1).reshape(B, -1)
    return jnp.take_along_axis(block_tables, index, axis=1).reshape(positions.shape)


def write_head_rows(pool: jax.Array | QuantizedArray, rows: jax.Array, pages: jax.Array,
                    slots: jax.Array) -> jax.Array | QuantizedArray:
    """Per-head rows [B,T,K,H] written into a key or value pool [K,P,page,H] at (pages, slots) [B,T]."""
    return write_rows(pool, rows.transpose(2, 0, 1, 3), pages, slots)


def write_rows(pool: jax.Array | QuantizedArray, rows: jax.Array, pages: jax.Array,
               slots: jax.Array) -> jax.Array | QuantizedArray:
    """Rows [B,T,C] written into a latent (or indexer key) pool [P,page,C] at (pages, slots) [B,T]
    (or rows [K,B,T,H] into a per-head pool [K,P,page,H]). Into a quantized pool the rows are
    quantized first (``write_quantized``: the same quantization the contiguous cache's write
    applies to the same rows)."""
    return write_quantized(pool, rows, lambda p, r: p.at[..., pages, slots, :].set(r, mode="drop"))
