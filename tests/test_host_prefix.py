"""The host prefix-cache tier (engine/kv_swap.py, ``paging.HostPrefixCache``): cached prefix pages
the device pool evicts are copied to host memory, and a later prefix match that misses the device
cache but hits the host tier copies them back instead of recomputing them.

Oracle: the same requests served with ``host_cache_bytes=0`` (the evicted prefix is recomputed;
the paged engine itself equals ``Engine.generate``: tests/test_serving.py): identical greedy
tokens and logprobs within 1e-5, while the tier's run prefills the shared prefix's pages fewer
tokens (counted by ``ServingStats.prefill_tokens``). The rows live in the ``pinned_host`` memory
kind where the backend has it (XLA:CPU does), numpy otherwise; the tier keeps its byte bound,
least recently used out first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dayzero.engine import serving as serving_module
from dayzero.engine.kv_swap import HostSwap, host_memory_kind
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.paging import HostPrefixCache, PagePool
from dayzero.engine.serving import ServingEngine

PAGE = 8
# 12 pages of 8, sequences of up to 8 pages: two 60-token fillers evict every page of the first.
SMALL = ServingConfig(slots=2, page_size=PAGE, num_pages=12, max_context=64, max_chunk=32, min_chunk=16)
NEW = 4


def _prompts(vocab: int) -> tuple[list[int], list[list[int]], list[int]]:
    """A first prompt (a 40-token shared prefix: 5 pages, then 5 tokens), two 60-token fillers,
    and a second prompt with the same prefix and another tail."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, 5 * PAGE).tolist()
    first, second = shared + rng.integers(0, vocab, 5).tolist(), shared + rng.integers(0, vocab, 7).tolist()
    return first, [rng.integers(0, vocab, 60).tolist() for _ in range(2)], second


def _serve_in_turn(engine, config: ServingConfig):
    """Serve first, the fillers, then second, one after the other; (server, second's completion,
    the stats' prefill tokens before second)."""
    first, fillers, second = _prompts(min(engine.config.vocab_size, 256))
    server = ServingEngine(engine, config)
    for prompt in [first, *fillers]:
        server.run([prompt], max_new_tokens=NEW, ignore_eos=True)
    before = server.stats.prefill_tokens
    out = server.run([second], max_new_tokens=NEW, ignore_eos=True, logprobs=True)[0]
    return server, out, server.stats.prefill_tokens - before


def _assert_host_tier_reuses(engine, config=SMALL) -> ServingEngine:
    """The evicted prefix comes back from the host tier: same tokens, 5 pages fewer prefilled."""
    plain, expected, recomputed = _serve_in_turn(engine, dataclasses.replace(config, host_cache_bytes=0))
    assert plain.swap is None or plain.swap.prefixes is None
    server, out, prefilled = _serve_in_turn(engine, config)
    assert out.token_ids == expected.token_ids
    np.testing.assert_allclose(out.logprobs, expected.logprobs, atol=1e-5)
    stats = server.stats
    assert plain.pool.evictions > 0 and stats.host_spilled_pages > 0
    assert stats.host_cached_tokens == 5 * PAGE and prefilled == recomputed - 5 * PAGE
    return server


def test_evicted_prefix_comes_back_from_pinned_host_memory(tiny_engine):
    server = _assert_host_tier_reuses(tiny_engine)
    assert server.swap.kind == host_memory_kind(jax.devices()[0]) == "pinned_host"  # XLA:CPU has the kind
    rows = list(server.swap.prefixes._rows.values())
    assert rows and all(isinstance(r, jax.Array) and r.sharding.memory_kind == "pinned_host" for r in rows)
    assert server.stats.pinned_host_pages == server.stats.host_pages >= server.stats.host_spilled_pages > 0


def test_numpy_host_rows_give_the_same_tokens(tiny_engine, monkeypatch):
    """Where a backend has no pinned_host memory the rows are numpy arrays (forced here)."""
    monkeypatch.setattr(serving_module, "HostSwap", functools.partial(HostSwap, kind="numpy"))
    server = _assert_host_tier_reuses(tiny_engine)
    assert server.swap.kind == "numpy" and server.stats.pinned_host_pages == 0 < server.stats.host_pages
    assert all(isinstance(r, np.ndarray) for r in server.swap.prefixes._rows.values())


