"""DeepSeek-V4 through the serving engine (``dayzero.engine.serving`` over a slot cache,
``dayzero.model.compressed_slots``).

The tiny V4 model of tests/v4_helpers.py (seed 5, as tests/test_v4_model.py: layers sliding, CSA
ratio 4, HCA ratio 16, CSA; window 16), converted once. The oracle is ``Engine.generate`` on the
contiguous cache (itself checked against HF in tests/test_v4_model.py), run once on the whole
batch of requests with their own sampling parameters (a row's tokens do not depend on its batch
or on the batch's sampling mode: ``sampling.sample``). Served with 2 slots for 6 requests and
prefill chunks of 2 tokens, so that:

- slots are reused: later requests start in a slot whose window ring, entries and compressor
  states an earlier request left behind (never reset, never read);
- every prompt is split in the middle of CSA windows (2 of 4 tokens) and of HCA windows and the
  16-token window ring, prompts of 37 and 50 tokens close 2-3 HCA windows and wrap the ring;
- greedy and seeded sampled rows decode in batches of 1 and 2 rows.

A slot holds ``max_context`` tokens, so V4 never runs out of room and is never preempted by the
engine; the recompute path a preemption takes is forced by hand (two running requests preempted
and readmitted into each other's slots).

Default suite: the slot writes against the contiguous cache's and the resolved configuration;
the served requests, the forced preemption and the HTTP request run under ``-m slow``.
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
from dayzero.engine.runtime import RunConfigError
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.tools.measure import CompileCounter
from dayzero.model import compressed_cache
from dayzero.model.compressed import NewCompressedLayer
from dayzero.model.compressed_cache import CompressedCache, NewCompressed
from dayzero.model.compressed_slots import append_to_slots, slot_cache_specs
from dayzero.model.weights import map_specs
from tests.v4_helpers import tiny_hf_model

# 2 slots (decode batches of 1 and 2), context 64, prefill chunks of exactly 2 tokens: the shapes
# compiled are 2 prefill (first chunk, later chunks) and 2 decode steps.
SERVING = ServingConfig(slots=2, max_context=64, max_chunk=2, min_chunk=2)
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
    request's tokens and logprobs are Engine.generate's, and nothing compiles after the warm-up."""
    assert server.config.slot_cache and not server.config.prefix_cache and server.pool is None
    with CompileCounter() as counter:
        served = server.run(PROMPTS, max_new_tokens=NEW, sampling=PARAMS, ignore_eos=True, logprobs=True)
    assert counter.count == 0
    _assert_same(served, v4.reference(), range(len(PROMPTS)))
    assert served[5].token_ids != served[0].token_ids  # the sampled row does sample
    stats = server.stats
    assert stats.prefill_chunks == sum(-(-n // 2) for n in LENGTHS) and stats.preemptions == 0
    assert stats.cached_tokens == 0 and stats.peak_pages == 0
    assert server._slots == [None, None]
    metrics = server.metrics()
    assert "pages_used" not in metrics and metrics["running"] == 0 and metrics["prefix_cache_hit_rate"] == 0.0


@pytest.mark.slow
def test_preempted_requests_recompute_into_each_others_slots(server, v4):
    """Two running requests preempted by hand (the engine never preempts V4: a slot has room for
    max_context tokens), one decoding and one mid-prefill, are readmitted into each other's slots,
    holding the other's stale rows, and recompute there (prompt + generated tokens): the same
    tokens as Engine.generate's."""
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


def test_append_writes_only_the_steps_real_rows(v4):
    """``append_to_slots`` against ``compressed_cache.append`` on the slot's row alone: a step of a
    real row in slot 1 and a padding row (no token, garbage rows, entry ids and states) naming the
    same slot writes exactly what the real row alone writes there, and slot 0 keeps its contents."""
    config = v4.engine.config
    pool = map_specs(lambda x: _random(x.shape) if len(x.shape) >= 3 else jnp.asarray(np.zeros(x.shape, x.dtype)),
                     slot_cache_specs(config, 2, 64))
    T, M = 3, 2
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
            n = n.replace(index_keys=_random((2, M, J)), index_ids=jnp.array([[3, -1], [5, 6]]),
                          index_state=state)
        layers.append(n)
    new = NewCompressed(layers=tuple(layers), num_new=jnp.array([T, 0]), rope_len=jnp.array(20))
    step = pool.replace(slots=jnp.array([1, 1]), lengths=jnp.array([17, 0]))
    written = jax.jit(append_to_slots)(step, new)
    # The oracle: slot 1's row as a contiguous cache of one row, appended by the contiguous cache.
    row = CompressedCache(layers=jax.tree.map(lambda x: x[1:2], pool.layers), lengths=jnp.array([17]),
                          rope_len=pool.rope_len, max_len=64)
    alone = jax.jit(compressed_cache.append)(row, jax.tree.map(lambda x: x[:1] if x.ndim else x, new))
    for i, layer in enumerate(alone.layers):
        for got, want, before in zip(*(map(np.asarray, jax.tree.leaves(t)) for t in (written.layers[i], layer,
                                                                                      pool.layers[i]))):
            np.testing.assert_array_equal(got[1], want[0])
            np.testing.assert_array_equal(got[0], before[0])
    np.testing.assert_array_equal(written.lengths, [17 + T, 0])


def test_slot_cache_config_and_refusals(v4):
    """The resolved config: one slot per request, no pages, no prefix cache (``num_pages``
    ignored); serving V4 on a mesh is refused in one sentence."""
    config = v4.engine.config
    resolved = dataclasses.replace(SERVING, num_pages=3).resolve(config, v4.engine.run)
    assert resolved.slot_cache and resolved.num_pages is None and resolved.max_table_pages == 1
    assert resolved.prefill_shapes() == [(2, None), (2, 1)] and resolved.table_widths() == [1]
    assert resolved.chunk_shape(0, 7) == (2, None) and resolved.chunk_shape(4, 3) == (2, 1)
    meshed = dataclasses.replace(v4.engine.run, placement=object())  # only its presence matters here
    with pytest.raises(RunConfigError, match="DeepSeek-V4 on a --mesh"):
        SERVING.resolve(config, meshed)
