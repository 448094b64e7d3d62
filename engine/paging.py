"""Host-side bookkeeping of the paged KV cache: page allocation and the prefix cache.

The device holds one pool of ``num_pages`` pages per layer (``dayzero.model.paged_cache``); this
module decides which page holds what. Pure Python, no jax: it is unit-tested on its own.

- Every page has a reference count: the number of running sequences whose block table holds it.
- A page nobody references is either *free* (its contents are worthless) or *cached*: it is a full
  page whose tokens, and every token before them in its sequence, are known, so a later sequence
  with the same prefix can reuse it instead of computing it again (``match_prefix``).
- Cached pages are kept until a page is needed and no free one is left; then the least recently
  used cached page is evicted (forgotten and reused).

A page is known by a chained hash: the hash of its tokens together with the hash of the page
before it, so equal hashes mean equal whole prefixes, not just equal blocks. Only full pages
are ever shared, and a sequence never writes into a page it did not allocate itself (it writes
at its own length, past every shared full page), so shared pages are never modified.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Sequence

import numpy as np


class PoolExhausted(RuntimeError):
    """No free page and no cached page left to evict."""


def page_hashes(tokens: Sequence[int], page_size: int, previous: Sequence[bytes] = ()) -> list[bytes]:
    """Chained hashes of every full page of ``tokens``.

    ``previous``: hashes already computed for the first pages (only the pages after them are
    hashed). A 128-bit BLAKE2 digest: accidental collisions (which would silently reuse a wrong
    page) are not a practical concern.
    """
    hashes = list(previous)
    for i in range(len(hashes), len(tokens) // page_size):
        block = np.asarray(tokens[i * page_size : (i + 1) * page_size], np.int64).tobytes()
        parent = hashes[-1] if hashes else b""
        hashes.append(hashlib.blake2b(parent + block, digest_size=16).digest())
    return hashes


class PagePool:
    """Allocator of ``num_pages`` KV pages with reference counts and a least-recently-used
    prefix cache.

    >>> pool = PagePool(num_pages=4)
    >>> a = pool.allocate(); pool.register(a, b"h0"); pool.release([a])
    >>> pool.match_prefix([b"h0", b"h1"]) == [a]
    True
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be at least 1")
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int32)
        self._free = collections.deque(range(num_pages))
        # Unreferenced full pages that keep their contents, oldest use first.
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page holding that block
        self._hash_of: dict[int, bytes] = {}  # page -> its prefix hash (registered pages only)
        self.evictions = 0
        # Called with the (page, prefix hash) pairs an allocation evicts (see ``allocate_many``).
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    # ---- counts ------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Pages an allocation can get now: the free ones plus the evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def in_use(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.available

    @property
    def cached(self) -> int:
        """Unreferenced pages kept for prefix reuse."""
        return len(self._cached)

    # ---- allocation --------------------------------------------------------------------------

    def allocate(self) -> int:
        """A page for the caller's exclusive use (reference count 1).

        Takes a free page if there is one, else evicts the least recently used cached page.
        Raises :class:`PoolExhausted` when every page is referenced.
        """
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """``n`` pages as :meth:`allocate` takes them, or none (:class:`PoolExhausted`) when fewer
        are available. The cached pages evicted for them are handed to ``on_evict`` (if set) as
        ``(page, prefix hash)`` pairs, oldest first, in one call before this returns: their
        contents are intact until the caller writes the pages (the host prefix tier copies them)."""
        if n > self.available:
            raise PoolExhausted(f"all {self.num_pages} pages are in use" if not self.available else
                                f"{n} pages asked for, {self.available} available")
        pages, evicted = [], []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                prefix_hash = self._hash_of.pop(page)
                del self._page_of[prefix_hash]
                evicted.append((page, prefix_hash))
                self.evictions += 1
            self.refcount[page] = 1
            pages.append(page)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages become cached (if registered) or free.

        Pass a sequence's pages in order: they are released last page first, so that when the
        cache is later evicted, the tail of a prefix goes before its head (a head is shared by
        more sequences than its tails).
        """
        for page in reversed(pages):
            if self.refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than it was referenced")
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if page in self._hash_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    # ---- prefix cache ------------------------------------------------------------------------

    def register(self, page: int, prefix_hash: bytes) -> None:
        """Record that ``page`` (referenced by the caller) now holds the full block ``prefix_hash``.

        If another page already holds that block (two sequences computed the same prefix at the
        same time), the first one stays the cached copy and this page stays private.
        """
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is not referenced; only a page in use can be registered")
        if prefix_hash in self._page_of or page in self._hash_of:
            return
        self._page_of[prefix_hash] = page
        self._hash_of[page] = prefix_hash

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages holding the longest cached prefix of the blocks ``hashes``, each referenced
        once more for the caller (release them when done)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.refcount[page] == 0:
                del self._cached[page]
            self.refcount[page] += 1
        return pages

    def clear_cache(self) -> None:
        """Forget every cached prefix (their pages become free); referenced pages keep theirs."""
        for page in list(self._cached):
            del self._page_of[self._hash_of.pop(page)]
            self._free.append(page)
        self._cached.clear()


class SnapshotPool:
    """Which prefix each of ``capacity`` state-snapshot rows holds, least recently used first.

    A model with per-sequence states beside its pages (a linear-attention hybrid, DeepSeek-V4)
    can reuse a cached prefix only where it also has the states as they were at the prefix's
    end. The serving engine copies a slot's states into a snapshot row when a prefill chunk ends
    on a page boundary, keyed by that page's chained hash (states depend only on the tokens
    before the boundary, which the hash names), and restores them when a later request reuses
    the prefix up to there. Rows are reused least recently used first.

    >>> snaps = SnapshotPool(capacity=1)
    >>> snaps.claim(b"h0"), snaps.lookup(b"h0"), snaps.claim(b"h1"), snaps.lookup(b"h0")
    (0, 0, 0, None)
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be at least 1")
        self._row_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))

    def lookup(self, prefix_hash: bytes) -> int | None:
        """The row holding the states at the end of ``prefix_hash``'s page, or None."""
        row = self._row_of.get(prefix_hash)
        if row is not None:
            self._row_of.move_to_end(prefix_hash)
        return row

    def claim(self, prefix_hash: bytes) -> int | None:
        """A row to copy the states at the end of ``prefix_hash``'s page into (a free one, else the
        least recently used one's), or None if a row holds them already."""
        if prefix_hash in self._row_of:
            self._row_of.move_to_end(prefix_hash)
            return None
        row = self._free.pop() if self._free else self._row_of.popitem(last=False)[1]
        self._row_of[prefix_hash] = row
        return row

    def __len__(self) -> int:
        return len(self._row_of)


