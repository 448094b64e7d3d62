"""The planner's pipeline (``stage``) meshes and host-memory tiers: arithmetic only.

Pipeline meshes. ``stage=S`` splits the decoder layers into S contiguous runs
as ``model.pipeline.plan_stages`` splits them: the footprint's ``stage_split``); the rest of the
mesh (``tensor``, ``expert``, ``data``) applies within a stage. A device holds its stage's layers'
weights and their KV for every row of its replica, plus the embedding, final norm and head, which
the pipeline keeps whole over ``stage`` (``model.pipeline.staged_specs``: only the layers are
stacked [stage, slot, ...]); a stage mesh's per-device figure is its largest stage's. The
pipeline pads every stage to the largest stage's layer count with zero slots: for layers of
equal size (the only ones ``model.pipeline`` stacks) that is the largest stage's bytes. A decode step sends each micro-batch's
residual (rows x width x itemsize) across every stage boundary; it crosses hosts when the stage
groups span hosts (``planner.spans_hosts``: ``stage`` is the slowest axis of the device order, so
whole stages sit on whole hosts once a stage has a host's devices). A device's collectives
(tensor and expert groups within its stage) are the model's per-step ones for a micro-batch's
rows, times its stage's share of the layers, once per micro-batch (an approximation for the few
that are not per layer, such as the head's).

The bubble: M micro-batches through S stages take M + S - 1 ticks for M ticks of work, so a
fraction (S - 1) / (M + S - 1) of each device's time idles. M is ``Workload.micro_batches``
(``--micro-batches``), by default S (one micro-batch per stage: fewer would idle more, more would
re-read each stage's weights more often per step), made a divisor of the replica's rows as
``model.pipeline.micro_batches`` makes it (the footprint's ``stage_split``).

Host tiers (with ``Workload.host_memory``): what a host's memory holds for its devices, and what
moving it costs over the host link (``Workload.host_bandwidth`` bytes per second per device;
default :data:`HOST_BANDWIDTH`):

- weight offload: when a mesh's device total is over its usable memory, whole decoder layers'
  weights (this device's share) move to the host and stream back each step, through a device
  buffer of two layers (one in use, the next arriving); each decode step (and prefill chunk)
  then reads those bytes over the link: ``offload bytes / bandwidth`` seconds added per step;
- KV swap: the serving engine's swap space (``dayzero serve --swap-space``, default the device
  pool's size): the pages of preempted sequences, copied back instead of recomputed; it costs
  nothing per step, and one sequence's pages (this device's share) over the link per readmission.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from dayzero.sharding import rules as R
from dayzero.sharding.plan_units import Component, device_bytes, logical_ways

FIRST, LAST = "first", "last"  # the stages the layer-less weights live on
# PCIe Gen5 x16 host-to-device copies, measured-typical (64 GB/s theoretical per direction;
# pinned-memory copies reach about 55 GB/s): bytes per second per device.
HOST_BANDWIDTH = 55e9
OFFLOAD_BUFFER_LAYERS = 2  # layers of streamed weights a device holds at once (double buffering)


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """A model's tensors by pipeline part: one tuple per decoder layer, and the tensors only the
    first stage (embedding, vision tower) or only the last (final norm, head) holds."""

    layers: tuple[tuple, ...]
    first: tuple = ()
    last: tuple = ()


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a pipeline step: (S - 1) / (M + S - 1); 0 without stages."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages and micro-batches must be at least 1, got {stages} and {micro_batches}")
    return (stages - 1) / (micro_batches + stages - 1)


def stage_totals(parts: Sequence[dict[str, int]], outer: dict[str, int],
                 ranges: Sequence[range]) -> list[dict[str, int]]:
    """Per stage, per component, the bytes a device of that stage holds: its layers' ``parts``
    (one {component: bytes} per layer) plus ``outer`` (``model.pipeline`` lays the embedding,
    final norm and head out without the stage axis: whole on every stage)."""
    out = []
    for layers in ranges:
        totals: dict[str, int] = {}
        for part in [parts[i] for i in layers] + [outer]:
            for k, v in part.items():
                totals[k] = totals.get(k, 0) + v
        out.append(totals)
    return out


@dataclasses.dataclass(frozen=True)
class HostTier:
    """What a host's memory holds for one mesh and what moving it costs (module docstring).
    Bytes are per device except ``swap_bytes`` and ``host_bytes`` (per host)."""

    host_memory: int  # bytes per host (given)
    usable: int  # of which the plan may fill (the workload's reserve kept free)
    bandwidth: float  # bytes per second per device over the host link
    offload_layers: int  # decoder layers whose weights (this device's share) live on the host
    offload_bytes: int  # those weights, per device
    buffer_bytes: int  # device memory the streaming takes (two of the largest layers), per device
    swap_bytes: int  # the serving engine's KV swap space, per host
    swap_sequence_bytes: int  # one sequence's KV on a device: what a readmission copies back
    devices_per_host: int

    @property
    def host_bytes(self) -> int:
        """Host memory used, per host: every device's offloaded weights and the swap space."""
        return self.offload_bytes * self.devices_per_host + self.swap_bytes

    @property
    def fits(self) -> bool:
        """Whether the host's usable memory holds it."""
        return self.host_bytes <= self.usable

    @property
    def step_seconds(self) -> float:
        """Added to each decode step (and prefill chunk): the offloaded weights over the link."""
        return self.offload_bytes / self.bandwidth

    @property
    def swap_in_seconds(self) -> float:
        """One preempted sequence's pages back onto its devices (each over its own link)."""
        return self.swap_sequence_bytes / self.bandwidth

    def to_json(self) -> dict:
        """A JSON-serialisable summary."""
        return {"host_memory_bytes": self.host_memory, "usable_bytes": self.usable, "host_bytes": self.host_bytes,
                "fits": self.fits, "bandwidth_bytes_per_s": self.bandwidth,
                "offload_layers": self.offload_layers, "offload_bytes_per_device": self.offload_bytes,
                "stream_buffer_bytes_per_device": self.buffer_bytes, "added_seconds_per_step": self.step_seconds,
                "kv_swap_bytes_per_host": self.swap_bytes, "kv_swap_sequence_bytes_per_device":
                self.swap_sequence_bytes, "kv_swap_in_seconds_per_sequence": self.swap_in_seconds}


