"""The serving engine's sizes and shape policy: :class:`ServingConfig` (how many slots, pages,
chunk and table-width buckets) resolved against a model and run configuration. The compiled steps
that follow this policy are in ``dayzero.engine.paged_steps`` (its docstring says why the shapes
are bucketed as they are)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from dayzero.engine.generate import GenerationError, bucket
from dayzero.engine.runtime import RunConfig, check_page_pool, resolve_run, with_kernels
from dayzero.kernels import KernelMode
from dayzero.model.compressed_paged import page_multiple
from dayzero.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Sizes of a paged serving engine. ``None`` fields take a default from the model
    (see :meth:`resolve`).

    slots: requests served at once (the largest decode batch). page_size: positions per KV page.
    num_pages: pages in the pool (default: room for ``max_context`` tokens, and 1024 per slot).
    max_context: longest sequence (prompt + new tokens) served (default: the model's context).
    max_chunk / min_chunk: prefill tokens per step (powers of two). chunk_budget: cap on
    chunk tokens x attended positions per prefill step (bounds its attention memory).
    min_table_pages: narrowest block table read (a power of two). prefix_cache: reuse the
    pages of a shared prompt prefix. kernels: how steps attend (None: as the engine's run
    configuration says; else resolved and checked against it by
    ``dayzero.engine.runtime.with_kernels``): reference gathers each row's pages; pallas and
    pallas_interpret run a first prefill chunk on the flash (or sparse) kernel and read the pages
    in place with the paged (or sparse) kernels in every later step, prefill chunk or decode
    (``dayzero.model.kernel_attention``). A linear-attention hybrid is paged (its attention
    layers) and keeps one row of linear-layer states per slot beside the pages
    (``dayzero.model.linear_cache``); DeepSeek-V4 pages its compressed entries and keeps its window
    rings and compressor states per slot (``dayzero.model.compressed_paged``), so its
    ``page_size`` must be a multiple of every compression ratio (default: 16 rounded up to one).
    state_snapshots: for those models, how many copies of a slot's states the prefix cache keeps
    (default 4 x ``slots``; 0 turns their prefix cache off): a cached prefix is reused only up to a
    page boundary whose states were copied when a prefill chunk ended there (see
    ``dayzero.engine.serving``). speculative: a ``speculative.SpecConfig`` (n-gram drafts, or a
    draft model's with its own page pool, ``dayzero.engine.serving_draft``; verified K+1 tokens
    per row in one decode step, ``dayzero.engine.serving_spec``), or None.
    swap_bytes: host memory for the pages (and slot states) of preempted requests, copied back
    at readmission instead of recomputed (``dayzero.engine.kv_swap``; default: as much as the
    device pool; 0: recompute). host_cache_bytes: host memory for a second prefix-cache tier: cached
    prefix pages the device pool evicts are copied there (least recently used out first) and
    copied back on a later prefix match instead of recomputed (``dayzero.engine.kv_swap``; default:
    as much as the device pool; 0: none; needs ``prefix_cache``). micro_batches: on a pipeline
    (``stage``) mesh, the micro-batches a decode step's rows are cut into (at most, a divisor of
    the batch; default: one per stage), so several are in flight through the stages
    (``dayzero.model.pipeline``; a prefill chunk, one sequence, is one micro-batch). Where every
    decoding row allows it, several decode steps run in one call with max(micro_batches, stages)
    micro-batches in flight across them (``dayzero.engine.serving_inflight``).
    """

    slots: int = 8
    page_size: int | None = None
    num_pages: int | None = None
    max_context: int | None = None
    max_chunk: int = 512
    min_chunk: int = 16
    chunk_budget: int = 1 << 21
    min_table_pages: int = 4
    prefix_cache: bool = True
    kernels: KernelMode | str | None = None
    state_snapshots: int | None = None
    speculative: Any = None
    swap_bytes: int | None = None
    host_cache_bytes: int | None = None
    micro_batches: int | None = None

    def __post_init__(self):
        checks = [
            (self.slots >= 1, "slots", "at least 1"),
            (self.page_size is None or self.page_size >= 1, "page_size", "at least 1"),
            (self.num_pages is None or self.num_pages >= 1, "num_pages", "at least 1"),
            (self.state_snapshots is None or self.state_snapshots >= 0, "state_snapshots", "at least 0"),
            (self.swap_bytes is None or self.swap_bytes >= 0, "swap_bytes", "at least 0"),
            (self.host_cache_bytes is None or self.host_cache_bytes >= 0, "host_cache_bytes", "at least 0"),
            (self.micro_batches is None or self.micro_batches >= 1, "micro_batches", "at least 1"),
            (self.max_context is None or self.max_context >= 2, "max_context", "at least 2"),
            (_pow2(self.min_chunk) and _pow2(self.max_chunk) and self.min_chunk <= self.max_chunk,
             "max_chunk", f"a power of two >= min_chunk={self.min_chunk} (also a power of two)"),
            (_pow2(self.min_table_pages), "min_table_pages", "a power of two"),
            (self.chunk_budget >= self.max_chunk * self.max_chunk, "chunk_budget",
             f"at least max_chunk**2 = {self.max_chunk**2}"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise GenerationError(f"{name}={getattr(self, name)!r} is invalid; it must be {expected}")

    def resolve(self, model: ModelConfig, run: RunConfig | None = None) -> "ServingConfig":
        """A copy with every default filled in for ``model`` run as ``run`` says (default: the
        platform's choices on one device); the kernels are :meth:`run_for`'s. Checks the pool can
        hold one sequence of ``max_context`` tokens, and that the kernels can address it."""
        context = self.max_context or model.max_position_embeddings
        if context > model.max_position_embeddings:
            raise GenerationError(
                f"max_context={context} is more than the model's context of "
                f"{model.max_position_embeddings} tokens; lower it")
        page_size = self.page_size or default_page_size(model)
        if model.compressed is not None and page_size % page_multiple(model):
            raise GenerationError(
                f"page_size={page_size} does not hold a whole number of this DeepSeek-V4 model's compressed "
                f"entries; use a multiple of {page_multiple(model)} (the least common multiple of its ratios)")
        per_seq = -(-context // page_size)
        pages = self.num_pages or max(per_seq, self.slots * -(-1024 // page_size))
        if pages < per_seq:
            raise GenerationError(
                f"num_pages={pages} cannot hold one sequence of max_context={context} tokens "
                f"({per_seq} pages of {page_size}); raise num_pages or lower max_context")
        run = self.run_for(model, run)
        check_page_pool(run, model, pages, page_size)
        if self.micro_batches is not None and (run.placement is None or run.placement.axes.get("stage", 1) == 1):
            raise GenerationError(f"micro_batches={self.micro_batches} cuts a pipeline's decode steps; it needs a "
                                  "--mesh with stage > 1: drop it or add a stage axis")
        # A hybrid's linear layers and V4's rings and compressors keep one state per slot beside
        # the pages: their prefix cache needs copies of those states at page boundaries.
        states = model.linear is not None or model.compressed is not None
        snapshots = (4 * self.slots if self.state_snapshots is None else self.state_snapshots) if states else 0
        if self.speculative is not None:
            from dayzero.engine.serving_spec import check_serving_speculation  # it imports this module

            check_serving_speculation(self.speculative, model, run)
        return dataclasses.replace(self, max_context=context, num_pages=pages, page_size=page_size,
                                   kernels=run.kernels, state_snapshots=snapshots,
                                   prefix_cache=self.prefix_cache and (snapshots > 0 or not states))

    def run_for(self, model: ModelConfig, run: RunConfig | None = None) -> RunConfig:
        """The run configuration serving runs with: ``run`` (default: the platform's choices on
        one device) with this config's ``kernels`` if it names any, checked against the rest."""
        return with_kernels(run or resolve_run(model), model, self.kernels)

    # ---- shape policy (on a resolved config) ----------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions."""
        return -(-tokens // self.page_size)

    @property
    def max_table_pages(self) -> int:
        """Width of the full block tables (the widest bucket)."""
        return max(bucket(self.pages_for(self.max_context), 1), self.min_table_pages)

    def attended(self, width: int | None) -> int:
        """Cached positions a step reading ``width`` table entries attends to (at most)."""
        return 0 if width is None else width * self.page_size

    def table_width(self, pages: int) -> int:
        """The bucketed table width that addresses ``pages`` pages."""
        return min(max(bucket(pages, 1), self.min_table_pages), self.max_table_pages)

    def chunk_shape(self, start: int, remaining: int) -> tuple[int, int | None]:
        """(T, W) of the next prefill chunk of a sequence with ``start`` positions cached and
        ``remaining`` to go: W None when nothing is cached (the chunk reads no cache)."""
        T = min(self.max_chunk, bucket(remaining, self.min_chunk))
        if start == 0:
            return T, None
        while True:
            W = self.table_width(self.pages_for(start + min(T, remaining)))
            if T <= self.min_chunk or T * W * self.page_size <= self.chunk_budget:
                return T, W
            T //= 2

    def decode_batches(self) -> list[int]:
        """Every decode batch size: powers of two below ``slots``, then ``slots``."""
        return [1 << e for e in range((self.slots - 1).bit_length()) if 1 << e < self.slots] + [self.slots]

    def decode_batch(self, rows: int) -> int:
        """The decode batch size that holds ``rows`` rows."""
        return min(b for b in self.decode_batches() if b >= rows)

    def chunk_sizes(self) -> list[int]:
        """Every prefill chunk length T."""
        return [1 << e for e in range(self.min_chunk.bit_length() - 1, self.max_chunk.bit_length())]

    def table_widths(self) -> list[int]:
        """Every table width W."""
        return [w for w in (1 << e for e in range(self.max_table_pages.bit_length())) if w >= self.min_table_pages]

    def prefill_shapes(self) -> list[tuple[int, int | None]]:
        """Every (T, W) ``chunk_shape`` can return."""
        shapes = [(T, None) for T in self.chunk_sizes()]
        for T, W in itertools.product(self.chunk_sizes(), self.table_widths()):
            # The table holds at least one cached position and the chunk's real tokens: more
            # than T/2 of them (else T would be a smaller bucket) unless T is the smallest.
            least = 1 + (T // 2 + 1 if T > self.min_chunk else 1)
            fits = W * self.page_size >= min(least, self.max_context)
            if fits and (T == self.min_chunk or T * W * self.page_size <= self.chunk_budget):
                shapes.append((T, W))
        return shapes


def default_page_size(model: ModelConfig) -> int:
    """16 positions a page, or for DeepSeek-V4 the least multiple of its ratios' multiple that is
    (128 for the published ratios 4 and 128)."""
    return math.lcm(16, page_multiple(model)) if model.compressed is not None else 16


def _pow2(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0
