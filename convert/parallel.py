"""Bounded parallel reads for the conversion loop.

:class:`ReadAhead` runs the per-leaf work (read the source tensors, transform, cast, hash) in a
thread pool, in the loop's order. It submits every leaf of the group being assembled plus at
most ``threads`` leaves of the groups after it, so those are read while the current group is
being written, and memory stays one group plus ``threads`` leaves, however large the model.

Each source file's sha256 is submitted to the same pool just before the first leaf that reads
from that file, so the hash and the tensor reads pass over the same pages while they are in the
page cache (a shard is read from disk about once, not once to convert and once to hash). For a
reader that cannot say which file holds a tensor, every file is hashed first.

numpy's file reads and casts and hashlib's updates release the GIL, so the threads overlap.
Once a leaf fails (a bad tensor, an interrupt), no further leaf starts: the error reaches the
loop with at most the leaves already running read after it.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Hashable


class ReadAhead:
    """Leaf results group by group from a bounded pool, and the source files' hashes."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int, items: list[tuple[str, Any]],
                 make: Callable[[Any], Any], files_of: Callable[[Any], list[Path]] | None,
                 files: list[Path], hash_file: Callable[[Path], str] | None):
        self._pool, self._threads, self._make = pool, threads, make
        self._items, self._next = items, 0
        self._queued: deque[tuple[str, Future]] = deque()
        self._files_of = files_of
        self._hash_file = hash_file
        self._hashes: dict[Hashable, Future] = {}
        if hash_file is not None and files_of is None:
            for f in files:
                self._hash(f)
        self._files = files
        self._failed = threading.Event()

    def _run(self, item: Any) -> Any:
        if self._failed.is_set():  # an earlier leaf failed: its error is what the loop reports
            raise CancelledError
        try:
            return self._make(item)
        except BaseException:
            self._failed.set()
            raise

    def _hash(self, file: Path) -> None:
        if self._hash_file is not None and str(file) not in self._hashes:
            self._hashes[str(file)] = self._pool.submit(self._hash_file, file)

    def _fill(self, group: str) -> None:
        """Submit the rest of ``group`` and up to ``threads`` leaves beyond it."""
        ahead = sum(1 for g, _ in self._queued if g != group)
        while self._next < len(self._items):
            g, item = self._items[self._next]
            if g != group:
                if ahead >= self._threads:
                    return
                ahead += 1
            if self._files_of is not None:
                for f in self._files_of(item):
                    self._hash(f)
            self._queued.append((g, self._pool.submit(self._run, item)))
            self._next += 1

    def group(self, group: str) -> list[Any]:
        """The results of ``group``'s items, in order (the groups must be asked for in order)."""
        self._fill(group)
        out = []
        while self._queued and self._queued[0][0] == group:
            out.append(self._queued.popleft()[1].result())
        self._fill(group)  # the next group's first leaves are read while this one is written
        return out

    def file_hashes(self) -> list[str]:
        """sha256 of every source file, in ``files`` order (hashing any no leaf read)."""
        for f in self._files:
            self._hash(f)
        return [self._hashes[str(f)].result() for f in self._files]