def host_tier(*, host_memory: int, reserve: float, bandwidth: float, devices_per_host: int, total: int,
              device_usable: int, layer_weight_bytes: Sequence[int], pool_bytes_per_replica: int,
              devices_per_replica: int, kv_per_device: int, rows: int) -> HostTier:
    """The host tier of one mesh. ``total``/``device_usable``: the device's bytes and what it may
    fill; ``layer_weight_bytes``: this device's share of each decoder layer it holds (offloaded
    largest first, the fewest layers that bring the device under ``device_usable`` with the
    streaming buffer; all of them when even that is not enough); the swap space is the replica's
    whole pool (``pool_bytes_per_replica``, the serving default) for each replica on the host;
    ``kv_per_device``/``rows``: one sequence's share on a device."""
    layers = sorted(layer_weight_bytes, reverse=True)
    n, offload, buffer = 0, 0, 0
    if total > device_usable and layers:
        buffer = OFFLOAD_BUFFER_LAYERS * layers[0]
        while n < len(layers) and total - offload + buffer > device_usable:
            offload += layers[n]
            n += 1
    swap = pool_bytes_per_replica * devices_per_host // devices_per_replica
    return HostTier(host_memory, int(host_memory * (1 - reserve)), bandwidth, n, offload, buffer if n else 0, swap,
                    math.ceil(kv_per_device / max(rows, 1)), devices_per_host)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A stage mesh's split: layer ranges, the largest stage's bytes per component (and its
    layers' weight bytes, for the host tier), the micro-batches and a micro-batch's workload."""

    ranges: tuple[range, ...]
    totals: dict[str, int]
    held: tuple[int, ...]  # weight bytes per device of each layer of the largest stage
    micro: int
    step_work: object  # the Workload of a micro-batch's rows (times data): the activations and collectives of one
    micro_rows: int  # rows of one micro-batch
    layers: int

    @classmethod
    def of(cls, model, work, axes: Mapping[str, int], rules: R.Rules) -> "Pipeline":
        """Split ``model`` over ``axes['stage']`` stages (raises MeshError: more stages than layers)."""
        weights = model.layer_weights(work, logical_ways(rules, axes))
        cache = model.layer_cache(work, axes)
        sized = [by_component(w + c, rules, axes) for w, c in zip(weights.layers, cache.layers)]
        layer_weights = [p.get(Component.WEIGHTS.value, 0) + p.get(Component.WEIGHT_SCALES.value, 0) for p in sized]
        rows = -(-work.batch // axes["data"])
        ranges, micro = model.stage_split(work, logical_ways(rules, axes), axes["stage"], rows,
                                          work.micro_batches or axes["stage"])
        outer = weights.first + weights.last + cache.first + cache.last
        per_stage = stage_totals(sized, by_component(outer, rules, axes), ranges)
        big = max(range(len(ranges)), key=lambda s: sum(per_stage[s].values()))
        micro_rows = -(-rows // micro)
        step_work = dataclasses.replace(work, batch=micro_rows * axes["data"])
        return cls(ranges, per_stage[big], tuple(layer_weights[i] for i in ranges[big]), micro, step_work,
                   micro_rows, len(layer_weights))

    @property
    def collective_scale(self) -> tuple[float, float]:
        """A device's share of the model's per-step collectives: its stage's layers, for each of a
        decode step's micro-batches (once for a prefill chunk)."""
        share = max(len(r) for r in self.ranges) / self.layers
        return self.micro * share, share

    def send_bytes(self, model, work) -> tuple[int, int]:
        """Bytes a device hands the next stage: a decode step's micro-batches (``micro`` x their
        rows) and a full prefill chunk's tokens, each token a residual of ``model.residual_width``
        elements at the compute dtype."""
        row = model.residual_width * work.compute_itemsize
        return self.micro * self.micro_rows * row, min(work.prefill_chunk, work.context) * row


def by_component(tensors, rules: R.Rules, axes: Mapping[str, int]) -> dict[str, int]:
    """Bytes per device of ``tensors``, per component."""
    out: dict[str, int] = {}
    for t in tensors:
        out[t.component.value] = out.get(t.component.value, 0) + device_bytes(t, rules, axes)
    return out


def mesh_host_tier(model, work, axes: Mapping[str, int], rules: R.Rules, totals: dict[str, int],
                   pipe: "Pipeline | None") -> HostTier:
    """The host tier of this mesh (``planner_pipeline.host_tier``)."""
    total = sum(totals.values())
    if pipe is not None:
        held = pipe.held
    elif hasattr(model, "layer_weights") and total > work.usable:
        split = model.layer_weights(work, logical_ways(rules, axes))
        held = [sum(device_bytes(t, rules, axes) for t in layer) for layer in split.layers]
    else:
        held = []
    pool = sum(t.count * math.ceil(math.prod(t.shape) * t.itemsize) for t in model.cache(work, axes)
               if t.component is not Component.STATE_SNAPSHOTS)
    kv = totals[Component.KV_CACHE.value] + totals[Component.KV_SCALES.value]
    return host_tier(host_memory=work.host_memory, reserve=work.reserve, bandwidth=work.host_bandwidth,
                     devices_per_host=work.devices_per_host, total=total, device_usable=work.usable,
                     layer_weight_bytes=held, pool_bytes_per_replica=pool,
                     devices_per_replica=axes["tensor"] * axes["expert"] * axes.get("stage", 1),
                     kv_per_device=kv, rows=-(-work.batch // axes["data"]))
