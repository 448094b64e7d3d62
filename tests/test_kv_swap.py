"""Preempted requests' KV pages (and slot states) swapped to host memory and back
(engine/kv_swap.py), instead of recomputed.

Oracle: the same requests served with ``swap_bytes=0`` (recomputation after preemption, itself
equal to ``Engine.generate``: tests/test_serving.py): identical greedy tokens and logprobs within
1e-5, while the swapping run prefills only the prompts (no recomputation) and counts its swaps.
A budget too small for any request recomputes; a cancelled swapped request frees its budget.
With the prefix cache on, a readmitted request copies back only the pages the device's prefix
cache no longer holds. The host rows live in the ``pinned_host`` memory kind (XLA:CPU has it).
On a linear-attention hybrid the slot's recurrent states travel with the pages.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.serving import ServingEngine
from tests.test_speculative import _repetitive_prompts

# Four requests of ~40-70 positions over 18 pages of 8: decoding preempts.
TIGHT = ServingConfig(slots=4, page_size=8, max_context=80, num_pages=18, max_chunk=32, prefix_cache=False)
NEW = 24


def _serve(engine, config, prompts) -> tuple[list, object]:
    server = ServingEngine(engine, config)
    ids = [server.submit(p, max_new_tokens=NEW, ignore_eos=True, logprobs=True) for p in prompts]
    for _ in server.stream():
        pass
    assert server.swap is None or server.swap.used == 0  # every swapped request came back
    return [server.completion(i) for i in ids], server.stats


def _assert_swapping_is_recomputing(engine, prompts, config=TIGHT) -> None:
    recomputed, plain = _serve(engine, dataclasses.replace(config, swap_bytes=0), prompts)
    swapped, stats = _serve(engine, config, prompts)
    for s, r in zip(swapped, recomputed):
        assert s.token_ids == r.token_ids
        np.testing.assert_allclose(s.logprobs, r.logprobs, atol=1e-5)
    assert plain.preemptions > 0 and stats.swapped_out == stats.swapped_in == stats.preemptions > 0
    assert stats.swapped_tokens > 0
    assert stats.prefill_tokens == sum(len(p) for p in prompts) < plain.prefill_tokens  # nothing recomputed


def test_swapped_requests_resume_with_the_same_tokens(tiny_engine):
    _assert_swapping_is_recomputing(tiny_engine, _repetitive_prompts(256) + [_repetitive_prompts(256)[1][:30]])


def test_budget_and_cancel(tiny_engine):
    prompts = _repetitive_prompts(256) + [_repetitive_prompts(256)[1][:30]]
    _, stats = _serve(tiny_engine, dataclasses.replace(TIGHT, swap_bytes=1), prompts)
    assert stats.preemptions > 0 and stats.swapped_out == 0  # nothing fits: recomputed
    server = ServingEngine(tiny_engine, TIGHT)
    ids = [server.submit(p, max_new_tokens=NEW, ignore_eos=True) for p in prompts]
    while not any(r.swapped for r in server._waiting):
        server.step()
    victim = next(r for r in server._waiting if r.swapped)
    assert server.swap.used == victim.swapped.nbytes > 0
    # The budget check before copying uses exactly the bytes the copy then holds.
    assert victim.swapped.nbytes == victim.swapped.num_pages * server.swap._page_bytes + server.swap._slot_bytes
    assert server.cancel(victim.id) and server.swap.used == 0
    for _ in server.stream():
        pass
    assert len(ids) == 4


def test_readmission_reuses_cached_pages_and_rows_live_in_pinned_host_memory(tiny_engine):
    """With the prefix cache on, a readmitted request reuses its leading full pages the device's
    prefix cache still holds and copies only the others back; the swapped rows are jax arrays in
    the pinned_host memory kind (XLA:CPU has it)."""
    prompts = _repetitive_prompts(256) + [_repetitive_prompts(256)[1][:30]]
    config = dataclasses.replace(TIGHT, prefix_cache=True, host_cache_bytes=0)
    recomputed, _ = _serve(tiny_engine, dataclasses.replace(config, swap_bytes=0), prompts)
    server = ServingEngine(tiny_engine, config)
    copies, into = [], server.swap.into

    def recording_into(swapped, pages, slot, skip=0):
        copies.append((swapped.computed, skip, {r.sharding.memory_kind for r in swapped.rows}))
        into(swapped, pages, slot, skip)

    server.swap.into = recording_into
    ids = [server.submit(p, max_new_tokens=NEW, ignore_eos=True, logprobs=True) for p in prompts]
    for _ in server.stream():
        pass
    for i, r in zip(ids, recomputed):
        assert server.completion(i).token_ids == r.token_ids
    assert copies and all(kinds == {"pinned_host"} for _, _, kinds in copies)
    assert any(skip > 0 for _, skip, _ in copies)  # pages found on the device, not copied
    assert server.stats.swapped_tokens == sum(c - skip * TIGHT.page_size for c, skip, _ in copies)
    assert server.stats.pinned_host_pages == server.stats.host_pages > 0


def test_hybrid_states_travel_with_the_pages():
    """A 2-layer Qwen3-Next-style hybrid (a gated-delta-net layer, an attention layer; random
    weights): its slot's recurrent and convolution states are swapped with its pages."""
    from tests import linear_helpers as L
    from tests.test_linear_serving import _random_engine

    hf = L.qwen_next_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            mlp_only_layers=[0, 1])
    engine = _random_engine(hf)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (40, 33, 21, 37)]
    _assert_swapping_is_recomputing(engine, prompts)
