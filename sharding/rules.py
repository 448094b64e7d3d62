"""Logical-axis rules: how each named array dimension maps onto the device mesh.

Model code names dimensions only by logical axis (``embed``, ``q_heads``, ...; see
``dayzero.model.weights.ParamSpec``). A :class:`Rules` table, built by one of the named strategy
factories below, maps every logical name to one mesh axis (``data``, ``tensor``, ``expert``,
``stage``) or to None (replicated). :func:`spec_for` turns a tuple of logical axes into a ``PartitionSpec`` for a
given mesh, and :func:`weight_shardings` does so for a whole weight tree.

Like the rest of ``dayzero.sharding`` this module imports nothing from ``dayzero.model``: weight
trees are walked by duck type (a leaf with ``shape`` and ``axes``), which is exactly what
``dayzero.model.weights.map_specs`` does with its ``is_spec`` test.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dayzero.sharding.distributed import MESH_AXES, MeshError

# Every logical axis name the model and its caches use. A rules table must give each one a rule,
# so that a new name added to the model fails loudly here instead of silently replicating.
LOGICAL_AXES = (
    "batch",
    "seq",
    "embed",
    "q_heads",
    "kv_heads",
    "head_dim",
    "ffw",
    "experts",
    "vocab",
    "cache_seq",
    "latent",
    "latent_seq",
    "latent_pages",
    "stage",
)


@dataclasses.dataclass(frozen=True)
class Rules:
    """One sharding strategy: a mesh axis (or None, replicated) for every logical axis name."""

    name: str
    table: Mapping[str, str | None]

    def __post_init__(self):
        missing = [a for a in LOGICAL_AXES if a not in self.table]
        unknown = [a for a in self.table if a not in LOGICAL_AXES]
        if missing or unknown:
            raise ValueError(f"rules {self.name!r}: missing logical axes {missing}, unknown ones {unknown}")
        bad = {a: m for a, m in self.table.items() if m is not None and m not in MESH_AXES}
        if bad:
            raise ValueError(f"rules {self.name!r} map to unknown mesh axes {bad}; use one of {MESH_AXES}")
        # Freeze the table: rules objects are shared between callers and must not drift.
        object.__setattr__(self, "table", MappingProxyType(dict(self.table)))

    def __hash__(self) -> int:
        # Rules travel as jit static arguments (inside a Placement), so they must hash; the
        # read-only table does not, its items do.
        return hash((self.name, tuple(sorted(self.table.items(), key=lambda kv: kv[0]))))

    def mesh_axis(self, logical: str | None) -> str | None:
        """The mesh axis that ``logical`` is split over (None: replicated, or an unnamed dim)."""
        if logical is None:
            return None
        if logical not in self.table:
            raise ValueError(f"logical axis {logical!r} has no rule in {self.name!r}; known: {LOGICAL_AXES}")
        return self.table[logical]


def _rules(name: str, **overrides: str | None) -> Rules:
    """A rules table that replicates every logical axis except those given (and ``stage``)."""
    table: dict[str, str | None] = {a: None for a in LOGICAL_AXES}
    # ``stage`` is the leading axis of pipeline-stacked layer weights and caches
    # (``dayzero.model.pipeline``): always over the ``stage`` mesh axis, which is inert (size 1)
    # on a mesh without pipeline parallelism, so every strategy composes with it.
    table["stage"] = "stage"
    table.update(overrides)
    return Rules(name, table)


# Megatron-style tensor parallelism: attention is split by head and the MLP by its hidden width,
# so each layer needs one reduction after ``o`` and one after ``down``. The vocabulary is split
# too, since the embedding and lm_head are among the largest matrices. ``embed`` stays
# replicated: splitting the residual stream would need a collective around every norm.
# The MLA latent cache has no head axis; left whole it would be copied on every tensor device
# (61 layers x 576 x 2 bytes = 70 KB per token for DeepSeek-V3, 70 GB at 1M tokens), so its
# positions are split over ``tensor`` instead and the softmax reduces across devices.
#
# ``latent_pages``, the page axis of the paged latent (and DSA indexer-key) pools, stays whole in
# every strategy: a paged kernel reads a row's pages in one program and returns a normalised
# output, not the softmax statistics a merge across devices would need (as ``mla_parallel`` merges
# the split contiguous cache). Splitting it is the next step for long-context MLA serving.
_TENSOR = dict(q_heads="tensor", kv_heads="tensor", ffw="tensor", vocab="tensor", latent_seq="tensor")


def single_device() -> Rules:
    """Everything replicated: the rules for one device (or for a mesh whose axes are all 1)."""
    return _rules("single_device")


def tensor_parallel() -> Rules:
    """Heads, MLP width and vocabulary over ``tensor``; experts' own width over ``tensor`` too."""
    return _rules("tensor_parallel", **_TENSOR)


def tensor_expert_parallel() -> Rules:
    """Tensor parallelism as above, plus whole experts split over the ``expert`` mesh axis."""
    return _rules("tensor_expert_parallel", experts="expert", **_TENSOR)


