"""The compiled steps of paged serving, and why the shape policy (``engine.serving_config``)
keeps their number small.

Every device call has a static shape drawn from a short list, so a serving run compiles a
bounded set of programs, all of which :meth:`PagedSteps.warmup` can compile up front:

- a prefill chunk: one sequence, T tokens (a power of two between ``min_chunk`` and
  ``max_chunk``), reading a block table W pages wide (a power of two, or none for a first
  chunk, which reads no cache);
- a decode step: one token for each decoding sequence, the rows packed into a batch of a
  power of two (up to ``slots``), reading a table W pages wide;
- the page write of each (the table is always full width there: the write's shape is T only);
- sampling, per batch size and sampling mode (and, once used or warmed up, with token masks and
  with top logprobs: separate programs, so unconstrained serving runs the ones it always ran).

Why the table width is a bucket: the reference attention gathers every page of the table and
attends over all of it (masked), so the width, not the pool or the model's context, sets the
cost of a step. Cut to the power of two above what the longest row needs, a step costs at most
twice the exact width, with log2(pages per sequence) shapes.

Why the chunk shrinks as the context grows: a chunk's attention scores are T x (W x page_size)
per head. Capping that product (``chunk_budget``) keeps each step's memory flat however long
the prompt is: beyond the KV pages themselves (and one layer's gathered copy of them), a 32k
prompt needs no more memory than a short one. The total attention work is the same; only the
weight matmuls run on fewer rows at a time.

Models with a fixed-size state per sequence beside their pages (a linear-attention hybrid's
layer states, DeepSeek-V4's window rings and compressor states; V4 pages its compressed entries,
``dayzero.model.compressed_paged``) keep one state row per serving slot: their steps take the
rows' slots beside the block tables (``run_step(..., slots)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.runtime import RunConfig
from dayzero.engine.serving_config import ServingConfig, default_page_size
from dayzero.engine.sampling import MAX_TOP_LOGPROBS, RowSampling, SamplingMode, SamplingParams, allow_all, sample
from dayzero.engine.sampling import top_logprobs as most_likely
from dayzero.engine.step_cache import StepCache
from dayzero.kernels import KernelMode
from dayzero.model.cache import empty_from_specs
from dayzero.model.compressed_paged import PagedCompressedCache
from dayzero.model.config import ModelConfig
from dayzero.model.kernel_attention import HeadSplit
from dayzero.model.linear_cache import HybridCache
from dayzero.model.mrope import ImageInput, continuation
from dayzero.model.mtp import main_hidden
from dayzero.model.paged_cache import append_to_pages, init_paged_cache, kernel_view, paged_cache_specs, with_written
from dayzero.model.parallel import Parallel
from dayzero.model.pipeline import micro_batches, pipeline_forward
from dayzero.model.pipeline_paged import serving_stages, staged_paged_specs
from dayzero.model.transformer import forward
from dayzero.model.weights import Weights


__all__ = ["PagedSteps", "RowParams", "Sampled", "ServingConfig", "default_page_size", "key_data", "sampling_mode"]

# Module-level jits, so that serving engines over the same model and shapes share compilations.
# On a mesh, ``layout`` (static) pins what a step returns: sampled tokens replicated (every process
# reads them back), the written pool in the sharding it was made with (so no step recompiles).
# Sampling with token masks is a jit of its own: a batch without constrained rows runs
# ``_sample_rows``, the same program as before constraints existed, and compiles no mask variant.
# ``top`` (static): 0, or how many most likely tokens (with log-probabilities) to return as well.
@functools.partial(jax.jit, static_argnames=("mode", "top", "layout"))
def _sample_rows(logits, temperature, top_k, top_p, min_p, keys, steps, mode: SamplingMode, top=0, layout=None):
    return _sampled(logits, (temperature, top_k, top_p, min_p, keys), steps, None, mode, top, layout)


@functools.partial(jax.jit, static_argnames=("mode", "top", "layout"))
def _sample_masked(logits, temperature, top_k, top_p, min_p, keys, steps, mask, mode: SamplingMode, top=0,
                   layout=None):
    return _sampled(logits, (temperature, top_k, top_p, min_p, keys), steps, mask, mode, top, layout)


def _sampled(logits, params, steps, mask, mode, top, layout):
    """The body of both sampling jits: tokens, logprobs (and the top ids and logprobs if ``top``)."""
    temperature, top_k, top_p, min_p, keys = params
    rows = RowSampling(temperature, top_k, top_p, min_p, jax.random.wrap_key_data(keys))
    out = sample(logits, rows, steps, mode, mask)
    if top:
        out = (*out, *most_likely(logits, top))
    return _pinned(out, layout)


def _image_positions(images, rope_deltas, lengths, T: int):
    """The ``ImageInput`` of a step: a prefill chunk's own (``images``), a text step's after an
    image prompt (positions shifted by the rows' ``rope_deltas``), or None (plain positions)."""
    return continuation(lengths, T, rope_deltas) if rope_deltas is not None else images


@functools.partial(jax.jit, static_argnames=("config", "kernels", "parallel", "all_logits", "hidden"))
def _forward_logits(weights, tokens, num_new, cache, images=None, rope_deltas=None, *, config,
                    kernels=KernelMode.REFERENCE, parallel=None, all_logits=False, hidden=False):
    # ``hidden``: (logits, the post-final-norm hidden states [B,T,D]) in place of the logits (MTP).
    images = _image_positions(images, rope_deltas, None if cache is None else cache.lengths, tokens.shape[1])
    layers = [] if hidden else None
    logits, new = forward(weights, config, tokens, cache, num_new, kernels=kernels, parallel=parallel, images=images,
                          all_logits=all_logits, hidden_out=layers)
    return ((logits, main_hidden(weights, config, layers[-1])) if hidden else logits), new


@functools.partial(jax.jit, static_argnames=("config", "plan", "parallel", "num_micro"))
def _pipeline_logits(weights, tokens, num_new, cache, *, config, plan, parallel, num_micro):
    # A pipeline (stage) mesh's step: staged weights and page pool, the rows cut into micro-batches.
    return pipeline_forward(weights, config, plan, parallel, tokens, cache, num_new, num_micro)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=(0,))
