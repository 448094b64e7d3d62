"""DeepSeek-V4 through the serving engine (``dayzero.engine.serving`` over its paged cache,
``dayzero.model.compressed_paged``: entries in pages, window rings and compressor states per slot).

The tiny V4 model of tests/v4_helpers.py (seed 5, as tests/test_v4_model.py: layers sliding, CSA
ratio 4, HCA ratio 16, CSA; window 16), converted once. The oracle is ``Engine.generate`` on the
contiguous cache (itself checked against HF in tests/test_v4_model.py), run once on the whole
batch of requests with their own sampling parameters (a row's tokens do not depend on its batch
or on the batch's sampling mode: ``sampling.sample``). Served with 2 slots for 6 requests and
prefill chunks of 2 tokens, so that:

- slots and pages are reused: later requests start in a slot whose window ring and compressor
  states an earlier request left behind, on pages holding its entries (never reset, never read);
- every prompt is split in the middle of CSA windows (2 of 4 tokens) and of HCA windows and the
  16-token window ring, prompts of 37 and 50 tokens close 2-3 HCA windows and wrap the ring;
- greedy and seeded sampled rows decode in batches of 1 and 2 rows.

A small pool (``num_pages`` 6 of 16 positions) makes the engine preempt by itself; the
recompute path is also forced by hand (two running requests preempted and readmitted into each
other's slots).

Default suite: the page and slot writes against the contiguous cache's and the resolved
configuration; the served requests, the preemptions and the HTTP request run under ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import types
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.convert import load_checkpoint
from dayzero.engine import Engine, SamplingParams
from dayzero.engine.generate import GenerationError
from dayzero.engine.paged_steps import _restore, _snapshot, default_page_size
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.tools.measure import CompileCounter
from dayzero.model import compressed_cache
from dayzero.model.compressed import NewCompressedLayer
from dayzero.model.compressed_cache import CompressedCache, NewCompressed
from dayzero.model.compressed_paged import append_to_paged, paged_specs
from dayzero.model.paged_rows import PagedRows, whole
from dayzero.model.quant import ValueFormat, dequantized, quantize
from dayzero.model.weights import map_specs
from tests.v4_helpers import tiny_hf_model

# 2 slots (decode batches of 1 and 2), context 64 (4 pages of 16), prefill chunks of exactly 2
# tokens, tables of 4 pages (min_table_pages: one width): 2 prefill and 2 decode shapes compiled.
PAGE = 16
# Room for every snapshot the requests take (the default, 4 per slot, would have evicted row 0's by
# the time its repeat, row 5, is admitted).
SERVING = ServingConfig(slots=2, max_context=64, max_chunk=2, min_chunk=2, state_snapshots=16)
NEW = 10
LENGTHS = (37, 5, 21, 50, 16, 37)
PROMPTS = [np.random.default_rng(s).integers(2, 256, n).tolist() for s, n in enumerate(LENGTHS)]
PROMPTS[5] = PROMPTS[0]  # the same prompt sampled (row 5) and greedy (row 0)
GREEDY = SamplingParams()
PLAIN, FILTERED = SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)
PARAMS = [GREEDY, PLAIN, GREEDY, FILTERED, GREEDY, SamplingParams(temperature=1.0, seed=7)]


pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


@pytest.fixture(scope="module")
def v4(hf_factory, tmp_path_factory, quick_compiles):
    """The converted tiny V4 model's Engine; ``reference()`` gives ``Engine.generate``'s
    completions of the requests (computed once, by the slow tests that need them)."""
    _, dz_dir = hf_factory.save_and_convert(tiny_hf_model(5), tmp_path_factory.mktemp("v4_serving"))
    config, weights = load_checkpoint(dz_dir, dtype=jnp.float32)
    engine = Engine(config, weights)
    done = []

    def reference():
        if not done:
            done.append(engine.generate(PROMPTS, max_new_tokens=NEW, sampling=PARAMS, ignore_eos=True, logprobs=True))
        return done[0]

    return types.SimpleNamespace(engine=engine, reference=reference)


@pytest.fixture(scope="module")
def server(v4):
    """A warmed-up V4 server (every step shape compiled: serving compiles nothing more)."""
    server = ServingEngine(v4.engine, SERVING)
    server.warmup()
    return server


def _assert_same(served, reference, rows):
    """Each served completion has the tokens and logprobs of its reference row in ``rows``."""
    for row, out in zip(rows, served):
        ref = reference[row]
        assert out.token_ids == ref.token_ids, f"request {row} ({LENGTHS[row]} tokens, {PARAMS[row]})"
        np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-4, atol=1e-5)


# The three tests below cost ~90 s (six compiles of the tiny V4 forward: four serving shapes and
# generate's two), too much for the default suite; it keeps the slot writes and the config.
@pytest.mark.slow
def test_served_requests_match_generate(server, v4):
    """Six requests over two slots, chunked prefill, greedy and seeded sampled rows: every
    request's tokens and logprobs are Engine.generate's, and nothing compiles after the warm-up.
    Row 5 repeats row 0's 37-token prompt: it reuses 2 cached pages (32 positions) with the window
    ring and compressor states snapshotted at position 32 restored into its slot, and still
    samples exactly as generate (a wrong or missing restore changes its logits)."""
    assert server.config.page_size == PAGE and server.config.prefix_cache
    with CompileCounter() as counter:
        served = server.run(PROMPTS, max_new_tokens=NEW, sampling=PARAMS, ignore_eos=True, logprobs=True)
    assert counter.count == 0
    _assert_same(served, v4.reference(), range(len(PROMPTS)))
    assert served[5].token_ids != served[0].token_ids  # the sampled row does sample
    stats = server.stats
    assert stats.prefill_chunks == sum(-(-n // 2) for n in LENGTHS) - 16 and stats.preemptions == 0
    assert stats.cached_tokens == 32 and stats.snapshots_restored == 1 and stats.peak_pages > 0
    assert server._slots == [None, None]
    metrics = server.metrics()
    assert metrics["pages_used"] == 0 and metrics["running"] == 0 and metrics["prefix_cache_hit_rate"] > 0


@pytest.mark.slow
def test_pool_driven_preemption_matches_generate(v4):
    """A pool of 4 pages for two requests (21 and 16 prompt tokens, 20 new: 3 pages each at the
    end): the engine preempts and recomputes by itself, on pages the other request wrote entries
    into, and both requests' tokens and logprobs are still Engine.generate's."""
    server = ServingEngine(v4.engine, dataclasses.replace(SERVING, num_pages=4))
    rows, new = [2, 4], 20
    prompts, params = [PROMPTS[r] for r in rows], [PARAMS[r] for r in rows]
    served = server.run(prompts, max_new_tokens=new, sampling=params, ignore_eos=True, logprobs=True)
    assert server.stats.preemptions > 0
    reference = v4.engine.generate(prompts, max_new_tokens=new, sampling=params, ignore_eos=True, logprobs=True)
    for out, ref in zip(served, reference):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_preempted_requests_recompute_into_each_others_slots(server, v4):
    """Two running requests preempted by hand, one decoding and one mid-prefill, are readmitted
    into each other's slots,
    holding the other's stale rows, and recompute there (prompt + generated tokens): the same
    tokens as Engine.generate's."""
    server = ServingEngine(v4.engine, dataclasses.replace(SERVING, prefix_cache=False))  # none restored
    rows = [0, 3, 1]
    before = server.stats.preemptions
    ids = [server.submit(PROMPTS[r], max_new_tokens=NEW, sampling=PARAMS[r], ignore_eos=True, logprobs=True)
           for r in rows]
    server.step()
    first, second = server._slots
    while first.generated < 3:  # the 37-token prompt decodes while the 50-token one prefills
        server.step()
    assert second.prefilling and second.computed > 0
    server._preempt(first)
    server._preempt(second)
    server.step()
    assert server._slots == [second, first] and server.stats.preemptions == before + 2
    for _ in server.stream():
        pass
    _assert_same([server.completion(i) for i in ids], v4.reference(), rows)


