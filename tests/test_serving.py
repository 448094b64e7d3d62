"""Continuous batching over the paged KV cache (``dayzero.engine.serving``).

The reference is ``Engine.generate`` running each request alone (contiguous cache, its own
compiled steps): served concurrently, with requests joining and leaving the decode slots,
prefilled in chunks, sharing prefix pages, or preempted and recomputed, every request must
produce exactly the tokens it produces alone. Most tests share one warmed-up server over the
session's tiny llama (conftest.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from dayzero.engine import Engine, GenerationError, SamplingParams
from dayzero.tools.measure import CompileCounter
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.weights import abstract_weights, init_weights

PAGE = 8
# Context 128 (16 pages, tables 8 or 16 wide), prefill chunks of 16 or 32 tokens, 4 decode slots
# (decode batches of 1, 2 or 4 rows).
SERVING = ServingConfig(slots=4, page_size=PAGE, num_pages=48, max_context=128, max_chunk=32, min_chunk=16,
                        min_table_pages=8)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


# Mixed lengths: shorter than a chunk, several chunks, exactly a page, one token.
PROMPTS = [_prompt(n, s) for s, n in enumerate((5, 70, 17, 40, 1, 24))]
NEW = [12, 5, 20, 8, 30, 16]


@pytest.fixture(scope="module")
def server(tiny_engine):
    """A warmed-up server over the session's tiny llama (compiles nothing more)."""
    server = ServingEngine(tiny_engine, SERVING)
    server.warmup()
    return server


def _alone(engine, prompt, max_new, sampling=SamplingParams(), ignore_eos=False):
    return engine.generate(prompt, max_new_tokens=max_new, sampling=sampling, ignore_eos=ignore_eos, logprobs=True)


def test_concurrent_greedy_requests_match_each_alone(server, tiny_engine):
    """Six requests of mixed lengths over four slots (two wait, then join as others leave)."""
    served = server.run(PROMPTS, max_new_tokens=NEW, logprobs=True)
    for prompt, new, out in zip(PROMPTS, NEW, served):
        alone = _alone(tiny_engine, prompt, new)
        assert out.token_ids == alone.token_ids
        assert out.finish_reason == alone.finish_reason
        np.testing.assert_allclose(out.logprobs, alone.logprobs, rtol=1e-4, atol=1e-5)
    assert server.stats.prefill_chunks > len(PROMPTS)  # the 70- and 40-token prompts took several chunks
    assert server.pool.in_use == 0  # every page was given back


@pytest.mark.slow  # seeded sampling through serving runs by default in tests/test_server.py
def test_sampled_requests_are_the_same_alone_and_among_others(server, tiny_engine):
    """Sampled requests keep their own parameters and seeds whatever shares the batch, and
    whichever sampling mode the batch needs (greedy, plain and filtered rows mixed)."""
    plain = SamplingParams(temperature=1.0, seed=5)
    filtered = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)
    mixed = [plain, SamplingParams(), SamplingParams(temperature=1.5, seed=1), SamplingParams(), filtered, plain]
    served = server.run(PROMPTS, max_new_tokens=NEW, sampling=mixed, ignore_eos=True)
    for prompt, new, params, out in zip(PROMPTS, NEW, mixed, served):
        assert out.token_ids == server.run([prompt], max_new_tokens=new, sampling=params, ignore_eos=True)[0].token_ids
    # As Engine.generate draws them alone (prompts of 5 and 1 tokens: one compiled bucket there).
    for i in (0, 4):
        assert served[i].token_ids == _alone(tiny_engine, PROMPTS[i], NEW[i], mixed[i], ignore_eos=True).token_ids
    greedy = server.run([PROMPTS[0]], max_new_tokens=NEW[0], ignore_eos=True)[0].token_ids
    assert served[0].token_ids != greedy  # it does sample


def test_prefix_cache_hit_gives_the_same_output_and_skips_the_shared_pages(server, tiny_engine):
    shared = _prompt(45, 100)  # 5 full pages of 8, then 5 tokens
    first, second = shared + _prompt(6, 101), shared + _prompt(9, 102)
    server.pool.clear_cache()
    before = server.stats.prefill_tokens, server.stats.cached_tokens
    a = server.run([first], max_new_tokens=10, ignore_eos=True)[0]
    assert server.stats.prefill_tokens - before[0] == len(first) and server.stats.cached_tokens == before[1]
    b = server.run([second], max_new_tokens=10, ignore_eos=True)[0]
    assert server.stats.cached_tokens - before[1] == 5 * PAGE
    assert server.stats.prefill_tokens - before[0] == len(first) + len(second) - 5 * PAGE
    assert a.token_ids == _alone(tiny_engine, first, 10, ignore_eos=True).token_ids
    assert b.token_ids == _alone(tiny_engine, second, 10, ignore_eos=True).token_ids
    # The same prompt again hits every full page but the last one's last token, whose logits
    # give the first new token (here: 6 full pages of the 51 tokens, 48 cached, 3 computed).
    again = server.run([first], max_new_tokens=10, ignore_eos=True)[0]
    assert again.token_ids == a.token_ids
    assert server.stats.cached_tokens - before[1] == 5 * PAGE + 6 * PAGE


