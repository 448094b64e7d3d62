"""Host memory as a second tier of the serving engine's KV pool, for two things:

- **Swap**: a preempted request's pages (and, for models with per-slot states, its slot's states)
  are copied to host memory and copied back into fresh pages when it is readmitted, instead of
  being recomputed from its tokens (``budget`` bytes; ``ServingConfig.swap_bytes``).
- **Host prefix tier**: a cached prefix page the device pool evicts is copied to host memory
  (``paging.HostPrefixCache``, LRU within ``ServingConfig.host_cache_bytes``); a later prefix match
  that misses the device cache but hits the host tier copies the pages back instead of
  recomputing them. Pages only: a model's per-slot states (a hybrid's recurrences, V4's rings)
  belong to a request, not a prefix; their snapshots at page boundaries stay on the device, and
  a host prefix is reused only up to a boundary that has one (``ServingEngine._restorable``).

Both move the same unit: one host *row* per page, all of the page's leaves (every layer; values
and scales of a quantized cache) bit-cast to bytes and concatenated, so a page is one host buffer
whatever the cache layout; a slot's states are one more row. Which axis of each pool leaf holds
pages (or slots) is found once, by declaring the pool twice (``PagedSteps.pool_specs`` with one more
page, one more slot) and seeing which axis grew, so every layout (per-head pools, latent rows,
quantized values and scales, V4's entry pages, a hybrid's state rows) goes through one gather
jit and one scatter jit. Page lists are padded to a power of two (one compile per length bucket):
the gather clips the padding's out-of-range ids and its rows are dropped; the scatter drops them.

Where the backend has the ``pinned_host`` memory kind (XLA:CPU does; the GPU and TPU runtimes
expose it too) the rows stay jax arrays in that memory, with their shardings (page-locked there:
the copies can be DMA transfers); elsewhere they are numpy arrays
(``jax.device_get``). :func:`host_memory_kind` decides, once. Multi-process serving uses neither
(a process holds only its shards).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.paging import HostPrefixCache
from dayzero.model.weights import is_spec

HOST_KINDS = ("auto", "pinned_host", "numpy")


def host_memory_kind(device, requested: str = "auto") -> str:
    """Where host rows live: ``"pinned_host"`` (a jax memory kind) when ``device`` has it and
    ``requested`` is ``"auto"`` or ``"pinned_host"``, else ``"numpy"`` (pageable host memory).
    Asking for ``"pinned_host"`` on a device without it raises."""
    if requested not in HOST_KINDS:
        raise ValueError(f"host memory kind {requested!r} is not one of {', '.join(HOST_KINDS)}")
    has_pinned = "pinned_host" in {m.kind for m in device.addressable_memories()}
    if requested == "pinned_host" and not has_pinned:
        raise ValueError(f"device {device} has no pinned_host memory; use host memory kind 'numpy' or 'auto'")
    return "pinned_host" if has_pinned and requested != "numpy" else "numpy"


def _grown_axes(small, large) -> list[int | None]:
    """Per leaf of two spec trees, the axis whose size differs (None: none does)."""
    a, b = (jax.tree.leaves(t, is_leaf=is_spec) for t in (small, large))
    return [next((i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n), None) for x, y in zip(a, b)]


def _padded(ids: list[int], fill: int) -> np.ndarray:
    n = 1 << max(len(ids) - 1, 0).bit_length()
    return np.asarray(ids + [fill] * (n - len(ids)), np.int32)


def _to_bytes(x: jax.Array) -> jax.Array:
    """[n, ...] -> [n, bytes]: each row's elements bit-cast to bytes."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)


