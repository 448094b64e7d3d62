"""Attention on the Pallas kernels (``--kernels pallas|pallas_interpret``): what a block reads
instead of gathered cache arrays.

``transformer.forward`` hands each attention block the layer's cached arrays on the reference
path. With a kernel mode it hands it a *kernel layer* instead, and the block calls one of its
methods (``attend`` for grouped-query attention, ``attend_latent`` for multi-head latent
attention, ``attend_sparse`` for DeepSeek sparse attention):

- :class:`NewTokensLayer`, a first prefill (nothing cached): the new tokens attend to each other
  through ``flash_attention`` (or ``sparse_attention`` over the indexer's picks); the block
  returns the new keys/values as usual, for ``append_to_cache`` / ``append_to_pages``.
- :class:`PagedLayer`, any step over a paged cache (a prefill chunk or a decode step): the block
  writes the new tokens' keys/values (latent rows, indexer keys) into the layer's pages, then
  ``paged_attention`` / ``paged_latent_attention`` (or ``sparse_attention`` over the picked page
  slots) reads the pages in place, new tokens included. ``forward`` returns the
  :class:`PagedKernelCache` with every layer written.

Why write first rather than merge the new tokens' scores into the kernel's result afterwards:
the kernels return normalised outputs, not their softmax statistics (the log-sum-exp a merge
needs), and a second kernel contract only for that would be a second implementation to keep
right. The step running this is jitted with the pool donated (``engine.paged_steps``), so each
write is an in-place scatter of B*T rows per layer, and it replaces the reference path's separate
page write.

This module also holds the page writes (``page_slots`` and the row writes) that ``paged_cache``
shares; it imports nothing from the model but ``quant`` (which imports nothing from it either),
so that the attention blocks can import it. The writes quantize into a quantized pool (the
reference path's); the kernels themselves read plain pools only.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.kernels import (KernelMode, flash_attention, paged_attention, paged_latent_attention,
                             sparse_attention)
from dayzero.kernels.paged_attention import gather_pages
from dayzero.model.quant import QuantizedArray, quantize_like

# ``select(key_cache) -> (indices [B,T,k], visible [B,T,k])``: the indexer's picks among the
# cached keys [B,S,J] (None: nothing cached) then the new ones (``dsa.select`` with the rest bound).
Select = Callable[[jax.Array | None], tuple[jax.Array, jax.Array]]


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
    quantized first, one scale per row (per head), and values and scales are written alike: the
    same quantization the contiguous cache's write applies to the same rows."""
    if isinstance(pool, QuantizedArray):
        q = quantize_like(rows, pool)
        return pool.replace(values=write_rows(pool.values, q.values, pages, slots),
                            scale=write_rows(pool.scale, q.scale, pages, slots))
    return pool.at[..., pages, slots, :].set(rows.astype(pool.dtype), mode="drop")


def _picks(indices: jax.Array, visible: jax.Array) -> jax.Array:
    """The indexer's picks as ``sparse_attention`` takes them: -1 where a pick is not visible."""
    return jnp.where(visible, indices, -1).astype(jnp.int32)


