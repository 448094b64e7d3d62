"""Multi-host start-up and mesh specifications shared by every command.

A multi-host run is JAX's multi-controller runtime: every process runs the same program and
joins through a coordinator (process 0's address). On CPU the cross-process collectives run over
gloo. A process that dies is noticed by the others through the runtime's heartbeats: after
``HEARTBEAT_TIMEOUT_S`` without one, the survivors' runtime ends them with an error naming the
missing task, instead of letting them wait in a collective forever. A process that never
arrives makes the others give up after ``INIT_TIMEOUT_S``. (``dayzero launch-local`` also stops
the rest as soon as one of its processes fails.)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

MESH_AXES = ("data", "tensor", "expert", "stage")
INIT_TIMEOUT_S = 120
HEARTBEAT_TIMEOUT_S = 20
SHUTDOWN_TIMEOUT_S = 30


class MeshError(ValueError):
    """A mesh or multi-host setting that cannot be used."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-controller run (all None: a single process)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def is_multi_process(self) -> bool:
        """True when any multi-host option was given."""
        return any(v is not None for v in (self.coordinator, self.num_processes, self.process_id))


def initialize(group: ProcessGroup) -> None:
    """Join the multi-controller JAX runtime (gloo collectives on CPU); no-op for one process."""
    if not group.is_multi_process:
        return
    missing = [
        flag
        for flag, value in (
            ("--coordinator", group.coordinator),
            ("--num-processes", group.num_processes),
            ("--process-id", group.process_id),
        )
        if value is None
    ]
    if missing:
        raise MeshError(f"multi-host runs need all of --coordinator, --num-processes and --process-id; missing {', '.join(missing)}")
    if not 0 <= group.process_id < group.num_processes:
        raise MeshError(f"--process-id {group.process_id} is outside [0, {group.num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
        initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )


def is_primary_process() -> bool:
    """True in process 0 (and in a single-process run): the one that writes shared files."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process of a multi-host run gets here (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def shared_token(token: str) -> str:
    """Process 0's ``token`` (ASCII) in every process, e.g. one temporary directory name for all."""
    if jax.process_count() == 1:
        return token
    from jax.experimental import multihost_utils

    raw = np.frombuffer(token.encode("ascii"), np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw))).decode("ascii")


def parse_mesh(text: str | None) -> dict[str, int]:
    """Parse ``data=2,tensor=4`` into ``{"data": 2, "tensor": 4}`` (empty for None)."""
    if not text:
        return {}
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
            raise MeshError(
                f"bad mesh entry {part!r} in --mesh {text!r}; write AXIS=N with AXIS one of "
                f"{', '.join(MESH_AXES)} and N >= 1, e.g. --mesh tensor=4"
            )
        if name in axes:
            raise MeshError(f"mesh axis {name!r} is given twice in --mesh {text!r}")
        axes[name] = int(size)
    return axes
