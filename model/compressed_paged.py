"""DeepSeek-V4's paged serving cache: compressed entries in pages, window rings and compressor
states per serving slot.

A V4 layer caches three things per sequence (``dayzero.model.compressed_cache``): a ring of the
last W key rows, the compressed entries (one per ``ratio`` tokens, growing with the sequence) and
the compressors' states (rings of a few projected rows). Only the entries grow, so only they are
paged; the rest is a fixed-size state per sequence, held like a linear-attention hybrid's states
(``dayzero.model.linear_cache``): one row per serving slot.

- A page covers ``page_size`` positions, as every paged cache's does, and so holds
  ``page_size // ratio`` entries of a layer of that ratio (and as many indexer keys on CSA
  layers): entry w of a row is slot ``w % per_page`` of page ``block_tables[b, w // per_page]``,
  and its window of tokens lies inside the page that holds it. One block table serves every
  layer kind; ``page_size`` must therefore be a multiple of every ratio (``entries_per_page``
  refuses others). Sliding layers have no pages.
- :class:`PagedCompressedCache` is the pool with one step's rows: ``block_tables`` [B,W],
  ``slots`` [B], ``lengths`` [B] and ``rope_len``. ``layer(i)`` hands ``compressed_block`` a
  :class:`~dayzero.model.compressed.CompressedLayer` as the contiguous cache does: the rings and
  states gathered from the step's slots, the entries and index keys as
  :class:`~dayzero.model.paged_rows.PagedRows` (the table's pages standing for [B, W * per_page,
  C] in entry order), which the attention gathers whole where it reads every entry (HCA,
  prefill, the indexer's scores) and reads only the picks from where it gathers (CSA decode).
  A step's reads therefore follow the table width (the sequence), not ``max_context``.
- :func:`append_to_paged` writes what ``forward`` returned: new entries into their pages, the
  rows' rings and states into their slots. Rows with no real token write nothing.

A slot needs no reset: a sequence starting at length 0 reads no stale ring row (ring slots are
read only for positions below its length) and its first call runs without a cache (fresh
compressor states); entries are read only below ``length // ratio``, all in its own pages.

The pools are declared with logical axes (:func:`paged_specs`) so meshes lay them out: entry and
index-key pages on ``latent_pages`` (kept whole, as the latent attention's pages), slot rows on
``batch``. With a quantized KV cache the rings, entries and index keys are stored quantized (one
scale per row), the compressor states in the model's float dtype, as in the contiguous cache.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model import compressed_cache, compressor
from dayzero.model.cache import buffer_spec, page_of, write_rows
from dayzero.model.compressed import CompressedLayer
from dayzero.model.compressed_cache import NewCompressed
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.paged_rows import PagedRows
from dayzero.model.paged_cache import after_input
from dayzero.model.quant import KVQuant
from dayzero.model.weights import Init, ParamSpec

__all__ = ["PagedCompressedCache", "paged_specs", "append_to_paged", "entries_per_page", "page_multiple"]

_PAGED = ("entries", "index_keys")  # the CompressedLayer fields held in pages; the rest per slot


def page_multiple(config: ModelConfig) -> int:
    """The smallest page size that holds a whole number of entries of every layer kind (the least
    common multiple of the model's compression ratios; 1 without compressed layers)."""
    cc = config.compressed
    ratios = [cc.ratio_of(k) for k in cc.kinds if k is not CompressKind.SLIDING]
    return math.lcm(*ratios) if ratios else 1


def entries_per_page(config: ModelConfig, kind: CompressKind, page_size: int) -> int:
    """Entries a page of ``page_size`` positions holds on a layer of ``kind`` (0 for sliding
    layers); a page size that is not a multiple of every ratio is refused."""
    multiple = page_multiple(config)
    if page_size % multiple:
        raise ValueError(f"page_size={page_size} does not hold a whole number of DeepSeek-V4's compressed "
                         f"entries; use a multiple of {multiple} (the least common multiple of its ratios)")
    if kind is CompressKind.SLIDING:
        return 0
    return page_size // config.compressed.ratio_of(kind)


@struct.dataclass
class PagedCompressedCache:
    """Per layer a :class:`~dayzero.model.compressed.CompressedLayer` whose rings and states are
    [slots, ...] and whose entries / index keys are pages [pages, per_page, C]; one step's
    ``block_tables`` [B,W], ``slots`` [B], ``lengths`` [B] and ``rope_len``; ``page_size``
    (static): positions per page."""

    layers: tuple[CompressedLayer, ...]
    block_tables: jax.Array
    slots: jax.Array
    lengths: jax.Array
    rope_len: jax.Array
    page_size: int = struct.field(pytree_node=False, default=1)

    keys_token_major = False  # no per-head keys (see ``transformer.forward``)

    @property
    def max_len(self) -> int:
        """The positions each row's table can address."""
        return self.block_tables.shape[1] * self.page_size

    @property
    def num_slots(self) -> int:
        """Rows of the per-slot pools."""
        return self.layers[0].window.shape[0]

    def layer(self, i: int, after: jax.Array | None = None) -> CompressedLayer:
        """Layer ``i``'s cache as the step's rows see it: rings and states gathered from their
        slots, entries and index keys left in their pages (``paged_rows.PagedRows``, read in entry
        order: the attention takes only the picks where it gathers), once ``after`` (the layer's
        input) exists."""
        tables, slots = after_input(self.block_tables, after), after_input(self.slots, after)
        take = functools.partial(jax.tree.map, lambda leaf: jnp.take(leaf, slots, axis=0, mode="clip"))
        view = {}
        for field, value in _fields(self.layers[i]).items():
            if value is not None:
                view[field] = PagedRows(value, tables) if field in _PAGED else take(value)
        return CompressedLayer(**view)

    def with_rows(self, **rows) -> "PagedCompressedCache":
        """A step's rows (``block_tables``, ``slots``, ``lengths``)."""
        return self.replace(**rows)

    @property
    def slot_states(self) -> tuple[dict, ...]:
        """The per-slot pools (each layer's ring and compressor states, [slots, ...]): what a
        prefix-cache snapshot copies (``engine.paged_steps``)."""
        return tuple({f: v for f, v in _fields(layer).items() if f not in _PAGED} for layer in self.layers)

    def with_slot_states(self, states: tuple[dict, ...]) -> "PagedCompressedCache":
        """The cache with ``states`` (as :attr:`slot_states` gives them) as its per-slot pools."""
        return self.replace(layers=tuple(layer.replace(**s) for layer, s in zip(self.layers, states)))


def _fields(layer: CompressedLayer) -> dict:
    return {f: getattr(layer, f) for f in ("window", "entries", "state", "index_keys", "index_state")}


def _layer_specs(config: ModelConfig, kind: CompressKind, num_pages: int, page_size: int, slots: int,
                 kv_quant: KVQuant) -> CompressedLayer:
    """One layer's pools: the contiguous cache's per-row declaration for ``slots`` rows, its
    entry buffers replaced by pages."""
    per_page = entries_per_page(config, kind, page_size)
    rows = compressed_cache.layer_spec(config, kind, slots, 1, kv_quant)
    if kind is CompressKind.SLIDING:
        return rows
    pages = dict(entries=(num_pages, per_page, config.head_dim))
    if kind is CompressKind.CSA:
        pages["index_keys"] = (num_pages, per_page, config.compressed.index_head_dim)
    return rows.replace(**{f: buffer_spec(shape, ("latent_pages", None, None), 2, kv_quant)
                           for f, shape in pages.items()})


def paged_specs(config: ModelConfig, num_pages: int, page_size: int, batch: int = 1, table_width: int = 1,
                kv_quant: KVQuant = KVQuant.NONE, state_slots: int = 1) -> PagedCompressedCache:
    """The pool declared abstractly (``paged_cache.paged_cache_specs`` hands V4 here): ``num_pages``
    pages of ``page_size`` positions for the entries, ``state_slots`` rows of rings and states,
    and ``batch`` step rows with tables ``table_width`` pages wide."""
    step = ParamSpec((batch,), ("batch",), Init.ZEROS, jnp.dtype(jnp.int32))
    tables = ParamSpec((batch, table_width), ("batch", None), Init.ZEROS, jnp.dtype(jnp.int32))
    rope_len = ParamSpec((), (), Init.ZEROS, jnp.dtype(jnp.int32))
    layers = tuple(_layer_specs(config, kind, num_pages, page_size, state_slots, kv_quant)
                   for kind in config.compressed.kinds)
    return PagedCompressedCache(layers=layers, block_tables=tables, slots=step, lengths=step, rope_len=rope_len,
                                page_size=page_size)


def _entry_pages(tables: jax.Array, ids: jax.Array, per_page: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """(page, slot in page) [B,M] of entries ``ids`` [B,M]; no entry (-1) or an entry past the
    table gets page ``num_pages`` (out of the pool: ``mode="drop"`` writes skip it)."""
    real = (ids >= 0) & (ids // per_page < tables.shape[1])
    safe = jnp.maximum(ids, 0)
    return jnp.where(real, page_of(tables, safe, per_page), num_pages), safe % per_page


def append_to_paged(cache: PagedCompressedCache, new: NewCompressed) -> PagedCompressedCache:
    """Write one ``forward`` call's entries into the step's pages and its rows' rings and states
    into their slots; advance the lengths (jit it with the cache donated, apart from
    ``forward``). The step's rows with a real token must name distinct slots."""
    S = cache.num_slots
    target = jnp.where(new.num_new > 0, cache.slots, S)  # rows without a real token: dropped

    def spread(x: jax.Array, fill) -> jax.Array:  # [B, ...] -> [S, ...], ``fill`` off the step
        return jnp.full((S, *x.shape[1:]), fill, x.dtype).at[target].set(x, mode="drop")

    def carried(new_state, old_state):  # the step's new states over every slot's own
        return jax.tree.map(lambda n, o: o.at[target].set(n.astype(o.dtype), mode="drop"), new_state, old_state)

    starts, num_new = spread(cache.lengths, 0), spread(new.num_new, 0)
    real = new.num_new[:, None] > 0
    layers = []
    for c, n in zip(cache.layers, new.layers):
        written = c.replace(window=compressor.ring_write(c.window, spread(n.rows, 0), starts, num_new))
        if n.entries is not None:
            ids = jnp.where(real, n.entry_ids, -1)
            written = written.replace(entries=_write_entries(c.entries, n.entries, ids, cache.block_tables),
                                      state=carried(n.state, c.state))
        if n.index_keys is not None:
            ids = jnp.where(real, n.index_ids, -1)
            written = written.replace(index_keys=_write_entries(c.index_keys, n.index_keys, ids, cache.block_tables),
                                      index_state=carried(n.index_state, c.index_state))
        layers.append(written)
    return cache.replace(layers=tuple(layers), lengths=cache.lengths + new.num_new, rope_len=new.rope_len)


def _write_entries(pool, rows: jax.Array, ids: jax.Array, tables: jax.Array):
    """Entries ``rows`` [B,M,C] written at their ids [B,M] (-1: none) through the step's
    block ``tables``."""
    per_page = pool.shape[1]
    pages, slots = _entry_pages(tables, ids, per_page, pool.shape[0])
    return write_rows(pool, rows, pages, slots)