def data_tensor() -> Rules:
    """Batch rows over ``data`` (weights replicated across it), tensor parallelism within."""
    return _rules("data_tensor", batch="data", **_TENSOR)


def spec_for(
    axes: tuple[str | None, ...],
    rules: Rules,
    mesh: Mesh,
    shape: tuple[int, ...] | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` of an array whose dimensions carry the logical ``axes``.

    Raises ValueError if two dimensions would be split over the same mesh axis (a spec may use each
    mesh axis once). A dimension is replicated rather than split when its mesh axis is not in
    ``mesh`` or has size 1, or, given ``shape``, when the dimension is not a multiple of the mesh
    axis size.
    """
    wanted = [rules.mesh_axis(a) for a in axes]
    # Checked on the rules alone, before anything is dropped below, so a clash is reported the same
    # way whatever the mesh and shapes: it is a bug in the rules table, not a property of a model.
    used = [m for m in wanted if m is not None]
    if len(used) != len(set(used)):
        clash = sorted({m for m in used if used.count(m) > 1})
        raise ValueError(
            f"logical axes {tuple(axes)} map to {tuple(wanted)} under rules {rules.name!r}: "
            f"mesh axis {', '.join(map(repr, clash))} used twice in one spec"
        )
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and axes {tuple(axes)} differ in rank")
    sizes = dict(mesh.shape)
    out: list[str | None] = []
    for i, m in enumerate(wanted):
        size = sizes.get(m, 1) if m is not None else 1
        # Replicate instead of failing when a dimension does not divide: e.g. a GQA model with 2 kv
        # heads on tensor=8 keeps its kv projections whole on every device (8x their memory, but
        # they are small) while q/o and the MLP still split. jax would reject the uneven split, and
        # refusing the whole mesh for one small tensor would be the less useful answer.
        if size == 1 or (shape is not None and shape[i] % size):
            out.append(None)
        else:
            out.append(m)
    return PartitionSpec(*out)


def _is_param_spec(x: Any) -> bool:
    # Duck-typed stand-in for dayzero.model.weights.is_spec (this package may not import the model).
    return hasattr(x, "axes") and hasattr(x, "shape") and not isinstance(x, jax.Array)


def weight_shardings(specs: Any, rules: Rules, mesh: Mesh) -> Any:
    """A tree of ``NamedSharding`` matching a ``ParamSpec`` tree (e.g. ``abstract_weights``)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, spec_for(s.axes, rules, mesh, s.shape)),
        specs,
        is_leaf=_is_param_spec,
    )


def make_mesh(axes: Mapping[str, int], devices: list | None = None) -> Mesh:
    """A mesh with all of ``MESH_AXES`` (sizes from ``axes``, missing ones 1) over ``devices``.

    ``devices`` defaults to ``jax.devices()`` (all devices of all processes); their count must equal
    the product of the sizes. Always naming every axis lets any rules object be used with any
    mesh: an axis of size 1 just replicates.
    """
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise MeshError(f"unknown mesh axes {unknown}; use {', '.join(MESH_AXES)}")
    shape = tuple(int(axes.get(a, 1)) for a in MESH_AXES)
    if any(s < 1 for s in shape):
        raise MeshError(f"mesh sizes must be >= 1, got {dict(axes)}")
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(devices):
        given = ",".join(f"{a}={s}" for a, s in axes.items())
        raise MeshError(
            f"mesh {given} needs {math.prod(shape)} devices but there are {len(devices)}; make the "
            "sizes multiply to the device count (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "fakes N devices)"
        )
    # Auto axis types: the model does not yet annotate out_sharding on its contractions, which
    # Explicit mode would require; XLA's propagation places the intermediates instead.
    return Mesh(device_grid(dict(zip(MESH_AXES, shape)), devices), MESH_AXES)


# The order devices are laid out in, slowest-varying first: ``tensor`` varies fastest, so that
# consecutive devices (jax.devices() lists each host's devices together) form the tensor groups,
# which all-reduce every layer and need the host's fast links (NVLink, ICI); ``expert`` groups
# (one all-to-all per MoE layer) come next and ``data`` replicas, which never talk, span hosts.
# ``stage`` is slowest of all: pipeline stages pass one activation per micro-batch to their
# neighbour (the least traffic of any axis), and it puts whole stages on whole hosts, so a
# multi-host run can give each process one or more stages.
DEVICE_ORDER = ("stage", "data", "expert", "tensor")


def device_grid(sizes: Mapping[str, int], devices: Any) -> np.ndarray:
    """``devices`` (a flat list in host order) as an array with axes ``MESH_AXES`` laid out in
    :data:`DEVICE_ORDER` (tensor innermost); ``sizes`` gives every axis of ``MESH_AXES``."""
    grid = np.asarray(devices).reshape([int(sizes[a]) for a in DEVICE_ORDER])
    return grid.transpose([DEVICE_ORDER.index(a) for a in MESH_AXES])


def grid_devices(grid: np.ndarray) -> list:
    """The inverse of :func:`device_grid`: a grid with axes ``MESH_AXES`` back to its flat list."""
    return list(grid.transpose([MESH_AXES.index(a) for a in DEVICE_ORDER]).reshape(-1))
