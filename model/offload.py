"""Weight offload: decoder layers' weights held in host memory, streamed to the device ahead of use.

A model whose weights exceed device memory still runs when only the layer being computed (and
the one after it) has to be on the device. :func:`offload_layers` moves ``Weights.layers`` into a
host memory kind (``pinned_host`` where the backend has it, else ``unpinned_host``), keeping each
array's sharding on a mesh: same mesh, same ``PartitionSpec``, only the memory kind changes. The
embedding, output head and final norm stay on the device (they are used at both ends of every
step). The jitted ``forward`` then brings each layer over with :func:`stream_layer`.

Prefetch is a rolling one-ahead fetch: while layer ``i`` computes, layer ``i + 1``'s transfer is in
flight. The transfer of layer ``i + 1`` is tied (``optimization_barrier``) to the hidden state that
enters layer ``i``, so it cannot start before layer ``i - 1`` has finished. Why not simply issue
every layer's transfer up front in the order of use: nothing would then stop XLA's scheduler
from starting all copies at once, and every layer could be resident together (no memory saved).
Tied this way, at most two layers' weights are on the device at a time, and the copy of the next
layer still overlaps the current layer's compute. XLA's host-offload pass accepts an
``optimization_barrier`` on the path from a host parameter to its move to the device.

On XLA:CPU the device and host memory kinds are the same RAM and XLA reads host-space parameters
in place, so the streaming is structural only there (the compiled program's entry layout marks the
layers' parameters as memory space 5, host; :func:`device_resident_bytes` reads it; the barriers
are dropped, and the compiled step has the same operations as with the weights on the device). On
GPU/TPU the moves become host-to-device copies that the scheduler overlaps with compute (not
measured here: no accelerator was available when this was written).

When no layer leaf is in host memory, :func:`stream_layer` returns the layer as is and adds no
operation: the traced program is the same as without this module.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import numpy as np

HOST_KINDS = ("pinned_host", "unpinned_host")  # in order of preference
# XLA's memory space number of host memory, as layouts print it: "{1,0:S(5)}".
HOST_MEMORY_SPACE = 5


class OffloadError(ValueError):
    """Weights cannot be offloaded as asked (no host memory kind, a bad kind, another mesh)."""


def _devices(weights: Any, placement: Any) -> list:
    """The devices the weights live on: the placement's mesh, else those of the first array leaf."""
    if placement is not None:
        return list(placement.mesh.devices.flat)
    for leaf in jax.tree.leaves(weights):
        if isinstance(leaf, jax.Array):
            return list(leaf.sharding.device_set)
    return [jax.devices()[0]]


def host_memory_kind(devices: list, memory_kind: str | None = None) -> str:
    """The host memory kind to hold offloaded weights on ``devices``: ``memory_kind`` when given
    (checked), else ``pinned_host`` where every device has it, else ``unpinned_host``."""
    kinds = set.intersection(*({m.kind for m in d.addressable_memories()} for d in devices))
    platform = devices[0].platform
    if memory_kind is not None:
        if memory_kind not in HOST_KINDS or memory_kind not in kinds:
            raise OffloadError(
                f"memory_kind={memory_kind!r} is not a host memory kind of the {platform} backend "
                f"(its devices have {', '.join(sorted(kinds))}); pass one of "
                f"{', '.join(k for k in HOST_KINDS if k in kinds) or 'none: it has no host memory kind'}")
        return memory_kind
    for kind in HOST_KINDS:
        if kind in kinds:
            return kind
    raise OffloadError(
        f"the {platform} backend has no host memory kind (its devices have {', '.join(sorted(kinds))}), "
        "so weights cannot be offloaded there; run without weight offload")


def _host_sharding(leaf: Any, placement: Any, devices: list, kind: str):
    """Where one leaf goes: its own sharding with only the memory kind changed."""
    if isinstance(leaf, jax.Array):
        if placement is not None and getattr(leaf.sharding, "mesh", None) != placement.mesh:
            raise OffloadError(
                f"a layer weight of shape {leaf.shape} is laid out as {leaf.sharding}, not on the placement's "
                f"mesh {dict(placement.mesh.shape)}; lay the weights out with placement.shardings(...) first")
        return leaf.sharding.with_memory_kind(kind)
    if placement is not None:
        raise OffloadError(
            f"a layer weight of shape {np.shape(leaf)} is a host {type(leaf).__name__}, not an array on the "
            f"placement's mesh {dict(placement.mesh.shape)}; lay the weights out with placement.shardings(...) first")
    return jax.sharding.SingleDeviceSharding(devices[0], memory_kind=kind)


