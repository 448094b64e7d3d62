"""The memory planner: per-device bytes of weights, KV cache and activations on candidate meshes.

Pure arithmetic over abstract declarations: every array the decode step holds is a
:class:`Tensor` (global shape, logical axes, bytes per element). Its per-device size on a mesh is
its shape with each dimension divided by the size of the mesh axis the strategy's rules split it
over (``spec_for``, which also decides what stays replicated), times its element size. No device
and no allocation is needed, so a 3-trillion-parameter model plans on a laptop.

What the tensors are is the model's business: a :class:`Footprint` (``dayzero.model.footprint``
implements it) lists the weights, the cache and the decode step's transient buffers. This
package imports nothing from ``dayzero.model`` (see DESIGN.md), so the footprint is passed in.

Mesh choice (:func:`plan`): every data x tensor x expert factorisation of the device count that
the rules can run is evaluated, each with the rules the engine uses on it
(``dayzero.sharding.placement.rules_for_mesh``; data and expert together have no rules table). The
recommendation is, among the meshes that fit, the one with the most data parallelism the batch
allows (data replicas decode their own rows and never talk to each other), then the most free
memory per device (room for more rows or context). :data:`RULE` states it for the output.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Protocol

from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MESH_AXES, MeshError
from dayzero.sharding.placement import rules_for_mesh

RULE = (
    "among meshes that fit, the most data parallelism the batch allows (replicas decode "
    "independently: no collectives between them), then the most free memory per device; "
    "when none fits, the one closest to fitting"
)

GiB = 1 << 30


class PlanError(ValueError):
    """A planner input that cannot be planned (bad size, dtype, preset, mesh)."""


class WeightDtype(enum.Enum):
    """Storage of the weights. ``float8``: e4m3 matrices with one fp32 scale per 128x128 block
    (DeepSeek's layout); embeddings, router, norms and biases stay bfloat16."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT8 = "float8"


class KVDtype(enum.Enum):
    """Storage of the KV cache. ``float8``/``int8``: one byte per value plus one fp32 scale per
    cached row (per position, and per kv head for per-head caches)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT8 = "float8"
    INT8 = "int8"


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float8": 1, "int8": 1}


class Component(enum.Enum):
    """What a tensor is, for the per-component totals."""

    WEIGHTS = "weights"
    WEIGHT_SCALES = "weight_scales"
    KV_CACHE = "kv_cache"
    KV_SCALES = "kv_scales"
    ACTIVATIONS = "activations"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One array (or ``count`` identical ones) as declared: global shape and logical axes."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int
    component: Component
    count: int = 1
    # Block scales: on the piece a device holds, the dims of each group are flattened and cut
    # into blocks of ``block`` elements, one value per block (a block cut by a shard boundary
    # needs its scale on both sides); dims in no group count whole.
    block_groups: tuple[tuple[int, ...], ...] = ()
    block: int = 1

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.name}: shape {self.shape} and axes {self.axes} differ in rank")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A point of the decode step and the transient tensors live there together."""

    name: str
    tensors: tuple[Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What to plan for: devices, their memory, dtypes, batch rows and context length."""

    devices: int
    device_memory: int  # bytes
    weight_dtype: WeightDtype = WeightDtype.BFLOAT16
    kv_dtype: KVDtype = KVDtype.BFLOAT16
    batch: int = 1
    context: int = 4096
    reserve: float = 0.1  # fraction of each device kept free (runtime, fragmentation)

    def __post_init__(self):
        for name in ("devices", "batch", "context", "device_memory"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.reserve < 1:
            raise PlanError(f"reserve must be in [0, 1), got {self.reserve}")

    @property
    def usable(self) -> int:
        """Bytes per device the plan may fill."""
        return int(self.device_memory * (1 - self.reserve))

    @property
    def compute_itemsize(self) -> int:
        """Activations: fp32 with fp32 weights, else bfloat16 (fp8 weights compute in bf16)."""
        return 4 if self.weight_dtype is WeightDtype.FLOAT32 else 2


class Footprint(Protocol):
    """What a model holds for decoding (implemented by ``dayzero.model.footprint``)."""

    name: str
    parameters: int
    num_experts: int | None  # routed experts (None: dense), for the expert axis

    def weights(self, work: Workload) -> list[Tensor]:
        """Weight (and weight-scale) tensors at ``work.weight_dtype``."""

    def cache(self, work: Workload) -> list[Tensor]:
        """KV cache (and scale) tensors for ``work.batch`` rows of ``work.context`` positions."""

    def activations(self, work: Workload, mesh: dict[str, int]) -> list[Stage]:
        """The decode step's transient buffers, stage by stage (the peak is the largest stage)."""


class _MeshShape:
    """Just the ``shape`` mapping ``spec_for`` reads: no devices needed."""

    def __init__(self, axes: dict[str, int]):
        self.shape = {a: int(axes.get(a, 1)) for a in MESH_AXES}


def local_shape(t: Tensor, rules: R.Rules, axes: dict[str, int]) -> tuple[int, ...]:
    """The shape of ``t``'s piece on one device."""
    mesh = _MeshShape(axes)
    spec = R.spec_for(t.axes, rules, mesh, t.shape)
    return tuple(d // (mesh.shape[m] if m else 1) for d, m in zip(t.shape, spec))


def device_bytes(t: Tensor, rules: R.Rules, axes: dict[str, int]) -> int:
    """Bytes of ``t`` (all ``count`` copies) on one device."""
    shape = local_shape(t, rules, axes)
    grouped = {d for group in t.block_groups for d in group}
    blocks = math.prod(-(-math.prod(shape[d] for d in group) // t.block) for group in t.block_groups)
    return t.count * blocks * math.prod(n for d, n in enumerate(shape) if d not in grouped) * t.itemsize


def _mesh_text(axes: dict[str, int]) -> str:
    text = ",".join(f"{a}={axes[a]}" for a in MESH_AXES if axes.get(a, 1) > 1)
    return text or "single device"


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Per-device bytes of every component on one mesh."""

    mesh: dict[str, int]
    strategy: str
    bytes: dict[str, int]  # Component value -> bytes per device
    peak_stage: str
    usable: int

    @property
    def total(self) -> int:
        """All components together, bytes per device."""
        return sum(self.bytes.values())

    @property
    def fits(self) -> bool:
        """Whether the total fits in the usable memory of a device."""
        return self.total <= self.usable

    @property
    def headroom(self) -> int:
        """Usable bytes left free per device (negative: over by that much)."""
        return self.usable - self.total

    def to_json(self) -> dict:
        """A JSON-serialisable summary."""
        return {
            "mesh": dict(self.mesh), "mesh_text": _mesh_text(self.mesh), "strategy": self.strategy,
            "bytes_per_device": {**self.bytes, "total": self.total}, "peak_stage": self.peak_stage,
            "fits": self.fits, "headroom_bytes": self.headroom,
        }


def evaluate(model: Footprint, work: Workload, axes: dict[str, int]) -> MeshPlan:
    """Per-device bytes of ``model`` under ``work`` on a mesh of these axis sizes."""
    axes = {a: int(axes.get(a, 1)) for a in MESH_AXES}
    try:
        rules = rules_for_mesh(axes)  # the rules the engine runs this mesh with
    except MeshError as e:
        raise PlanError(str(e)) from None
    totals = {c.value: 0 for c in Component}
    for t in model.weights(work) + model.cache(work):
        totals[t.component.value] += device_bytes(t, rules, axes)
    peak, peak_name = 0, ""
    for stage in model.activations(work, axes):
        size = sum(device_bytes(t, rules, axes) for t in stage.tensors)
        if size > peak:
            peak, peak_name = size, stage.name
    totals[Component.ACTIVATIONS.value] = peak
    return MeshPlan(axes, rules.name, totals, peak_name, work.usable)


def candidate_meshes(devices: int, batch: int, num_experts: int | None) -> list[dict[str, int]]:
    """Every data x tensor x expert split of ``devices`` the rules can run: data divides the batch,
    expert divides the number of experts (and needs experts), data and expert not together."""
    out = []
    for data in _divisors(devices):
        for expert in _divisors(devices // data):
            tensor = devices // data // expert
            if batch % data or (expert > 1 and (not num_experts or num_experts % expert)):
                continue
            if data > 1 and expert > 1:
                continue
            out.append({"data": data, "tensor": tensor, "expert": expert})
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _preference(p: MeshPlan) -> tuple:
    # The RULE: fitting first, then data parallelism, then headroom (then fewer tensor devices).
    # Among meshes that do not fit, the closest to fitting comes first.
    return (p.fits, p.mesh["data"] if p.fits else 0, p.headroom, -p.mesh["tensor"])


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
                "reserve": w.reserve, "weight_dtype": w.weight_dtype.value, "kv_dtype": w.kv_dtype.value,
                "batch": w.batch, "context": w.context,
            },
            "fits": self.fits, "rule": "given by --mesh" if self.forced else RULE,
            "recommended": self.recommended.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "advice": list(self.advice),
        }


def plan(model: Footprint, work: Workload, mesh: dict[str, int] | None = None) -> Plan:
    """Plan ``model`` for ``work``: evaluate the candidate meshes (or only ``mesh``) and choose."""
    if mesh is not None:
        mesh = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
        if math.prod(mesh.values()) != work.devices:
            raise PlanError(f"--mesh {_mesh_text(mesh)} has {math.prod(mesh.values())} devices, not {work.devices}")
        if mesh["expert"] > 1 and (not model.num_experts or model.num_experts % mesh["expert"]):
            raise PlanError(f"expert={mesh['expert']} must divide the model's {model.num_experts or 0} experts")
        if work.batch % mesh["data"]:
            raise PlanError(f"data={mesh['data']} must divide the batch of {work.batch} rows")
        candidates = [evaluate(model, work, mesh)]
    else:
        candidates = [evaluate(model, work, m) for m in candidate_meshes(work.devices, work.batch, model.num_experts)]
    candidates.sort(key=_preference, reverse=True)
    best = candidates[0]
    advice = () if best.fits else tuple(_advice(model, work, mesh))
    return Plan(model.name, model.parameters, work, best, tuple(candidates), mesh is not None, advice)


def _fits_somewhere(model: Footprint, work: Workload, mesh: dict[str, int] | None) -> bool:
    """Whether ``mesh`` (or, if None, any candidate mesh) fits ``work``."""
    if mesh is not None:
        return evaluate(model, work, mesh).fits
    return any(evaluate(model, work, m).fits for m in candidate_meshes(work.devices, work.batch, model.num_experts))


def _advice(model: Footprint, work: Workload, mesh: dict[str, int] | None) -> list[str]:
    """What would fit: fp8 weights or cache, more devices, a shorter context, fewer rows."""
    out = []
    if work.weight_dtype is not WeightDtype.FLOAT8 and _fits_somewhere(
            model, dataclasses.replace(work, weight_dtype=WeightDtype.FLOAT8), mesh):
        out.append("float8 weights (--weight-dtype float8) would fit")
    if work.kv_dtype in (KVDtype.FLOAT32, KVDtype.BFLOAT16) and _fits_somewhere(
            model, dataclasses.replace(work, kv_dtype=KVDtype.FLOAT8), mesh):
        out.append("a float8 KV cache (--kv-dtype float8) would fit")
    for factor in (2, 4, 8, 16, 32, 64):
        more = dataclasses.replace(work, devices=work.devices * factor)
        if _fits_somewhere(model, more, None if mesh is None else {**mesh, "tensor": mesh["tensor"] * factor}):
            out.append(f"{more.devices} devices of this memory would fit")
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


def _largest(fits, upper: int) -> int:
    """The largest n < ``upper`` for which ``fits(n)`` holds, assuming it holds for all smaller n
    (0: not even 1); rounded down to a multiple of 1024 when at least that."""
    if upper <= 1 or not fits(1):
        return 0
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