def test_the_tier_keeps_its_byte_bound(tiny_engine):
    """A tier of two pages holds the two most recently evicted pages: the first prompt's prefix
    (evicted before the fillers') is gone, so it is recomputed, with the same tokens."""
    probe = ServingEngine(tiny_engine, SMALL)
    budget = 2 * probe.swap._page_bytes
    server, out, prefilled = _serve_in_turn(tiny_engine, dataclasses.replace(SMALL, host_cache_bytes=budget))
    tier = server.swap.prefixes
    assert len(tier) == 2 and tier.used == budget and tier.evictions > 0
    assert server.stats.host_cached_tokens == 0 and prefilled == len(_prompts(256)[2])
    assert out.token_ids == _serve_in_turn(tiny_engine, dataclasses.replace(SMALL, host_cache_bytes=0))[1].token_ids


def test_no_tier_without_prefix_cache_or_budget(tiny_engine):
    assert ServingEngine(tiny_engine, dataclasses.replace(SMALL, prefix_cache=False)).swap.prefixes is None
    assert ServingEngine(tiny_engine, dataclasses.replace(SMALL, host_cache_bytes=1)).swap.prefixes is None
    assert ServingEngine(tiny_engine, dataclasses.replace(SMALL, host_cache_bytes=0, swap_bytes=0)).swap is None


def test_host_prefix_cache_is_lru_within_its_budget():
    tier = HostPrefixCache(budget=30)
    row = np.zeros(10, np.uint8)
    for h in (b"a", b"b", b"c"):
        assert tier.put(h, row)
    assert len(tier.match([b"a", b"b"])) == 2  # a and b used: c is now the oldest ...
    assert tier.put(b"d", row) and b"c" not in tier and tier.used == 30 and tier.evictions == 1
    assert tier.put(b"e", row) and b"b" not in tier  # ... then b (a, the head, was touched last)
    assert tier.match([b"a", b"b", b"d"]) == [row]  # a run stops at the first miss
    assert not tier.put(b"big", np.zeros(31, np.uint8)) and len(tier) == 3
    with pytest.raises(ValueError, match="budget=-1"):
        HostPrefixCache(-1)


def test_allocate_many_hands_evicted_pages_over_once():
    pool = PagePool(num_pages=3)
    seen = []
    pool.on_evict = seen.append
    pages = pool.allocate_many(3)
    for page, h in zip(pages, (b"h0", b"h1", b"h2")):
        pool.register(page, h)
    pool.release(pages)  # last page first: h2, h1, h0 from oldest to newest
    assert pool.allocate_many(2) == [pages[2], pages[1]] and seen == [[(pages[2], b"h2"), (pages[1], b"h1")]]
    with pytest.raises(Exception, match="2 pages asked for, 1 available"):
        pool.allocate_many(2)
    assert pool.available == 1 and len(seen) == 1  # a refused allocation takes and evicts nothing


@pytest.mark.slow
def test_hybrid_reuses_host_pages_up_to_a_snapshot():
    """A 2-layer Qwen3-Next-style hybrid (random weights): its slot states are per request, not
    part of a prefix; the host tier holds pages only, and the device's state snapshots (kept at
    page boundaries) say how far a host prefix can be reused."""
    from tests import linear_helpers as L
    from tests.test_linear_serving import _random_engine

    hf = L.qwen_next_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            mlp_only_layers=[0, 1])
    server = _assert_host_tier_reuses(_random_engine(hf))
    assert server.stats.snapshots_restored > 0


def test_serve_host_cache_option():
    from dayzero.engine.cli import build_parser
    from dayzero.engine.server_run import ServeError, serving_config

    parse = build_parser().parse_args
    assert serving_config(parse(["serve", "--host-cache", "3MiB"])).host_cache_bytes == 3 << 20
    assert serving_config(parse(["serve", "--host-cache", "0"])).host_cache_bytes == 0
    assert serving_config(parse(["serve"])).host_cache_bytes is None  # default: the device pool's size
    with pytest.raises(ServeError, match="--host-cache 'lots' is not a size"):
        serving_config(parse(["serve", "--host-cache", "lots"]))
    with pytest.raises(Exception, match="host_cache_bytes=-1 is invalid"):
        ServingConfig(host_cache_bytes=-1)
