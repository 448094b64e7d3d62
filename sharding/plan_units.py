"""The planner's units: what a step holds and moves (:class:`Tensor`, :class:`Collective`), their
per-device bytes on a mesh (``spec_for`` on a stand-in mesh with only ``.shape``), whether a mesh
axis's groups span hosts, and sizes as the command line spells them. Re-exported by
``dayzero.sharding.planner`` (see there)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
from typing import Mapping

import numpy as np

from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MESH_AXES


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
    return t.count * _piece_bytes(t.shape, t.axes, t.itemsize, rules, tuple(sorted(axes.items())))


# Cached by shape, not by name: a pipeline's layers repeat the same shapes under their own names,
# evaluated on every candidate mesh.
@functools.lru_cache(maxsize=1 << 16)
def _piece_bytes(shape: tuple, logical: tuple, itemsize: float, rules: R.Rules, axes: tuple) -> int:
    mesh = _MeshShape(dict(axes))
    spec = R.spec_for(logical, rules, mesh, shape)
    return math.ceil(math.prod(d // (mesh.shape[m] if m else 1) for d, m in zip(shape, spec)) * itemsize)


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


# ---- sizes ------------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_size(text: str, what: str = "device memory") -> int:
    """``80GiB`` / ``141GB`` / ``96G`` (binary) / ``85899345920`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise PlanError(
            f"{what} {text!r} is not a size; write a number with an optional unit, e.g. "
            "80GiB, 141GB, 96G (binary) or 85899345920 (bytes)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Bytes as a short binary-unit string, e.g. ``21.3 GiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
