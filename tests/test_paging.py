"""The host-side page allocator and prefix cache (``dayzero.engine.paging``): no jax involved."""

from __future__ import annotations

import pytest

from dayzero.engine.paging import PagePool, PoolExhausted, page_hashes

PAGE = 4


def test_allocate_gives_distinct_pages_until_exhausted():
    pool = PagePool(5)
    pages = [pool.allocate() for _ in range(5)]
    assert sorted(pages) == list(range(5))
    assert pool.available == 0 and pool.in_use == 5
    with pytest.raises(PoolExhausted, match="all 5 pages"):
        pool.allocate()
    pool.release(pages[:2])
    assert pool.available == 2
    assert sorted(pool.allocate() for _ in range(2)) == sorted(pages[:2])


def test_release_more_than_referenced_is_an_error():
    pool = PagePool(2)
    page = pool.allocate()
    pool.release([page])
    with pytest.raises(ValueError, match=f"page {page} released"):
        pool.release([page])


def test_bad_pool_size():
    with pytest.raises(ValueError, match="num_pages=0"):
        PagePool(0)


def test_page_hashes_chain_whole_prefixes():
    tokens = list(range(10))
    hashes = page_hashes(tokens, PAGE)
    assert len(hashes) == 2  # two full pages; the last two tokens are no page yet
    assert hashes == page_hashes(tokens[:8], PAGE) == page_hashes(tokens, PAGE, hashes[:1])
    # The same second block after a different first block is a different prefix.
    other = page_hashes([9, 9, 9, 9] + tokens[4:8], PAGE)
    assert other[1] != hashes[1]
    assert len(set(hashes + other)) == 4


def test_prefix_match_shares_pages_with_reference_counts():
    pool = PagePool(6)
    hashes = page_hashes(list(range(12)), PAGE)
    pages = [pool.allocate() for _ in range(3)]
    for page, h in zip(pages, hashes):
        pool.register(page, h)
    # A second sequence with the same first two blocks, then a different third one.
    other = page_hashes(list(range(8)) + [7, 7, 7, 7], PAGE)
    assert pool.match_prefix(other) == pages[:2]
    assert [int(pool.refcount[p]) for p in pages] == [2, 2, 1]
    pool.release(pages)  # the first sequence ends: its third page stays cached
    assert pool.cached == 1 and pool.available == 4
    assert pool.match_prefix(hashes) == pages  # the cached page is referenced again
    assert pool.cached == 0 and pool.available == 3
    assert pool.match_prefix(page_hashes([5] * 8, PAGE)) == []


def test_least_recently_released_cached_page_is_evicted_first():
    pool = PagePool(3)
    seq_a = page_hashes(list(range(8)), PAGE)
    seq_b = page_hashes(list(range(100, 104)), PAGE)
    a_pages = [pool.allocate(), pool.allocate()]
    b_page = pool.allocate()
    for page, h in zip(a_pages, seq_a):
        pool.register(page, h)
    pool.register(b_page, seq_b[0])
    pool.release(a_pages)  # released tail first: a_pages[1] is the oldest
    pool.release([b_page])
    assert pool.cached == 3 and pool.available == 3
    assert pool.allocate() == a_pages[1]
    assert pool.evictions == 1
    assert pool.match_prefix(seq_a) == [a_pages[0]]  # the head survived its tail
    assert pool.allocate() == b_page  # a_pages[0] is referenced now; b is the only cached page
    assert pool.match_prefix(seq_b) == []
    with pytest.raises(PoolExhausted):
        pool.allocate()


def test_register_keeps_the_first_copy_and_needs_a_reference():
    pool = PagePool(3)
    h = page_hashes(list(range(4)), PAGE)[0]
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, h)
    pool.register(second, h)  # computed twice concurrently: the second stays private
    pool.release([second])
    assert pool.cached == 0 and pool.available == 2  # the private copy went back to the free list
    assert pool.match_prefix([h]) == [first]
    free = pool.allocate()
    pool.release([free])
    with pytest.raises(ValueError, match=f"page {free} is not referenced"):
        pool.register(free, b"x")


def test_clear_cache_frees_cached_pages_only():
    pool = PagePool(2)
    hashes = page_hashes(list(range(8)), PAGE)
    kept, cached = pool.allocate(), pool.allocate()
    pool.register(kept, hashes[0])
    pool.register(cached, hashes[1])
    pool.release([cached])
    pool.clear_cache()
    assert pool.cached == 0 and pool.available == 1
    assert pool.match_prefix(hashes) == [kept]  # a referenced page keeps its registration
