"""A mesh plus the rules that lay a model out on it: what the engine, loader and converter share.

Which strategy a ``--mesh`` gets (:func:`rules_for_mesh`):

==============================  =========================  ====================================
mesh axes (sizes > 1)           rules                      what is split
==============================  =========================  ====================================
none (or no ``--mesh``)         no placement: one device   nothing (today's single-device path)
``tensor``                      ``tensor_parallel``        heads, MLP width, vocabulary, experts'
                                                           width, MLA latent cache positions
``expert`` (with or without     ``tensor_expert_parallel`` as tensor, plus whole experts over
``tensor``)                                                ``expert`` (tokens dispatched to them)
``data`` (with or without       ``data_tensor``            batch rows over ``data``, tensor
``tensor``)                                                parallel within
``data`` and ``expert``         refused                    (no rules table for it yet)
==============================  =========================  ====================================

``stage`` (pipeline parallelism) composes with every row: each table maps the logical ``stage``
axis (the leading axis of pipeline-stacked layers, ``dayzero.model.pipeline``) to the ``stage``
mesh axis, and the rest of the table applies within a stage.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MESH_AXES, MeshError, parse_mesh


def rules_for_mesh(axes: Mapping[str, int]) -> R.Rules:
    """The rules strategy for a mesh with these axis sizes (table in the module docstring)."""
    data, tensor, expert = (int(axes.get(a, 1)) for a in ("data", "tensor", "expert"))
    if data > 1 and expert > 1:
        raise MeshError(
            f"mesh data={data} x expert={expert} is not supported; use data x tensor for dense "
            "models or tensor x expert for Mixture-of-Experts models"
        )
    if expert > 1:
        return R.tensor_expert_parallel()
    if data > 1:
        return R.data_tensor()
    if tensor > 1:
        return R.tensor_parallel()
    return R.single_device()


@dataclasses.dataclass(frozen=True)
class Placement:
    """A device mesh and the rules that map logical axes onto it (hashable: usable as a jit static)."""

    mesh: Mesh
    rules: R.Rules

    @property
    def axes(self) -> dict[str, int]:
        """The mesh's axis sizes, e.g. ``{"data": 1, "tensor": 8, "expert": 1}``."""
        return {a: int(s) for a, s in self.mesh.shape.items()}

    def shardings(self, specs: Any) -> Any:
        """A ``NamedSharding`` tree for a tree of abstract declarations (weights or cache)."""
        return R.weight_shardings(specs, self.rules, self.mesh)

    def sharding(self, axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None) -> NamedSharding:
        """The sharding of one array whose dimensions carry the logical ``axes``."""
        return NamedSharding(self.mesh, R.spec_for(axes, self.rules, self.mesh, shape))

    def replicated(self) -> NamedSharding:
        """Whole on every device of the mesh."""
        return NamedSharding(self.mesh, PartitionSpec())

    def replicate(self, value: Any) -> jax.Array:
        """A host value as a global array replicated over the mesh.

        Every process must pass the same value (as in any multi-controller program). Built from
        a callback rather than ``device_put`` so that multi-process runs need no equality check
        (a collective) per call; typed PRNG keys go through their raw key data.
        """
        if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(value)
            return jax.random.wrap_key_data(self.replicate(np.asarray(jax.random.key_data(value))), impl=impl)
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, self.replicated(), lambda index: host[index])


def placement_for(axes: Mapping[str, int], devices: list | None = None) -> Placement | None:
    """The placement for a mesh of these sizes; None (the single-device path) when all are 1."""
    if math.prod(int(axes.get(a, 1)) for a in MESH_AXES) == 1 and all(int(s) >= 1 for s in axes.values()):
        return None
    rules = rules_for_mesh(axes)
    return Placement(R.make_mesh(axes, devices), rules)


def placement_from_text(text: str | None) -> Placement | None:
    """``--mesh tensor=4,data=2`` -> its :class:`Placement` (None without ``--mesh`` or for 1 device)."""
    return placement_for(parse_mesh(text))
