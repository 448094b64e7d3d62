"""Linear-attention hybrids through the serving engine: the attention layers' KV pages beside a
pool of one ``LinearState`` row per slot (``dayzero.model.linear_cache``).

The oracle is ``Engine.generate`` on the contiguous cache (whose states are the batch's rows),
run once on the whole batch with each row's sampling parameters (a row's tokens do not depend on
its batch or the batch's sampling mode). The served model is the tiny Qwen3-Next of
tests/linear_helpers.py (seed 0: GDN, attention, GDN, attention; 4 experts), converted; its
delta-rule chunk is set to 24 (a dayzero setting, not a checkpoint's: the function is the same
for any chunk), so that no served prefill chunk (16 or 32 tokens, starts at multiples of 16)
lines up with generate's one 64-token prefill: generate runs delta chunks [0,24) [24,48)
[48,64), a served 32-token chunk [0,24) [24,32) then [32,56) [56,64) padded past the prompt,
and a 16-token chunk the token-by-token form. Served with 2 slots for 6 requests, so that:

- slots are reused: a later request starts in a slot whose states an earlier request left there
  (never reset; a first chunk reads no state);
- prompts of 37 and 50 tokens prefill in two chunks (32 + 5, 32 + 18), the second reading the
  pages and the state the first wrote;
- greedy and seeded sampled rows decode in batches of 1 and 2;
- a repeated prompt (rows 4 and 5 repeat row 0's) reuses the 2 cached pages with the linear
  layers' states snapshotted at position 32 restored into its slot, and prefills its last 5
  tokens only; a chunk that would end past a page boundary mid-page stops at the boundary (the
  21- and 50-token prompts: 16 + 5 and 32 + 16 + 2), so that the states there are snapshotted.

Preemption is forced by hand (two running requests readmitted into each other's slots) and
happens by itself on a pool of 6 pages. int8 KV pages are served in the chunks generate prefills
in (a chunk reads its own keys unquantized, earlier ones quantized). The kernels (``pallas_interpret``:
the paged attention kernels and the delta-rule kernels) are served on a variant with linear head
dims of 16 (the smallest the delta kernels tile) against the reference generate.

Default suite: the resolved config, the refusals (kernels at untileable sizes, speculative
decoding), the pool's bytes and dtypes against a count by hand, the pool's row gather/scatter
against numpy, and one small served-vs-generate (random weights, 2 layers). The rest is slow.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dayzero.engine.generate as generate_module
from dayzero.convert import load_checkpoint
from dayzero.engine import Engine, SamplingParams
from dayzero.engine.runtime import RunConfigError, resolve_run
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.engine.speculative import SpecConfig, SpeculativeError
from dayzero.kernels import KernelMode
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.linear_cache import NewHybrid, append_states, attention_config
from dayzero.model.paged_cache import init_paged_cache
from dayzero.tools.measure import CompileCounter
from tests import linear_helpers as L
from tests.linear_mesh_checks import random_weights

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

DELTA_CHUNK = 24
# 2 slots, pages of 16, context 64 (4 pages: one table width), prefill chunks of 16 or 32 tokens:
# 4 prefill shapes (T in 16, 32; first chunk or not) and 2 decode batches.
SERVING = ServingConfig(slots=2, page_size=16, max_context=64, max_chunk=32, min_chunk=16, min_table_pages=4)
NEW = 10
LENGTHS = (37, 5, 21, 50, 37, 37)
PROMPTS = [np.random.default_rng(s).integers(0, 64, n).tolist() for s, n in enumerate(LENGTHS)]
PROMPTS[4] = PROMPTS[5] = PROMPTS[0]  # the same prompt greedy (rows 0, 4) and sampled (row 5)
GREEDY = SamplingParams()
PLAIN, FILTERED = SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)
PARAMS = [GREEDY, PLAIN, GREEDY, FILTERED, GREEDY, SamplingParams(temperature=1.0, seed=7)]
# The prefill chunks (real tokens) each prompt length takes under SERVING.
CHUNKS = {37: [32, 5], 5: [5], 21: [16, 5], 50: [32, 16, 2]}


def _random_engine(hf_config, kv_cache: str = "none", kernels: str | None = None) -> Engine:
    """An engine over random weights of an HF config (N(0, 0.2): O(1) logits)."""
    config = parse_hf_config(hf_config.to_dict())
    return Engine(config, random_weights(config), kv_cache=kv_cache, kernels=kernels)


def _assert_same(served, reference, rows=None):
    """Each served completion has the tokens and logprobs of its reference row."""
    rows = range(len(served)) if rows is None else rows
    for row, out in zip(rows, served):
        ref = reference[row]
        assert out.token_ids == ref.token_ids, f"request {row}"
        np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-4, atol=1e-5, err_msg=f"request {row}")


# ---- default suite: configuration, refusals, the pool ------------------------------------------


def test_resolved_config_keeps_state_snapshots():
    """A hybrid's prefix cache keeps 4 state snapshots per slot by default; with none it is off
    (a hit would restore pages but not the linear layers' states); the same model without its
    linear layers has a prefix cache and no snapshots."""
    config = parse_hf_config(L.qwen_next_config().to_dict())
    resolved = ServingConfig(slots=3, max_context=64).resolve(config)
    assert resolved.prefix_cache and resolved.state_snapshots == 12 and resolved.num_pages is not None
    assert not ServingConfig(max_context=64, state_snapshots=0).resolve(config).prefix_cache
    plain = ServingConfig(max_context=64).resolve(attention_config(config))
    assert plain.prefix_cache and plain.state_snapshots == 0


def _state_bytes_by_hand(hf, itemsize: int) -> int:
    """One linear layer's state for one sequence, from the HF config's own fields: the three
    convolutions' last W-1 inputs (q and k: Hk x dk channels, v: Hv x dv) in the model's dtype,
    and the fp32 delta-rule state, Hv x dk x dv."""
    if isinstance(hf, type(L.kimi_config())):
        lin = hf.linear_attn_config
        W, Hk, Hv, dk, dv = (lin["short_conv_kernel_size"], lin["num_heads"], lin["num_heads"], lin["head_dim"],
                             lin["head_dim"])
    else:
        W, Hk, Hv, dk, dv = (hf.linear_conv_kernel_dim, hf.linear_num_key_heads, hf.linear_num_value_heads,
                             hf.linear_key_head_dim, hf.linear_value_head_dim)
    return (W - 1) * (2 * Hk * dk + Hv * dv) * itemsize + Hv * dk * dv * 4


def _page_bytes_by_hand(hf, kv_cache: str, num_pages: int, page_size: int) -> int:
    """The attention layers' pages: keys and values per kv head (Qwen3-Next; int8: a byte per value
    and an fp32 scale per position and head) or one latent row of kv_lora_rank + rope dims (Kimi)."""
    layers = hf.layer_types.count("full_attention")
    if isinstance(hf, type(L.kimi_config())):
        assert kv_cache == "none"
        return layers * num_pages * page_size * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
    per_head = hf.head_dim * 4 if kv_cache == "none" else hf.head_dim + 4
    return 2 * layers * num_pages * page_size * hf.num_key_value_heads * per_head


@pytest.mark.parametrize("model, kv_cache", [("qwen", "none"), ("qwen", "int8"), ("kimi", "none")])
def test_state_pool_bytes_and_dtypes(model, kv_cache):
    """The pool of a 3-slot server: exactly slots x linear layers x one layer's state bytes
    beside the pages (both counted by hand from the HF config); the states in the model's dtype
    (convolution inputs) and fp32 (delta-rule state) whatever the KV cache, the pages int8 values
    with fp32 scales under int8 KV."""
    hf = L.qwen_next_config() if model == "qwen" else L.kimi_config()
    engine = _random_engine(hf, kv_cache)
    server = ServingEngine(engine, ServingConfig(slots=3, page_size=16, max_context=64, num_pages=7))
    pool = server.steps.pool
    linear_layers = hf.layer_types.count("linear_attention")
    states = 3 * linear_layers * _state_bytes_by_hand(hf, 4)
    assert len(pool.states) == linear_layers
    assert sum(x.nbytes for x in jax.tree.leaves(pool.states)) == states
    # The prefix cache's snapshots: 4 rows of a slot's states per slot.
    assert server.kv_bytes == 5 * states + _page_bytes_by_hand(hf, kv_cache, 7, 16)
    for state in pool.states:
        assert state.recurrent.dtype == jnp.float32 and state.recurrent.shape[0] == 3
        assert {state.conv_q.dtype, state.conv_k.dtype, state.conv_v.dtype} == {engine.weights.embed.dtype}
    if kv_cache == "int8":
        for page in (*pool.attn.k_pages, *pool.attn.v_pages):
            assert page.values.dtype == jnp.int8 and page.scale.dtype == jnp.float32


@pytest.mark.parametrize("dk, dv, named", [(8, 8, "dk=8"), (16, 8, "dv=8")])
def test_kernels_at_untileable_linear_dims(monkeypatch, dk, dv, named):
    """Linear head dims the delta-rule kernels cannot tile: named kernels are refused in one line
    naming the size (by the engine and by serving); ``auto`` resolves to the reference path, also
    where it would mean the kernels (a GPU platform, emulated), where a model of dims 16 gets them."""
    hf = L.qwen_next_config(linear_key_head_dim=dk, linear_value_head_dim=dv)
    config = parse_hf_config(hf.to_dict())
    with pytest.raises(RunConfigError) as refused:
        _random_engine(hf, kernels="pallas_interpret")
    message = str(refused.value)
    assert "\n" not in message and named in message and "pallas_interpret" in message
    with pytest.raises(RunConfigError, match=named):
        ServingConfig(kernels="pallas_interpret").resolve(config, resolve_run(config))
    assert resolve_run(config, kernels="auto").kernels is KernelMode.REFERENCE
    import dayzero.engine.runtime as runtime

    monkeypatch.setattr(runtime, "resolve_mode", functools.partial(runtime.resolve_mode, platform="gpu"))
    assert resolve_run(config, kernels="auto").kernels is KernelMode.REFERENCE
    tileable = parse_hf_config(L.qwen_next_config(linear_key_head_dim=16, linear_value_head_dim=16).to_dict())
    assert resolve_run(tileable, kernels="auto").kernels is KernelMode.PALLAS


def test_speculative_decoding_refused():
    """Speculative decoding cannot roll the states back past a rejected draft: refused in one line."""
    engine = _random_engine(L.qwen_next_config())
    with pytest.raises(SpeculativeError) as refused:
        engine.generate([1, 2, 3], max_new_tokens=4, speculative=SpecConfig())
    message = str(refused.value)
    assert "\n" not in message and "linear-attention" in message and "--speculative" in message


def test_pool_rows_gather_and_scatter():
    """A step over the state pool, against numpy indexing: each row reads its slot's state; the
    write puts a real row's new state into its slot, while padding rows (no token) naming the
    same slot or another write nothing."""
    config = parse_hf_config(L.qwen_next_config().to_dict())
    rng = np.random.default_rng(0)
    pool = init_paged_cache(config, 4, 16, state_slots=3)
    pool = pool.replace(states=jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), pool.states))
    slots = np.array([2, 2, 0])  # row 0 real, rows 1 and 2 padding
    step = pool.with_rows(slots=jnp.asarray(slots), block_tables=jnp.zeros((3, 1), jnp.int32),
                          lengths=jnp.zeros(3, jnp.int32))
    for i in (0, 2):  # the linear layers
        for got, want in zip(jax.tree.leaves(step.layer(i)), jax.tree.leaves(pool.states[i // 2])):
            np.testing.assert_array_equal(got, np.asarray(want)[slots])
    new_states = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal((3, *x.shape[1:])), x.dtype), pool.states)
    written = jax.jit(append_states)(step, NewHybrid(None, new_states, jnp.array([4, 0, 0])), step.attn)
    for layer in range(2):
        leaves = (map(np.asarray, jax.tree.leaves(t)) for t in (written.states[layer], new_states[layer],
                                                                 pool.states[layer]))
        for got, new, before in zip(*leaves):
            np.testing.assert_array_equal(got[2], new[0])
            np.testing.assert_array_equal(got[:2], before[:2])


@pytest.mark.slow  # 11 s (suite time): the slot gather/scatter test above covers the pool's mechanics by default
def test_served_small_hybrid_matches_generate():
    """Two requests through one slot (the second starts where the first left its states), one
    greedy and one sampled, on a 2-layer hybrid (GDN, attention; random weights): the tokens and
    logprobs of Engine.generate."""
    hf = L.qwen_next_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            mlp_only_layers=[0, 1])
    engine = _random_engine(hf)
    prompts, params = [PROMPTS[2], PROMPTS[1][:4] + PROMPTS[3][:5]], [GREEDY, PLAIN]
    reference = engine.generate(prompts, max_new_tokens=4, sampling=params, ignore_eos=True, logprobs=True)
    config = ServingConfig(slots=1, page_size=16, max_context=32, max_chunk=32, min_chunk=32, min_table_pages=2)
    server = ServingEngine(engine, config)
    served = server.run(prompts, max_new_tokens=4, sampling=params, ignore_eos=True, logprobs=True)
    _assert_same(served, reference)
    # 3 chunks: the 21-token prompt's first stops at its page boundary (16), a snapshot point.
    assert server.stats.prefill_chunks == 3 and server.stats.preemptions == 0


# ---- slow: the converted model served ------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(hf_factory, tmp_path_factory, quick_compiles):
    """The converted tiny Qwen3-Next (delta chunk 24) and ``reference()``: Engine.generate's
    completions of the requests (computed once)."""
    _, dz_dir = hf_factory.save_and_convert(L.random_model(L.qwen_next_config(), seed=0),
                                            tmp_path_factory.mktemp("linear_serving"))
    config, weights = load_checkpoint(dz_dir, dtype=jnp.float32)
    config = dataclasses.replace(config, linear=dataclasses.replace(config.linear, chunk=DELTA_CHUNK))
    engine, done = Engine(config, weights), []

    def reference():
        if not done:
            done.append(engine.generate(PROMPTS, max_new_tokens=NEW, sampling=PARAMS, ignore_eos=True, logprobs=True))
        return done[0]

    return types.SimpleNamespace(engine=engine, config=config, weights=weights, reference=reference)


@pytest.fixture(scope="module")
def server(qwen):
    """A warmed-up server of the converted model (every step shape compiled)."""
    server = ServingEngine(qwen.engine, SERVING)
    server.warmup()
    return server


@pytest.mark.slow
def test_served_requests_match_generate(server, qwen):
    """Six requests over two slots, chunked prefill across the delta-rule chunks, greedy and
    seeded sampled rows, a repeated prompt restored from the prefix cache and its state snapshot
    (twice): every request's tokens and logprobs are Engine.generate's (a wrong or missing
    restore changes them); nothing compiled after the warm-up."""
    assert server.config.prefix_cache
    with CompileCounter() as counter:
        served = server.run(PROMPTS, max_new_tokens=NEW, sampling=PARAMS, ignore_eos=True, logprobs=True)
    assert counter.count == 0
    _assert_same(served, qwen.reference())
    assert served[4].token_ids == served[0].token_ids != served[5].token_ids  # repeated; the sampled row samples
    assert len({t for out in served for t in out.token_ids}) > 5  # not one token over and over
    stats = server.stats
    restored = [4, 5]  # their first 32 positions from the prefix cache: one chunk of 5 each
    chunks = sum(len(CHUNKS[n]) for row, n in enumerate(LENGTHS) if row not in restored) + len(restored)
    assert stats.prefill_chunks == chunks and stats.preemptions == 0
    assert stats.cached_tokens == 64 and stats.snapshots_restored == 2
    assert server.steps.shapes_run == {(1, 16, None), (1, 32, None), (1, 16, 4), (1, 32, 4), (1, 1, 4), (2, 1, 4)}


@pytest.mark.slow
def test_preempted_requests_recompute_into_each_others_slots(server, qwen):
    """Two running requests preempted by hand, one decoding and one between its two prefill
    chunks, are readmitted into each other's slots, holding the other's states, and recompute
    there (prompt + generated tokens, states included): the same tokens as Engine.generate's.
    Without a prefix cache (the requests would be restored from the one the test above filled),
    on the same compiled steps."""
    server = ServingEngine(qwen.engine, dataclasses.replace(SERVING, prefix_cache=False))
    rows = [0, 3, 1]
    before = server.stats.preemptions
    ids = [server.submit(PROMPTS[r], max_new_tokens=NEW, sampling=PARAMS[r], ignore_eos=True, logprobs=True)
           for r in rows]
    server.step()
    first, second = server._slots
    while first.generated < 2:  # the 37-token prompt decodes while the 50-token one prefills
        server.step()
    assert second.prefilling and second.computed == 32
    server._preempt(first)
    server._preempt(second)
    server.step()
    assert server._slots == [second, first] and server.stats.preemptions == before + 2
    for _ in server.stream():
        pass
    _assert_same([server.completion(i) for i in ids], qwen.reference(), rows)


# Requests that grow by 30 tokens each, on a pool of 6 pages of 16 (room for one sequence of
# max_context and 2 pages more): decoding requests run out of pages and the engine preempts (the
# schedule depends on the lengths alone: twice, with every prefill shape in the recomputation).
TINY_POOL_LENGTHS, TINY_POOL_NEW = (21, 13, 9, 30), 30
TINY_POOL_PROMPTS = [np.random.default_rng(10 + s).integers(0, 64, n).tolist() for s, n in enumerate(TINY_POOL_LENGTHS)]


@pytest.mark.slow
def test_preempted_on_a_tiny_pool_match_generate(qwen):
    """On a pool of 6 pages the engine preempts decoding requests itself and recomputes them
    (prompt + generated tokens, into whichever slot is free): Engine.generate's tokens and logprobs."""
    params = PARAMS[:len(TINY_POOL_PROMPTS)]
    reference = qwen.engine.generate(TINY_POOL_PROMPTS, max_new_tokens=TINY_POOL_NEW, sampling=params,
                                     ignore_eos=True, logprobs=True)
    server = ServingEngine(qwen.engine, dataclasses.replace(SERVING, num_pages=6))
    served = server.run(TINY_POOL_PROMPTS, max_new_tokens=TINY_POOL_NEW, sampling=params, ignore_eos=True,
                        logprobs=True)
    assert server.stats.preemptions > 0
    _assert_same(served, reference)


