"""Rows still in their pages: a lazy [B, W * per_page, C] view of a page pool through block tables.

A paged cache's ``layer(i)`` usually gathers each row's pages into a contiguous array before the
attention reads it (``kernel_attention.gathered``). Where the attention reads only a few rows per
query (DeepSeek-V4's CSA entries picked by its indexer), that gather is a copy of the whole
context every step for nothing: :class:`PagedRows` hands the pages over instead, and the reader
either takes the rows it needs straight from the pool (:meth:`PagedRows.take`) or gathers them
all (:meth:`PagedRows.whole`) where it reads every row anyway.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model.kernel_attention import gathered
from dayzero.model.quant import QuantizedArray


@struct.dataclass
class PagedRows:
    """``pool`` [P, per_page, C] (plain or a channel-layout ``QuantizedArray``) read through
    ``tables`` [B, W]: stands for [B, W * per_page, C], row r of batch row b at slot
    ``r % per_page`` of page ``tables[b, r // per_page]``."""

    pool: Any
    tables: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of the view: [B, W * per_page, C]."""
        B, W = self.tables.shape
        _, per_page, C = self.pool.shape
        return B, W * per_page, C

    def whole(self) -> Any:
        """Every row, gathered page by page into [B, W * per_page, C] (quantized stays quantized)."""
        return gathered(self.pool, self.tables)

    def take(self, rows: jax.Array) -> Any:
        """Rows ``rows`` [B, n, 1] (indices into the view, within it) -> [B, n, C], read straight
        from their pages (a quantized pool's values and scales alike)."""
        per_page = self.pool.shape[1]
        pages = jnp.take_along_axis(self.tables, rows[..., 0] // per_page, axis=1)  # [B, n]
        slots = rows[..., 0] % per_page

        def read(leaf: jax.Array) -> jax.Array:
            return leaf[pages, slots]

        if isinstance(self.pool, QuantizedArray):
            return self.pool.replace(values=read(self.pool.values), scale=read(self.pool.scale))
        return read(self.pool)


def whole(rows: Any) -> Any:
    """``rows`` as an array: a :class:`PagedRows` gathered, anything else as it is."""
    return rows.whole() if isinstance(rows, PagedRows) else rows


def stored_like(rows: Any) -> Any:
    """What ``quant.as_stored`` needs to know of ``rows``: its pool for a :class:`PagedRows`."""
    return rows.pool if isinstance(rows, PagedRows) else rows
