"""How the forward pass uses a device mesh beyond laying out its arrays.

Most of the model runs on a mesh without knowing it: weights and caches carry their shardings
(from their logical axes) and XLA partitions the computation. Two blocks write their collectives
by hand inside ``jax.shard_map``, and take a :class:`Parallel` to do so:

- MoE, when the rules split ``experts`` over a mesh axis of size > 1: tokens are dispatched to
  the devices owning their experts (``dayzero.model.moe_parallel``: ``ragged_all_to_all`` on
  GPU/TPU, its emulation by dense ``all_to_all`` on CPU; buffers sized by :meth:`Parallel.capacity`);
- multi-head latent attention, when the rules split ``latent_seq`` (the latent cache's
  positions): each device attends over its own slice of the cache and the partial softmaxes are
  merged (``dayzero.model.mla_parallel``), so the cache is never gathered.

Pipeline parallelism (``dayzero.model.pipeline``) runs whole stages inside a ``shard_map`` manual
over ``stage``; the blocks above then nest their own ``shard_map`` in it, over
:meth:`Parallel.shard_mesh`.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
from jax.sharding import AbstractMesh, Mesh

from dayzero.sharding.placement import Placement


@dataclasses.dataclass(frozen=True)
class Parallel:
    """A placement plus the options of the hand-written parallel blocks (hashable: a jit static).

    ``capacity_factor``: the most rows one device sends another in the expert-parallel
    dispatch, as a multiple of the average (None: no pair is ever dropped; see
    ``dayzero.model.moe_parallel``). ``impl``: the grouped matmul of the experts
    (``dayzero.model.moe.GroupedMatmul``, None for the platform's default). ``exchange``: how the
    dispatch moves rows (``dayzero.model.moe_parallel.Exchange``, None for the platform's
    default: ragged_all_to_all on GPU/TPU, dense all_to_all on CPU).
    """

    placement: Placement
    capacity_factor: float | None = None
    impl: enum.Enum | None = None
    exchange: enum.Enum | None = None

    def __post_init__(self):
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor {self.capacity_factor} must be > 0 (or None for no drops)")

    def mesh_axis(self, logical: str) -> str | None:
        """The mesh axis the rules split ``logical`` over, if its size is > 1 (else None)."""
        axis = self.placement.rules.mesh_axis(logical)
        return axis if axis is not None and self.placement.mesh.shape[axis] > 1 else None

    def size(self, logical: str) -> int:
        """How many ways ``logical`` is split (1: whole on every device)."""
        axis = self.mesh_axis(logical)
        return 1 if axis is None else int(self.placement.mesh.shape[axis])

    def capacity(self, tokens_per_device: int, experts_per_token: int) -> int:
        """The most rows one device sends one destination device in the expert-parallel dispatch
        (the rows of each dense block; receive buffers hold ep times this)."""
        worst = tokens_per_device * experts_per_token
        if self.capacity_factor is None:
            return worst
        return max(1, min(worst, math.ceil(self.capacity_factor * worst / self.size("experts"))))

    def shard_mesh(self) -> Mesh | AbstractMesh:
        """The mesh a hand-written block passes to ``jax.shard_map``: the placement's, or inside a
        pipeline stage (a ``shard_map`` already manual over ``stage``) the context's abstract mesh,
        which jax requires of a nested ``shard_map`` (the remaining axes become manual there)."""
        context = jax.sharding.get_abstract_mesh()
        if not context.empty and context.manual_axes:
            return context
        return self.placement.mesh
