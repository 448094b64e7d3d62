"""Decode attention read straight from the KV pages by the paged kernels (``--kernels pallas``).

The reference path of a paged cache (``PagedKVCache.layer``) gathers each row's pages into a
contiguous view that the attention blocks read beside the new token's keys. With a kernel mode,
a decode step (one new token per row) hands each attention block a :class:`PagedDecodeLayer`
instead: the block writes the new token's keys and values (or latent row) into the layer's pages,
then ``paged_attention`` / ``paged_latent_attention`` reads the pages in place, new token
included.

Why write first rather than merge the new token's score into the kernel's result afterwards:
the kernels return normalised outputs, not their softmax statistics (the log-sum-exp a merge
needs), and a second kernel contract only for that would be a second implementation to keep
right. The step running this is jitted with the pool donated (``engine.paged_steps``), so each
write is an in-place scatter of B rows per layer, and it replaces the reference path's separate
page write: ``forward`` returns the :class:`PagedDecodeCache` with every layer written.

This module holds the page-layout primitives (``page_slots`` and the row writes) that
``paged_cache.append_to_pages`` shares; it imports nothing from the model, so that the attention
blocks can import it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.kernels import KernelMode, paged_attention, paged_latent_attention


def page_slots(block_tables: jax.Array, lengths: jax.Array, num_new: jax.Array, T: int,
               page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """Where each of T new tokens per row goes: (page [B,T], slot in page [B,T]).

    Token t of row b is at position ``lengths[b] + t``. Padding tokens (t >= num_new[b]) and
    positions past the table get page ``num_pages``, out of the pool, so a write with
    ``mode="drop"`` skips them (they must not land in a page another row owns).
    """
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    index = positions // page_size
    W = block_tables.shape[1]
    pages = jnp.take_along_axis(block_tables, jnp.minimum(index, W - 1), axis=1)
    real = (jnp.arange(T)[None, :] < num_new[:, None]) & (index < W)
    return jnp.where(real, pages, num_pages), positions % page_size


def write_head_rows(pool: jax.Array, rows: jax.Array, pages: jax.Array, slots: jax.Array) -> jax.Array:
    """Per-head rows [B,T,K,H] written into a key or value pool [K,P,page,H] at (pages, slots) [B,T]."""
    return pool.at[:, pages, slots].set(rows.transpose(2, 0, 1, 3).astype(pool.dtype), mode="drop")


def write_rows(pool: jax.Array, rows: jax.Array, pages: jax.Array, slots: jax.Array) -> jax.Array:
    """Rows [B,T,C] written into a latent (or indexer key) pool [P,page,C] at (pages, slots) [B,T]."""
    return pool.at[pages, slots].set(rows.astype(pool.dtype), mode="drop")


@struct.dataclass
class PagedDecodeLayer:
    """One layer's pages as a decode step's attention reads them in place.

    ``pages``: (keys, values) [K,P,page,H] each, or (latent rows,) [P,page,C]; the rows' block
    tables [B,W], their lengths [B] before this step and ``num_new`` [B] (1, or 0 for a padding
    row, whose write is dropped and whose output is zero). ``window``: the layer's sliding window.
    """

    pages: tuple[jax.Array, ...]
    block_tables: jax.Array
    lengths: jax.Array
    num_new: jax.Array
    mode: KernelMode = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False, default=None)

    def _where(self, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
        return page_slots(self.block_tables, self.lengths, self.num_new, 1, page_size, num_pages)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Grouped-query attention of the new queries q [B,1,N,H] over the pages plus the new
        keys/values k, v [B,1,K,H] (written into the pages first) -> (output [B,1,N,H], the
        written (key pages, value pages)). Scale 1/sqrt(H), as ``transformer.attend``."""
        if q.shape[1] != 1:
            raise ValueError(f"paged decode attention takes one new token per row, got {q.shape[1]}")
        k_pool, v_pool = self.pages
        where = self._where(k_pool.shape[1], k_pool.shape[2])
        k_pool, v_pool = write_head_rows(k_pool, k, *where), write_head_rows(v_pool, v, *where)
        out = paged_attention(q[:, 0].astype(k_pool.dtype), k_pool, v_pool, self.block_tables,
                              self.lengths + self.num_new, window=self.window, mode=self.mode)
        return out[:, None].astype(q.dtype), (k_pool, v_pool)

    def attend_latent(self, q: jax.Array, new: jax.Array, value_dim: int) -> tuple[jax.Array, tuple[jax.Array]]:
        """Absorbed latent attention of q [B,1,N,C] (already scaled) over the latent pages plus
        the new rows [B,1,C] (written first) -> (output [B,1,N,value_dim], (the written pages,))."""
        if q.shape[1] != 1:
            raise ValueError(f"paged decode attention takes one new token per row, got {q.shape[1]}")
        (pool,) = self.pages
        pool = write_rows(pool, new, *self._where(pool.shape[0], pool.shape[1]))
        out = paged_latent_attention(q[:, 0].astype(pool.dtype), pool, self.block_tables,
                                     self.lengths + self.num_new, value_dim=value_dim, sm_scale=1.0,
                                     mode=self.mode)
        return out[:, None].astype(q.dtype), (pool,)


@struct.dataclass
class PagedDecodeCache:
    """A paged cache as ``transformer.forward`` reads it for a decode step with kernels: per
    layer its pages (as :class:`PagedDecodeLayer` takes them), the block tables [B,W], lengths
    [B], ``rope_len``, this step's ``num_new`` [B], the kernel mode and each layer's window.

    ``forward`` given one returns it with the new token written into every layer's pages and
    the lengths advanced, in place of the keys/values to append (see the module docstring).
    Made and taken apart by ``paged_cache.decode_view`` / ``paged_cache.with_decoded``.
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

    def layer(self, i: int, after: jax.Array | None = None) -> PagedDecodeLayer:
        """Layer ``i``'s pages for its attention block (``after`` is not needed: nothing is gathered)."""
        return PagedDecodeLayer(self.pages[i], self.block_tables, self.lengths, self.num_new, self.mode,
                                self.windows[i])

    def written(self, pages: list[tuple[jax.Array, ...]], rope_len: jax.Array) -> "PagedDecodeCache":
        """This cache with every layer's ``pages`` written by its block and the lengths advanced."""
        return self.replace(pages=tuple(pages), lengths=self.lengths + self.num_new, rope_len=rope_len)