@pytest.mark.slow
def test_server_completion_matches_generate(v4):
    """One greedy request through the OpenAI-compatible HTTP server (engine/server.py, in
    process on a loopback port) over a V4 serving engine."""
    import uvicorn

    from dayzero.engine.server import ServerOptions, create_app
    from dayzero.engine.server_run import _listen

    sock = _listen("127.0.0.1", 0)
    ready = threading.Event()
    app = create_app(ServingEngine(v4.engine, SERVING), ServerOptions(model_name="v4", on_ready=ready.set))
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        assert ready.wait(60)
        port = sock.getsockname()[1]
        body = dict(model="v4", prompt=PROMPTS[2], max_tokens=NEW, temperature=0, ignore_eos=True,
                    return_token_ids=True)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            choice = json.loads(reply.read())["choices"][0]
    finally:
        http.should_exit = True
        thread.join(60)
    assert choice["token_ids"] == v4.reference()[2].token_ids and choice["finish_reason"] == "length"


_RNG = np.random.default_rng(0)


def _random(shape) -> jax.Array:
    return jnp.asarray(_RNG.standard_normal(shape), jnp.float32)


def _random_pool(config, num_pages: int, slots: int):
    """A V4 page pool with random contents (integer leaves, the step rows, zero)."""
    specs = paged_specs(config, num_pages, PAGE, batch=2, table_width=4, state_slots=slots)
    return map_specs(lambda x: _random(x.shape) if len(x.shape) >= 3 else jnp.asarray(np.zeros(x.shape, x.dtype)),
                     specs)


