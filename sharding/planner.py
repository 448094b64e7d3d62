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

Mesh choice (:func:`plan`): every data x tensor x expert factorisation of the device count whose
data size divides the batch is evaluated with the rules the engine uses on it
(``dayzero.sharding.placement.rules_for_mesh``). A mesh the engine refuses keeps its reason in
``refused`` and is never recommended; among the rest :data:`RULE` decides.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Mapping, Protocol

import numpy as np

from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MESH_AXES, MeshError
from dayzero.sharding.placement import rules_for_mesh

RULE = (
    "among meshes the engine runs and that fit: tensor groups inside one host first (tensor "
    "parallelism all-reduces every layer), then the most data parallelism the batch allows "
    "(replicas never talk), then the fewest bytes crossing hosts per decode step (then per "
    "prefill chunk), then the most free memory per device; when none fits, the runnable mesh "
    "closest to fitting"
)

GiB = 1 << 30
# The serving engine's prefix-cache snapshot rows per slot for models with per-sequence states
# (``ServingConfig.state_snapshots``' default, 4 x ``slots``; kept equal by a test).
SNAPSHOTS_PER_SLOT = 4
DTYPES = {"bfloat16": 2, "float32": 4}  # compute / float-weight dtypes a plan may name
STEPS = ("decode", "prefill")


class PlanError(ValueError):
    """A planner input that cannot be planned (bad size, dtype, preset, mesh)."""


class Component(enum.Enum):
    """What a tensor is, for the per-component totals."""

    WEIGHTS = "weights"
    WEIGHT_SCALES = "weight_scales"
    KV_CACHE = "kv_cache"
    KV_SCALES = "kv_scales"
    STATE_SNAPSHOTS = "state_snapshots"  # the prefix cache's copies of per-sequence states (values and scales)
    ACTIVATIONS = "activations"


