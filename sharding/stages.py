"""Splitting a stack of decoder layers into contiguous pipeline stages.

A pipeline runs at the pace of its slowest stage, and a stage's weights must fit its devices, so
the split minimises the largest stage's parameter bytes. Stages are contiguous (stage s hands its
activations only to stage s+1) and non-empty (an empty stage would be a device group holding
nothing and adding a tick of latency). :func:`balanced_stages` is exact: a binary search over the
answer (the largest stage's bytes), each candidate checked greedily in one pass, which is optimal
for contiguous splits with non-negative weights.
"""

from __future__ import annotations

from typing import Sequence

from dayzero.sharding.distributed import MeshError


def _fits(layer_bytes: Sequence[int], num_stages: int, cap: int) -> bool:
    """Whether the layers split into at most ``num_stages`` contiguous runs of <= ``cap`` bytes each."""
    runs, used = 1, 0
    for b in layer_bytes:
        if b > cap:
            return False
        if used + b > cap:
            runs, used = runs + 1, 0
        used += b
    return runs <= num_stages


def _greedy_cuts(layer_bytes: Sequence[int], num_stages: int, cap: int) -> list[int]:
    """Stage start indices for a split under ``cap``, leaving enough layers for the later stages.

    Fills each stage up to ``cap`` but closes it early when the layers left would otherwise be fewer
    than the stages left, so every stage is non-empty. A greedy fill from the left that respects
    ``cap`` never needs more stages than the feasibility check counted, and closing a run early only
    lowers its bytes, so the result stays under ``cap``.
    """
    n = len(layer_bytes)
    starts, used = [0], 0
    for i, b in enumerate(layer_bytes):
        stages_left = num_stages - len(starts)  # stages still to open after the current one
        must_close = n - i == stages_left  # layers left == stages left: one layer each from here
        if i > starts[-1] and (used + b > cap or must_close) and stages_left > 0:
            starts.append(i)
            used = 0
        used += b
    return starts


def balanced_stages(layer_bytes: Sequence[int], num_stages: int) -> tuple[range, ...]:
    """Contiguous, non-empty layer ranges, one per stage, minimising the largest stage's bytes.

    ``layer_bytes[i]`` is decoder layer i's parameter bytes (anything non-negative additive works:
    bytes, FLOPs). Raises :class:`MeshError` when there are more stages than layers (a stage would
    be empty) or ``num_stages`` < 1. Ties between equally good splits go to the one whose earlier
    stages are fuller (a deterministic choice).
    """
    n = len(layer_bytes)
    if num_stages < 1:
        raise MeshError(f"a pipeline needs at least 1 stage, got stage={num_stages}")
    if num_stages > n:
        raise MeshError(
            f"--mesh stage={num_stages} is more stages than the model's {n} decoder layers; use stage <= {n}"
        )
    bad = [b for b in layer_bytes if b < 0]
    if bad:
        raise ValueError(f"layer sizes must be >= 0, got {bad[0]}")
    lo, hi = max(layer_bytes), sum(layer_bytes)
    while lo < hi:  # the smallest cap under which num_stages contiguous runs suffice
        mid = (lo + hi) // 2
        if _fits(layer_bytes, num_stages, mid):
            hi = mid
        else:
            lo = mid + 1
    starts = _greedy_cuts(layer_bytes, num_stages, lo) + [n]
    return tuple(range(a, b) for a, b in zip(starts, starts[1:]))