@pytest.mark.slow
def test_int8_kv_served_matches_generate(qwen, monkeypatch):
    """int8 KV pages, the states fp32: the six requests served in chunks of 32 have the tokens
    and logprobs of Engine.generate with int8 KV prefilling in the same chunks (a chunk attends to
    its own keys unquantized and to the earlier chunks' quantized, so the chunks must match; a
    preempted request's recomputation would not, which is why preemption is checked unquantized);
    the int8 pages do change the logprobs (against unquantized generate)."""
    engine = Engine(qwen.config, qwen.weights, kv_cache="int8")
    # No prefix cache: its chunks stop at page boundaries, and a restored request skips a chunk.
    server = ServingEngine(engine, dataclasses.replace(SERVING, min_chunk=32, prefix_cache=False))
    assert all(s.recurrent.dtype == jnp.float32 for s in server.steps.pool.states)
    assert server.steps.pool.attn.k_pages[0].values.dtype == jnp.int8
    served = server.run(PROMPTS, max_new_tokens=NEW, sampling=PARAMS, ignore_eos=True, logprobs=True)
    assert server.stats.preemptions == 0
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", 32)  # the server's chunk boundaries
    _assert_same(served, engine.generate(PROMPTS, max_new_tokens=NEW, sampling=PARAMS, ignore_eos=True,
                                         logprobs=True))
    # Each request's first token (its prompt alone decides it; those over 32 tokens read a chunk
    # of quantized keys) against the unquantized reference: int8's step is ~1% of a row's largest
    # value: measured 2e-3 to 4e-3 here, far above the tolerance.
    first = [abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(served, qwen.reference())]
    assert max(first) > 1e-3


