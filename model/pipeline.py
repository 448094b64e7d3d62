"""Pipeline parallelism: decoder layers split into contiguous stages over the ``stage`` mesh axis.

Layout. The layers are split by :func:`dayzero.sharding.stages.balanced_stages` (balanced by
parameter bytes). Each stage's layers are stacked into *slots*, and the slots of all stages into
one tree whose leaves are [S, P, ...] (S stages, P = the largest stage's layer count), split over
``stage`` by the logical axis of the same name; a stage with fewer layers pads its last slots with
zeros and an ``active`` flag of False, which the forward pass skips (its output is discarded). The
KV cache is stacked the same way ([S, P, B, ...]), so each stage's cache lives on its own devices.
One stacked tree, rather than a tuple of per-stage trees, is what makes the whole pipeline one SPMD
program: every stage runs the same code on its own slice.

Schedule. :func:`pipeline_forward` runs inside ``jax.shard_map`` manual over ``stage`` only; the
other mesh axes stay automatic, so tensor parallelism within a stage is XLA's, and the
expert-parallel MoE block nests its own ``shard_map`` (``Parallel.shard_mesh``). The batch is cut
into M micro-batches and the loop runs M + S - 1 ticks: at tick t stage s runs micro-batch t - s
through its slots and ``ppermute``s the activations to stage s + 1 (GPipe's schedule, forward
only). A stage with no micro-batch at a tick computes on stale data that is thrown away: the
bubble, (S - 1) / (M + S - 1) of the ticks. The embedding runs before the loop (stage 0 reads its
micro-batch from it), the final norm and head after it, on the last stage's hidden states.
Decoding with the micro-batches in flight across steps (no drain between them) is
``dayzero.model.pipeline_inflight``.

Layer kinds. A stack needs layers of one kind (structure and shapes). A model whose first layers
are of another kind (DeepSeek's and Kimi's dense first layers before the MoE ones) gets them as a
*prefix* stack placed deliberately on stage 0, which takes correspondingly fewer main layers
(:func:`plan_stages` chooses the split minimising the largest stage's bytes under that
constraint). Other stages hold that stack as zero padding ([S, Q, ...] with Q prefix layers),
which costs them Q dense layers of memory: small beside MoE layers, and what keeps every stage
one program. MTP modules are not run by the engine and stay outside the pipeline, in ``outer``.

Caches. A stage slot's cache is the layer's cache tuple as ``decoder_layer`` reads and returns
it: (keys, values) for softmax attention, (latent rows,) for multi-head latent attention (MLA,
DeepSeek-V3, Kimi-K2). :class:`StagedKVCache` stacks each buffer of that tuple [S, Q + P, ...],
declared from ``cache.cache_specs`` and written by ``cache.append_to_cache`` applied per slot, so
one implementation runs both kinds (the paged form is ``dayzero.model.pipeline_paged``). On a
mesh, MLA's split latent attention nests its own ``shard_map`` as the MoE block does.

Quantized weights (int8, fp8, fp8-block, int4, MXFP4; ``dayzero.model.quant.QuantizedArray``)
stack like float ones: values and scales each get the [S, P] lead, and the static layout
metadata (``in_axes``, ``block``) keeps describing one layer, which is what the stage body
computes with once it has sliced off the stage and slot axes.

What it covers is what :func:`pipeline_refusal` does not refuse: softmax attention (GQA/MHA, one
window for every layer) or MLA without a sparse indexer, dense or MoE MLPs (a dense prefix then
MoE), float or quantized weights, a float KV cache, the reference attention. Each refusal is
one sentence naming the feature.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from dayzero.model.cache import KVCache, LatentCache, NewKV, NewLatent, append_to_cache, cache_specs
from dayzero.model.config import ModelConfig
from dayzero.model.kernel_attention import gathered
from dayzero.model.norm import rms_norm
from dayzero.model.paged_cache import after_input
from dayzero.model.parallel import Parallel
from dayzero.model.quant import NIBBLE_TYPES, KVQuant
from dayzero.model.rope import rope_cos_sin
from dayzero.model.transformer import attention_masks, decoder_layer, output_logits
from dayzero.model.weights import ParamSpec, Weights, is_spec, map_specs
from dayzero.sharding.distributed import MeshError
from dayzero.sharding.stages import balanced_stages


def pipeline_refusal(config: ModelConfig, axes: Mapping[str, int], *, kernels: Any = None,
                     quantized: bool = False, kv_quantized: bool = False) -> str | None:
    """Why ``config`` cannot run pipelined on a mesh of these axis sizes (None: it can, or the
    mesh has no ``stage`` axis > 1). ``kernels``: the resolved attention mode (None or the
    reference path is fine); ``quantized`` / ``kv_quantized``: the weights / KV cache are not
    float (accepted: every weight and KV format runs pipelined)."""
    stages = int(axes.get("stage", 1))
    if stages <= 1:
        return None
    mesh = f"--mesh stage={stages}"
    if stages > config.num_layers:
        return f"{mesh} is more stages than the model's {config.num_layers} decoder layers; use stage <= {config.num_layers}"
    unsupported = [
        (config.dsa is not None, "DeepSeek sparse attention (DeepSeek-V3.2's indexer)"),
        (config.compressed is not None, "DeepSeek-V4's compressed attention"),
        (config.linear is not None, "hybrid linear-attention layers"),
        (config.hyper is not None, "hyper-connections"),
        (config.vision is not None, "a vision tower"),
        (config.moe is not None and _interleaved(config.moe.layers),
         "dense and MoE layers interleaved (dense first layers, then MoE, are supported)"),
        (kernels is not None and getattr(kernels, "value", kernels) not in ("reference", "auto"),
         "the Pallas attention kernels"),
    ]
    for bad, what in unsupported:
        if bad:
            return (f"{mesh} (pipeline parallelism) does not support {what} yet; drop the stage axis and "
                    "use tensor/expert/data parallelism")
    return None


def _interleaved(moe_layers: tuple[bool, ...]) -> bool:
    """Whether MoE flags are other than some dense layers then only MoE layers."""
    first = moe_layers.index(True) if True in moe_layers else len(moe_layers)
    return not all(moe_layers[first:])


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Which layers each stage runs (contiguous ranges as (start, stop) pairs), of which the first
    ``prefix`` (layers of another kind, e.g. DeepSeek's dense first layers) all sit on stage 0.
    Hashable: a jit static argument.

    Each stage has ``prefix`` prefix slots (active on stage 0 only) then P main slots (the largest
    stage's main-layer count; the others pad up to it). Cache slot j of a stage is prefix slot j
    for j < prefix, main slot j - prefix after."""

    ranges: tuple[tuple[int, int], ...]
    prefix: int = 0

    @property
    def num_stages(self) -> int:
        """S, the number of stages."""
        return len(self.ranges)

    @property
    def slots(self) -> int:
        """P, the largest stage's main-layer count (the others pad up to it)."""
        return max(b - max(a, self.prefix) for a, b in self.ranges)

    def slot_layers(self) -> tuple[tuple[int | None, ...], ...]:
        """Per stage, per main slot: the layer index it runs, or None for a padding slot."""
        starts = [max(a, self.prefix) for a, _ in self.ranges]
        return tuple(tuple(a + p if a + p < b else None for p in range(self.slots))
                     for a, (_, b) in zip(starts, self.ranges))

    def prefix_layers(self) -> tuple[tuple[int | None, ...], ...]:
        """Per stage, per prefix slot: the layer index (stage 0 only), or None."""
        return tuple(tuple(j if s == 0 else None for j in range(self.prefix)) for s in range(self.num_stages))

    def active(self) -> jax.Array:
        """[S, P] bool: which main slots hold a layer."""
        return jnp.array([[i is not None for i in row] for row in self.slot_layers()])

    def prefix_active(self) -> jax.Array:
        """[S, prefix] bool: which prefix slots hold a layer (stage 0's)."""
        return jnp.array([[i is not None for i in row] for row in self.prefix_layers()], bool).reshape(
            self.num_stages, self.prefix)