def _append(pool, new, layout=None):
    return _pinned(append_to_pages(pool, new), layout)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "parallel", "layout"), donate_argnames=("pool",))
def _forward_in_place(weights, tokens, pool, num_new, images=None, rope_deltas=None, *, config, kernels,
                      parallel=None, layout=None):
    # One jit for the forward and the page writes, with the pool donated: each layer writes the
    # new tokens into its pages before the kernel reads them (see dayzero.model.kernel_attention).
    images = _image_positions(images, rope_deltas, pool.lengths, tokens.shape[1])
    view = kernel_view(pool, num_new, kernels, tuple(config.sliding_windows), HeadSplit.of(parallel))
    logits, view = forward(weights, config, tokens, view, num_new, parallel=parallel, images=images)
    return logits, _pinned(with_written(pool, view), layout)


@functools.partial(jax.jit, static_argnums=(1,))
def _empty_rows(states, rows: int):
    # Zeroed snapshot rows shaped as the slot states, made by a jit so that they are committed to
    # their device(s) like the arrays every later copy returns (uncommitted inputs compile apart).
    return jax.tree.map(lambda leaf: jnp.zeros((rows, *leaf.shape[1:]), leaf.dtype), states)


@functools.partial(jax.jit, donate_argnums=(0,))
def _snapshot(snapshots, states, slot, row):
    # Copy slot ``slot``'s states into snapshot ``row`` (an out-of-range row writes nothing).
    return jax.tree.map(lambda snap, pool: snap.at[row].set(pool[slot], mode="drop"), snapshots, states)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=(0,))
def _restore(pool, snapshots, slot, row, layout=None):
    # Copy snapshot ``row`` into slot ``slot``'s states (an out-of-range slot writes nothing).
    states = jax.tree.map(lambda p, snap: p.at[slot].set(snap[row], mode="drop"), pool.slot_states, snapshots)
    return _pinned(pool.with_slot_states(states), layout)


# The jits above as compiled executables, per (step, model, run configuration, pool, shape): shared
# by every serving engine of the process, and read from disk on a warm start (engine/step_cache.py;
# the statics and arguments of each call are in the disk key).
_STEPS = StepCache(scope="paged_steps")


def _pinned(tree, layout):
    """``tree`` constrained to ``layout`` (a matching tree of shardings), or as it is (None)."""
    return tree if layout is None else jax.lax.with_sharding_constraint(tree, layout)