def test_without_prefix_cache_nothing_is_reused(tiny_engine):
    server = ServingEngine(tiny_engine, dataclasses.replace(SERVING, prefix_cache=False))
    out = server.run([PROMPTS[1], PROMPTS[1]], max_new_tokens=3, ignore_eos=True)
    assert out[0].token_ids == out[1].token_ids
    assert server.stats.cached_tokens == 0 and server.stats.prefill_tokens == 2 * len(PROMPTS[1])


def test_pool_exhaustion_preempts_and_every_request_finishes_unchanged(server, tiny_engine):
    """Another tenant holds 32 of the 48 pages: the 16 left (128 tokens) cannot hold four
    requests growing to ~60 tokens each, so decode runs out of pages, the latest admitted request
    is preempted and later recomputed (same pool shape as the shared server: nothing compiles)."""
    held = [server.pool.allocate() for _ in range(32)]
    before = server.stats.preemptions
    prompts = [_prompt(n, 200 + n) for n in (20, 30, 9, 25, 14)]
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=10, seed=4), SamplingParams()]
    try:
        served = server.run(prompts, max_new_tokens=40, sampling=params, ignore_eos=True)
    finally:
        server.pool.release(held)
    assert server.stats.preemptions > before
    for prompt, p, out in zip(prompts, params, served):
        assert out.token_ids == _alone(tiny_engine, prompt, 40, p, ignore_eos=True).token_ids
    assert server.pool.in_use == 0


def test_no_compilation_after_warmup_across_a_mixed_workload(server):
    """Mixed lengths (1..120 tokens, prefix hits, several chunk and table widths), greedy,
    plain and filtered sampling, requests joining mid-stream: nothing compiles."""
    prompts = [_prompt(n, 300 + n) for n in (1, 15, 16, 33, 64, 100, 120)] + [PROMPTS[1] + [3, 4]]
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=2), SamplingParams(top_k=5, temperature=1.0)]
    with CompileCounter() as counter:
        ids = [server.submit(p, max_new_tokens=min(128 - len(p), 9), sampling=params[i % 3])
               for i, p in enumerate(prompts[:4])]
        for i, event in enumerate(server.stream()):
            if i == 3:  # join while others run
                ids += [server.submit(p, max_new_tokens=min(128 - len(p), 9)) for p in prompts[4:]]
        assert all(server.completion(i).token_ids for i in ids)
    assert counter.count == 0


def test_stream_yields_every_token_once_and_finishes_each_request(server):
    ids = [server.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[:3], NEW[:3])]
    events = list(server.stream())
    for rid in ids:
        mine = [e for e in events if e.request_id == rid]
        out = server.completion(rid)
        assert [e.token for e in mine] == out.token_ids
        assert [e.finish_reason for e in mine] == [None] * (len(mine) - 1) + [out.finish_reason]
    assert not server.has_work


def test_eos_stops_a_served_request(tiny_model, tiny_engine):
    """With EOS := a token the greedy run emits at step >= 2, the request stops there, as alone."""
    greedy = tiny_engine.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True).token_ids
    stop = next(i for i, t in enumerate(greedy) if i >= 2 and greedy.index(t) == i)
    engine = Engine(tiny_model.config, tiny_model.weights)
    engine.eos_ids = (greedy[stop],)
    out = ServingEngine(engine, SERVING).run([PROMPTS[0], PROMPTS[2]], max_new_tokens=12)
    assert out[0].token_ids == greedy[: stop + 1] and out[0].finish_reason == "stop"
    other = tiny_engine.generate(PROMPTS[2], max_new_tokens=12, ignore_eos=True).token_ids
    cut = other.index(greedy[stop]) + 1 if greedy[stop] in other else len(other)
    assert out[1].token_ids == other[:cut]
    assert out[1].finish_reason == ("stop" if cut < len(other) or other[-1] == greedy[stop] else "length")


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(prompt=_prompt(120, 0), max_new_tokens=9), "max_context of 128"),
        (dict(prompt=_prompt(5, 0), max_new_tokens=0), "max_new_tokens=0"),
        (dict(prompt=[1, 999]), "999"),
        (dict(prompt=[]), "empty"),
        (dict(prompt=[1, 2], sampling=0.5), "SamplingParams"),
    ],
    ids=["past_max_context", "no_new_tokens", "bad_id", "empty", "bad_sampling"],
)
def test_bad_requests_are_refused_at_submit(server, kwargs, text):
    with pytest.raises(GenerationError, match=text):
        server.submit(**kwargs)