def _from_bytes(b: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """[n, bytes] -> [n, *shape] of ``dtype``: :func:`_to_bytes` undone."""
    item = jnp.dtype(dtype).itemsize
    return jax.lax.bitcast_convert_type(b.reshape((b.shape[0], *shape) + ((item,) if item > 1 else ())), dtype)


@functools.partial(jax.jit, static_argnames=("axes",))
def _gather(leaves, index, *, axes):
    """One row of bytes per id of ``index``: the slices at that id along each leaf's axis in
    ``axes``, concatenated in leaf order. Out-of-range ids clip."""
    parts = [_to_bytes(jnp.moveaxis(jnp.take(x, index, axis=a, mode="clip"), a, 0)) for x, a in zip(leaves, axes)]
    rows = jnp.concatenate(parts, axis=1)
    return tuple(rows[i] for i in range(rows.shape[0]))


@functools.partial(jax.jit, static_argnames=("axes", "layout"), donate_argnums=(0,))
def _scatter(leaves, index, rows, *, axes, layout=None):
    """``leaves`` with their slices at ``index`` (along each leaf's axis in ``axes``) set from
    ``rows``, as :func:`_gather` made them. Out-of-range ids are dropped; ``layout``: the
    leaves' shardings, kept."""
    packed = jnp.stack(rows)
    out, offset = [], 0
    for i, (x, a) in enumerate(zip(leaves, axes)):
        shape = x.shape[:a] + x.shape[a + 1:]
        size = math.prod(shape) * x.dtype.itemsize
        value = jnp.moveaxis(_from_bytes(packed[:, offset : offset + size], shape, x.dtype), 0, a)
        x = x.at[(slice(None),) * a + (index,)].set(value, mode="drop")
        offset += size
        out.append(x if layout is None else jax.lax.with_sharding_constraint(x, layout[i]))
    return out


@dataclasses.dataclass
class Swapped:
    """A request's KV on the host: one row per page of its first ``num_pages`` pages (in
    block-table order), its slot's states as one row (None: the model has none), and the
    positions they hold."""

    rows: list
    states: object | None
    computed: int

    @property
    def num_pages(self) -> int:
        """Pages held."""
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(r.nbytes for r in self.rows) + (0 if self.states is None else self.states.nbytes)


class HostSwap:
    """Copies pages (and slot states) between the device pool of one ``PagedSteps`` and host
    memory: preempted requests within ``budget`` bytes, evicted prefix pages in a host prefix tier
    of ``host_cache`` bytes (0: none). ``kind``: where host rows live (:func:`host_memory_kind`)."""

    def __init__(self, steps, budget: int, host_cache: int = 0, kind: str = "auto"):
        s = steps.serving
        specs = steps.pool_specs
        self.page_axes = tuple(_grown_axes(specs(s.num_pages, s.slots), specs(s.num_pages + 1, s.slots)))
        self.slot_axes = tuple(_grown_axes(specs(s.num_pages, s.slots), specs(s.num_pages, s.slots + 1)))
        self.steps, self.budget, self.used = steps, budget, 0
        # Host bytes per page row and per slot row (checked against the budgets before any copy).
        leaves = jax.tree.leaves(steps.pool)
        per = lambda axes: sum(x.nbytes // x.shape[a] for x, a in zip(leaves, axes) if a is not None)  # noqa: E731
        self._page_bytes, self._slot_bytes = per(self.page_axes), per(self.slot_axes)
        self._layout = None if steps.layout is None else tuple(jax.tree.leaves(steps.layout))
        self.kind = host_memory_kind(next(iter(leaves[0].sharding.device_set)), kind)
        # A tier smaller than one page could hold nothing.
        self.prefixes = HostPrefixCache(host_cache) if host_cache >= self._page_bytes else None

    # ---- swap ----------------------------------------------------------------------------------

    def out(self, pages: list[int], computed: int, slot: int) -> Swapped | None:
        """Copy ``pages`` (holding ``computed`` positions) and slot ``slot``'s states to the host;
        None (nothing copied) when they would not fit the budget (known before copying)."""
        if not pages or self.used + len(pages) * self._page_bytes + self._slot_bytes > self.budget:
            return None
        states = self._rows_out([slot], slot=True)[0] if self._slot_bytes else None
        swapped = Swapped(self._rows_out(pages), states, computed)
        self.used += swapped.nbytes
        return swapped

    def into(self, swapped: Swapped, pages: list[int], slot: int, skip: int = 0) -> None:
        """Copy ``swapped`` back into ``pages`` and slot ``slot``, but its first ``skip`` pages
        (``pages`` already holds those: found in the device's prefix cache); frees its budget."""
        self._rows_in(pages[skip : swapped.num_pages], swapped.rows[skip:])
        if swapped.states is not None:
            self._rows_in([slot], [swapped.states], slot=True)
        self.release(swapped)

    def release(self, swapped: Swapped) -> None:
        """Forget ``swapped`` (its request was readmitted or cancelled)."""
        self.used -= swapped.nbytes

    # ---- host prefix tier ----------------------------------------------------------------------

    def spill(self, evicted: list[tuple[int, bytes]]) -> int:
        """Copy the prefix pages the device pool evicts (``(page, prefix hash)`` pairs, before
        anything overwrites them) into the host prefix tier, but those it holds already; returns
        the number copied."""
        if self.prefixes is None:
            return 0
        new = [(page, h) for page, h in evicted if h not in self.prefixes]
        for (_, h), row in zip(new, self._rows_out([page for page, _ in new])):
            self.prefixes.put(h, row)
        return len(new)

    def match(self, hashes: list[bytes]) -> list:
        """Host rows of the longest leading run of ``hashes`` the host prefix tier holds."""
        return [] if self.prefixes is None else self.prefixes.match(hashes)

    def fill(self, pages: list[int], rows: list) -> None:
        """Copy host prefix rows (from :meth:`match`) into ``pages``."""
        self._rows_in(pages, rows)

    def warmup(self) -> int:
        """Compile every copy up front (a gather and a scatter per page-count bucket up to one
        sequence's pages, and the slot's), on out-of-range ids: nothing is read or written that
        matters. Returns the number of programs."""
        s = self.steps.serving
        largest = len(_padded([0] * s.pages_for(s.max_context), 0))
        shapes = [(False, 1 << i) for i in range(largest.bit_length())] + ([(True, 1)] if self._slot_bytes else [])
        for slot, size in shapes:
            nowhere = [self._axes(slot)[1]] * size
            self._rows_in(nowhere, self._rows_out(nowhere, slot), slot)
        return 2 * len(shapes)

    def _axes(self, slot: bool) -> tuple[tuple, int]:
        """The axes copied and the out-of-range id padding uses: of the slots or of the pages."""
        s = self.steps.serving
        return (self.slot_axes, s.slots) if slot else (self.page_axes, s.num_pages)

    # ---- copies --------------------------------------------------------------------------------

    def _rows_out(self, ids: list[int], slot: bool = False) -> list:
        """Host rows of pages (``slot``: slots) ``ids``: one gather, one transfer."""
        if not ids:
            return []
        axes, fill = self._axes(slot)
        leaves = [x for x, a in zip(jax.tree.leaves(self.steps.pool), axes) if a is not None]
        rows = _gather(leaves, self.steps._host(_padded(list(ids), fill)), axes=tuple(a for a in axes if a is not None))
        rows = list(rows[: len(ids)])  # the padding's rows are never copied
        if self.kind == "numpy":
            return list(jax.device_get(rows))
        return list(jax.device_put(rows, [r.sharding.with_memory_kind(self.kind) for r in rows]))

    def _rows_in(self, ids: list[int], rows: list, slot: bool = False) -> None:
        """Scatter host ``rows`` into pages (``slot``: slots) ``ids``: one transfer, one scatter."""
        if not ids:
            return
        if self.kind != "numpy":
            rows = jax.device_put(list(rows), [r.sharding.with_memory_kind("device") for r in rows])
        axes, fill = self._axes(slot)
        index = _padded(list(ids), fill)  # out of range: dropped by the scatter
        rows = list(rows) + [rows[-1]] * (len(index) - len(rows))
        # Only the copied leaves go in: the others (the pool's block tables and lengths, whose
        # shapes follow the last step) would make every call another program.
        leaves, tree = jax.tree.flatten(self.steps.pool)
        copied = [i for i, a in enumerate(axes) if a is not None]
        written = _scatter([leaves[i] for i in copied], self.steps._host(index), tuple(rows),
                           axes=tuple(axes[i] for i in copied),
                           layout=None if self._layout is None else tuple(self._layout[i] for i in copied))
        for i, x in zip(copied, written):
            leaves[i] = x
        self.steps.pool = jax.tree.unflatten(tree, leaves)
