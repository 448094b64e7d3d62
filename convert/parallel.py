"""Bounded parallel reads for the conversion loop.

:class:`ReadAhead` runs the per-piece work (read the source tensors, transform, cast, hash) in a
thread pool and hands the results back in the loop's order. What it keeps in flight is bounded
twice: by bytes (``budget``: each piece reserves its estimated ``cost`` when submitted, keeps
only the bytes its result holds once made, and frees them when the loop releases it, once it is
written) and by count (``threads`` pieces being made plus two being written). A piece larger than
the budget still runs, alone. So while one piece is written the next ones are read, and memory
stays near the budget however large the model.

Each source file's sha256 is submitted to the same pool just before the first piece that reads
from that file, so the hash and the tensor reads pass over the same pages while they are in the
page cache (a shard is read from disk about once, not once to convert and once to hash). For a
reader that cannot say which file holds a tensor, every file is hashed first.

numpy's file reads and casts and hashlib's updates release the GIL, so the threads overlap.
Once a piece fails (a bad tensor, an interrupt), no further piece starts: the error reaches the
loop with at most the pieces already running read after it.

:func:`schedule` cuts the conversion into those pieces and sizes them from the headers alone
(:class:`LeafSize`): a leaf is one piece, unless it is a stack of experts that needs more than a
``max_memory`` the user gave, which is then cut into slices of experts that fit. Without one the
budget is what the largest leaf needs: about twice the largest tensor (the tensor read and its
transformed copy), so memory follows the largest tensor, never a layer group.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Hashable

import numpy as np

from dayzero.convert import transforms as T
from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map import Combine, Recipe
from dayzero.sharding.planner import PlanError, parse_size


class ReadAhead:
    """Piece results in order from a bounded pool, and the source files' hashes."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int, items: list[Any],
                 make: Callable[[Any], Any], files_of: Callable[[Any], list[Path]] | None,
                 files: list[Path], hash_file: Callable[[Path], str] | None,
                 cost: Callable[[Any], int] = lambda item: 0, held: Callable[[Any], int] = lambda result: 0,
                 budget: int | None = None):
        self._pool, self._threads, self._make = pool, threads, make
        self._items, self._next, self._taken = items, 0, 0
        self._cost, self._held, self._budget = cost, held, budget
        self._queued: deque[Future] = deque()
        self._reserved: dict[int, int] = {}  # submitted, not yet released: bytes each may hold now
        self._lock = threading.Lock()
        self.peak_reserved = 0  # the most bytes reserved at once (for tests and reports)
        self._files_of = files_of
        self._hash_file = hash_file
        self._hashes: dict[Hashable, Future] = {}
        if hash_file is not None and files_of is None:
            for f in files:
                self._hash(f)
        self._files = files
        self._failed = threading.Event()

    def _run(self, index: int) -> Any:
        if self._failed.is_set():  # an earlier piece failed: its error is what the loop reports
            raise CancelledError
        try:
            result = self._make(self._items[index])
        except BaseException:
            self._failed.set()
            raise
        with self._lock:  # the piece's transient buffers are gone; it holds its result only
            if index in self._reserved:
                self._reserved[index] = self._held(result)
        return result

    def _hash(self, file: Path) -> None:
        if self._hash_file is not None and str(file) not in self._hashes:
            self._hashes[str(file)] = self._pool.submit(self._hash_file, file)

    def _fits(self, cost: int) -> bool:
        """True when a piece of ``cost`` may start now (always, when nothing else is in flight)."""
        with self._lock:
            if not self._reserved:
                return True
            if len(self._reserved) >= self._threads + 2:  # threads being made + two being written
                return False
            return self._budget is None or sum(self._reserved.values()) + cost <= self._budget

    def _fill(self) -> None:
        """Submit the next pieces, in order, while they fit."""
        while self._next < len(self._items):
            item = self._items[self._next]
            cost = self._cost(item)
            if not self._fits(cost):
                return
            if self._files_of is not None:
                for f in self._files_of(item):
                    self._hash(f)
            with self._lock:
                self._reserved[self._next] = cost
                self.peak_reserved = max(self.peak_reserved, sum(self._reserved.values()))
            self._queued.append(self._pool.submit(self._run, self._next))
            self._next += 1

    def release(self, index: int) -> None:
        """Item ``index``'s result is gone (written, and no reference to it is left): its bytes
        are free for the pieces after it."""
        with self._lock:
            self._reserved.pop(index, None)

    def take(self, make_room: Callable[[], None]) -> tuple[int, Any]:
        """``(index, result)`` of the next item, in order; its bytes count until the caller
        :meth:`release` s it. When the next item cannot start until results the caller still
        holds are released, ``make_room()`` is called first and must release them all."""
        self._fill()
        if not self._queued:
            make_room()
            self._fill()
        index = self._taken
        self._taken += 1
        return index, self._queued.popleft().result()

    def file_hashes(self) -> list[str]:
        """sha256 of every source file, in ``files`` order (hashing any no piece read)."""
        for f in self._files:
            self._hash(f)
        return [self._hashes[str(f)].result() for f in self._files]


