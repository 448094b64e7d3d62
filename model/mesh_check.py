"""Which meshes the engine runs a model on: its placement checks, device-free.

The engine refuses a mesh it cannot run when it is built (``dayzero.engine.runtime``:
``check_placement``, the kernels' head split) or when ``--mesh`` becomes a placement
(``dayzero.sharding.placement.rules_for_mesh``: no rules table for ``data`` x ``expert``). The
planner must never recommend such a mesh, and must not decide it by a copy of those rules. So the
decision lives here, taking only the mesh's axis sizes (no devices): :func:`mesh_refusal` returns
the engine's one-sentence reason or None. ``runtime.check_placement`` and
``runtime._check_kernels_on_mesh`` raise it as a ``RunConfigError``; the planner's footprint
(``dayzero.model.footprint``) records it as a candidate mesh's ``refused``. It lives in ``model``
rather than ``engine`` because the footprint is model code and ``model`` never imports ``engine``.
DeepSeek-V4 is also refused on a ``tensor`` size that does not divide its output groups
(:func:`compressed_split_refusal`).
"""

from __future__ import annotations

from typing import Mapping

from dayzero.kernels import KernelMode
from dayzero.model.config import ModelConfig
from dayzero.model.moe_parallel import check_expert_parallel
from dayzero.sharding.distributed import MESH_AXES, MeshError
from dayzero.sharding.placement import rules_for_mesh


def split_heads(config: ModelConfig) -> list[tuple[str, int]]:
    """The head counts the kernels split over ``tensor`` (kv heads only where they are per head)."""
    return [("query heads", config.num_heads)] + ([] if config.mla is not None else [("kv heads", config.num_kv_heads)])


def kernel_split_refusal(config: ModelConfig, tensor: int, kernels: KernelMode) -> str | None:
    """Why ``kernels`` cannot run on a ``tensor``-way head split (None: they can, or the mode is
    the reference path). The kernels run per device inside ``shard_map`` over the head split:
    each device needs whole kv heads and all the query heads that read them."""
    if kernels is KernelMode.REFERENCE or kernels is KernelMode.AUTO:
        return None
    for what, n in split_heads(config):
        if n % tensor:
            return (f"--kernels {kernels.value} on --mesh tensor={tensor} needs the {n} {what} to split evenly over "
                    f"tensor={tensor}; use a tensor size that divides {n}, or --kernels reference")
    return None


def mesh_refusal(config: ModelConfig, axes: Mapping[str, int],
                 kernels: KernelMode = KernelMode.REFERENCE) -> str | None:
    """The engine's reason for refusing to run ``config`` on a mesh of these axis sizes with
    attention on ``kernels`` (a resolved mode; the reference path has no head-split limit), or
    None when it runs there."""
    sizes = {a: int(axes.get(a, 1)) for a in MESH_AXES}
    try:
        rules_for_mesh(sizes)
    except MeshError as e:
        return str(e)
    ep = sizes["expert"]
    if ep > 1 and config.moe is None:
        return (f"--mesh expert={ep} needs a Mixture-of-Experts model and this one has no experts; "
                f"use tensor={ep}")
    if ep > 1:
        try:
            check_expert_parallel(config.moe.num_experts, ep)
        except ValueError as e:
            return str(e)
    reason = compressed_split_refusal(config, sizes["tensor"])
    return reason if reason is not None else kernel_split_refusal(config, sizes["tensor"], kernels)


def compressed_split_refusal(config: ModelConfig, tensor: int) -> str | None:
    """Why DeepSeek-V4's attention cannot split over ``tensor`` (None: it can, or the model has no
    compressed attention). Its heads split over ``tensor`` in whole output groups: ``o_a`` [g, N*H/g,
    d_g] is laid out by group. A ``tensor`` that does not divide the g groups would leave ``o_a``
    (as large as ``q_b``) whole on every device while the heads around it split (GSPMD computes that
    correctly, at a tensor-fold copy of o_a per layer), so such a mesh is refused instead; g dividing
    evenly also splits the N heads evenly (every group holds N/g whole heads)."""
    cc = config.compressed
    if cc is None or tensor <= 1 or cc.o_groups % tensor == 0:
        return None
    return (f"--mesh tensor={tensor} cannot split DeepSeek-V4's {cc.o_groups} output groups (o_groups, "
            f"{config.num_heads} query heads) evenly; use a tensor size that divides {cc.o_groups} and put the "
            "other devices on expert or data")