def _new_rows(pool, T: int, M: int) -> NewCompressed:
    """Random additions of a 2-row step: T rows, M entries per CSA/HCA layer (ids 3 and none for
    row 0, 5 and 6 for row 1), random states."""
    layers = []
    for c in pool.layers:
        H = c.window.shape[-1]
        n = NewCompressedLayer(rows=_random((2, T, H)))
        if c.entries is not None:
            state = jax.tree.map(lambda s: _random((2, *s.shape[1:])), c.state)
            n = n.replace(entries=_random((2, M, H)), entry_ids=jnp.array([[3, -1], [5, 6]]), state=state)
        if c.index_keys is not None:
            J = c.index_keys.shape[-1]
            state = jax.tree.map(lambda s: _random((2, *s.shape[1:])), c.index_state)
            n = n.replace(index_keys=_random((2, M, J)), index_ids=jnp.array([[3, -1], [5, 6]]), index_state=state)
        layers.append(n)
    return NewCompressed(layers=tuple(layers), num_new=jnp.array([T, 0]), rope_len=jnp.array(20))


def _gathered(cache, i: int):
    """Layer ``i`` of a paged cache as the step's rows see it, its paged rows gathered whole."""
    layer = cache.layer(i)
    return layer.replace(entries=whole(layer.entries), index_keys=whole(layer.index_keys))


def test_append_writes_only_the_steps_real_rows(v4):
    """``append_to_paged`` against ``compressed_cache.append`` on a contiguous row: a real row in
    slot 1 (pages 4, 0, 2, 5) and a padding row (no token, garbage rows, entry ids and states)
    naming the same slot and other pages write exactly what the contiguous cache's append writes
    for the real row alone (its rings, states and entries, read back through the pages); slot 0
    and the pages outside the real row's table keep their contents."""
    config = v4.engine.config
    pool = _random_pool(config, num_pages=8, slots=2)
    tables = jnp.array([[4, 0, 2, 5], [1, 3, 6, 7]], jnp.int32)
    step = pool.with_rows(block_tables=tables, slots=jnp.array([1, 1]), lengths=jnp.array([17, 0]))
    new = _new_rows(pool, T=3, M=2)
    written = jax.jit(append_to_paged)(step, new)
    # The oracle: the real row as a contiguous cache row (its view of the pool), appended by the
    # contiguous cache's own writes.
    alone = step.with_rows(block_tables=tables[:1], slots=jnp.array([1]), lengths=jnp.array([17]))
    row = CompressedCache(layers=tuple(_gathered(alone, i) for i in range(len(pool.layers))),
                          lengths=jnp.array([17]), rope_len=pool.rope_len, max_len=64)
    want = jax.jit(compressed_cache.append)(row, jax.tree.map(lambda x: x[:1] if x.ndim else x, new))
    got = written.with_rows(block_tables=tables[:1], slots=jnp.array([1]), lengths=jnp.array([20]))
    for i, layer in enumerate(want.layers):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(_gathered(got, i)), jax.tree.leaves(layer)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"layer {i} {path}")
    untouched = [1, 3, 6, 7]
    for before, after in zip(pool.layers, written.layers):
        for field in ("window", "state", "index_state"):
            for x, y in zip(jax.tree.leaves(getattr(before, field)), jax.tree.leaves(getattr(after, field))):
                np.testing.assert_array_equal(np.asarray(y)[0], np.asarray(x)[0])  # slot 0
        for field in ("entries", "index_keys"):
            if getattr(before, field) is not None:
                np.testing.assert_array_equal(np.asarray(getattr(after, field))[untouched],
                                              np.asarray(getattr(before, field))[untouched])
    np.testing.assert_array_equal(written.lengths, [20, 0])


