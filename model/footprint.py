"""What a model holds and moves while it serves, declared abstractly for the deployment planner.

:class:`DecodeFootprint` implements ``dayzero.sharding.planner.Footprint``. Everything it lists is
read from the engine's own declarations, so the planner sizes what the engine would allocate:

- the weights: ``abstract_weights(config, QuantConfig(scheme))`` -- each leaf's stored dtype
  (quantized values) or the compute dtype, each ``QuantizedArray``'s scale as declared -- laid out
  for the mesh by ``weights.mesh_aligned_specs`` as the engine lays them out (a block scale whose
  shard would start inside a block is re-blocked, so per-device scale bytes are the aligned ones);
- the KV: the serving engine's page pools, ``paged_cache_specs`` (values and per-slot scales)
  with ``ceil(context / page_size)`` pages for each of a replica's ``batch / data`` rows (each
  data replica serves its share of the rows from its own pool), laid out by the pools' own axes:
  per-head pools split by kv head, latent and indexer-key pools whole on every device (the rules
  keep ``latent_pages`` whole). Not ``cache_specs``' contiguous cache (``Engine.generate``'s,
  whose latent positions split over ``tensor``): a deployment serves from the pools. The block
  tables, lengths and ``rope_len`` are not counted: small int32 host inputs of each step;
- a linear-attention hybrid's KV: the pages of its attention layers only, plus its linear layers'
  state pool (a ``LinearState`` per layer and slot: conv inputs and the fp32 recurrent state, one
  row per batch row whatever the context, value heads split over ``tensor``). The transient
  buffers are still sized as if every layer were an attention layer (an over-estimate for the
  linear layers, whose chunked form holds [chunk, chunk] per head, not [T, S]);
- the prefix cache's state snapshots, for a hybrid and DeepSeek-V4 (``Component.STATE_SNAPSHOTS``):
  ``engine.paged_steps.PagedSteps.snapshots``, copies of a slot's per-sequence states (a hybrid's
  linear states, V4's rings and compressor states) at page boundaries, ``work.snapshot_rows``
  rows per replica (the serving default: 4 per planned row) of each per-slot tensor, declared and
  laid out as the slot states are (``paged_cache_specs(...).slot_states`` with that many rows: a
  hybrid's value heads split over ``tensor``, V4's whole; quantized rings with their scales).
  The engine gives them that layout from their first copy on (the warmup's); until then a fresh
  tree sits whole on the first device (``tools/plan_measure`` measures both; this counts the former);
- DeepSeek-V4's KV: its serving pool from the same ``paged_cache_specs`` (compressed entries and
  index keys in pages of a multiple of its ratios, 128 positions for the published models; window
  rings and compressor states in one slot per row), laid out by their own axes; V4's page size,
  cache and steps are counted in ``model.footprint_v4``;
- whether the engine runs the model on a mesh: ``model.mesh_check.mesh_refusal``, the decision
  ``engine.runtime`` raises;
- the transient buffers (``activations``) and the collectives (``model.footprint_steps``) of
  the serving engine's two steps on the reference path, one replica's (``data`` > 1 serves
  independent replicas on ``tensor`` x ``expert`` devices each, ``engine.replicas``): a decode
  step (the replica's ``ceil(batch / data)`` rows, one token each, each reading the pages of the
  widest block table for ``work.context``, ``Workload.decode_positions``) and a prefill chunk
  (one row, as the serving engine prefills one request at a time), shaped as the serving engine shapes its chunks
  (``Workload.prefill_shapes``: a full ``work.prefill_chunk`` over what the chunk budget lets it
  attend, and the last chunk of a context-long prompt, shrunk to the budget).

For pipeline (``stage``) meshes the same weights and pools are also listed by decoder layer
(``layer_weights``, ``layer_cache``: a leaf's layer from its path, a hybrid's attention pages and
linear states mapped to their layers), the layer ranges and micro-batches are ``model.pipeline``'s
own (``stage_split``), and what that pipeline does not run yet is ``pipeline_gap``.

Every array is counted at the bytes per element the device holds (:func:`held_itemsize`): the
4-bit types (int4 and MXFP4's float4_e2m1fn values) at half a byte, packed, not at their numpy
itemsize of 1.

Storage is spelled as ``dayzero generate`` spells it and parsed with the engine's parsers
(``quant.parse_weight_quant`` / ``parse_kv_quant``). ``auto`` is refused: it is the platform's
choice at run time, and a plan is made for accelerators from a CPU; the error says what it means
there.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Mapping

import jax
import jax.numpy as jnp

from dayzero.kernels import KernelMode
from dayzero.model import footprint_v4, pipeline
from dayzero.model.config import ModelConfig
from dayzero.model.footprint_steps import Step, step_collectives, step_stages
from dayzero.model.mesh_check import mesh_refusal
from dayzero.model.paged_cache import paged_cache_specs
from dayzero.model.quant import (AUTO, AUTO_KV, AUTO_WEIGHTS, KVQuant, QuantConfig, QuantError, QuantizedArray,
                                 WeightQuant, parse_kv_quant, parse_weight_quant)
from dayzero.model.weights import abstract_weights, is_spec_node, leaf_path, mesh_aligned_specs, parameter_count
from dayzero.sharding.planner import Collective, Component, PlanError, Stage, Tensor, Workload
from dayzero.sharding.planner_pipeline import FIRST, LAST, LayerSplit
from dayzero.sharding.distributed import MeshError

_ACCELERATORS = ("gpu", "tpu")
# Weight schemes by how closely they keep the float values (block scales beat per-channel ones).
_FIDELITY = (WeightQuant.NONE, WeightQuant.FP8_BLOCK, WeightQuant.FP8, WeightQuant.INT8, WeightQuant.INT4,
             WeightQuant.INT4_ALL)


@dataclasses.dataclass(frozen=True)
class Storage:
    """A workload's storage options, parsed: the weight scheme (with its block), the KV-cache
    scheme, the compute dtype and the attention mode."""

    quant: QuantConfig
    kv: KVQuant
    dtype: jnp.dtype
    kernels: KernelMode


def storage(work: Workload) -> Storage:
    """``work``'s options parsed by the engine's parsers; raises ``QuantError`` (or PlanError for
    the kernels) naming the value and what to write instead."""
    _no_auto(work.quantize, "--quantize", AUTO_WEIGHTS, WeightQuant)
    _no_auto(work.kv_cache, "--kv-cache", AUTO_KV, KVQuant)
    try:
        kernels = KernelMode(work.kernels)
    except ValueError:
        raise PlanError(f"--kernels {work.kernels!r} is not a mode; choose one of "
                        f"{', '.join(m.value for m in KernelMode)}") from None
    return Storage(QuantConfig(parse_weight_quant(work.quantize, allow_auto=False)), parse_kv_quant(work.kv_cache),
                   jnp.dtype(work.dtype), kernels)


def _no_auto(value: str, flag: str, table: dict, kind) -> None:
    if value == AUTO:
        means = ", ".join(f"{table.get(p, kind('none')).value} on {p.upper()}" for p in _ACCELERATORS)
        raise QuantError(f"{flag} auto is chosen by the platform at run time (today: {means}); a plan needs the "
                         f"storage named: one of {', '.join(k.value for k in kind)}")


@dataclasses.dataclass(frozen=True)
class DecodeFootprint:
    """The planner's view of ``config`` (see ``dayzero.sharding.planner.Footprint``)."""

    config: ModelConfig
    name: str = "model"

    @property
    def parameters(self) -> int:
        """Parameters of the abstract weight tree."""
        return parameter_count(abstract_weights(self.config))

    @property
    def num_experts(self) -> int | None:
        """Routed experts per MoE layer (None for a dense model)."""
        return None if self.config.moe is None else self.config.moe.num_experts

    def storage_options(self) -> dict[str, tuple[str, ...]]:
        """The spellings of ``--quantize`` and ``--kv-cache`` (every scheme of the engine's enums),
        the most faithful first: advice names the first that fits."""
        weights = sorted(WeightQuant, key=lambda q: _FIDELITY.index(q) if q in _FIDELITY else len(_FIDELITY))
        return {"quantize": tuple(q.value for q in weights), "kv_cache": tuple(k.value for k in KVQuant)}

    def page_size(self, work: Workload) -> int:
        """The serving engine's page for this model: ``work.page_size``, for DeepSeek-V4 rounded
        up to a multiple of its ratios (``footprint_v4.page_size``)."""
        return footprint_v4.page_size(self.config, work) if self.config.compressed is not None else work.page_size

    def refusal(self, work: Workload, axes: Mapping[str, int]) -> str | None:
        """The engine's reason for refusing this mesh (``mesh_check.mesh_refusal``); ``auto``
        kernels never refuse one (they take the reference path where the heads do not split)."""
        kernels = storage(work).kernels
        return mesh_refusal(self.config, axes, KernelMode.REFERENCE if kernels is KernelMode.AUTO else kernels)

    def weights(self, work: Workload, ways: Mapping[str, int]) -> list[Tensor]:
        """Every weight leaf as the engine stores it on a mesh splitting each logical axis
        ``ways[axis]`` ways: values, and the scales of quantized projections."""
        s = storage(work)
        return list(_weight_tensors(self.config, s.quant, s.dtype.name, _split_ways(tuple(sorted(ways.items())))))

    def cache(self, work: Workload, axes: Mapping[str, int]) -> list[Tensor]:
        """The serving engine's page pools (values and scales) holding ``work.batch`` rows of
        ``work.context`` positions, one replica's pool per data replica, and its prefix cache's
        state snapshots where the model keeps per-sequence states (module docstring)."""
        s = storage(work)
        rows = -(-work.batch // int(axes.get("data", 1)))
        page = self.page_size(work)
        pool = _cache_tensors(self.config, s.kv, s.dtype.name, rows, work.context, page)  # V4's: footprint_v4
        return list(pool + _snapshot_tensors(self.config, s.kv, s.dtype.name, work.snapshot_rows(rows), page))

    @property
    def num_layers(self) -> int:
        """Decoder layers (what pipeline stages divide)."""
        return self.config.num_layers

    @property
    def residual_width(self) -> int:
        """Elements per token of the residual a pipeline stage hands to the next: D, or
        DeepSeek-V4's n hyper-connection streams of D."""
        hyper = getattr(self.config, "hyper", None)
        return self.config.hidden_size * (hyper.mult if hyper is not None else 1)

    def stage_split(self, work: Workload, ways: Mapping[str, int], stages: int, rows: int, wanted: int
                    ) -> tuple[tuple[range, ...], int]:
        """The pipeline's layer ranges over ``stages`` stages and its micro-batches for ``rows``
        rows when ``wanted`` are asked for, as ``model.pipeline`` makes them (``plan_stages`` over
        the weights as the engine holds them: quantized as ``work`` says, aligned to the mesh's
        logical ``ways``; ``micro_batches``); raises MeshError for more stages than layers, or
        layers the pipeline cannot stack."""
        s = storage(work)
        ranges = _stage_ranges(self.config, stages, s.quant, _split_ways(tuple(sorted(ways.items()))))
        return ranges, pipeline.micro_batches(rows, wanted)

    def pipeline_gap(self, work: Workload, axes: Mapping[str, int]) -> str | None:
        """Why ``model.pipeline`` cannot run this stage mesh yet (``pipeline_refusal``; None: it
        can, or no stages). The plan reports it beside the figures, which are the design's."""
        s = storage(work)
        return pipeline.pipeline_refusal(self.config, axes, kernels=s.kernels,
                                         quantized=s.quant.weights is not WeightQuant.NONE,
                                         kv_quantized=s.kv is not KVQuant.NONE)

    def layer_weights(self, work: Workload, ways: Mapping[str, int]) -> LayerSplit:
        """:meth:`weights` split by decoder layer, the embedding (and a vision tower) apart as the
        first stage's and the final norm and head as the last's."""
        s = storage(work)
        return _layer_weights(self.config, s.quant, s.dtype.name, _split_ways(tuple(sorted(ways.items()))))

    def layer_cache(self, work: Workload, axes: Mapping[str, int]) -> LayerSplit:
        """:meth:`cache` (pools and state snapshots) split by decoder layer."""
        s = storage(work)
        rows = -(-work.batch // int(axes.get("data", 1)))
        return _layer_cache(self.config, s.kv, s.dtype.name, rows, work.snapshot_rows(rows), work.context,
                            self.page_size(work))

    def steps(self, work: Workload, axes: Mapping[str, int]) -> dict[str, list[Step]]:
        """The serving engine's steps on the reference path, one replica's (``data`` > 1 is
        independent replicas, ``engine.replicas``): the decode step (its ``ceil(batch / data)``
        rows of one token over the widest block table, ``Workload.decode_positions``) and the
        prefill chunks with the largest buffers (``Workload.prefill_shapes``), sized (see the
        module docstring)."""
        quantized_kv = storage(work).kv is not KVQuant.NONE
        sizes = dict(k=work.compute_itemsize, expert=int(axes.get("expert", 1)),
                     tensor=int(axes.get("tensor", 1)), converted=quantized_kv)
        rows = -(-work.batch // int(axes.get("data", 1)))
        if self.config.compressed is not None:
            return footprint_v4.steps(self.config, work, rows, sizes)
        return {"decode": [Step(B=rows, T=1, S=work.decode_positions, **sizes)],
                "prefill": [Step(B=1, T=T, S=S, **sizes) for T, S in work.prefill_shapes()]}

    def activations(self, work: Workload, axes: Mapping[str, int]) -> dict[str, list[Stage]]:
        """Each step's stages (``footprint_steps.step_stages``); a step with several shapes
        lists every shape's stages, named with the shape, so its peak is the largest of them."""
        out = {}
        for name, steps in self.steps(work, axes).items():
            out[name] = [stage if len(steps) == 1 else dataclasses.replace(stage, name=f"{stage.name} ({_shape(st)})")
                         for st in steps for stage in step_stages(self.config, st)]
        return out

    def collectives(self, work: Workload, axes: Mapping[str, int]) -> dict[str, list[Collective]]:
        """Each step's collectives (``footprint_steps.step_collectives``); for the prefill, those
        of its full chunk (the first shape: the most tokens, the most bytes moved per chunk)."""
        return {name: step_collectives(self.config, steps[0]) for name, steps in self.steps(work, axes).items()}


def _shape(st: Step) -> str:
    return f"{st.T} tokens over {st.S}" if st.S else f"{st.T} tokens, reading no cache"


# The planner evaluates many meshes (and, for its advice, other options and sizes) of one model:
# the tensor lists are built once per distinct argument.
@functools.lru_cache(maxsize=64)
def _weight_tensors(config: ModelConfig, quant: QuantConfig, dtype: str, ways: tuple) -> tuple[Tensor, ...]:
    return tuple(_tensors(_aligned_specs(config, quant, _split_ways(ways)), dtype, Component.WEIGHTS,
                          Component.WEIGHT_SCALES))


def _split_ways(ways: tuple) -> tuple:
    """The logical axes a mesh splits (more than 1 way), ``stage`` left out: no weight leaf has
    it (the pipeline stacks layers on it), so meshes differing only there share one layout."""
    return tuple((a, n) for a, n in ways if n > 1 and a != "stage")


@functools.lru_cache(maxsize=32)
def _aligned_specs(config: ModelConfig, quant: QuantConfig, ways: tuple):
    """The weight specs as the engine lays them out on a mesh splitting ``ways`` (``_split_ways``)."""
    specs = abstract_weights(config, quant)
    return mesh_aligned_specs(specs, dict(ways)) if ways else specs  # as Engine lays quantized weights out


@functools.lru_cache(maxsize=256)
def _cache_tensors(config: ModelConfig, kv: KVQuant, dtype: str, rows: int, context: int,
                   page_size: int) -> tuple[Tensor, ...]:
    return _replica_pool(_pool_specs(config, kv, rows, context, page_size), dtype)


def _pool_specs(config: ModelConfig, kv: KVQuant, rows: int, context: int, page_size: int):
    """A replica's serving pool of ``rows`` rows as a spec tree, the host inputs (block tables,
    lengths, ``rope_len``: module docstring) left out; DeepSeek-V4's from ``footprint_v4``."""
    if config.compressed is not None:
        return footprint_v4.pool_specs(config, rows, context, page_size, kv)
    per_row = -(-context // page_size)
    specs = paged_cache_specs(config, rows * per_row, page_size, batch=rows, table_width=per_row, kv_quant=kv,
                              state_slots=rows)
    if config.linear is not None:  # a hybrid: the attention layers' pages, and a state row per slot
        pages = specs.attn.replace(block_tables=None, lengths=None, rope_len=None)
        return specs.replace(attn=pages, slots=None)
    return specs.replace(block_tables=None, lengths=None, rope_len=None)


@functools.lru_cache(maxsize=256)
def _snapshot_tensors(config: ModelConfig, kv: KVQuant, dtype: str, rows: int, page: int) -> tuple[Tensor, ...]:
    """A replica's ``rows`` prefix-cache snapshot rows (``PagedSteps.snapshots``): the pool's
    per-slot states declared with ``rows`` slots (one page: the pages are not copied); none for
    a model without per-sequence states, or with no rows."""
    specs = _snapshot_specs(config, kv, rows, page)
    return () if specs is None else _replica_pool(specs, dtype, Component.STATE_SNAPSHOTS, Component.STATE_SNAPSHOTS)


def _snapshot_specs(config: ModelConfig, kv: KVQuant, rows: int, page: int):
    if rows == 0 or (config.linear is None and config.compressed is None):
        return None
    return paged_cache_specs(config, 1, page, kv_quant=kv, state_slots=rows).slot_states


def _replica_pool(specs, dtype: str, values: Component = Component.KV_CACHE,
                  scales: Component = Component.KV_SCALES, part=None) -> tuple:
    """A replica's pool (or snapshot rows) as tensors of ``values`` and ``scales``. Its per-slot
    rows (a hybrid's linear states, DeepSeek-V4's rings and compressor states, declared on
    ``batch``) are the replica's own: each replica lays its pool out on its ``tensor`` x
    ``expert`` devices (``engine.replicas``), so ``batch`` does not split them again over ``data``.
    With ``part``: ``(key, tensor)`` pairs, as :func:`_tensors` gives them."""
    def own(t: Tensor) -> Tensor:
        return dataclasses.replace(t, axes=tuple(None if a == "batch" else a for a in t.axes))

    if part is None:
        return tuple(own(t) for t in _tensors(specs, dtype, values, scales))
    return tuple((k, own(t)) for k, t in _tensors(specs, dtype, values, scales, part))


# ---- per decoder layer (pipeline stages) --------------------------------------------------------


def _weight_part(name: str) -> int | str:
    """Which pipeline part holds a weight leaf: its decoder layer, or the first stage (the
    embedding, and a vision tower, which run before the first layer) or the last (the final
    norm, the head, anything after the last layer)."""
    match = re.match(r"layers/(\d+)/", name)
    if match:
        return int(match.group(1))
    return FIRST if name.startswith(("embed", "vision/")) else LAST


def _cache_part(config: ModelConfig, name: str) -> int:
    """The decoder layer a pool or snapshot leaf belongs to. Pools are lists per layer; a
    hybrid's attention pages (``attn/...``) count its attention layers only and its states
    (``states/...``, snapshot rows) its linear layers only."""
    match = re.search(r"(?:^|/)(\d+)(?:/|:|$)", name)
    if match is None:
        raise ValueError(f"cache leaf {name!r} has no layer index; the planner cannot place it on a pipeline stage")
    i = int(match.group(1))
    if config.linear is None:
        return i
    linear = name.startswith(("states/",)) or not name.startswith("attn/")
    return [n for n, is_linear in enumerate(config.linear.layers) if is_linear == linear][i]


@functools.lru_cache(maxsize=64)
def _stage_ranges(config: ModelConfig, stages: int, quant: QuantConfig, ways: tuple) -> tuple[range, ...]:
    try:
        plan = pipeline.plan_stages(_aligned_specs(config, quant, ways), stages)
    except MeshError:
        raise
    except ValueError as e:  # layers the pipeline cannot stack (e.g. more than two kinds): no stage mesh
        raise MeshError(f"--mesh stage={stages}: {e}") from None
    return tuple(range(a, b) for a, b in plan.ranges)


@functools.lru_cache(maxsize=64)
def _layer_weights(config: ModelConfig, quant: QuantConfig, dtype: str, ways: tuple) -> LayerSplit:
    specs = _aligned_specs(config, quant, ways)
    return _split(config.num_layers, _tensors(specs, dtype, Component.WEIGHTS, Component.WEIGHT_SCALES, _weight_part))


@functools.lru_cache(maxsize=256)
def _layer_cache(config: ModelConfig, kv: KVQuant, dtype: str, rows: int, snapshot_rows: int, context: int,
                 page: int) -> LayerSplit:
    part = functools.partial(_cache_part, config)
    pairs = _replica_pool(_pool_specs(config, kv, rows, context, page), dtype, part=part)
    snapshots = _snapshot_specs(config, kv, snapshot_rows, page)
    if snapshots is not None:
        pairs += _replica_pool(snapshots, dtype, Component.STATE_SNAPSHOTS, Component.STATE_SNAPSHOTS, part)
    return _split(config.num_layers, pairs)


def _split(num_layers: int, pairs) -> LayerSplit:
    layers: list[list[Tensor]] = [[] for _ in range(num_layers)]
    ends: dict[str, list[Tensor]] = {FIRST: [], LAST: []}
    for key, t in pairs:
        (ends[key] if isinstance(key, str) else layers[key]).append(t)
    return LayerSplit(tuple(map(tuple, layers)), tuple(ends[FIRST]), tuple(ends[LAST]))


def _tensors(specs, dtype: str, values: Component, scales: Component, part=None) -> list[Tensor]:
    """A spec tree's leaves as tensors: float leaves at ``dtype`` (or their fixed dtype), a
    quantized node as its stored values and its scale. Identical leaves (every layer's ``q``, ...)
    become one tensor with a count: the planner sizes each distinct one once per mesh. With
    ``part`` (a leaf name -> key), only leaves of the same key merge, and each tensor's key is
    returned beside it (``(key, tensor)`` pairs)."""
    same: dict[tuple, list[Tensor]] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec_node)
    for path, node in flat:
        name = leaf_path(path)
        key = None if part is None else part(name)
        pieces = ([_tensor(name, node.values, dtype, values), _tensor(name + ":scale", node.scale, dtype, scales)]
                  if isinstance(node, QuantizedArray) else [_tensor(name, node, dtype, values)])
        for t in pieces:
            same.setdefault((key, t.shape, t.axes, t.itemsize, t.component), []).append(t)
    merged = [(k[0], dataclasses.replace(ts[0], count=len(ts))) for k, ts in same.items()]
    return [t for _, t in merged] if part is None else merged


# 4-bit element types. XLA packs them two to a byte on every platform, although ml_dtypes'
# itemsize (and so ``jax.Array.nbytes`` and a shard's ``nbytes``) says 1, as numpy holds them on
# the host. Checked: XLA:CPU, measured here (process RSS grows 0.500 bytes per element of an int4,
# uint4 or float4_e2m1fn array, 1.000 for int8; ``tools/plan_measure.held_bytes_per_element``,
# which the validation compares with these figures); XLA:GPU by its source (openxla/xla
# ``xla/service/gpu/gpu_transfer_manager.h``: ``PackSubbyteTypes()`` is true, and the PJRT GPU
# client allocates ``CeilOfRatio(bytes, 8 / bit width)`` for a sub-byte buffer); TPU's transfer
# manager packs them too (``xla/stream_executor/tpu/tpu_transfer_manager_interface.h``,
# ``PackSubbyteTypes()`` true). No device was at hand to measure GPU/TPU memory here.
_PACKED_BITS = {jnp.dtype(jnp.int4): 4, jnp.dtype(jnp.uint4): 4, jnp.dtype(jnp.float4_e2m1fn): 4}


def held_itemsize(dtype) -> float:
    """Bytes per element of ``dtype`` as the device holds an array of it: half a byte for the
    4-bit types (packed, see above), else the dtype's itemsize."""
    dtype = jnp.dtype(dtype)
    return _PACKED_BITS[dtype] / 8 if dtype in _PACKED_BITS else dtype.itemsize


def _tensor(name: str, spec, dtype: str, component: Component) -> Tensor:
    return Tensor(name, tuple(spec.shape), tuple(spec.axes), held_itemsize(spec.dtype or dtype), component)