@pytest.mark.slow  # interpreted kernels
def test_kernels_served_match_reference_generate(hf_factory, tmp_path_factory):
    """``pallas_interpret``, on a variant with linear head dims 16 (delta chunk 16): the paged
    attention kernels and the delta-rule kernels (chunked for prefill chunks of 16 and 32, the
    token-by-token kernel for decode) serve three requests over two slots with the tokens and
    logprobs of the reference path's Engine.generate."""
    hf = L.qwen_next_config(linear_key_head_dim=16, linear_value_head_dim=16)
    _, dz_dir = hf_factory.save_and_convert(L.random_model(hf, seed=1), tmp_path_factory.mktemp("linear_kernels"))
    config, weights = load_checkpoint(dz_dir, dtype=jnp.float32)
    config = dataclasses.replace(config, linear=dataclasses.replace(config.linear, chunk=16))
    rows = [0, 1, 3]  # 37, 5 and 50 tokens: every prefill shape, decode batches of 1 and 2
    prompts, params = [PROMPTS[r] for r in rows], [PARAMS[r] for r in rows]
    reference = Engine(config, weights).generate(prompts, max_new_tokens=6, sampling=params, ignore_eos=True,
                                                 logprobs=True)
    server = ServingEngine(Engine(config, weights, kernels="pallas_interpret"), SERVING)
    assert server.config.kernels is KernelMode.PALLAS_INTERPRET
    served = server.run(prompts, max_new_tokens=6, sampling=params, ignore_eos=True, logprobs=True)
    _assert_same(served, reference)