def offload_layers(weights: Any, placement: Any = None, memory_kind: str | None = None) -> Any:
    """``weights`` (a :class:`~dayzero.model.weights.Weights`) with every decoder layer's arrays in
    host memory (quantized leaves' values and scales alike); the rest stays where it is.

    ``placement``: the mesh the weights are laid out on (None: one device); each layer array keeps
    its mesh and ``PartitionSpec``, only its memory kind changes. ``memory_kind``: the host kind to
    use (default ``pinned_host``, else ``unpinned_host`` where pinned memory is absent). Raises
    :class:`OffloadError` where the backend has no host memory kind or for an unknown kind.
    """
    devices = _devices(weights, placement)
    kind = host_memory_kind(devices, memory_kind)
    layers = jax.tree.map(lambda x: jax.device_put(x, _host_sharding(x, placement, devices, kind)), weights.layers)
    return weights.replace(layers=layers)


def _on_host(leaf: Any) -> bool:
    """Whether an array (or a tracer of one, inside jit) lives in host memory."""
    return getattr(jax.typeof(leaf), "memory_space", None) == jax.memory.Space.Host


def has_host_leaves(tree: Any) -> bool:
    """Whether any array of ``tree`` lives in host memory."""
    return any(_on_host(x) for x in jax.tree.leaves(tree))


def to_device(tree: Any) -> Any:
    """``tree`` (a layer's weights, ``QuantizedArray`` leaves included) with every host-memory
    array moved to device memory, each keeping its own sharding; arrays already on the device are
    returned untouched (no operation added). For use inside a jitted forward pass."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if _on_host(x) else x, tree)


def _after(tree: Any, ready: jax.Array) -> Any:
    """``tree`` made to depend on ``ready``: an ``optimization_barrier`` over both, so nothing that
    reads the returned tree (a transfer) can start before ``ready`` is computed."""
    return jax.lax.optimization_barrier((ready, tree))[1]


def stream_layer(layers: tuple, i: int, x: jax.Array, ahead: Any = None) -> tuple[Any, Any]:
    """Layer ``i``'s weights on the device, and the transfer of layer ``i + 1`` issued to overlap
    layer ``i``'s compute (rolling one-ahead prefetch; see the module docstring).

    ``x``: the hidden state that enters layer ``i`` (the next layer's transfer waits for it).
    ``ahead``: what the call for layer ``i - 1`` returned second (None for the first layer).
    Returns ``(layer, ahead)``; pass ``ahead`` to the call for layer ``i + 1``. With every layer on
    the device it returns ``(layers[i], None)`` and adds nothing to the program.
    """
    layer = to_device(layers[i]) if ahead is None else ahead
    following = None
    if i + 1 < len(layers) and has_host_leaves(layers[i + 1]):
        following = to_device(_after(layers[i + 1], x))
    return layer, following


# ---- the device budget check ------------------------------------------------------------------------

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")


def _element_bits(dtype: str) -> int:
    """Bits per element of an HLO element type ("f32", "bf16", "s4", "f8e4m3fn", "pred")."""
    if dtype == "pred":
        return 8
    digits = re.search(r"\d+", dtype)
    if digits is None:  # token or an opaque type: no bytes of its own
        return 0
    return int(digits.group())


def _entry_parameters(hlo_text: str) -> str:
    """The parameter part of the entry computation layout: "(f32[4,8]{1,0:S(5)}, s32[2]{0})"."""
    start = hlo_text.find("entry_computation_layout={(")
    if start < 0:
        raise OffloadError("the HLO text has no entry_computation_layout; pass a compiled step "
                           "(jax.jit(f).lower(...).compile()) or its .as_text()")
    start += len("entry_computation_layout={")
    end = hlo_text.find(")->", start)
    return hlo_text[start:end + 1]


def device_resident_bytes(compiled_or_hlo_text: Any) -> int:
    """Bytes of a compiled program's parameters that live in device memory (per device on a mesh:
    the entry layout holds each device's shard), read from its entry computation layout: every
    parameter array not in host memory space ``S(5)``. Use it to check a step fits a device budget."""
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    total = 0
    for dtype, dims, layout in _ARRAY.findall(_entry_parameters(text)):
        if f"S({HOST_MEMORY_SPACE})" in (layout or ""):
            continue
        count = math.prod(int(d) for d in dims.split(",") if d)
        total += -(-count * _element_bits(dtype) // 8)
    return total
