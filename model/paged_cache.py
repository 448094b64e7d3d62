"""The paged KV cache: one pool of fixed-size pages per layer, shared by every sequence.

A sequence's positions live in the pages its row of ``block_tables`` lists, in order: position
p is slot ``p % page_size`` of page ``block_tables[b, p // page_size]``. Pages are handed out
and taken back by the host (``dayzero.engine.paging``), so sequences of any lengths share one
pool without each reserving room for the longest, and sequences with a common prefix can share
its pages.

Layouts are those of the paged attention kernels (``dayzero.kernels``): per layer keys and
values [K, P, page_size, H] (kv heads, pool pages, slots, head dim); multi-head latent
attention's latent rows [P, page_size, C] and, with sparse attention, the indexer keys
[P, page_size, J].

With a quantized KV cache (``kv_quant`` int8 / fp8, as the contiguous cache's
``cache.cache_specs``) every pool is a :class:`~dayzero.model.quant.QuantizedArray`: stored
values in the pool's layout and one fp32 scale per (kv head, page, slot) for keys and values
(scale [K, P, page_size, 1]), per (page, slot) for latent rows and indexer keys ([P, page_size,
1]). Writes quantize each new row; ``layer(i)`` gathers values and scales alike and hands the
attention blocks the gathered view still quantized, which they read through ``dequantized``
exactly as they read the contiguous cache (so the two caches compute the same function, and a
sparse block dequantizes only the rows it picks). The Pallas kernels read the stored values with
their scale pages in place.

:func:`paged_cache_specs` declares the pools abstractly (logical axes), so that on a mesh they
are laid out as the contiguous cache is: per-head pools split by kv head over ``tensor``.

The caches here have the interface ``transformer.forward`` reads (``lengths``, ``rope_len``,
``max_len``, ``layer(i)``): ``layer(i)`` gathers each row's pages into the contiguous view the
attention blocks take (K and V [B,K,S,H], keys token-major unlike the contiguous cache; latent
[B,S,C]) with S = the table's width times the page size. That gather is the reference path; a
paged kernel reads the pages in place.
``append_to_pages`` writes what ``forward`` returns into the pages (jit it apart from
``forward``, with the cache donated, for the reason the transformer module docstring gives).
With a kernel mode, a step reads the pages in place instead: ``kernel_view`` wraps the cache for
it and ``with_written`` takes the written pages back (``dayzero.model.kernel_attention``).

DeepSeek-V4's cache pages its compressed entries and keeps its window rings and compressor
states per serving slot (``dayzero.model.compressed_paged``), as a linear-attention hybrid keeps
its states (``dayzero.model.linear_cache``); :func:`paged_cache_specs` and
:func:`append_to_pages` hand both over to their modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.kernels import KernelMode
from dayzero.model.compressed_cache import NewCompressed
from dayzero.model.config import ModelConfig
from dayzero.model.cache import (NewKV, NewLatent, buffer_spec, empty_from_specs, page_slots, write_head_rows,
                                 write_rows)
from dayzero.model.kernel_attention import HeadSplit, PagedKernelCache, gathered
from dayzero.model.quant import KVQuant, QuantizedArray
from dayzero.model.weights import Init, ParamSpec

__all__ = ["PagedKVCache", "PagedLatentCache", "init_paged_cache", "paged_cache_specs", "page_slots",
           "append_to_pages", "kernel_view", "with_written", "after_input"]


@struct.dataclass
class PagedKVCache:
    """Per-layer key and value pages [K, P, page_size, H], the rows' block tables [B, W] (page
    ids, int32), their lengths [B] and ``rope_len`` (as :class:`~dayzero.model.cache.KVCache`).

    Table entries past a row's last page may hold any page id: they are read (masked) but never
    written.
    """

    k_pages: tuple[jax.Array | QuantizedArray, ...]
    v_pages: tuple[jax.Array | QuantizedArray, ...]
    block_tables: jax.Array
    lengths: jax.Array
    rope_len: jax.Array

    @property
    def page_size(self) -> int:
        """Positions per page."""
        return self.k_pages[0].shape[2]

    @property
    def max_len(self) -> int:
        """S, the positions each row's table can address."""
        return self.block_tables.shape[1] * self.page_size

    # The gathered keys stay token-major [B,K,S,H] (see ``layer``).
    keys_token_major = True

    def layer(self, i: int, after: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Layer ``i``'s keys and values, both [B,K,S,H], gathered from the pages once ``after``
        (the layer's input) is computed.

        Keys are not transposed to the contiguous cache's [B,K,H,S]: on XLA:CPU that transpose of
        the gathered copy cost more than the whole attention (``attend`` reads them token-major).
        """
        tables = after_input(self.block_tables, after)
        return gathered(self.k_pages[i], tables), gathered(self.v_pages[i], tables)


def after_input(block_tables: jax.Array, after: jax.Array | None) -> jax.Array:
    """``block_tables`` (any int array of row indices) unchanged, but computed from ``after`` too.

    Without a data dependency XLA gathers every layer's pages at the start of the step, so
    that a copy of the whole context of every row is live at once (measured: temp memory
    growing with the number of layers); ``optimization_barrier`` does not order it on XLA:CPU.
    min(t, t + flag) with flag in {0, 1} is t, and no simplifier folds it away.
    """
    if after is None:
        return block_tables
    flag = jnp.isnan(after.reshape(-1)[0]).astype(block_tables.dtype)
    return jnp.minimum(block_tables, block_tables + flag)


@struct.dataclass
class PagedLatentCache:
    """Multi-head latent attention's paged cache: per layer latent pages [P, page_size, C]
    (and indexer key pages [P, page_size, J] with sparse attention), block tables [B, W],
    lengths [B] and ``rope_len`` (as :class:`~dayzero.model.cache.LatentCache`)."""

    latent_pages: tuple[jax.Array | QuantizedArray, ...]
    block_tables: jax.Array
    lengths: jax.Array
    rope_len: jax.Array
    index_key_pages: tuple[jax.Array | QuantizedArray, ...] | None = None

    keys_token_major = False  # no per-head keys (see ``transformer.forward``)

    @property
    def page_size(self) -> int:
        """Positions per page."""
        return self.latent_pages[0].shape[1]

    @property
    def max_len(self) -> int:
        """S, the positions each row's table can address."""
        return self.block_tables.shape[1] * self.page_size

    def layer(self, i: int, after: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """Layer ``i``'s latent rows [B,S,C] (and indexer keys [B,S,J]), gathered from the pages
        once ``after`` (the layer's input) is computed."""
        tables = after_input(self.block_tables, after)
        latent = gathered(self.latent_pages[i], tables)
        if self.index_key_pages is None:
            return (latent,)
        return latent, gathered(self.index_key_pages[i], tables)


def paged_cache_specs(config: ModelConfig, num_pages: int, page_size: int, batch: int = 1, table_width: int = 1,
                      kv_quant: KVQuant = KVQuant.NONE, state_slots: int = 1) -> PagedKVCache | PagedLatentCache:
    """The paged cache declared abstractly: a ``ParamSpec`` (shape, logical axes) at every leaf,
    as ``cache.cache_specs`` declares the contiguous cache, so the pool's shapes
    (:func:`init_paged_cache`) and its shardings on a mesh (``Placement.shardings``) come from one
    tree. Per-head pools split their kv heads as the contiguous cache does (``kv_heads``); the
    latent and indexer-key pools have no head axis: their page axis is ``latent_pages``, which
    the rules keep whole (``sharding.rules`` says why). With ``kv_quant`` every pool is a
    ``QuantizedArray`` of values and a float32 scale per (head,) page and slot, split with its
    values. A linear-attention hybrid gets a ``linear_cache.HybridCache``: pages for its attention
    layers and a pool of ``state_slots`` rows of linear-layer states (one per serving slot);
    DeepSeek-V4 a ``compressed_paged.PagedCompressedCache`` (entries in pages, ``state_slots``
    rows of window rings and compressor states)."""
    def pool(shape: tuple[int, ...], axes: tuple[str | None, ...]):
        return buffer_spec(shape, axes, len(shape) - 1, kv_quant)  # the channel is every pool's last axis

    if config.compressed is not None:  # entries in pages, rings and compressor states per slot
        from dayzero.model.compressed_paged import paged_specs

        return paged_specs(config, num_pages, page_size, batch, table_width, kv_quant, state_slots)
    if config.linear is not None:
        from dayzero.model.linear_cache import attention_config, hybrid_specs

        pages = paged_cache_specs(attention_config(config), num_pages, page_size, batch, table_width, kv_quant)
        return hybrid_specs(config, pages, state_slots, batch)
    tables = ParamSpec((batch, table_width), ("batch", None), Init.ZEROS, jnp.dtype(jnp.int32))
    lengths = ParamSpec((batch,), ("batch",), Init.ZEROS, jnp.dtype(jnp.int32))
    rope_len = ParamSpec((), (), Init.ZEROS, jnp.dtype(jnp.int32))
    L = config.num_layers
    if config.mla is not None:
        width = config.mla.kv_lora_rank + config.mla.rope_dim
        keys = None
        if config.dsa is not None:
            keys = tuple(pool((num_pages, page_size, config.dsa.head_dim), ("latent_pages", None, None))
                         for _ in range(L))
        latent = tuple(pool((num_pages, page_size, width), ("latent_pages", None, None)) for _ in range(L))
        return PagedLatentCache(latent, tables, lengths, rope_len, keys)
    kv = pool((config.num_kv_heads, num_pages, page_size, config.head_dim), ("kv_heads", None, None, "head_dim"))
    return PagedKVCache(k_pages=(kv,) * L, v_pages=(kv,) * L, block_tables=tables, lengths=lengths, rope_len=rope_len)


def init_paged_cache(
    config: ModelConfig, num_pages: int, page_size: int, batch: int = 1, table_width: int = 1, dtype=jnp.float32,
    kv_quant: KVQuant = KVQuant.NONE, shardings=None, state_slots: int = 1,
) -> PagedKVCache | PagedLatentCache:
    """A zeroed pool of ``num_pages`` pages of ``page_size`` positions per layer, with ``batch``
    empty rows whose tables are ``table_width`` wide (replace ``block_tables`` and ``lengths``
    to serve sequences). ``kv_quant``: store the pages quantized (see the module docstring).
    ``shardings``: a matching tree of shardings (``Placement.shardings`` of
    :func:`paged_cache_specs`) to make each pool in place on its devices. ``state_slots``: the
    rows of a hybrid's state pool."""
    return empty_from_specs(paged_cache_specs, config, num_pages, page_size, batch, table_width, kv_quant,
                            state_slots, jnp.dtype(dtype), shardings=shardings)


def append_to_pages(cache: PagedKVCache | PagedLatentCache, new: NewKV | NewLatent) -> PagedKVCache | PagedLatentCache:
    """Write one ``forward`` call's keys/values (or latent rows) at each row's length, through its
    block table, and advance the lengths (a pipeline's staged pool: ``pipeline_paged``).

    Every page a real token lands in must be in the row's table (the host allocates them
    first). Jit it with the cache donated, apart from ``forward``.
    """
    from dayzero.model.pipeline_paged import StagedPagedCache, append_staged_pages  # it imports this module

    if isinstance(cache, StagedPagedCache):  # a pipeline mesh's pool: every stage slot's pages
        return append_staged_pages(cache, new)
    if isinstance(new, NewCompressed):  # DeepSeek-V4: entries into pages, rings and states into slots
        from dayzero.model.compressed_paged import append_to_paged

        return append_to_paged(cache, new)
    if not isinstance(cache, (PagedKVCache, PagedLatentCache)):  # a hybrid: pages, then the state pool
        from dayzero.model.linear_cache import append_states

        return append_states(cache, new, append_to_pages(cache.attn, new.attn))
    T = (new.latent[0] if isinstance(new, NewLatent) else new.k[0]).shape[1]
    if isinstance(cache, PagedLatentCache):
        num_pages = cache.latent_pages[0].shape[0]
        pages, slots = page_slots(cache.block_tables, cache.lengths, new.num_new, T, cache.page_size, num_pages)

        latent = tuple(write_rows(p, n, pages, slots) for p, n in zip(cache.latent_pages, new.latent))
        keys = None
        if cache.index_key_pages is not None:
            keys = tuple(write_rows(p, n, pages, slots) for p, n in zip(cache.index_key_pages, new.index_keys))
        return cache.replace(latent_pages=latent, index_key_pages=keys,
                             lengths=cache.lengths + new.num_new, rope_len=new.rope_len)
    num_pages = cache.k_pages[0].shape[1]
    pages, slots = page_slots(cache.block_tables, cache.lengths, new.num_new, T, cache.page_size, num_pages)
    k = tuple(write_head_rows(p, n, pages, slots) for p, n in zip(cache.k_pages, new.k))
    v = tuple(write_head_rows(p, n, pages, slots) for p, n in zip(cache.v_pages, new.v))
    return cache.replace(k_pages=k, v_pages=v, lengths=cache.lengths + new.num_new, rope_len=new.rope_len)


def kernel_view(cache: PagedKVCache | PagedLatentCache, num_new: jax.Array, mode: KernelMode,
                windows: tuple[int | None, ...], split: HeadSplit | None = None) -> PagedKernelCache:
    """``cache`` as a step on the kernels reads it (``mode`` resolved, not reference; ``windows``:
    each layer's sliding window; ``split``: the mesh the kernels run on, None for one device).
    Quantized pools are handed over as they are: the kernels read their scale pages. A hybrid's
    view is its pages' view beside its states (``windows`` still one per decoder layer)."""
    if not isinstance(cache, (PagedKVCache, PagedLatentCache)):
        attn_windows = tuple(w for w, lin in zip(windows, cache.linear) if not lin)
        return cache.replace(attn=kernel_view(cache.attn, num_new, mode, attn_windows, split))
    if isinstance(cache, PagedKVCache):
        pages = tuple(zip(cache.k_pages, cache.v_pages))
    elif cache.index_key_pages is None:
        pages = tuple((p,) for p in cache.latent_pages)
    else:
        pages = tuple(zip(cache.latent_pages, cache.index_key_pages))
    return PagedKernelCache(pages, cache.block_tables, cache.lengths, cache.rope_len, num_new, mode, windows, split)


def with_written(cache: PagedKVCache | PagedLatentCache, view: PagedKernelCache) -> PagedKVCache | PagedLatentCache:
    """``cache`` holding the pages, lengths and ``rope_len`` of a kernel step's written ``view``
    (a hybrid's: its written pages' view and its rows' new states, a ``NewHybrid``)."""
    if not isinstance(cache, (PagedKVCache, PagedLatentCache)):
        from dayzero.model.linear_cache import append_states

        return append_states(cache, view, with_written(cache.attn, view.attn))
    moved = dict(lengths=view.lengths, rope_len=view.rope_len)
    if isinstance(cache, PagedKVCache):
        return cache.replace(k_pages=tuple(p[0] for p in view.pages), v_pages=tuple(p[1] for p in view.pages),
                             **moved)
    keys = None if cache.index_key_pages is None else tuple(p[1] for p in view.pages)
    return cache.replace(latent_pages=tuple(p[0] for p in view.pages), index_key_pages=keys, **moved)