@struct.dataclass
class NewTokensLayer:
    """A first prefill on the kernels: nothing cached, the T new tokens of each row attend to
    each other (causally; ``num_new`` [B] of them are real, the rest is bucket padding).
    ``window``: the layer's sliding window."""

    num_new: jax.Array
    mode: KernelMode = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False, default=None)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Grouped-query attention of q [B,T,N,H] over k, v [B,T,K,H] -> (output [B,T,N,H],
        (k, v) to cache). Scale 1/sqrt(H), as ``transformer.attend``."""
        out = flash_attention(q, k.astype(q.dtype), v.astype(q.dtype), causal=True, kv_lengths=self.num_new,
                              window=self.window, mode=self.mode)
        return out, (k, v)

    def attend_latent(self, q: jax.Array, new: jax.Array, value_dim: int) -> tuple[jax.Array, tuple[jax.Array]]:
        """Absorbed latent attention of q [B,T,N,C] (already scaled) over the new rows [B,T,C]
        -> (output [B,T,N,C], whose first ``value_dim`` columns are the values' part; (new,))."""
        rows = new.astype(q.dtype)[:, :, None]  # one kv head, keys = values
        out = flash_attention(q, rows, rows, causal=True, kv_lengths=self.num_new, sm_scale=1.0, mode=self.mode)
        return out, (new,)

    def attend_sparse(self, q: jax.Array, new: jax.Array, new_keys: jax.Array, select: Select,
                      value_dim: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Sparse latent attention of q [B,T,N,C] over the new rows [B,T,C] the indexer picks ->
        (output [B,T,N,value_dim], (new rows, new indexer keys) to cache)."""
        indices, visible = select(None)
        out = sparse_attention(q, new.astype(q.dtype), _picks(indices, visible), value_dim=value_dim,
                               sm_scale=1.0, mode=self.mode)
        return out, (new, new_keys)


@struct.dataclass
class PagedLayer:
    """One layer's pages as a step on the kernels reads them in place.

    ``pages``: (keys, values) [K,P,page,H] each, or (latent rows,) [P,page,C] (and indexer keys
    [P,page,J] with sparse attention); the rows' block tables [B,W], their lengths [B] before this
    step and ``num_new`` [B] (how many of the step's T tokens are real; the writes of the others
    are dropped). ``window``: the layer's sliding window.
    """

    pages: tuple[jax.Array, ...]
    block_tables: jax.Array
    lengths: jax.Array
    num_new: jax.Array
    mode: KernelMode = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False, default=None)

    def _where(self, pool: jax.Array, T: int) -> tuple[jax.Array, jax.Array]:
        """(page, slot) [B,T] of each new token in ``pool`` (a [.., P, page, C] pool)."""
        return page_slots(self.block_tables, self.lengths, self.num_new, T, pool.shape[-2], pool.shape[-3])

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Grouped-query attention of q [B,T,N,H] over the pages plus the new keys/values k, v
        [B,T,K,H] (written into the pages first) -> (output [B,T,N,H], the written (key pages,
        value pages)). Scale 1/sqrt(H), as ``transformer.attend``."""
        k_pool, v_pool = self.pages
        where = self._where(k_pool, q.shape[1])
        k_pool, v_pool = write_head_rows(k_pool, k, *where), write_head_rows(v_pool, v, *where)
        out = paged_attention(q.astype(k_pool.dtype), k_pool, v_pool, self.block_tables,
                              self.lengths + self.num_new, q_offsets=self.lengths, window=self.window,
                              mode=self.mode)
        return out.astype(q.dtype), (k_pool, v_pool)

    def attend_latent(self, q: jax.Array, new: jax.Array, value_dim: int) -> tuple[jax.Array, tuple[jax.Array]]:
        """Absorbed latent attention of q [B,T,N,C] (already scaled) over the latent pages plus
        the new rows [B,T,C] (written first) -> (output [B,T,N,value_dim], (the written pages,))."""
        pool = self.pages[0]
        pool = write_rows(pool, new, *self._where(pool, q.shape[1]))
        out = paged_latent_attention(q.astype(pool.dtype), pool, self.block_tables, self.lengths + self.num_new,
                                     q_offsets=self.lengths, value_dim=value_dim, sm_scale=1.0, mode=self.mode)
        return out.astype(q.dtype), (pool,)

    def attend_sparse(self, q: jax.Array, new: jax.Array, new_keys: jax.Array, select: Select,
                      value_dim: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Sparse latent attention of q [B,T,N,C] over the latent rows the indexer picks, the new
        rows and indexer keys written into the pages first -> (output [B,T,N,value_dim], the
        written (latent pages, indexer key pages)).

        The indexer scores every cached key (its dense part: a gathered [B,S,J] view of the key
        pages); the picks, positions in the cached-then-new order ``dsa.select`` returns, become
        slots of the flattened latent pool, which ``sparse_attention`` reads in place.
        """
        pool, key_pool = self.pages
        where = self._where(pool, q.shape[1])
        pool, key_pool = write_rows(pool, new, *where), write_rows(key_pool, new_keys, *where)
        cached_keys = gather_pages(key_pool, self.block_tables)
        indices, visible = select(cached_keys)
        S, page = cached_keys.shape[1], pool.shape[1]
        positions = jnp.where(indices < S, indices, self.lengths[:, None, None] + indices - S)
        slots = page_of(self.block_tables, positions, page) * page + positions % page
        out = sparse_attention(q.astype(pool.dtype), pool.reshape(-1, pool.shape[-1]), _picks(slots, visible),
                               value_dim=value_dim, sm_scale=1.0, mode=self.mode)
        return out.astype(q.dtype), (pool, key_pool)


KernelLayer = NewTokensLayer | PagedLayer


@struct.dataclass
class PagedKernelCache:
    """A paged cache as ``transformer.forward`` reads it for a step on the kernels: per layer its
    pages (as :class:`PagedLayer` takes them), the block tables [B,W], lengths [B], ``rope_len``,
    this step's ``num_new`` [B], the kernel mode and each layer's window.

    ``forward`` given one returns it with the new tokens written into every layer's pages and
    the lengths advanced, in place of the keys/values to append (see the module docstring).
    Made and taken apart by ``paged_cache.kernel_view`` / ``paged_cache.with_written``.
    """

    pages: tuple[tuple[jax.Array, ...], ...]
    block_tables: jax.Array
    lengths: jax.Array
    rope_len: jax.Array
    num_new: jax.Array
    mode: KernelMode = struct.field(pytree_node=False)
    windows: tuple[int | None, ...] = struct.field(pytree_node=False)

    keys_token_major = True  # unused: the kernels read the pages themselves

    @property
    def max_len(self) -> int:
        """S, the positions each row's table can address."""
        first = self.pages[0][0]
        return self.block_tables.shape[1] * first.shape[-2]

    def layer(self, i: int, after: jax.Array | None = None) -> PagedLayer:
        """Layer ``i``'s pages for its attention block (``after`` is not needed: nothing is gathered
        before the block runs)."""
        return PagedLayer(self.pages[i], self.block_tables, self.lengths, self.num_new, self.mode, self.windows[i])

    def written(self, pages: list[tuple[jax.Array, ...]], rope_len: jax.Array) -> "PagedKernelCache":
        """This cache with every layer's ``pages`` written by its block and the lengths advanced."""
        return self.replace(pages=tuple(pages), lengths=self.lengths + self.num_new, rope_len=rope_len)
