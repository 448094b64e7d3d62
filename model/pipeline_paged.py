"""The serving engine's page pool laid out for pipeline stages.

Each stage holds the pages of its own layers: the per-layer key and value pools of
``dayzero.model.paged_cache`` ([K, pages, page_size, H]) stacked like the staged layers
(``dayzero.model.pipeline``), [S, Q + P, K, pages, page_size, H] split over ``stage``. One page
id names the same positions in every layer of every stage, so the host's block tables, prefix
cache and swap work on page ids exactly as without stages; the tables, lengths and ``rope_len``
are replicated. ``pipeline.pipeline_forward`` reads this cache through the tables (each slot
gathers its micro-batch's pages), and :func:`append_staged_pages` writes what it returns.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import struct

from dayzero.model.cache import page_slots, write_head_rows
from dayzero.model.config import ModelConfig
from dayzero.model.paged_cache import paged_cache_specs
from dayzero.model.pipeline import StagedNewKV, StagedWeights, StagePlan
from dayzero.model.weights import map_specs


def serving_stages(weights) -> StagePlan | None:
    """The stage plan of weights laid out for a pipeline mesh (``StagedWeights``), else None."""
    return weights.plan if isinstance(weights, StagedWeights) else None


@struct.dataclass
class StagedPagedCache:
    """Key and value pages [S, Q + P, K, pages, page_size, H] (stage, slot, then a paged layer's
    layout), the rows' block tables [B, W], lengths [B] and ``rope_len``."""

    k_pages: jax.Array
    v_pages: jax.Array
    block_tables: jax.Array
    lengths: jax.Array
    rope_len: jax.Array

    @property
    def page_size(self) -> int:
        """Positions per page."""
        return self.k_pages.shape[4]

    @property
    def max_len(self) -> int:
        """The positions each row's table can address."""
        return self.block_tables.shape[1] * self.page_size


def staged_paged_specs(config: ModelConfig, plan: StagePlan, num_pages: int, page_size: int, batch: int = 1,
                       table_width: int = 1) -> StagedPagedCache:
    """The staged pool declared abstractly: each stage slot's pools as ``paged_cache_specs``
    declares one layer's, behind the logical axes ("stage", None)."""
    flat = paged_cache_specs(config, num_pages, page_size, batch, table_width)
    lead = (plan.num_stages, plan.prefix + plan.slots)
    stacked = map_specs(lambda s: dataclasses.replace(s, shape=lead + s.shape, axes=("stage", None) + s.axes),
                        (flat.k_pages[0], flat.v_pages[0]))
    return StagedPagedCache(k_pages=stacked[0], v_pages=stacked[1], block_tables=flat.block_tables,
                            lengths=flat.lengths, rope_len=flat.rope_len)


def append_staged_pages(cache: StagedPagedCache, new: StagedNewKV) -> StagedPagedCache:
    """Write one pipelined call's keys/values [S, Q + P, B, T, K, H] at each row's length, through
    its block table, into every stage slot's pages, and advance the lengths (the staged form of
    ``paged_cache.append_to_pages``; jit it with the cache donated)."""
    num_pages, T = cache.k_pages.shape[3], new.k.shape[3]
    pages, slots = page_slots(cache.block_tables, cache.lengths, new.num_new, T, cache.page_size, num_pages)
    write = jax.vmap(jax.vmap(lambda pool, rows: write_head_rows(pool, rows, pages, slots)))
    return cache.replace(k_pages=write(cache.k_pages, new.k), v_pages=write(cache.v_pages, new.v),
                         lengths=cache.lengths + new.num_new, rope_len=new.rope_len)
