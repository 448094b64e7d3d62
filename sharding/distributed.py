"""Multi-host start-up and mesh specifications shared by every command."""

from __future__ import annotations

import dataclasses

import jax

MESH_AXES = ("data", "tensor", "expert")


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
    )


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