# --- pieces and their budget --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafSize:
    """What making one leaf holds at most, from the headers alone (the read pool's estimate)."""

    stored: int  # bytes of the arrays stored for it (values and scale when quantized)
    part: int  # bytes of its largest source tensor
    count: int  # its source tensors: the experts of a stack, else 1
    floats: int  # bytes of the leaf in float32 (a quantized leaf is read so first)
    quantized: bool
    stacked: bool
    aliased: bool  # the array read is the array stored (no transform, no cast)

    def cost(self, k: int | None = None) -> int:
        """Bytes held while ``k`` of its source tensors (default: all) become stored arrays."""
        k = self.count if k is None else k

        def share(n: int) -> int:  # a slice's share, rounded up
            return -(-n * k // self.count)

        if self.quantized:  # float32 leaf, one source tensor and its copy; values stacked from parts
            return share(self.floats) + 2 * share(self.stored) + self.part + self.floats // self.count
        if self.stacked:  # the stack, filled one read and transformed source tensor at a time
            return share(self.stored) + self.part + self.stored // self.count
        return self.stored if self.aliased else self.stored + self.part

    def least(self) -> int:
        """The least it can be made in: one expert at a time for a stack, else all of it."""
        return self.cost(1) if self.stacked else self.cost()


def stored_names(r: Recipe, quantized: bool) -> list[str]:
    """The arrays stored for a leaf: itself, or its values and scale."""
    return [f"{r.target}/values", f"{r.target}/scale"] if quantized else [r.target]


def leaf_size(r: Recipe, reader: Any, stored: dict[str, tuple[tuple[int, ...], np.dtype]],
              quantized: bool) -> LeafSize:
    """:class:`LeafSize` of the leaf ``r`` makes; ``stored``: ``{name: (shape, dtype)}`` of the
    stored arrays."""
    parts = [math.prod(reader.shape(n)) * np.dtype(reader.dtype(n)).itemsize for n in r.sources]
    names = stored_names(r, quantized)
    elements = math.prod(stored[names[0]][0])
    nbytes = sum(math.prod(stored[n][0]) * np.dtype(stored[n][1]).itemsize for n in names)
    aliased = r.steps == (T.identity,) and np.dtype(reader.dtype(r.sources[0])) == np.dtype(stored[names[0]][1])
    return LeafSize(nbytes, max(parts), len(r.sources), 4 * elements, quantized, r.combine is Combine.STACK, aliased)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One pool task: a whole leaf, or the experts ``[start, stop)`` of a stacked one."""

    recipe: Recipe
    cost: int  # bytes it may hold while made (its reservation in the read pool)
    start: int = 0
    stop: int | None = None  # None: the whole leaf

    @property
    def last(self) -> bool:
        """True for the piece that completes its leaf."""
        return self.stop is None or self.stop == len(self.recipe.sources)

    def sources(self) -> tuple[str, ...]:
        """The source tensors this piece reads."""
        return self.recipe.sources if self.stop is None else self.recipe.sources[self.start:self.stop]


def schedule(recipes: tuple[Recipe, ...], reader: Any, stored: dict[str, tuple[tuple[int, ...], np.dtype]],
             quantized: set[str], max_memory: int | None) -> tuple[list[Piece], int]:
    """``(pieces in order, budget)`` for ``recipes`` (``quantized``: the leaves stored quantized).

    With ``max_memory`` the budget is that, and a stack of experts that needs more is cut into
    slices that fit; by default it is what the largest leaf needs and nothing is cut. Raises
    :class:`ConvertError`, naming the least that would do, when a piece that cannot be cut
    smaller needs more than ``max_memory``.
    """
    sizes = [leaf_size(r, reader, stored, r.target in quantized) for r in recipes]
    if max_memory is None:
        pieces = [Piece(r, size.cost()) for r, size in zip(recipes, sizes)]
        return pieces, max(pc.cost for pc in pieces)
    r, size = max(zip(recipes, sizes), key=lambda rs: rs[1].least())
    least = size.least()
    if least > max_memory:
        what = "one expert of it at a time" if size.stacked else "made whole: it is not a stack of experts"
        raise ConvertError(
            f"--max-memory {max_memory} bytes is less than converting {r.target} needs ({least} bytes, {what}); "
            f"pass --max-memory {math.ceil(least / 2**20)}MiB or more")
    pieces = []
    for r, size in zip(recipes, sizes):
        k = size.count if size.cost() <= max_memory else max(
            k for k in range(1, size.count + 1) if size.cost(k) <= max_memory)
        if k == size.count:
            pieces.append(Piece(r, size.cost()))
        else:
            pieces += [Piece(r, size.cost(min(k, size.count - i)), i, min(i + k, size.count))
                       for i in range(0, size.count, k)]
    return pieces, max_memory


def parse_memory(value: int | str | None) -> int | None:
    """``--max-memory``: bytes, or a size with a unit ("8GiB", "500MB", "64G" binary); None stays None."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        try:
            size = parse_size(str(value))
        except PlanError:
            size = 0
    if size <= 0:
        raise ConvertError(f"--max-memory {value!r} is not a size; write a positive number of bytes with an "
                           "optional unit, e.g. 8GiB, 500MB, 64G (binary) or 1073741824")
    return size