@dataclasses.dataclass
class RowParams:
    """Sampling parameters of a batch's rows as host arrays (one entry per row)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    key_data: np.ndarray  # [B, key words]: each row's PRNG key from its seed

    @classmethod
    def of(cls, params: list[SamplingParams], keys: list[np.ndarray], rows: int) -> "RowParams":
        """``params`` (with their ``keys``, see :func:`key_data`) in the first rows of ``rows``;
        greedy padding rows after them."""
        words = keys[0].shape if keys else key_data(0).shape
        out = cls(np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
                  np.zeros(rows, np.float32), np.zeros((rows, *words), np.uint32))
        for row, (p, key) in enumerate(zip(params, keys)):
            out.temperature[row], out.top_k[row], out.top_p[row], out.min_p[row] = (
                p.temperature, p.top_k, p.top_p, p.min_p)
            out.key_data[row] = key
        return out


@dataclasses.dataclass
class Sampled:
    """What a sampling step returns, on the host: per row [B] the token and its logprob (and,
    when asked for, the most likely tokens [B, k] with their logprobs, most likely first)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


def key_data(seed: int) -> np.ndarray:
    """The raw words of the PRNG key of ``seed`` (``sample`` folds each token's index into it)."""
    return np.asarray(jax.random.key_data(jax.random.key(int(seed))))


def sampling_mode(params: list[SamplingParams]) -> SamplingMode:
    """The cheapest mode serving every row (a row's tokens do not depend on it, see ``sample``)."""
    if all(p.greedy for p in params):
        return SamplingMode.GREEDY
    return SamplingMode.FILTERED if any(p.filtered for p in params) else SamplingMode.PLAIN