@pytest.mark.parametrize("budget", [1 << 10, 1 << 12])
def test_warmup_covers_every_chunk_shape(tiny_model, budget):
    """Every (chunk, table width) the scheduler can ask for is among those warm-up compiles."""
    config = dataclasses.replace(SERVING, chunk_budget=budget).resolve(tiny_model.config)
    shapes = set(config.prefill_shapes())
    for start in range(config.max_context):
        for remaining in range(1, config.max_context - start + 1):
            T, W = config.chunk_shape(start, remaining)
            assert (T, W) in shapes, (start, remaining)
            assert W is None or config.pages_for(start + min(T, remaining)) <= W  # the table holds the chunk
    # Under the small budget a 32-token chunk never reads a 16-page (128-position) table.
    assert ((32, 16) in shapes) == (budget >= 32 * 16 * PAGE)


def test_run_with_a_bad_prompt_queues_nothing(server):
    with pytest.raises(GenerationError, match="999"):
        server.run([PROMPTS[0], [1, 999]], max_new_tokens=3)
    assert not server.has_work


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(num_pages=10), "num_pages=10 cannot hold one sequence of max_context=128"),
        (dict(max_context=4096), "max_context=4096 is more than the model's context of 256"),
        (dict(max_chunk=48), "max_chunk=48"),
        (dict(chunk_budget=100), "chunk_budget=100"),
        (dict(slots=0), "slots=0"),
    ],
)
def test_bad_serving_config_is_refused(tiny_engine, kwargs, text):
    with pytest.raises(GenerationError, match=text):
        ServingEngine(tiny_engine, dataclasses.replace(SERVING, **kwargs))


@pytest.mark.slow  # latent pages served: tests/test_mesh_serving.py and test_serving_kernels.py
def test_latent_attention_model_is_served_like_alone():
    """DeepSeek-V3.2 (multi-head latent attention + sparse attention): latent and indexer-key
    pages; the indexer's top-8 of 16+ visible tokens really drops some."""
    config = parse_hf_config(dict(
        model_type="deepseek_v32", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
        index_topk=8, index_n_heads=16, index_head_dim=32))
    engine = Engine(config, init_weights(abstract_weights(config), jax.random.key(0), scale=0.2))
    prompts = [_prompt(n, 400 + n) for n in (3, 12, 14)]  # one prompt bucket in Engine.generate
    served = ServingEngine(engine, SERVING).run(prompts, max_new_tokens=[10, 6, 12], ignore_eos=True)
    for prompt, new, out in zip(prompts, (10, 6, 12), served):
        assert out.token_ids == engine.generate(prompt, max_new_tokens=new, ignore_eos=True).token_ids


@pytest.mark.slow  # chunked prefill's tokens are checked by default (test_engine, test_serving_kernels)
def test_long_prompt_prefills_in_chunks_with_flat_step_memory():
    """A 32k-token prompt on a one-layer, one-head model: chunks shrink as the context grows, so
    that chunk tokens x attended positions stays under the budget, and the memory XLA plans for a
    prefill step stays flat from where the budget starts to bind (4k positions) up to the whole
    prompt, where a fixed 512-token chunk would need several times more."""
    length, budget, page, max_chunk = 32768, 1 << 21, 256, 512
    config = parse_hf_config(dict(
        model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=16, vocab_size=256, max_position_embeddings=length + page,
        rms_norm_eps=1e-5))
    engine = Engine(config, init_weights(abstract_weights(config), jax.random.key(0), scale=0.2))
    server = ServingEngine(engine, ServingConfig(slots=1, page_size=page, max_chunk=max_chunk, chunk_budget=budget))
    out = server.run([_prompt(length, 7)], max_new_tokens=2, ignore_eos=True)[0]
    assert len(out.token_ids) == 2
    assert server.stats.prefill_tokens == length and server.stats.prefill_chunks > length // max_chunk
    prefill = {(T, W) for B, T, W in server.steps.shapes_run if T > 1}
    for T, W in prefill:
        assert T <= max_chunk and T * (W or 0) * page <= budget, (T, W)
    assert server.stats.largest_chunk_scores <= budget + max_chunk**2
    binds = budget // (max_chunk * page)  # the table width at which the budget starts to shrink chunks
    widest = max(W for _, W in prefill if W is not None)
    assert widest * page >= length and widest >= 4 * binds
    temp = {W: server.steps.forward_temp_bytes(1, T, W) for T, W in prefill if W in (binds, widest)}
    assert temp[widest] <= 1.25 * temp[binds], temp
    assert server.steps.forward_temp_bytes(1, max_chunk, widest) > 3 * temp[widest]