def _spec_bytes(tree: Any) -> int:
    """Parameter bytes of a tree of ``ParamSpec`` (4 bytes an element where no dtype is set). A
    quantized leaf's values and scales are both specs, counted at their stored dtypes, 4-bit values
    at half a byte (as ``quant.stored_bytes`` counts arrays)."""
    def one(s: ParamSpec) -> int:
        n = math.prod(s.shape)
        if s.dtype is None:
            return 4 * n
        return -(-n // 2) if jnp.dtype(s.dtype) in NIBBLE_TYPES else n * jnp.dtype(s.dtype).itemsize

    return sum(one(s) for s in jax.tree.leaves(tree, is_leaf=is_spec))


def _kind(layer: Any) -> Any:
    """What must match for layers to share a stack: tree structure and leaf shapes."""
    leaves, tree = jax.tree.flatten(layer, is_leaf=is_spec)
    return tree, tuple(tuple(x.shape) for x in leaves)


def layer_prefix(layers: tuple) -> int:
    """How many leading layers differ in kind from the last one (0: all alike). Raises
    ``ValueError`` unless those leading layers are alike and all later ones like the last."""
    kinds = [_kind(layer) for layer in layers]
    prefix = next(i for i in range(len(kinds)) if all(k == kinds[-1] for k in kinds[i:]))
    if any(k != kinds[0] for k in kinds[:prefix]):
        raise ValueError("pipeline stages take at most two kinds of decoder layer, a prefix of one kind then the "
                         "rest of another (e.g. dense first layers then MoE layers)")
    return prefix


def plan_stages(specs: Weights, num_stages: int) -> StagePlan:
    """The stage split of a weight-spec tree (``abstract_weights``): contiguous, minimising the
    largest stage's parameter bytes, with a prefix of another layer kind (dense first layers)
    kept whole on stage 0, which then takes correspondingly fewer of the main layers."""
    sizes = [_spec_bytes(layer) for layer in specs.layers]
    prefix, n = layer_prefix(specs.layers), len(sizes)
    if prefix == 0 or num_stages == 1:
        ranges = balanced_stages(sizes, num_stages)
        return StagePlan(tuple((r.start, r.stop) for r in ranges), prefix)
    if n - prefix < num_stages - 1:
        raise MeshError(f"--mesh stage={num_stages} leaves a stage without layers: the first {prefix} layers stay "
                        f"together on stage 0 and only {n - prefix} others remain; use stage <= {n - prefix + 1}")
    best = None
    for stop in range(prefix, n - num_stages + 2):  # stage 0 = [0, stop): the prefix and stop - prefix more
        rest = balanced_stages(sizes[stop:], num_stages - 1)
        cost = max(sum(sizes[:stop]), *(sum(sizes[stop + i] for i in r) for r in rest))
        if best is None or cost < best[0]:
            best = (cost, ((0, stop),) + tuple((stop + r.start, stop + r.stop) for r in rest))
    return StagePlan(best[1], prefix)


@struct.dataclass
class StagedWeights:
    """A model laid out for the pipeline: ``outer`` (embedding, final norm, head; ``layers``
    empty), ``layers``, one layer tree whose leaves are stacked [S, P, ...], ``prefix``, the
    prefix layers stacked [S, prefix, ...] (None without a prefix), and the ``plan`` that laid
    them out (static: it travels with the weights into every step that runs them)."""

    outer: Weights
    layers: Any
    prefix: Any = None
    plan: StagePlan | None = struct.field(pytree_node=False, default=None)


def stacked_spec(tree: Any, lead: tuple[int, int]) -> Any:
    """``tree`` (per-layer specs: weights or cache buffers) with the [S, slots] lead prepended to
    every ``ParamSpec`` under the logical axes ("stage", None)."""
    return map_specs(lambda s: dataclasses.replace(s, shape=lead + s.shape, axes=("stage", None) + s.axes), tree)


def staged_specs(specs: Weights, plan: StagePlan) -> StagedWeights:
    """The abstract tree of :class:`StagedWeights`: each layer leaf [S, slots, ...] with logical
    axes ("stage", None, ...), from the per-layer specs (a quantized leaf's values and scales alike)."""
    S = plan.num_stages
    prefix = stacked_spec(specs.layers[0], (S, plan.prefix)) if plan.prefix else None
    return StagedWeights(outer=specs.replace(layers=()), layers=stacked_spec(specs.layers[-1], (S, plan.slots)),
                         prefix=prefix, plan=plan)


def _stack(layers: tuple, rows: tuple[tuple[int | None, ...], ...], like: Any) -> Any:
    """``layers`` placed as ``rows`` (stage by slot) says, [S, slots, ...] leaves, zero padding."""
    zero = jax.tree.map(jnp.zeros_like, like)
    flat = [layers[i] if i is not None else zero for row in rows for i in row]
    return jax.tree.map(lambda *xs: jnp.stack(xs).reshape((len(rows), len(rows[0])) + xs[0].shape), *flat)


def stage_weights(weights: Weights, plan: StagePlan) -> StagedWeights:
    """Stack ``weights.layers`` into the stages' slots as ``plan`` says (padding slots zero)."""
    if layer_prefix(weights.layers) != plan.prefix:
        raise ValueError(f"the weights' layers do not have the plan's {plan.prefix} prefix layers")
    prefix = _stack(weights.layers, plan.prefix_layers(), weights.layers[0]) if plan.prefix else None
    return StagedWeights(outer=weights.replace(layers=()),
                         layers=_stack(weights.layers, plan.slot_layers(), weights.layers[-1]), prefix=prefix,
                         plan=plan)


@struct.dataclass
class StagedKVCache:
    """The contiguous cache stacked like the layers: each buffer of one layer's cache tuple
    (``KVCache.layer``: keys [B, K, H, L] and values [B, K, L, H]; ``LatentCache.layer``: latent
    rows [B, L, C] with ``latent``) as [S, Q + P, ...] (Q prefix then P main slots), lengths [B],
    ``rope_len``."""

    buffers: tuple[jax.Array, ...]
    lengths: jax.Array
    rope_len: jax.Array
    latent: bool = struct.field(pytree_node=False, default=False)

    @property
    def max_len(self) -> int:
        """L, the positions each row can hold (axis 1 of a latent row buffer, 2 of the values)."""
        return self.buffers[-1].shape[3 if self.latent else 4]


@struct.dataclass
class StagedNewKV:
    """What one pipelined call adds: per buffer of a layer's cache tuple its new rows
    [S, Q + P, B, T, ...] as ``decoder_layer`` returns them, per-row real tokens, ``rope_len``."""

    rows: tuple[jax.Array, ...]
    num_new: jax.Array
    rope_len: jax.Array


def layer_cache(latent: bool, buffers: tuple, lengths: jax.Array, rope_len: jax.Array) -> KVCache | LatentCache:
    """One layer's contiguous cache over ``buffers`` (its cache tuple): the form
    ``cache.append_to_cache`` writes, so that a stage slot is written as any layer is."""
    if latent:
        return LatentCache(latent=buffers[:1], lengths=lengths, rope_len=rope_len)
    return KVCache(k=buffers[:1], v=buffers[1:], lengths=lengths, rope_len=rope_len)


def layer_new(latent: bool, rows: tuple, num_new: jax.Array, rope_len: jax.Array) -> NewKV | NewLatent:
    """One layer's new rows (as ``decoder_layer`` returns them) in the form the cache writes take."""
    if latent:
        return NewLatent(latent=rows[:1], num_new=num_new, rope_len=rope_len)
    return NewKV(k=rows[:1], v=rows[1:], num_new=num_new, rope_len=rope_len)


def _each(fn, *trees):
    """``fn`` on every array of cache buffers (a quantized buffer's values and scale alike; its
    format metadata keeps describing one layer's buffer, as the stacked weights' does)."""
    return jax.tree.map(fn, *trees)


def _row_dims(config: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """Per buffer of a layer's cache tuple, the trailing dims of one token's new row."""
    if config.mla is not None:
        return ((config.mla.kv_lora_rank + config.mla.rope_dim,),)
    return ((config.num_kv_heads, config.head_dim),) * 2


def staged_cache_specs(config: ModelConfig, plan: StagePlan, batch: int, max_len: int,
                       kv_quant: KVQuant = KVQuant.NONE) -> StagedKVCache:
    """The staged cache declared abstractly (a ``ParamSpec`` at every leaf; zeros): one layer's
    buffers as ``cache.cache_specs`` declares them (quantized as ``kv_quant`` says), stacked
    behind ("stage", None)."""
    flat = cache_specs(config, batch, max_len, kv_quant)
    return StagedKVCache(buffers=stacked_spec(flat.layer(0), (plan.num_stages, plan.prefix + plan.slots)),
                         lengths=flat.lengths, rope_len=flat.rope_len, latent=config.mla is not None)


def _written(latent: bool, buffers: tuple, rows: tuple, starts: jax.Array) -> tuple:
    """Each slot's new rows [slots, B, T, ...] written into its buffers [slots, B, ...] at ``starts``
    [B]: ``append_to_cache`` of one layer, per slot."""
    def one(layer_buffers, layer_rows):
        layer = layer_cache(latent, layer_buffers, starts, jnp.zeros((), jnp.int32))
        return append_to_cache(layer, layer_new(latent, layer_rows, jnp.zeros_like(starts), layer.rope_len)).layer(0)

    return jax.vmap(one)(buffers, rows)


def append_staged(cache: StagedKVCache, new: StagedNewKV) -> StagedKVCache:
    """Write one pipelined call's rows at each row's length and advance the lengths (the staged
    form of ``cache.append_to_cache``; jit it with the cache donated)."""
    buffers = jax.vmap(lambda b, r: _written(cache.latent, b, r, cache.lengths))(cache.buffers, new.rows)
    return cache.replace(buffers=buffers, lengths=cache.lengths + new.num_new, rope_len=new.rope_len)


def micro_batches(batch: int, wanted: int) -> int:
    """The micro-batch count used for ``batch`` rows: the largest divisor of ``batch`` that is at
    most ``wanted`` (micro-batches are equal slices of rows)."""
    return max(m for m in range(1, max(1, min(wanted, batch)) + 1) if batch % m == 0)


def bubble_fraction(num_stages: int, num_micro: int) -> float:
    """The share of stage-ticks with no micro-batch to run: (S - 1) / (M + S - 1)."""
    return (num_stages - 1) / (num_micro + num_stages - 1)


def _rows(x: jax.Array, m: jax.Array, mb: int, axis: int = 0) -> jax.Array:
    """Micro-batch ``m``'s ``mb`` rows of ``x`` along ``axis``."""
    return jax.lax.dynamic_slice_in_dim(x, m * mb, mb, axis=axis)


def _put_rows(buf: jax.Array, rows: jax.Array, m: jax.Array, keep: jax.Array, axis: int = 0) -> jax.Array:
    """``buf`` with micro-batch ``m``'s rows replaced by ``rows`` where ``keep`` (a scalar bool)."""
    old = _rows(buf, m, rows.shape[axis], axis)
    rows = jnp.where(keep, rows.astype(buf.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(buf, rows, m * rows.shape[axis], axis=axis)


@dataclasses.dataclass(frozen=True)
class _Step:
    """What the stage body needs besides arrays (static)."""

    config: ModelConfig
    plan: StagePlan
    parallel: Parallel | None
    num_micro: int
    fresh: bool  # no cache to read (a first prefill)
    paged: bool = False  # the cache is a page pool read through block tables (serving)
    max_len: int | None = None  # the positions a cached row can hold (None when fresh)


def _stage_slots(step: _Step, stacks, caches, x, tokens, starts, num_new, rope_len, tables=None):
    """One micro-batch through this stage's slots (``stacks``: (layers, active, window kinds) per
    stack, the prefix first) -> (x, per cache buffer the new rows [slots, mb, T, ...]). ``caches``: per
    buffer the micro-batch's rows of the contiguous cache [slots, mb, ...], or with
    ``step.paged`` the stage's whole page pools, read through the micro-batch's block
    ``tables`` [mb, W]; () when fresh."""
    config = step.config
    T = x.shape[1]
    positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    cos_sin = rope_cos_sin(config.rope, config.head_dim, config.max_position_embeddings, positions, rope_len)
    # Each distinct attention window's masks once; a slot picks its layer's (``_window_kinds``).
    windows = [attention_masks(starts, num_new, T, step.max_len, w) for w in _windows(config)]

    def slot(x, xs):
        w, on, kind, buffers = xs
        masks = windows[0] if len(windows) == 1 else _pick_masks(windows, kind)
        cached = None if step.fresh else buffers
        if step.paged and not step.fresh:  # this slot's pages gathered per row (keys token-major)
            tab = after_input(tables, x)
            cached = tuple(gathered(b, tab) for b in buffers)
        y, new, _ = decoder_layer(w, config, x, cos_sin, cached, masks, step.parallel,
                                  keys_token_major=step.paged, tokens=tokens)
        return jnp.where(on, y, x), tuple(new)

    added, first = [], 0
    for layers, active, kinds in stacks:  # the prefix stack's slots come first in the cache
        n = active.shape[0]
        x, new = jax.lax.scan(slot, x, (layers, active, kinds, _each(lambda a: a[first:first + n], caches)))
        added, first = added + [new], first + n
    return x, tuple(jnp.concatenate(parts) for parts in zip(*added))


def _stage_body(step: _Step, stacks, caches, tables, x_all, tokens, starts, num_new, rope_len):
    """The per-stage program (inside ``shard_map`` over ``stage``): M + S - 1 ticks of running a
    micro-batch through the stage and passing its activations on. Returns the last stage's final
    hidden state of each row's last real token [B, D] (summed over stages: zero elsewhere) and,
    per cache buffer, the stage's new rows [1, slots, B, T, ...]. ``tables``: the rows' block
    tables [B, W] with a paged cache (else unused)."""
    S, M = step.plan.num_stages, step.num_micro
    stacks = jax.tree.map(lambda a: a[0], stacks)
    caches = _each(lambda a: a[0], caches)  # [slots, B, ...] rows, or [slots, *pool] pages
    me = jax.lax.axis_index("stage")
    B, T, D = x_all.shape
    mb = B // M
    Pn = step.plan.prefix + step.plan.slots

    def tick(carry, t):
        received, out, new = carry
        m = jnp.clip(t - me, 0, M - 1)
        valid = (t - me >= 0) & (t - me < M)
        x = jnp.where(me == 0, _rows(x_all, m, mb), received)
        mine = caches if step.paged else _each(lambda a: _rows(a, m, mb, axis=1), caches)
        y, added = _stage_slots(step, stacks, mine, x, _rows(tokens, m, mb), _rows(starts, m, mb),
                                _rows(num_new, m, mb), rope_len,
                                _rows(tables, m, mb) if step.paged and not step.fresh else None)
        new = tuple(_put_rows(b, a, m, valid, axis=1) for b, a in zip(new, added))
        last = jnp.clip(_rows(num_new, m, mb) - 1, 0, T - 1)
        y_last = jnp.take_along_axis(y, last[:, None, None], axis=1)[:, 0]
        out = _put_rows(out, y_last, m, valid & (me == S - 1))
        passed = jax.lax.ppermute(y, "stage", [(s, s + 1) for s in range(S - 1)])
        return (passed, out, new), None

    init = (jnp.zeros((mb, T, D), x_all.dtype), jnp.zeros((B, D), x_all.dtype),
            tuple(jnp.zeros((Pn, B, T) + dims, x_all.dtype) for dims in _row_dims(step.config)))
    (_, out, new), _ = jax.lax.scan(tick, init, jnp.arange(M + S - 1))
    return jax.lax.psum(out, "stage"), tuple(n[None] for n in new)


def _stacks(weights: StagedWeights, plan: StagePlan, config: ModelConfig) -> tuple:
    """(layers, active, window kinds) per stack, the prefix stack first."""
    stacks = ((weights.layers, plan.active(), _window_kinds(config, plan.slot_layers())),)
    if not plan.prefix:
        return stacks
    return ((weights.prefix, plan.prefix_active(), _window_kinds(config, plan.prefix_layers())),) + stacks


def _windows(config: ModelConfig) -> tuple[int | None, ...]:
    """The model's distinct attention windows (None: full attention first)."""
    return tuple(sorted(set(config.sliding_windows), key=lambda w: -1 if w is None else w))


def _window_kinds(config: ModelConfig, rows: tuple[tuple[int | None, ...], ...]) -> jax.Array:
    """[S, slots] int32: per stage slot of ``rows`` (layer indices, None for padding), the index
    of its layer's window in :func:`_windows` (0 for padding). Layers with different windows
    (gpt-oss alternates sliding and full attention) share a stack: each slot picks its masks."""
    windows = _windows(config)
    kinds = [[0 if i is None else windows.index(config.sliding_windows[i]) for i in row] for row in rows]
    return jnp.array(kinds, jnp.int32).reshape(len(rows), len(rows[0]) if rows else 0)


def _pick_masks(windows: list, kind: jax.Array) -> tuple:
    """The masks (cached or None, new) of window ``kind`` among each window's ``windows``."""
    return tuple(None if parts[0] is None else jnp.stack(parts)[kind] for parts in zip(*windows))


def pipeline_forward(weights: StagedWeights, config: ModelConfig, plan: StagePlan, parallel: Parallel,
                     tokens: jax.Array, cache: StagedKVCache | None = None, num_new: jax.Array | None = None,
                     num_micro: int = 1) -> tuple[jax.Array, StagedNewKV]:
    """``transformer.forward`` pipelined over the ``stage`` axis: logits of each row's last real
    token [B, V] and what :func:`append_staged` writes. ``tokens`` [B, T] run as the continuation
    of each cached row (``cache`` None: a first prefill; a :class:`StagedKVCache`, or a staged page
    pool read through its block tables, ``dayzero.model.pipeline_paged``); ``num_micro``
    micro-batches (a divisor of B, see :func:`micro_batches`)."""
    B, T = tokens.shape
    if B % num_micro:
        raise ValueError(f"{num_micro} micro-batches do not divide the batch of {B} rows; use micro_batches()")
    if num_new is None:
        num_new = jnp.full((B,), T, jnp.int32)
    if cache is None:
        starts, rope_len = jnp.zeros((B,), jnp.int32), jnp.max(num_new)
    else:
        starts, rope_len = cache.lengths, jnp.maximum(cache.rope_len, jnp.max(cache.lengths + num_new))
    x_all = jnp.take(weights.outer.embed, tokens, axis=0)
    paged = hasattr(cache, "block_tables")
    step = _Step(config, plan, parallel, num_micro, cache is None, paged, None if cache is None else cache.max_len)
    stage = P("stage")
    caches = () if cache is None else cache.pages if paged else cache.buffers
    tables = cache.block_tables if paged else jnp.zeros((), jnp.int32)
    body = jax.shard_map(
        lambda *a: _stage_body(step, *a), mesh=parallel.placement.mesh,
        in_specs=(stage, stage, P(), P(), P(), P(), P(), P()),
        out_specs=(P(), stage), axis_names={"stage"},
        # Inputs replicated over stage feed per-stage values (axis_index, ppermute): the type
        # check would need pvary on each; the psum makes the hidden output equal on every stage.
        check_vma=False,
    )
    hidden, rows = body(_stacks(weights, plan, config), caches, tables, x_all, tokens, starts, num_new, rope_len)
    x = rms_norm(hidden, weights.outer.final_norm, config.rms_norm_eps, offset=config.norm_weight_offset)
    logits = output_logits(weights.outer, x[:, None, :])[:, 0, :]
    return logits, StagedNewKV(rows=rows, num_new=num_new, rope_len=rope_len)