class PagedSteps:
    """The page pool on the device(s) and the compiled forward, page write and sampling steps.
    A model with per-slot states (a hybrid's ``HybridCache``, V4's ``PagedCompressedCache``) holds
    them beside its pages; its steps read the rows' slots too.

    On a mesh (``run.placement``) the pool is laid out by its logical axes
    (``paged_cache_specs``: per-head pages split by kv head), the forward runs with the mesh's
    hand-written blocks (expert-parallel MoE, split latent attention, the kernels per device),
    host inputs are replicated over the mesh through ``host`` and every step's outputs are pinned
    (sampled tokens replicated, the pool in its own layout).
    """

    def __init__(self, config: ModelConfig, weights: Weights, serving: ServingConfig, run: RunConfig,
                 host=None):
        """Steps for ``serving`` (resolved) of a model run as ``run`` says (``serving.run_for``:
        its kernels are the ones steps attend with); ``host(value)`` turns host arrays into step
        inputs (default: ``jnp.asarray``, one device)."""
        self.config, self.weights, self.serving, self.run = config, weights, serving, run
        self._host = host or (lambda value: jax.tree.map(jnp.asarray, value))
        self.parallel: Parallel | None = run.parallel
        self.stages = serving_stages(weights)  # a pipeline mesh's StagePlan, or None
        dtype = (weights.outer if self.stages else weights).embed.dtype
        specs = self.pool_specs(serving.num_pages, serving.slots)
        self.layout = None if run.placement is None else run.placement.shardings(specs)
        self.sample_layout = None if run.placement is None else run.placement.replicated()
        if self.stages:
            self.pool = empty_from_specs(staged_paged_specs, config, self.stages, serving.num_pages,
                                         serving.page_size, 1, 1, run.kv_cache, dtype, shardings=self.layout)
        else:
            self.pool = init_paged_cache(config, serving.num_pages, serving.page_size, dtype=dtype,
                                         kv_quant=run.kv_cache, shardings=self.layout, state_slots=serving.slots)
        self.snapshots = None  # copies of slot states at page boundaries (models with per-slot states)
        if serving.prefix_cache and serving.state_snapshots:
            empty = _empty_rows(self.pool.slot_states, serving.state_snapshots)
            # On a mesh, laid out as the slot states are (their shardings do not depend on the rows).
            self.snapshots = empty if self.layout is None else jax.device_put(empty, self.layout.slot_states)
        self.shapes_run: set[tuple[int, int, int | None]] = set()  # (B, T, W) of every forward run
        self.samplings_run: set[tuple[int, SamplingMode, bool, int]] = set()  # (B, mode, masked, top) of each
        self.compile_s = 0.0  # seconds of the first call of each step shape (compile, then run)

    def pool_specs(self, num_pages: int, slots: int):
        """The page pool of ``num_pages`` pages (and ``slots`` state rows) declared abstractly:
        ``paged_cache_specs``, or on a pipeline mesh stacked by stage (``staged_paged_specs``)."""
        s = self.serving
        if self.stages:
            return staged_paged_specs(self.config, self.stages, num_pages, s.page_size, kv_quant=self.run.kv_cache)
        return paged_cache_specs(self.config, num_pages, s.page_size, kv_quant=self.run.kv_cache, state_slots=slots)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the page pool (every layer; a quantized pool's values and scales) and of the
        prefix cache's state snapshots."""
        return sum(x.nbytes for x in jax.tree.leaves((self.pool, self.snapshots)) if x.ndim >= 3)

    @property
    def has_slot_states(self) -> bool:
        """Whether the model keeps per-slot states beside its pages (a hybrid, DeepSeek-V4)."""
        return isinstance(self.pool, (HybridCache, PagedCompressedCache))

    def snapshot(self, slot: int, row: int) -> None:
        """Copy slot ``slot``'s states into snapshot ``row`` (after the step that wrote them)."""
        self.snapshots = _snapshot(self.snapshots, self.pool.slot_states, *self._host((np.int32(slot), np.int32(row))))

    def restore(self, slot: int, row: int) -> None:
        """Copy snapshot ``row`` into slot ``slot``'s states (before the slot's next step)."""
        self.pool = _restore(self.pool, self.snapshots, *self._host((np.int32(slot), np.int32(row))), layout=self.layout)

    def run_step(self, tokens: np.ndarray, num_new: np.ndarray, lengths: np.ndarray, tables: np.ndarray,
                 width: int | None, slots: np.ndarray | None = None, images: ImageInput | None = None,
                 rope_deltas: np.ndarray | None = None, all_logits: bool = False, hidden: bool = False) -> jax.Array:
        """Forward ``tokens`` [B,T] (``num_new`` real per row) after each row's ``lengths``
        cached positions, write their keys/values into the pages of ``tables`` [B, full width]
        and return the logits of each row's last real token [B,V] (on the device).

        ``width``: the table width the attention reads (None: nothing cached, read nothing).
        ``slots`` [B]: each row's serving slot, whose state rows a model with per-slot states
        (a hybrid, DeepSeek-V4) reads and writes (default: slot 0 for every row; ignored by others).
        ``images``: the M-RoPE positions and image entries of a prefill chunk of an image prompt;
        ``rope_deltas`` [B]: the rows' position shifts in a decode step after image prompts (each
        another program, compiled on first use: ``warmup`` compiles the text-only steps).
        ``all_logits``: return every position's logits [B,T,V] (a speculative verify step; on the
        gathered reference path). ``hidden``: return (logits, the target's post-final-norm hidden
        states [B,T,D] of the step's positions), as the MTP drafter reads them (reference path too).
        """
        shape = (*tokens.shape, width)
        self.shapes_run.add(shape)
        tables = self._slotted(tables, slots)
        fn, signature, args, static = self._forward_call(tokens, num_new, lengths, tables, width, images,
                                                         rope_deltas)
        if all_logits:  # (speculation runs on the reference path only: serving_spec refuses kernels)
            signature, static = signature + ("all_logits",), dict(static, all_logits=True)
        if hidden:
            signature, static = signature + ("hidden",), dict(static, hidden=True)
        with self._compiling(signature) as done:
            if fn is _forward_in_place:
                logits, self.pool = _STEPS.call(fn, signature, *args, static=static)
            else:
                logits, new = _STEPS.call(fn, signature, *args, static=static)
                # The write's shape is the step's (its image variants write alike).
                self.pool = _STEPS.call(_append, ("append", signature[1][:4]), self._with_rows(tables, lengths), new,
                                        static=dict(layout=self.layout))
            done(logits)
        return logits

    def _forward_call(self, tokens, num_new, lengths, tables, width, images=None, rope_deltas=None) -> tuple:
        """(jitted forward, its signature, arguments, statics) of a ``run_step``: on the kernels,
        the forward that writes the pages in place; else the forward whose new keys/values
        ``_append`` writes."""
        # What tells this step apart from every other serving step of the process (the pool's shape).
        s = self.serving
        key = (self.config, self.run, (s.num_pages, s.page_size, s.slots), (*tokens.shape, width))
        extra = ()
        if images is not None:  # told apart by the (bucketed) image entry count
            n = 0 if images.embeds is None else images.embeds.shape[0]
            key, extra = key + ("images", n, len(images.deepstack)), (self._host(images), None)
        elif rope_deltas is not None:
            key, extra = key + ("rope_deltas",), (None, self._host(np.asarray(rope_deltas, np.int32)))
        statics = dict(config=self.config, kernels=self.run.kernels, parallel=self.parallel)
        tokens, num_new, read = self.forward_args(tokens, num_new, lengths, tables, width)
        if self.stages:  # (no images, no kernels: the pipeline refuses both)
            fn, statics = self._logits_step(tokens.shape[0])
            return fn, ("pipeline", key, statics["num_micro"]), (self.weights, tokens, num_new, read), statics
        if self.reads_in_place(width):
            return _forward_in_place, ("in_place", key), (self.weights, tokens, read, num_new, *extra), dict(
                statics, layout=self.layout)
        return _forward_logits, ("logits", key), (self.weights, tokens, num_new, read, *extra), statics

    def _logits_step(self, batch: int) -> tuple:
        """(jitted forward that returns logits and new keys/values, its statics) for ``batch`` rows."""
        if not self.stages:
            return _forward_logits, dict(config=self.config, kernels=self.run.kernels, parallel=self.parallel)
        num_micro = micro_batches(batch, self.serving.micro_batches or self.stages.num_stages)
        return _pipeline_logits, dict(config=self.config, plan=self.stages, parallel=self.parallel, num_micro=num_micro)

    @contextlib.contextmanager
    def _compiling(self, signature: tuple):
        """Time a forward step into ``compile_s`` if its ``signature`` is not compiled in this
        process yet (that first call compiles, or reads the step from disk); ``done(result)``
        waits for the result so the time covers the compile and the run."""
        first = signature not in _STEPS
        start, results = time.perf_counter(), []
        yield results.append
        if first:
            jax.block_until_ready(results)
            self.compile_s += time.perf_counter() - start

    def _slotted(self, tables: np.ndarray, slots: np.ndarray | None):
        """A model with per-slot states: its step tables ``(block tables, slots)``; other models'
        tables as they are."""
        if not isinstance(self.pool, (HybridCache, PagedCompressedCache)):
            return tables
        return tables, np.zeros(len(tables), np.int32) if slots is None else np.asarray(slots, np.int32)

    def _with_rows(self, tables, lengths: np.ndarray):
        """The pool with these rows' block tables (with per-slot states: (block tables, slots))
        and lengths, as a step's input."""
        lengths = self._host(np.asarray(lengths, np.int32))
        if isinstance(tables, tuple):
            tables, slots = tables
            return self.pool.with_rows(block_tables=self._host(np.asarray(tables, np.int32)), lengths=lengths,
                                       slots=self._host(slots))
        return self.pool.replace(block_tables=self._host(np.asarray(tables, np.int32)), lengths=lengths)

    def reads_in_place(self, width: int | None) -> bool:
        """Whether a step reading ``width`` table pages runs on the paged kernels (any step that
        reads the cache, with a kernel mode) rather than the gathered reference path."""
        return self.run.on_kernels and width is not None

    def forward_args(self, tokens, num_new, lengths, tables, width) -> tuple:
        """(tokens, num_new, cache to read) of a step's forward call (``run_step``), as step inputs."""
        if width is None:
            read = None
        elif isinstance(tables, tuple):  # (block tables, slots)
            read = self._with_rows((tables[0][:, :width], tables[1]), lengths)
        else:
            read = self._with_rows(tables[:, :width], lengths)
        return self._host(np.asarray(tokens, np.int32)), self._host(np.asarray(num_new, np.int32)), read

    def forward_temp_bytes(self, B: int, T: int, width: int | None) -> int:
        """Temporary device memory XLA plans for the forward call of shape (B, T, width): the
        step's working memory beyond weights, pool and outputs."""
        tables = self._slotted(np.zeros((B, self.serving.max_table_pages), np.int32), None)
        args = self.forward_args(np.zeros((B, T)), np.zeros(B), np.zeros(B), tables, width)
        fn, statics = self._logits_step(B)
        compiled = fn.lower(self.weights, *args, **statics).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)

    def sample(self, logits: jax.Array, rows: RowParams, steps: np.ndarray, mode: SamplingMode,
               masks: np.ndarray | None = None, top: int = 0) -> "Sampled":
        """Tokens [B] and their logprobs [B] for each row, with its own parameters and its
        own ``steps`` (tokens it generated before this one), read back to the host.

        ``masks``: packed allowed-token bitmasks [B, ceil(V/32)] (uint32; see
        ``sampling.TokenConstraint``), or None for a batch without constraints (the program
        compiled without masks). ``top``: 0, or the number of most likely tokens to return with
        their logprobs (``Sampled.top_ids``/``top_logprobs`` [B, top]).
        """
        self.samplings_run.add((len(rows.temperature), mode, masks is not None, top))
        fn, signature, args, static = self._sample_call(logits, rows, steps, mode, masks, top)
        return Sampled(*(np.asarray(x) for x in _STEPS.call(fn, signature, *args, static=static)))

    def _sample_call(self, logits, rows: RowParams, steps, mode: SamplingMode, masks, top: int) -> tuple:
        """(jitted sampling step, its signature, arguments, statics) of a :meth:`sample`."""
        args = (rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.key_data, np.asarray(steps, np.int32))
        static = dict(mode=mode, top=top, layout=self.sample_layout)
        key = (self.config, self.run, len(rows.temperature), mode, top)
        if self.sample_layout is not None:
            # One input layout for every call: a forward's logits come split over the vocabulary
            # on a mesh, warmup's zeros whole, and one compiled program serves both.
            logits = jax.device_put(logits, self.sample_layout)
        if masks is None:
            return _sample_rows, ("sample", key), (logits, *self._host(args)), static
        return _sample_masked, ("sample_masked", key), (logits, *self._host((*args, np.asarray(masks, np.uint32)))), static

    def warmup(self, constrained: bool = False, top_logprobs: bool = False) -> int:
        """Compile every shape serving can use; returns how many calls it made. Sampling with
        token masks (``constrained``) and with top logprobs are extra variants of each sampling
        step, compiled only when asked for (else on a constrained or top-logprobs batch's first use).

        Each call writes nothing (no real token) and so leaves the pool as it was.
        """
        s = self.serving
        steps = [(np.zeros((1, T)), np.zeros(1), np.zeros(1), np.zeros((1, s.max_table_pages), np.int32), W)
                 for T, W in s.prefill_shapes()]
        steps += [(np.zeros((B, 1)), np.zeros(B), np.zeros(B), np.zeros((B, s.max_table_pages), np.int32), W)
                  for B, W in itertools.product(s.decode_batches(), s.table_widths())]
        masked = (False, True) if constrained else (False,)
        tops = (0, MAX_TOP_LOGPROBS) if top_logprobs else (0,)  # ``top_width`` of none and of any
        samplings = []
        for B, mode, mask, top in itertools.product(s.decode_batches(), SamplingMode, masked, tops):
            masks = np.tile(allow_all(self.config.vocab_size), (B, 1)) if mask else None
            samplings.append((jnp.zeros((B, self.config.vocab_size), jnp.float32), RowParams.of([], [], B),
                              np.zeros(B), mode, masks, self.top_width(top)))
        # The forwards and samplings compile in parallel first (the page writes, whose inputs
        # are forward outputs, compile as the shapes then run one by one).
        start = time.perf_counter()
        # (Models with per-slot states read (tables, slots), as ``run_step`` passes them: ``_slotted``.)
        _STEPS.prepare_all([self._forward_call(*step[:3], self._slotted(step[3], None), step[4]) for step in steps]
                           + [self._sample_call(*sampling) for sampling in samplings])
        self.compile_s += time.perf_counter() - start
        for step in steps:
            self.run_step(*step)
        for sampling in samplings:
            self.sample(*sampling)
        if self.snapshots is not None:  # out-of-range rows and slots: both copies write nothing
            for _ in range(2):  # twice: on a mesh the first call may return another layout
                self.snapshot(0, s.state_snapshots)
                self.restore(s.slots, 0)
        return len(steps) + len(samplings)

    def top_width(self, k: int) -> int:
        """The ``top`` a batch whose rows ask for at most ``k`` top logprobs samples with: 0, or
        every row's possible maximum (one compiled variant for all k)."""
        return min(MAX_TOP_LOGPROBS, self.config.vocab_size) if k else 0