def test_paged_config_and_refusals(v4):
    """The resolved config: pages of 16 positions (a multiple of the tiny model's ratios 4 and 16;
    the published 4 and 128 give 128), a prefix cache unless no state snapshots; a page size that splits an entry's window
    is refused in one sentence, and so is a raw pool declared with one."""
    config = v4.engine.config
    resolved = SERVING.resolve(config, v4.engine.run)
    assert resolved.page_size == PAGE and resolved.prefix_cache and resolved.num_pages >= 4
    assert not dataclasses.replace(SERVING, state_snapshots=0).resolve(config, v4.engine.run).prefix_cache
    published = dataclasses.replace(config, compressed=dataclasses.replace(config.compressed, hca_ratio=128))
    assert default_page_size(published) == 128
    with pytest.raises(GenerationError, match=r"page_size=8 does not hold .* multiple of 16"):
        dataclasses.replace(SERVING, page_size=8).resolve(config, v4.engine.run)
    with pytest.raises(ValueError, match=r"page_size=24 .* multiple of 16"):
        paged_specs(config, 4, 24)


def test_snapshot_and_restore_copy_one_slots_states(v4):
    """The prefix cache's state copies (``paged_steps._snapshot``/``_restore``) on a random pool:
    slot 2's rings and compressor states go to snapshot row 1 and from there into slot 0; every
    other slot, every page and the other snapshot row keep their contents; out-of-range rows and
    slots (the warm-up's calls) write nothing. (Both jits donate their first argument: each call
    gets a fresh copy.)"""
    pool = _random_pool(v4.engine.config, num_pages=4, slots=3)
    copy = lambda tree: jax.tree.map(jnp.array, tree)  # noqa: E731
    leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]  # noqa: E731
    zeros = jax.tree.map(lambda leaf: jnp.zeros((2, *leaf.shape[1:]), leaf.dtype), pool.slot_states)
    snaps = _snapshot(copy(zeros), pool.slot_states, jnp.int32(2), jnp.int32(1))
    restored = _restore(copy(pool), snaps, jnp.int32(0), jnp.int32(1))
    for snap, before, after in zip(leaves(snaps), leaves(pool.slot_states), leaves(restored.slot_states)):
        np.testing.assert_array_equal(snap[1], before[2])
        np.testing.assert_array_equal(snap[0], 0)
        np.testing.assert_array_equal(after[0], before[2])
        np.testing.assert_array_equal(after[1:], before[1:])
    for layer, before in zip(restored.layers, pool.layers):
        for field in ("entries", "index_keys"):
            if getattr(layer, field) is not None:
                np.testing.assert_array_equal(getattr(layer, field), getattr(before, field))
    unchanged = _snapshot(copy(snaps), pool.slot_states, jnp.int32(0), jnp.int32(2))
    for got, want in zip(leaves(unchanged), leaves(snaps)):
        np.testing.assert_array_equal(got, want)
    untouched = _restore(copy(pool), snaps, jnp.int32(3), jnp.int32(1))
    for got, want in zip(leaves(untouched), leaves(pool)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("quantized", [False, True])
def test_paged_rows_take_reads_the_rows_the_gather_holds(quantized):
    """``PagedRows.take`` (the picks read straight from the pages) against ``numpy`` indexing of
    the whole gathered view (``PagedRows.whole``), for a plain and an int8 pool (values and
    scales taken alike), rows from every page of two tables in any order."""
    pool = _random((6, 4, 8))
    if quantized:
        pool = quantize(pool, ValueFormat.INT8, (2,))
    rows = PagedRows(pool, jnp.array([[3, 0, 5], [1, 1, 2]], jnp.int32))
    picks = jnp.array([[11, 0, 4, 7, 9], [2, 10, 5, 5, 0]], jnp.int32)[..., None]
    got = rows.take(picks)
    want = np.take_along_axis(np.asarray(dequantized(rows.whole(), jnp.float32)), np.asarray(picks), axis=1)
    assert rows.shape == (2, 12, 8) and isinstance(got, type(pool))
    np.testing.assert_array_equal(np.asarray(dequantized(got, jnp.float32)), want)
