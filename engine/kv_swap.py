"""Host memory as a second tier of the serving engine's KV pool: a preempted request's pages (and,
for models with per-slot states, its slot's states) are copied to host memory and copied back
into fresh pages when it is readmitted, instead of being recomputed from its tokens.

Which axis of each pool leaf holds pages (or slots) is found once, by declaring the pool twice
(``paged_cache_specs`` with one more page, one more slot) and seeing which axis grew, so every
cache layout (per-head pools, latent rows, quantized values and scales, V4's entry pages, a
hybrid's state rows) is handled by one gather and one scatter. The page lists are padded to a
power of two (one compile per length bucket): the gather clips the padding's out-of-range ids
and the host copy drops those rows; the scatter drops them.

The host copies are numpy arrays (``jax.device_get``). ``budget`` bytes of them are kept at most
(``ServingConfig.swap_bytes``; default the device pool's size): a request that would not fit is
recomputed as before. Multi-process serving recomputes (a process holds only its shards).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.model.paged_cache import paged_cache_specs
from dayzero.model.weights import is_spec


def _grown_axes(small, large) -> list[int | None]:
    """Per leaf of two spec trees, the axis whose size differs (None: none does)."""
    a, b = (jax.tree.leaves(t, is_leaf=is_spec) for t in (small, large))
    return [next((i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n), None) for x, y in zip(a, b)]


def _padded(ids: list[int], fill: int) -> np.ndarray:
    n = 1 << max(len(ids) - 1, 0).bit_length()
    return np.asarray(ids + [fill] * (n - len(ids)), np.int32)


@functools.partial(jax.jit, static_argnames=("page_axes", "slot_axes"))
def _take(leaves, pages, slot, *, page_axes, slot_axes):
    out = []
    for x, p, s in zip(leaves, page_axes, slot_axes):
        if p is not None:
            out.append(jnp.take(x, pages, axis=p, mode="clip"))
        elif s is not None:
            out.append(jnp.take(x, slot[None], axis=s, mode="clip"))
    return out


@functools.partial(jax.jit, static_argnames=("page_axes", "slot_axes", "layout"), donate_argnums=(0,))
def _put(leaves, pages, slot, values, *, page_axes, slot_axes, layout=None):
    out, it = [], iter(values)
    for i, (x, p, s) in enumerate(zip(leaves, page_axes, slot_axes)):
        axis, index = (p, pages) if p is not None else (s, slot[None])
        if axis is not None:
            x = x.at[(slice(None),) * axis + (index,)].set(next(it).astype(x.dtype), mode="drop")
        out.append(x if layout is None else jax.lax.with_sharding_constraint(x, layout[i]))
    return out


@dataclasses.dataclass
class Swapped:
    """A request's KV on the host: its first ``len(pages)`` pages' contents (in block-table order),
    its slot's states, and the positions they hold."""

    values: list[np.ndarray]
    computed: int
    num_pages: int

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(v.nbytes for v in self.values)


class HostSwap:
    """Copies requests' pages (and slot states) between the device pool of one ``PagedSteps`` and
    host memory, within ``budget`` bytes."""

    def __init__(self, steps, budget: int):
        s, c = steps.serving, steps.config
        specs = lambda pages, slots: paged_cache_specs(c, pages, s.page_size, kv_quant=steps.run.kv_cache,  # noqa: E731
                                                       state_slots=slots)
        self.page_axes = tuple(_grown_axes(specs(s.num_pages, s.slots), specs(s.num_pages + 1, s.slots)))
        self.slot_axes = tuple(_grown_axes(specs(s.num_pages, s.slots), specs(s.num_pages, s.slots + 1)))
        # The page axis of each leaf copied (None for a slot-state leaf), in the order they are copied.
        self._copied = [p for p, q in zip(self.page_axes, self.slot_axes) if p is not None or q is not None]
        self.steps, self.budget, self.used = steps, budget, 0
        # Host bytes per swapped page and per slot (checked against the budget before any copy).
        leaves = jax.tree.leaves(steps.pool)
        per = lambda axes: sum(x.nbytes // x.shape[a] for x, a in zip(leaves, axes) if a is not None)  # noqa: E731
        self._page_bytes, self._slot_bytes = per(self.page_axes), per(self.slot_axes)
        self._layout = None if steps.layout is None else tuple(jax.tree.leaves(steps.layout))

    def out(self, pages: list[int], computed: int, slot: int) -> Swapped | None:
        """Copy ``pages`` (holding ``computed`` positions) and slot ``slot``'s states to the host;
        None (nothing copied) when they would not fit the budget (known before copying)."""
        if not pages or self.used + len(pages) * self._page_bytes + self._slot_bytes > self.budget:
            return None
        steps = self.steps
        host = jax.device_get(_take(jax.tree.leaves(steps.pool), *self._indices(pages, slot),
                                    page_axes=self.page_axes, slot_axes=self.slot_axes))
        values = [np.asarray(v).take(np.arange(len(pages)), axis=a) if a is not None else np.asarray(v)
                  for v, a in zip(host, self._copied)]
        swapped = Swapped(values, computed, len(pages))
        self.used += swapped.nbytes
        return swapped

    def into(self, swapped: Swapped, pages: list[int], slot: int) -> None:
        """Copy ``swapped`` back into the first of ``pages`` and slot ``slot``; frees its budget."""
        steps = self.steps
        leaves, tree = jax.tree.flatten(steps.pool)
        index, slot_index = self._indices(pages[: swapped.num_pages], slot)
        values = [self._pad(v, a, len(index)) for v, a in zip(swapped.values, self._copied)]
        leaves = _put(leaves, index, slot_index, values, page_axes=self.page_axes, slot_axes=self.slot_axes,
                      layout=self._layout)
        steps.pool = jax.tree.unflatten(tree, leaves)
        self.release(swapped)

    def release(self, swapped: Swapped) -> None:
        """Forget ``swapped`` (its request was readmitted or cancelled)."""
        self.used -= swapped.nbytes

    def _indices(self, pages: list[int], slot: int) -> tuple:
        out_of_range = self.steps.serving.num_pages  # padding: clipped by the gather, dropped by the scatter
        return self.steps._host((_padded(list(pages), out_of_range), np.int32(slot)))

    @staticmethod
    def _pad(value: np.ndarray, axis: int | None, n: int) -> np.ndarray:
        if axis is None:
            return value
        widths = [(0, 0)] * value.ndim
        widths[axis] = (0, n - value.shape[axis])
        return np.pad(value, widths)