class HostPrefixCache:
    """Prefix pages the device pool evicted, kept in host memory: the serving engine's second
    prefix-cache tier (``dayzero.engine.kv_swap``). Maps a page's chained prefix hash to its host
    row (anything with ``nbytes``), within ``budget`` bytes; the least recently used rows go first.

    >>> tier = HostPrefixCache(budget=8)
    >>> tier.put(b"h0", np.zeros(8, np.uint8)), len(tier.match([b"h0", b"h1"]))
    (True, 1)
    """

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"budget={budget} must be at least 0 bytes")
        self.budget, self.used, self.evictions = budget, 0, 0
        self._rows: collections.OrderedDict[bytes, object] = collections.OrderedDict()

    def __contains__(self, prefix_hash: bytes) -> bool:
        return prefix_hash in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, prefix_hash: bytes, row) -> bool:
        """Keep ``row`` as the page ``prefix_hash`` (most recently used), evicting the least
        recently used rows to make room; False (nothing kept) if it is larger than the budget."""
        if prefix_hash in self._rows:
            self._rows.move_to_end(prefix_hash)
            return True
        if row.nbytes > self.budget:
            return False
        while self.used + row.nbytes > self.budget:
            _, old = self._rows.popitem(last=False)
            self.used -= old.nbytes
            self.evictions += 1
        self._rows[prefix_hash] = row
        self.used += row.nbytes
        return True

    def match(self, hashes: Sequence[bytes]) -> list:
        """The rows of the longest leading run of ``hashes`` held, marked used (the head of a
        prefix most recently: it is shared by more sequences than its tail, so it goes last)."""
        found = []
        for h in hashes:
            if h not in self._rows:
                break
            found.append(h)
        for h in reversed(found):
            self._rows.move_to_end(h)
        return [self._rows[h] for h in found]
