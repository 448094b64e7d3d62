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

The page writes are ``dayzero.model.cache``'s (shared with the paged cache's reference path);
this module imports nothing of the model but ``cache`` and ``quant``, so that the attention blocks
can import it. The writes quantize into a quantized pool (one scale per row and head, as the
contiguous cache's writes), and the kernels read such a pool's values with their scale pages.

Attention sinks (gpt-oss, ``AttentionWeights.sinks`` [N]) go to the flash and paged kernels as
their ``sinks`` (float32); on a mesh each device passes its own query heads' sinks.

On a mesh (``HeadSplit``) every kernel call runs inside ``shard_map``: each device attends with
its own query heads over its own kv heads' pages (latent pools are whole on every device), its
share of the rows when the batch splits over ``data``. The page writes stay outside, ordinary
sharded scatters.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dayzero.kernels import (KernelMode, flash_attention, paged_attention, paged_latent_attention,
                             sparse_attention)
from dayzero.kernels.paged_attention import gather_pages
from dayzero.model.cache import page_of, page_slots, write_head_rows, write_rows
from dayzero.model.quant import QuantizedArray

# ``select(key_cache) -> (indices [B,T,k], visible [B,T,k])``: the indexer's picks among the
# cached keys [B,S,J] (None: nothing cached) then the new ones (``dsa.select`` with the rest bound).
Select = Callable[[jax.Array | None], tuple[jax.Array, jax.Array]]


def _picks(indices: jax.Array, visible: jax.Array) -> jax.Array:
    """The indexer's picks as ``sparse_attention`` takes them: -1 where a pick is not visible."""
    return jnp.where(visible, indices, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """How the kernels run on a mesh: each kernel call inside ``jax.shard_map``, query heads
    (with their kv heads) split over ``heads`` and the rows over ``rows`` (mesh axis names, None:
    not split). Each device then runs the kernel on its own heads and rows against its own pages
    (per-head pools are split by kv head like the heads; latent pools are whole everywhere), so
    no page moves between devices. The run configuration guarantees whole kv heads per device
    (``dayzero.engine.runtime``)."""

    mesh: Mesh
    heads: str | None
    rows: str | None

    @classmethod
    def of(cls, parallel) -> "HeadSplit | None":
        """The split of a ``dayzero.model.parallel.Parallel`` (None: one device)."""
        if parallel is None:
            return None
        return cls(parallel.placement.mesh, parallel.mesh_axis("q_heads"), parallel.mesh_axis("batch"))

    def row_axis(self, batch: int) -> str | None:
        """The rows' mesh axis for a call over ``batch`` rows (None when they do not divide)."""
        if self.rows is None or batch % self.mesh.shape[self.rows]:
            return None
        return self.rows


def _on_devices(split: HeadSplit | None, kernel: Callable, args: tuple, in_specs: tuple, out_spec) -> jax.Array:
    """``kernel(*args)``, on one device or per device inside ``shard_map`` with these specs
    (a spec may stand for a whole subtree, e.g. a quantized pool's values and scale)."""
    if split is None:
        return kernel(*args)
    return jax.shard_map(kernel, mesh=split.mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)


def _sinks(sinks: jax.Array | None) -> jax.Array | None:
    """Attention sinks as the kernels take them: float32 [N] (None: none)."""
    return None if sinks is None else sinks.astype(jnp.float32)


def _sinks_spec(split: HeadSplit | None, sinks: jax.Array | None) -> P | None:
    """The sinks' shard_map spec: split with the query heads, so each device reads its heads' sinks."""
    return None if split is None or sinks is None else P(split.heads)


def _pool_args(pool: jax.Array | QuantizedArray) -> tuple[jax.Array, jax.Array | None]:
    """(stored values, their scale or None) of a page pool, as the kernels take them."""
    if isinstance(pool, QuantizedArray):
        return pool.values, pool.scale
    return pool, None


@struct.dataclass
class NewTokensLayer:
    """A first prefill on the kernels: nothing cached, the T new tokens of each row attend to
    each other (causally; ``num_new`` [B] of them are real, the rest is bucket padding).
    ``window``: the layer's sliding window; ``split``: the mesh the kernels run on (None: one
    device)."""

    num_new: jax.Array
    mode: KernelMode = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False, default=None)
    split: HeadSplit | None = struct.field(pytree_node=False, default=None)

    def _specs(self, batch: int) -> tuple[P, P]:
        """(per-head spec [B,T,heads,...], per-row spec [B,...]) of this call's arguments."""
        rows = None if self.split is None else self.split.row_axis(batch)
        heads = None if self.split is None else self.split.heads
        return P(rows, None, heads, None), P(rows)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
               sinks: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Grouped-query attention of q [B,T,N,H] over k, v [B,T,K,H] -> (output [B,T,N,H],
        (k, v) to cache). Scale 1/sqrt(H), and ``sinks`` [N] (None: none), as ``transformer.attend``."""
        def kernel(q, k, v, lengths, sinks):
            return flash_attention(q, k, v, causal=True, kv_lengths=lengths, window=self.window, sinks=sinks,
                                   mode=self.mode)

        heads, rows = self._specs(q.shape[0])
        args = (q, k.astype(q.dtype), v.astype(q.dtype), self.num_new, _sinks(sinks))
        out = _on_devices(self.split, kernel, args, (heads, heads, heads, rows, _sinks_spec(self.split, sinks)), heads)
        return out, (k, v)

    def attend_latent(self, q: jax.Array, new: jax.Array, value_dim: int) -> tuple[jax.Array, tuple[jax.Array]]:
        """Absorbed latent attention of q [B,T,N,C] (already scaled) over the new rows [B,T,C]
        -> (output [B,T,N,C], whose first ``value_dim`` columns are the values' part; (new,))."""
        def kernel(q, rows, lengths):  # one kv head, keys = values
            return flash_attention(q, rows, rows, causal=True, kv_lengths=lengths, sm_scale=1.0, mode=self.mode)

        heads, rows = self._specs(q.shape[0])
        out = _on_devices(self.split, kernel, (q, new.astype(q.dtype)[:, :, None], self.num_new),
                          (heads, rows, rows), heads)
        return out, (new,)

    def attend_sparse(self, q: jax.Array, new: jax.Array, new_keys: jax.Array, select: Select,
                      value_dim: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Sparse latent attention of q [B,T,N,C] over the new rows [B,T,C] the indexer picks ->
        (output [B,T,N,value_dim], (new rows, new indexer keys) to cache)."""
        def kernel(q, rows, picks):
            return sparse_attention(q, rows, picks, value_dim=value_dim, sm_scale=1.0, mode=self.mode)

        indices, visible = select(None)
        heads, rows = self._specs(q.shape[0])
        out = _on_devices(self.split, kernel, (q, new.astype(q.dtype), _picks(indices, visible)),
                          (heads, rows, rows), heads)
        return out, (new, new_keys)


@struct.dataclass
class PagedLayer:
    """One layer's pages as a step on the kernels reads them in place.

    ``pages``: (keys, values) [K,P,page,H] each, or (latent rows,) [P,page,C] (and indexer keys
    [P,page,J] with sparse attention), plain or quantized (the kernels read the values with their
    scale pages); the rows' block tables [B,W], their lengths [B] before this step and
    ``num_new`` [B] (how many of the step's T tokens are real; the writes of the others are
    dropped). ``window``: the layer's sliding window; ``split``: the mesh (None: one device).
    """

    pages: tuple[jax.Array | QuantizedArray, ...]
    block_tables: jax.Array
    lengths: jax.Array
    num_new: jax.Array
    mode: KernelMode = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False, default=None)
    split: HeadSplit | None = struct.field(pytree_node=False, default=None)

    def _where(self, pool: jax.Array | QuantizedArray, T: int) -> tuple[jax.Array, jax.Array]:
        """(page, slot) [B,T] of each new token in ``pool`` (a [.., P, page, C] pool)."""
        return page_slots(self.block_tables, self.lengths, self.num_new, T, pool.shape[-2], pool.shape[-3])

    def _specs(self, batch: int) -> tuple[P, P, str | None]:
        """(per-head spec [B,T,heads,...], per-row spec [B,...], the heads' mesh axis)."""
        rows = None if self.split is None else self.split.row_axis(batch)
        heads = None if self.split is None else self.split.heads
        return P(rows, None, heads, None), P(rows), heads

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
               sinks: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Grouped-query attention of q [B,T,N,H] over the pages plus the new keys/values k, v
        [B,T,K,H] (written into the pages first) -> (output [B,T,N,H], the written (key pages,
        value pages)). Scale 1/sqrt(H), and ``sinks`` [N] (None: none), as ``transformer.attend``."""
        k_pool, v_pool = self.pages
        where = self._where(k_pool, q.shape[1])
        k_pool, v_pool = write_head_rows(k_pool, k, *where), write_head_rows(v_pool, v, *where)
        dtype = q.dtype if isinstance(k_pool, QuantizedArray) else k_pool.dtype

        def kernel(q, k_pool, v_pool, tables, lengths, offsets, sinks):
            (k_values, k_scales), (v_values, v_scales) = _pool_args(k_pool), _pool_args(v_pool)
            scales = {} if k_scales is None else dict(k_scales=k_scales, v_scales=v_scales)
            return paged_attention(q, k_values, v_values, tables, lengths, q_offsets=offsets, window=self.window,
                                   sinks=sinks, mode=self.mode, **scales)

        heads, rows, head_axis = self._specs(q.shape[0])
        args = (q.astype(dtype), k_pool, v_pool, self.block_tables, self.lengths + self.num_new, self.lengths,
                _sinks(sinks))
        specs = (heads, P(head_axis), P(head_axis), rows, rows, rows, _sinks_spec(self.split, sinks))
        out = _on_devices(self.split, kernel, args, specs, heads)
        return out.astype(q.dtype), (k_pool, v_pool)

    def attend_latent(self, q: jax.Array, new: jax.Array, value_dim: int) -> tuple[jax.Array, tuple[jax.Array]]:
        """Absorbed latent attention of q [B,T,N,C] (already scaled) over the latent pages plus
        the new rows [B,T,C] (written first) -> (output [B,T,N,value_dim], (the written pages,))."""
        pool = self.pages[0]
        pool = write_rows(pool, new, *self._where(pool, q.shape[1]))
        dtype = q.dtype if isinstance(pool, QuantizedArray) else pool.dtype

        def kernel(q, pool, tables, lengths, offsets):
            values, scales = _pool_args(pool)
            extra = {} if scales is None else dict(latent_scales=scales)
            return paged_latent_attention(q, values, tables, lengths, q_offsets=offsets, value_dim=value_dim,
                                          sm_scale=1.0, mode=self.mode, **extra)

        heads, rows, _ = self._specs(q.shape[0])
        args = (q.astype(dtype), pool, self.block_tables, self.lengths + self.num_new, self.lengths)
        out = _on_devices(self.split, kernel, args, (heads, P(), rows, rows, rows), heads)
        return out.astype(q.dtype), (pool,)

    def attend_sparse(self, q: jax.Array, new: jax.Array, new_keys: jax.Array, select: Select,
                      value_dim: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Sparse latent attention of q [B,T,N,C] over the latent rows the indexer picks, the new
        rows and indexer keys written into the pages first -> (output [B,T,N,value_dim], the
        written (latent pages, indexer key pages)).

        The indexer scores every cached key (its dense part: a gathered [B,S,J] view of the key
        pages, read through ``dequantized`` when quantized); the picks, positions in the
        cached-then-new order ``dsa.select`` returns, become slots of the flattened latent pool,
        which ``sparse_attention`` reads in place.
        """
        pool, key_pool = self.pages
        where = self._where(pool, q.shape[1])
        pool, key_pool = write_rows(pool, new, *where), write_rows(key_pool, new_keys, *where)
        cached_keys = gathered(key_pool, self.block_tables)
        indices, visible = select(cached_keys)
        S, page = cached_keys.shape[1], pool.shape[1]
        positions = jnp.where(indices < S, indices, self.lengths[:, None, None] + indices - S)
        slots = page_of(self.block_tables, positions, page) * page + positions % page
        dtype = q.dtype if isinstance(pool, QuantizedArray) else pool.dtype

        def kernel(q, pool, picks):
            values, scales = _pool_args(pool)
            flat = values.reshape(-1, values.shape[-1])
            extra = {} if scales is None else dict(kv_scales=scales.reshape(-1, 1))
            return sparse_attention(q, flat, picks, value_dim=value_dim, sm_scale=1.0, mode=self.mode, **extra)

        heads, rows, _ = self._specs(q.shape[0])
        out = _on_devices(self.split, kernel, (q.astype(dtype), pool, _picks(slots, visible)), (heads, P(), rows),
                          heads)
        return out.astype(q.dtype), (pool, key_pool)


def gathered(pool: jax.Array | QuantizedArray, tables: jax.Array) -> jax.Array | QuantizedArray:
    """``gather_pages`` of a pool; a quantized pool's values and scales are gathered alike (one
    row gather each) and stay quantized: the scale's channel axis is the last one in both the
    pool and the gathered view, so the layout metadata carries over unchanged."""
    if isinstance(pool, QuantizedArray):
        return pool.replace(values=gather_pages(pool.values, tables), scale=gather_pages(pool.scale, tables))
    return gather_pages(pool, tables)


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
    split: HeadSplit | None = struct.field(pytree_node=False, default=None)

    keys_token_major = True  # unused: the kernels read the pages themselves

    @property
    def max_len(self) -> int:
        """S, the positions each row's table can address."""
        first = self.pages[0][0]
        return self.block_tables.shape[1] * first.shape[-2]

    def layer(self, i: int, after: jax.Array | None = None) -> PagedLayer:
        """Layer ``i``'s pages for its attention block (``after`` is not needed: nothing is gathered
        before the block runs)."""
        return PagedLayer(self.pages[i], self.block_tables, self.lengths, self.num_new, self.mode, self.windows[i],
                          self.split)

    def written(self, pages: list[tuple[jax.Array, ...]], rope_len: jax.Array) -> "PagedKernelCache":
        """This cache with every layer's ``pages`` written by its block and the lengths advanced."""
        return self.replace(pages=tuple(pages), lengths=self.lengths + self.num_new, rope_len=rope_len)
