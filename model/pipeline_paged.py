"""The serving engine's page pool laid out for pipeline stages.

Each stage holds the pages of its own layers: one layer's pools as ``dayzero.model.paged_cache``
declares them (keys and values [K, pages, page_size, H]; multi-head latent attention's latent
rows [pages, page_size, C]) stacked like the staged layers (``dayzero.model.pipeline``),
[S, Q + P, ...] split over ``stage``. One page id names the same positions in every layer of
every stage, so the host's block tables, prefix cache and swap work on page ids exactly as
without stages; the tables, lengths and ``rope_len`` are replicated. ``pipeline.pipeline_forward``
reads this cache through the tables (each slot gathers its micro-batch's pages), and
:func:`append_staged_pages` writes what it returns, one slot at a time as
``paged_cache.append_to_pages`` writes one layer.
"""

from __future__ import annotations

import jax
from flax import struct

from dayzero.model.config import ModelConfig
from dayzero.model.quant import KVQuant
from dayzero.model.paged_cache import PagedKVCache, PagedLatentCache, append_to_pages, paged_cache_specs
from dayzero.model.pipeline import StagedNewKV, StagedWeights, StagePlan, layer_new, stacked_spec


def serving_stages(weights) -> StagePlan | None:
    """The stage plan of weights laid out for a pipeline mesh (``StagedWeights``), else None."""
    return weights.plan if isinstance(weights, StagedWeights) else None


@struct.dataclass
class StagedPagedCache:
    """Per pool of one layer's paged cache (key and value pages, or with ``latent`` the latent
    pages) [S, Q + P, ...] (stage, slot, then the pool's layout), the rows' block tables [B, W],
    lengths [B] and ``rope_len``."""

    pages: tuple[jax.Array, ...]
    block_tables: jax.Array
    lengths: jax.Array
    rope_len: jax.Array
    latent: bool = struct.field(pytree_node=False, default=False)

    @property
    def page_size(self) -> int:
        """Positions per page (the slot axis, next to last in every pool)."""
        return self.pages[0].shape[-2]

    @property
    def max_len(self) -> int:
        """The positions each row's table can address."""
        return self.block_tables.shape[1] * self.page_size


def _pools(cache: PagedKVCache | PagedLatentCache) -> tuple:
    """Layer 0's pools of a paged cache (or of its specs), in the order of its cache tuple."""
    if isinstance(cache, PagedLatentCache):
        return cache.latent_pages[:1]
    return cache.k_pages[0], cache.v_pages[0]


def _layer_pages(cache: StagedPagedCache, pools: tuple) -> PagedKVCache | PagedLatentCache:
    """One layer's paged cache over ``pools`` with ``cache``'s tables, lengths and ``rope_len``."""
    rows = dict(block_tables=cache.block_tables, lengths=cache.lengths, rope_len=cache.rope_len)
    if cache.latent:
        return PagedLatentCache(latent_pages=pools[:1], **rows)
    return PagedKVCache(k_pages=pools[:1], v_pages=pools[1:], **rows)


def staged_paged_specs(config: ModelConfig, plan: StagePlan, num_pages: int, page_size: int, batch: int = 1,
                       table_width: int = 1, kv_quant: KVQuant = KVQuant.NONE) -> StagedPagedCache:
    """The staged pool declared abstractly: each stage slot's pools as ``paged_cache_specs``
    declares one layer's (quantized as ``kv_quant`` says), behind the logical axes ("stage", None)."""
    flat = paged_cache_specs(config, num_pages, page_size, batch, table_width, kv_quant)
    pages = stacked_spec(_pools(flat), (plan.num_stages, plan.prefix + plan.slots))
    return StagedPagedCache(pages=pages, block_tables=flat.block_tables, lengths=flat.lengths,
                            rope_len=flat.rope_len, latent=config.mla is not None)


def append_staged_pages(cache: StagedPagedCache, new: StagedNewKV) -> StagedPagedCache:
    """Write one pipelined call's rows [S, Q + P, B, T, ...] at each row's length, through its
    block table, into every stage slot's pages, and advance the lengths (the staged form of
    ``paged_cache.append_to_pages``, which writes each slot as one layer; jit it with the cache
    donated)."""
    def one(pools, rows):
        layer = append_to_pages(_layer_pages(cache, pools), layer_new(cache.latent, rows, new.num_new, new.rope_len))
        return _pools(layer)

    pages = jax.vmap(jax.vmap(one))(cache.pages, new.rows)
    return cache.replace(pages=pages, lengths=cache.lengths + new.num_new, rope_len=new.rope_len)