class Op(enum.Enum):
    """Collective operations, by what each device sends."""

    ALL_REDUCE = "all_reduce"  # ring: 2(n-1)/n of the buffer
    ALL_GATHER = "all_gather"  # ring: (n-1)/n of the gathered result
    ALL_TO_ALL = "all_to_all"  # the buffer times the share sent off-device


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One array (or ``count`` identical ones) as declared: global shape and logical axes.
    ``itemsize``: bytes per element as the device holds it, 0.5 for a 4-bit type (XLA packs two
    to a byte; the footprint says why), so a piece's bytes are rounded up per array."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: float
    component: Component
    count: int = 1

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.name}: shape {self.shape} and axes {self.axes} differ in rank")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A point of a step and the transient tensors live there together."""

    name: str
    tensors: tuple[Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a step (``count`` times): ``op`` over the devices that split the logical
    axis ``over`` (a dimension of ``size``; none when the rules leave it whole). ``shape``/``axes``:
    the buffer on a device of that group (all-reduce: what it reduces; all-gather: the gathered
    result; all-to-all: what it sends in one direction, of which ``share`` leaves the device,
    None for the (n-1)/n of uniform traffic)."""

    name: str
    op: Op
    over: str
    size: int
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int
    count: int = 1
    share: float | None = None


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

    def __post_init__(self):
        for name in ("quantize", "kv_cache", "dtype", "kernels"):  # enums given: their spelling
            value = getattr(self, name)
            object.__setattr__(self, name, str(getattr(value, "value", value)))
        for name in ("devices", "batch", "context", "device_memory", "prefill_chunk", "devices_per_host",
                     "page_size"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, got {getattr(self, name)}")
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


class _MeshShape:
    """Just the ``shape`` mapping ``spec_for`` reads: no devices needed."""

    def __init__(self, axes: Mapping[str, int]):
        self.shape = {a: int(axes.get(a, 1)) for a in MESH_AXES}


def local_shape(t: Tensor | Collective, rules: R.Rules, axes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of ``t``'s piece on one device."""
    mesh = _MeshShape(axes)
    spec = R.spec_for(t.axes, rules, mesh, t.shape)
    return tuple(d // (mesh.shape[m] if m else 1) for d, m in zip(t.shape, spec))


def device_bytes(t: Tensor, rules: R.Rules, axes: Mapping[str, int]) -> int:
    """Bytes of ``t`` (all ``count`` copies) on one device (a 4-bit piece rounded up to whole bytes)."""
    return t.count * math.ceil(math.prod(local_shape(t, rules, axes)) * t.itemsize)


def logical_ways(rules: R.Rules, axes: Mapping[str, int]) -> dict[str, int]:
    """How many ways the mesh splits each logical axis (its mesh axis's size; 1 when whole)."""
    return {a: int(axes.get(rules.mesh_axis(a), 1)) if rules.mesh_axis(a) else 1 for a in R.LOGICAL_AXES}


def group_size(c: Collective, rules: R.Rules, axes: Mapping[str, int]) -> int:
    """Devices taking part in ``c``: how many ways its ``over`` dimension is split (as
    ``spec_for`` decides: 1 when the mesh axis does not divide it)."""
    mesh_axis = R.spec_for((c.over,), rules, _MeshShape(axes), (c.size,))[0]
    return 1 if mesh_axis is None else int(axes[mesh_axis])


def collective_bytes(c: Collective, rules: R.Rules, axes: Mapping[str, int]) -> int:
    """Bytes one device sends for ``c`` (all ``count`` times): ring all-reduce 2(n-1)/n of its
    buffer, ring all-gather (n-1)/n of the gathered result, all-to-all the share sent away."""
    n = group_size(c, rules, axes)
    if n == 1:
        return 0
    buffer = math.prod(local_shape(c, rules, axes)) * c.itemsize
    share = {Op.ALL_REDUCE: 2 * (n - 1) / n, Op.ALL_GATHER: (n - 1) / n,
             Op.ALL_TO_ALL: (n - 1) / n if c.share is None else c.share}[c.op]
    return round(c.count * buffer * share)


def spans_hosts(axes: Mapping[str, int], mesh_axis: str, devices_per_host: int) -> bool:
    """Whether the device groups along ``mesh_axis`` reach over more than one host, with the
    engine's device order (``rules.device_grid``: host h holds devices h*devices_per_host ...,
    tensor innermost)."""
    sizes = {a: int(axes.get(a, 1)) for a in MESH_AXES}
    hosts = R.device_grid(sizes, np.arange(math.prod(sizes.values())) // devices_per_host)
    groups = np.moveaxis(hosts, MESH_AXES.index(mesh_axis), -1).reshape(-1, sizes[mesh_axis])
    return bool((groups != groups[:, :1]).any())


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
        }


def evaluate(model: Footprint, work: Workload, axes: Mapping[str, int]) -> MeshPlan:
    """Per-device bytes, peaks and collectives of ``model`` under ``work`` on a mesh of these
    axis sizes, and the engine's refusal of it if any (a mesh without a rules table has no
    figures: zeros)."""
    axes = {a: int(axes.get(a, 1)) for a in MESH_AXES}
    refused = model.refusal(work, axes)
    in_host = axes["tensor"] == 1 or not spans_hosts(axes, "tensor", work.devices_per_host)
    try:
        rules = rules_for_mesh(axes)  # the rules the engine runs this mesh with
    except MeshError as e:
        zeros = dict.fromkeys((c.value for c in Component), 0)
        empty = dict.fromkeys((o.value for o in Op), 0)
        return MeshPlan(axes, "none", zeros, "", work.usable, dict.fromkeys(STEPS, 0), empty, dict(empty),
                        0, 0, in_host, refused or str(e))
    totals = {c.value: 0 for c in Component}
    for t in model.weights(work, logical_ways(rules, axes)) + model.cache(work, axes):
        totals[t.component.value] += device_bytes(t, rules, axes)
    peaks, names = {}, {}
    for step, stages in model.activations(work, axes).items():
        sizes = [(sum(device_bytes(t, rules, axes) for t in s.tensors), s.name) for s in stages]
        peaks[step], names[step] = max(sizes, key=lambda x: x[0]) if sizes else (0, "")
    top = max(peaks, key=lambda s: peaks[s])
    totals[Component.ACTIVATIONS.value] = peaks[top]
    sent, crossing, detail = _collectives(model.collectives(work, axes), rules, axes, work.devices_per_host)
    return MeshPlan(axes, rules.name, totals, f"{top}: {names[top]}", work.usable, peaks, sent["decode"],
                    sent["prefill"], crossing["decode"], crossing["prefill"], in_host, refused, tuple(detail))


def _collectives(per_step: Mapping[str, list[Collective]], rules: R.Rules, axes: Mapping[str, int],
                 devices_per_host: int) -> tuple[dict, dict, list]:
    """Per step: bytes sent per op, the inter-host part, and one record per collective."""
    sent = {s: dict.fromkeys((o.value for o in Op), 0) for s in STEPS}
    crossing, detail = dict.fromkeys(STEPS, 0), []
    for step, collectives in per_step.items():
        for c in collectives:
            size = collective_bytes(c, rules, axes)
            if not size:
                continue
            mesh_axis = rules.mesh_axis(c.over)
            across = spans_hosts(axes, mesh_axis, devices_per_host)
            sent[step][c.op.value] += size
            crossing[step] += size if across else 0
            detail.append({"step": step, "name": c.name, "op": c.op.value, "mesh_axis": mesh_axis,
                           "group": group_size(c, rules, axes), "bytes": size, "inter_host": across})
    return sent, crossing, detail


def candidate_meshes(devices: int, batch: int) -> list[dict[str, int]]:
    """Every data x tensor x expert split of ``devices`` whose data size divides the batch (more
    replicas than rows would idle). Whether the engine runs each is ``evaluate``'s ``refused``."""
    out = []
    for data in _divisors(devices):
        for expert in _divisors(devices // data):
            if batch % data == 0:
                out.append({"data": data, "tensor": devices // data // expert, "expert": expert})
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _preference(p: MeshPlan) -> tuple:
    # The RULE. Fitting meshes by host locality, data, inter-host bytes, headroom (then fewer
    # tensor devices); runnable ones that do not fit by closeness; refused ones last.
    if p.fits:
        return (2, p.tensor_in_host, p.mesh["data"], -p.inter_host, -p.inter_host_prefill, p.headroom,
                -p.mesh["tensor"])
    return (1 if p.runs else 0, 0, 0, 0, 0, p.headroom if p.runs else 0, -p.mesh["tensor"])


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
                "state_snapshots": w.state_snapshots,
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
        candidates = [evaluate(model, work, m) for m in candidate_meshes(work.devices, work.batch)]
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
    meshes = [mesh] if mesh is not None else candidate_meshes(work.devices, work.batch)
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
        if _fits_somewhere(model, more, None if mesh is None else {**mesh, "tensor": mesh["tensor"] * factor}):
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


# ---- sizes ------------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """``80GiB`` / ``141GB`` / ``96G`` (binary) / ``85899345920`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise PlanError(
            f"device memory {text!r} is not a size; write a number with an optional unit, e.g. "
            "80GiB, 141GB, 96G (binary) or 85899345920 (bytes)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Bytes as a short binary-unit string, e.g. ``21.3 GiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
