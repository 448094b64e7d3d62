"""The deployment planner: per-device memory, collectives and runnability of a model on meshes.

Pure arithmetic over abstract declarations: every array a step holds is a :class:`Tensor` (global
shape, logical axes, bytes per element). Its per-device size on a mesh is its shape with each
dimension divided by the size of the mesh axis the strategy's rules split it over (``spec_for``,
which also decides what stays replicated), times its element size. Every collective a step runs
is a :class:`Collective` (the buffer, the logical axis whose split makes it, the op), whose
per-device bytes follow from the same rules. No device and no allocation is needed, so a
3-trillion-parameter model plans on a laptop.

What the tensors and collectives are is the model's business: a :class:`Footprint`
(``dayzero.model.footprint`` implements it) lists the weights (with their quantization scales),
the KV (the serving engine's page pools; for a linear-attention hybrid or DeepSeek-V4 also the
states each sequence keeps beside its pages, and the prefix cache's snapshots of them), the
transient buffers of a decode step and of a prefill chunk, their collectives, the page size the
serving engine would use, and whether the engine runs the model on a mesh at all (``refusal``:
the engine's own check). This
package imports nothing from ``dayzero.model`` (see DESIGN.md), so the footprint is passed in.

Mesh choice (:func:`plan`): every stage x data x tensor x expert factorisation of the device
count whose data size divides the batch is evaluated with the rules the engine uses on it
(``dayzero.sharding.placement.rules_for_mesh``); a ``stage`` mesh as its largest pipeline stage,
with its bubble and the residuals it hands across stage boundaries, and every mesh with its
host-memory tier when one is given (``dayzero.sharding.planner_pipeline``). A mesh the engine refuses keeps its reason in
``refused`` and is never recommended; among the rest :data:`RULE` decides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Protocol

from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MESH_AXES, MeshError
from dayzero.sharding.placement import rules_for_mesh
from dayzero.sharding.plan_units import (  # the planner's units, re-exported (``__all__``)
    Collective, Component, Op, PlanError, Stage, Tensor, collective_bytes, device_bytes, format_size, group_size,
    local_shape, logical_ways, parse_size, spans_hosts)
from dayzero.sharding.planner_pipeline import HOST_BANDWIDTH, HostTier, LayerSplit, Pipeline, bubble_fraction, \
    mesh_host_tier

__all__ = ["Collective", "Component", "Footprint", "HostTier", "LayerSplit", "MeshPlan", "Op", "Plan", "PlanError",
           "Stage", "Tensor", "Workload", "candidate_meshes", "collective_bytes", "device_bytes", "evaluate",
           "format_size", "group_size", "local_shape", "logical_ways", "parse_size", "plan", "spans_hosts"]

RULE = (
    "among meshes the engine runs and that fit: tensor groups inside one host first (tensor "
    "parallelism all-reduces every layer), then the smallest pipeline bubble (none without "
    "stages: a pipeline only where nothing else fits, with the fewest stages that do), then the "
    "most data parallelism the batch allows (replicas never talk), then the fewest bytes crossing "
    "hosts per decode step (then per prefill chunk), then the most free memory per device; a "
    "pipeline the engine's stages do not run yet for this model comes after every mesh that "
    "runs; then meshes that fit with weights offloaded to --host-memory (least streaming time per "
    "step first); when none fits, the runnable mesh closest to fitting"
)

GiB = 1 << 30
# The serving engine's prefix-cache snapshot rows per slot for models with per-sequence states
# (``ServingConfig.state_snapshots``' default, 4 x ``slots``; kept equal by a test).
SNAPSHOTS_PER_SLOT = 4
DTYPES = {"bfloat16": 2, "float32": 4}  # compute / float-weight dtypes a plan may name
STEPS = ("decode", "prefill")



@dataclasses.dataclass(frozen=True)
class Workload:
    """What to plan for: devices and their memory, the storage options (spelled as ``dayzero
    generate --quantize/--kv-cache`` spells them; parsed by the footprint with the engine's
    parsers), the compute dtype, batch rows, context, the prefill chunk, devices per host, and the
    serving engine's settings the plan follows (chunk limits, page, prefix-cache state snapshots)."""

    devices: int
    device_memory: int  # bytes
    quantize: str = "none"
    kv_cache: str = "none"
    dtype: str = "bfloat16"
    batch: int = 1
    context: int = 4096
    prefill_chunk: int = 512  # the serving engine's max_chunk: a power of two
    devices_per_host: int = 8
    reserve: float = 0.1  # fraction of each device kept free (runtime, fragmentation)
    kernels: str = "auto"  # attention: auto never refuses a mesh; pallas needs whole heads per device
    # The serving engine's limits on a prefill chunk (``engine.paged_steps.ServingConfig``'s
    # defaults, which a test keeps equal): chunk tokens x attended positions at most
    # ``chunk_budget``, halving the chunk down to ``min_chunk`` tokens to get there.
    chunk_budget: int = 1 << 21
    min_chunk: int = 16
    # The serving engine's KV page where nothing else constrains it (``ServingConfig.page_size``
    # resolves to ``engine.paged_steps.default_page_size(model)``: 16, kept equal by a test): the
    # KV planned is its page pools, ceil(context / page) pages per row. DeepSeek-V4's footprint
    # rounds it up to a multiple of its ratios as that default does (128 for the published model);
    # the page a plan used is ``Plan.page_size``.
    page_size: int = 16
    # Prefix-cache snapshot rows per replica for models with per-sequence states (a hybrid's
    # linear layers, DeepSeek-V4's rings and compressor states): ``ServingConfig.state_snapshots``;
    # None for its default, SNAPSHOTS_PER_SLOT per planned row (:meth:`snapshot_rows`); 0: none.
    state_snapshots: int | None = None
    # Host tiers (``planner_pipeline``): host memory per host (None: none planned) and the bytes
    # per second a device's host link moves; micro-batches of a pipeline's decode step (None:
    # ``planner_pipeline.default_micro_batches``).
    host_memory: int | None = None
    host_bandwidth: float = HOST_BANDWIDTH
    micro_batches: int | None = None

    def __post_init__(self):
        for name in ("quantize", "kv_cache", "dtype", "kernels"):  # enums given: their spelling
            value = getattr(self, name)
            object.__setattr__(self, name, str(getattr(value, "value", value)))
        for name in ("devices", "batch", "context", "device_memory", "prefill_chunk", "devices_per_host",
                     "page_size"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("host_memory", "micro_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.host_bandwidth > 0:
            raise PlanError(f"host_bandwidth must be positive (bytes per second), got {self.host_bandwidth}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise PlanError(f"state_snapshots must be at least 0 (0: none), got {self.state_snapshots}")
        if not 0 <= self.reserve < 1:
            raise PlanError(f"reserve must be in [0, 1), got {self.reserve}")
        if self.prefill_chunk & (self.prefill_chunk - 1):
            raise PlanError(f"prefill_chunk {self.prefill_chunk} must be a power of two, as the serving engine's "
                            f"chunks are; use {1 << (self.prefill_chunk.bit_length() - 1)}")
        if self.dtype not in DTYPES:
            raise PlanError(f"dtype {self.dtype!r} is not planned; use one of {', '.join(DTYPES)}")

    def snapshot_rows(self, rows: int) -> int:
        """Prefix-cache snapshot rows of a replica serving ``rows`` rows at once (its slots), as
        ``ServingConfig.resolve`` sets them for a model with per-sequence states."""
        return SNAPSHOTS_PER_SLOT * rows if self.state_snapshots is None else self.state_snapshots

    @property
    def usable(self) -> int:
        """Bytes per device the plan may fill."""
        return int(self.device_memory * (1 - self.reserve))

    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(T, S) of the prefill chunks with the largest buffers, as the serving engine shapes
        them (``ServingConfig.chunk_shape``): a full chunk over the most positions the budget
        allows it (the buffers that grow with T), and the last chunk of a ``context``-long
        prompt, halved until T x S fits the budget (the ones that grow with S)."""
        full = min(self.prefill_chunk, self.context)
        last = full
        while last > self.min_chunk and last * self.context > self.chunk_budget:
            last //= 2
        shapes = {(full, min(self.context, max(full, self.chunk_budget // full))), (last, self.context)}
        return tuple(sorted(shapes, reverse=True))

    @property
    def decode_positions(self) -> int:
        """Positions a serving decode step reads per row on the reference path: the block table
        of the widest bucket for ``context`` (``ServingConfig.max_table_pages``: a power of two
        of pages) times the page size."""
        pages = -(-self.context // self.page_size)
        return (1 << (pages - 1).bit_length()) * self.page_size

    @property
    def compute_itemsize(self) -> int:
        """Bytes per element of activations and float weights."""
        return DTYPES[self.dtype]


class Footprint(Protocol):
    """What a model holds and moves while serving (implemented by ``dayzero.model.footprint``)."""

    name: str
    parameters: int
    num_experts: int | None  # routed experts (None: dense)

    def storage_options(self) -> dict[str, tuple[str, ...]]:
        """The spellings ``quantize`` and ``kv_cache`` accept (for advice)."""

    def page_size(self, work: Workload) -> int:
        """Positions a KV page covers as the serving engine would page this model (``work.page_size``
        or a size the model needs instead): the page the cache and steps are planned with."""

    def refusal(self, work: Workload, axes: Mapping[str, int]) -> str | None:
        """The engine's reason for refusing this mesh with ``work``'s options (None: it runs)."""

    def weights(self, work: Workload, ways: Mapping[str, int]) -> list[Tensor]:
        """Weight and scale tensors stored as ``work`` says, laid out for a mesh that splits each
        logical axis ``ways[axis]`` ways (block scales are re-blocked for it)."""

    def cache(self, work: Workload, axes: Mapping[str, int]) -> list[Tensor]:
        """KV (and scale) tensors holding ``work.batch`` rows of ``work.context`` positions as the
        serving engine holds them on a mesh of these axis sizes (each data replica its own pool),
        and the prefix cache's state snapshots (``Component.STATE_SNAPSHOTS``) where it keeps any."""

    def activations(self, work: Workload, axes: Mapping[str, int]) -> dict[str, list[Stage]]:
        """Transient buffers stage by stage, per step (``decode``, ``prefill``)."""

    def collectives(self, work: Workload, axes: Mapping[str, int]) -> dict[str, list[Collective]]:
        """The collectives of one step, per step (``decode``, ``prefill``)."""

    # For pipeline (``stage``) meshes; a footprint without them is planned without stages.
    num_layers: int  # decoder layers
    residual_width: int  # elements per token a stage hands the next

    def layer_weights(self, work: Workload, ways: Mapping[str, int]) -> LayerSplit:
        """:meth:`weights` by decoder layer (and the first and last stages' own)."""

    def layer_cache(self, work: Workload, axes: Mapping[str, int]) -> LayerSplit:
        """:meth:`cache` by decoder layer."""

    def stage_split(self, work: Workload, ways: Mapping[str, int], stages: int, rows: int, wanted: int
                    ) -> tuple[tuple[range, ...], int]:
        """Layer ranges of ``stages`` stages (weights as ``work`` stores them on a mesh splitting
        the logical ``ways``) and the micro-batches of ``rows`` rows (``wanted`` asked)."""



def _mesh_text(axes: Mapping[str, int]) -> str:
    text = ",".join(f"{a}={axes[a]}" for a in MESH_AXES if axes.get(a, 1) > 1)
    return text or "single device"


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Per-device bytes, activation peaks and collectives of one mesh, and whether it runs."""

    mesh: dict[str, int]
    strategy: str
    bytes: dict[str, int]  # Component value -> bytes per device
    peak_stage: str  # "decode: ..." or "prefill: ..."
    usable: int
    activation_peaks: dict[str, int]  # step -> its peak bytes per device
    collectives: dict[str, int]  # per decode step: op -> bytes sent per device
    collectives_prefill: dict[str, int]  # per prefill chunk
    inter_host: int  # bytes per device per decode step on axes whose groups span hosts
    inter_host_prefill: int  # the same per prefill chunk
    tensor_in_host: bool  # the tensor groups (if any) stay inside one host
    refused: str | None = None  # the engine's reason for not running this mesh
    detail: tuple[dict, ...] = ()  # each collective: step, name, op, mesh axis, group, bytes
    stages: tuple[tuple[int, int], ...] = ()  # a pipeline's layer ranges [start, stop), stage by stage
    micro_batches: int = 1  # a pipeline decode step's micro-batches (M)
    stage_send: tuple[int, int] = (0, 0)  # bytes per device handed to the next stage: decode step, prefill chunk
    stage_across_hosts: bool = False  # some stage boundary crosses hosts
    host: HostTier | None = None  # the host tier, with ``Workload.host_memory``
    pipeline_gap: str | None = None  # why ``model.pipeline`` does not run this stage mesh yet

    @property
    def bubble(self) -> float:
        """The pipeline's idle share of a decode step, (S-1)/(M+S-1); 0 without stages."""
        return bubble_fraction(max(len(self.stages), 1), self.micro_batches)

    @property
    def fits_with_host(self) -> bool:
        """Whether it fits once weights are offloaded to the host tier (which must hold them)."""
        h = self.host
        return self.fits or (self.runs and h is not None and h.fits and h.offload_layers > 0
                             and self.total - h.offload_bytes + h.buffer_bytes <= self.usable)

    @property
    def total(self) -> int:
        """All components together, bytes per device."""
        return sum(self.bytes.values())

    @property
    def runs(self) -> bool:
        """Whether the engine runs this mesh with these options."""
        return self.refused is None

    @property
    def fits(self) -> bool:
        """Whether the engine runs it and the total fits in a device's usable memory."""
        return self.runs and self.total <= self.usable

    @property
    def headroom(self) -> int:
        """Usable bytes left free per device (negative: over by that much)."""
        return self.usable - self.total

    def to_json(self) -> dict:
        """A JSON-serialisable summary."""
        return {
            "mesh": dict(self.mesh), "mesh_text": _mesh_text(self.mesh), "strategy": self.strategy,
            "refused": self.refused, "bytes_per_device": {**self.bytes, "total": self.total},
            "peak_stage": self.peak_stage, "activation_peaks": dict(self.activation_peaks),
            "fits": self.fits, "headroom_bytes": self.headroom,
            "collectives_per_decode_step": dict(self.collectives),
            "collectives_per_prefill_chunk": dict(self.collectives_prefill),
            "inter_host_bytes": {"decode": self.inter_host, "prefill": self.inter_host_prefill},
            "tensor_in_host": self.tensor_in_host, "collective_detail": list(self.detail),
            "pipeline": None if not self.stages else {
                "stages": len(self.stages), "layers": [list(r) for r in self.stages],
                "micro_batches": self.micro_batches, "bubble_fraction": self.bubble,
                "send_bytes_per_device": {"decode": self.stage_send[0], "prefill": self.stage_send[1]},
                "across_hosts": self.stage_across_hosts, "not_run_yet": self.pipeline_gap},
            "host_tier": None if self.host is None else self.host.to_json(), "fits_with_host": self.fits_with_host,
        }


def evaluate(model: Footprint, work: Workload, axes: Mapping[str, int]) -> MeshPlan:
    """Per-device bytes, peaks and collectives of ``model`` under ``work`` on a mesh of these
    axis sizes, and the engine's refusal of it if any (a mesh without a rules table has no
    figures: zeros). A ``stage`` mesh is its largest stage's device (``planner_pipeline``)."""
    axes = {a: int(axes.get(a, 1)) for a in MESH_AXES}
    refused = model.refusal(work, axes)
    in_host = axes["tensor"] == 1 or not spans_hosts(axes, "tensor", work.devices_per_host)
    try:
        rules = rules_for_mesh(axes)  # the rules the engine runs this mesh with
        pipe = Pipeline.of(model, work, axes, rules) if axes.get("stage", 1) > 1 else None
    except MeshError as e:
        zeros = dict.fromkeys((c.value for c in Component), 0)
        empty = dict.fromkeys((o.value for o in Op), 0)
        return MeshPlan(axes, "none", zeros, "", work.usable, dict.fromkeys(STEPS, 0), empty, dict(empty),
                        0, 0, in_host, refused or str(e))
    totals = {c.value: 0 for c in Component}
    if pipe is None:
        for t in model.weights(work, logical_ways(rules, axes)) + model.cache(work, axes):
            totals[t.component.value] += device_bytes(t, rules, axes)
    else:
        totals.update(pipe.totals)
    step_work = work if pipe is None else pipe.step_work
    peaks, names = {}, {}
    for step, stages in model.activations(step_work, axes).items():
        sizes = [(sum(device_bytes(t, rules, axes) for t in s.tensors), s.name) for s in stages]
        peaks[step], names[step] = max(sizes, key=lambda x: x[0]) if sizes else (0, "")
    top = max(peaks, key=lambda s: peaks[s])
    totals[Component.ACTIVATIONS.value] = peaks[top]
    scale = (1.0, 1.0) if pipe is None else pipe.collective_scale
    sent, crossing, detail = _collectives(model.collectives(step_work, axes), rules, axes, work.devices_per_host,
                                          scale)
    extra = {}
    if pipe is not None:
        across = spans_hosts(axes, "stage", work.devices_per_host)
        send = pipe.send_bytes(model, work)
        crossing = {step: crossing[step] + (send[i] if across else 0) for i, step in enumerate(STEPS)}
        gap = model.pipeline_gap(work, axes) if hasattr(model, "pipeline_gap") else None
        extra = dict(stages=tuple((r.start, r.stop) for r in pipe.ranges), micro_batches=pipe.micro,
                     stage_send=send, stage_across_hosts=across, pipeline_gap=gap)
    if work.host_memory is not None:
        extra["host"] = mesh_host_tier(model, work, axes, rules, totals, pipe)
    return MeshPlan(axes, rules.name, totals, f"{top}: {names[top]}", work.usable, peaks, sent["decode"],
                    sent["prefill"], crossing["decode"], crossing["prefill"], in_host, refused, tuple(detail), **extra)


def _collectives(per_step: Mapping[str, list[Collective]], rules: R.Rules, axes: Mapping[str, int],
                 devices_per_host: int, scale: tuple[float, float] = (1.0, 1.0)) -> tuple[dict, dict, list]:
    """Per step: bytes sent per op, the inter-host part, and one record per collective (each
    times ``scale``'s factor for its step: a pipeline stage's share)."""
    sent = {s: dict.fromkeys((o.value for o in Op), 0) for s in STEPS}
    crossing, detail = dict.fromkeys(STEPS, 0), []
    for step, collectives in per_step.items():
        for c in collectives:
            size = round(collective_bytes(c, rules, axes) * scale[STEPS.index(step)])
            if not size:
                continue
            mesh_axis = rules.mesh_axis(c.over)
            across = spans_hosts(axes, mesh_axis, devices_per_host)
            sent[step][c.op.value] += size
            crossing[step] += size if across else 0
            detail.append({"step": step, "name": c.name, "op": c.op.value, "mesh_axis": mesh_axis,
                           "group": group_size(c, rules, axes), "bytes": size, "inter_host": across})
    return sent, crossing, detail


def candidate_meshes(devices: int, batch: int, layers: int = 1) -> list[dict[str, int]]:
    """Every stage x data x tensor x expert split of ``devices`` whose data size divides the
    batch (more replicas than rows would idle) and with at most ``layers`` stages (a stage holds
    at least one decoder layer). Whether the engine runs each is ``evaluate``'s ``refused``."""
    out = []
    for stage in (s for s in _divisors(devices) if s <= max(layers, 1)):
        for data in _divisors(devices // stage):
            for expert in _divisors(devices // stage // data):
                if batch % data == 0:
                    out.append({"data": data, "tensor": devices // stage // data // expert, "expert": expert,
                                "stage": stage})
    return out


def _candidates(model: Footprint, work: Workload) -> list[dict[str, int]]:
    """:func:`candidate_meshes` for ``model`` (no stages for a footprint without layers)."""
    return candidate_meshes(work.devices, work.batch, getattr(model, "num_layers", 1))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _preference(p: MeshPlan) -> tuple:
    # The RULE. Fitting meshes by what the engine's pipeline runs, host locality, bubble, data,
    # inter-host bytes, headroom (then
    # fewer tensor devices); then those fitting with weights offloaded to the host, by the time
    # streaming adds; runnable ones that do not fit by closeness; refused ones last.
    if p.fits:
        return (3, p.pipeline_gap is None, p.tensor_in_host, -p.bubble, p.mesh["data"], -p.inter_host,
                -p.inter_host_prefill, p.headroom, -p.mesh["tensor"])
    if p.fits_with_host:
        return (2, p.pipeline_gap is None, p.tensor_in_host, -p.host.step_seconds, p.mesh["data"], -p.inter_host,
                -p.bubble, 0, -p.mesh["tensor"])
    return (1 if p.runs else 0, 0, 0, 0, 0, 0, 0, p.headroom if p.runs else 0, -p.mesh["tensor"])


@dataclasses.dataclass(frozen=True)
class Plan:
    """The outcome: the recommended mesh, every candidate, and advice when nothing fits."""

    model: str
    parameters: int
    work: Workload
    recommended: MeshPlan
    candidates: tuple[MeshPlan, ...]
    forced: bool  # the mesh was given, not chosen
    advice: tuple[str, ...]
    page_size: int  # positions a KV page covers, as planned (``Footprint.page_size``)

    @property
    def fits(self) -> bool:
        """Whether the recommended (or given) mesh fits."""
        return self.recommended.fits

    def to_json(self) -> dict:
        """A JSON-serialisable summary (the ``dayzero plan --json`` object)."""
        w = self.work
        return {
            "model": self.model, "parameters": self.parameters,
            "workload": {
                "devices": w.devices, "device_memory_bytes": w.device_memory, "usable_bytes": w.usable,
                "reserve": w.reserve, "quantize": w.quantize, "kv_cache": w.kv_cache, "dtype": w.dtype,
                "kernels": w.kernels, "batch": w.batch, "context": w.context, "prefill_chunk": w.prefill_chunk,
                "devices_per_host": w.devices_per_host, "page_size": self.page_size,
                "state_snapshots": w.state_snapshots, "host_memory_bytes": w.host_memory,
                "host_bandwidth_bytes_per_s": w.host_bandwidth, "micro_batches": w.micro_batches,
            },
            "fits": self.fits, "rule": "given by --mesh" if self.forced else RULE,
            "recommended": self.recommended.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "advice": list(self.advice),
        }


def plan(model: Footprint, work: Workload, mesh: Mapping[str, int] | None = None) -> Plan:
    """Plan ``model`` for ``work``: evaluate the candidate meshes (or only ``mesh``) and choose
    by :data:`RULE`. Raises :class:`PlanError` when the given mesh, or every candidate, is one the
    engine refuses."""
    if mesh is not None:
        mesh = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
        if math.prod(mesh.values()) != work.devices:
            raise PlanError(f"--mesh {_mesh_text(mesh)} has {math.prod(mesh.values())} devices, not {work.devices}")
        if work.batch % mesh["data"]:
            raise PlanError(f"data={mesh['data']} must divide the batch of {work.batch} rows")
        candidates = [evaluate(model, work, mesh)]
        if not candidates[0].runs:
            raise PlanError(f"the engine refuses --mesh {_mesh_text(mesh)}: {candidates[0].refused}")
    else:
        candidates = [evaluate(model, work, m) for m in _candidates(model, work)]
        if not any(c.runs for c in candidates):
            raise PlanError(f"the engine runs {model.name} on no mesh of {work.devices} devices with these options; "
                            f"e.g. {_mesh_text(candidates[-1].mesh)}: {candidates[-1].refused}")
    candidates.sort(key=_preference, reverse=True)
    best = candidates[0]
    advice = () if best.fits else tuple(_advice(model, work, mesh))
    return Plan(model.name, model.parameters, work, best, tuple(candidates), mesh is not None, advice,
                model.page_size(work))


def _fits_somewhere(model: Footprint, work: Workload, mesh: Mapping[str, int] | None) -> bool:
    """Whether ``mesh`` (or, if None, any candidate mesh) runs and fits ``work``."""
    meshes = [mesh] if mesh is not None else _candidates(model, work)
    return any(evaluate(model, work, m).fits for m in meshes)


def _advice(model: Footprint, work: Workload, mesh: Mapping[str, int] | None) -> list[str]:
    """What would fit, on a mesh the engine runs, spelled as the command line spells it: another
    weight or KV storage, a smaller prefill chunk, more devices, a shorter context, fewer rows."""
    out = []
    for field, flag in (("quantize", "--quantize"), ("kv_cache", "--kv-cache")):
        fitting = [o for o in model.storage_options()[field] if o not in ("none", getattr(work, field))
                   and _fits_somewhere(model, dataclasses.replace(work, **{field: o}), mesh)]
        if fitting:
            others = f" (so would {', '.join(fitting[1:])})" if fitting[1:] else ""
            out.append(f"{flag} {fitting[0]} would fit{others}")
    chunk = _largest(lambda n: _fits_somewhere(model, dataclasses.replace(work, prefill_chunk=n), mesh),
                     work.prefill_chunk, power_of_two=True)
    if chunk:
        out.append(f"a prefill chunk of {chunk} tokens would fit (--prefill-chunk {chunk})")
    for factor in (2, 4, 8, 16, 32, 64):
        more = dataclasses.replace(work, devices=work.devices * factor)
        if mesh is None:
            fitting = [p for p in (evaluate(model, more, m) for m in _candidates(model, more)) if p.fits]
            if fitting:
                out.append(f"{more.devices} devices of this memory would fit (--devices {more.devices}): "
                           f"{_why(max(fitting, key=_preference), more)}")
                break
        elif _fits_somewhere(model, more, {**mesh, "tensor": mesh["tensor"] * factor}):
            out.append(f"{more.devices} devices of this memory would fit (--devices {more.devices})")
            break
    context = _largest(lambda n: _fits_somewhere(model, dataclasses.replace(work, context=n), mesh), work.context)
    if context:
        out.append(f"a context of {context} tokens would fit (--context {context})")
    batch = _largest(lambda n: _fits_somewhere(model, dataclasses.replace(work, batch=n), mesh), work.batch)
    if batch:
        out.append(f"a batch of {batch} rows would fit (--batch {batch})")
    if not out:
        out.append("nothing short of more devices would fit: the weights alone exceed the usable memory")
    return out


def _why(p: MeshPlan, work: Workload) -> str:
    """The mesh ``p`` and, for a pipeline, what it is: stages over hosts, groups within one."""
    text = _mesh_text(p.mesh)
    if not p.stages:
        return text
    hosts = max(1, work.devices // work.devices_per_host)
    return (f"{text}, a pipeline of {len(p.stages)} stages over {hosts} host{'s' * (hosts > 1)} "
            f"({'tensor groups inside a host' if p.tensor_in_host else 'tensor groups across hosts'}; "
            f"{format_size(p.stage_send[0])} per device to the next stage per decode step, bubble "
            f"{p.bubble:.0%} at {p.micro_batches} micro-batches)")


def _largest(fits, upper: int, power_of_two: bool = False) -> int:
    """The largest n < ``upper`` for which ``fits(n)`` holds, assuming it holds for all smaller n
    (0: not even 1); a power of two with ``power_of_two``, else rounded down to a multiple of
    1024 when at least that."""
    if upper <= 1 or not fits(1):
        return 0
    if power_of_two:
        n = 1
        while 2 * n < upper and fits(2 * n):
            n *= 2
        return n
    lo, hi = 1, upper - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo - lo % 1024 if lo >= 1024 else lo
