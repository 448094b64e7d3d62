"""Speculative decoding in the serving engine (engine/serving_spec.py): n-gram drafts verified in
one paged step per decode, the pages rolled back by bookkeeping.

Oracle: the same requests served without speculation (itself ``Engine.generate``'s tokens,
tests/test_serving.py): greedy ids identical and logprobs within 1e-5, with drafts both accepted
and rejected, requests of different lengths finishing mid-run, a pool small enough to preempt,
and a repeated prompt served from the prefix cache. The sampled rule is tests/test_speculative.py's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dayzero.engine import Engine, SamplingParams
from dayzero.engine.generate import GenerationError
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.sampling import TokenConstraint  # noqa: F401 (the protocol the fake below follows)
from dayzero.engine.serving import ServingEngine
from dayzero.engine.speculative import SpecConfig
from tests.test_speculative import _repetitive_prompts

SPEC = SpecConfig(num_draft_tokens=3)
BASE = ServingConfig(slots=4, page_size=8, max_context=128, max_chunk=32)


def _serve(engine: Engine, config: ServingConfig, prompts, news, sampling=SamplingParams()) -> tuple[list, object]:
    server = ServingEngine(engine, config)
    ids = [server.submit(p, max_new_tokens=n, ignore_eos=True, logprobs=True, sampling=sampling)
           for p, n in zip(prompts, news)]
    for _ in server.stream():
        pass
    return [server.completion(i) for i in ids], server.stats


def _same(fast, plain) -> None:
    for f, p in zip(fast, plain):
        assert f.token_ids == p.token_ids
        np.testing.assert_allclose(f.logprobs, p.logprobs, atol=1e-5)


@pytest.mark.parametrize("config", [BASE, pytest.param(
    dataclasses.replace(BASE, max_context=80, num_pages=16, prefix_cache=False), marks=pytest.mark.slow)],
                         ids=["pool", "preempting"])
def test_greedy_serving_is_lossless(tiny_engine, config):
    prompts = _repetitive_prompts(256) + [_repetitive_prompts(256)[0]]  # the last repeats the first: cached
    news = [30, 17, 24, 30]
    plain, plain_stats = _serve(tiny_engine, config, prompts, news)
    fast, stats = _serve(tiny_engine, dataclasses.replace(config, speculative=SPEC), prompts, news)
    _same(fast, plain)
    assert [len(f.token_ids) for f in fast] == news
    assert 0 < stats.spec_accepted < stats.spec_drafted
    assert stats.decode_steps < plain_stats.decode_steps  # fewer steps for the same tokens
    if config.num_pages == 16:
        assert stats.preemptions > 0 or plain_stats.preemptions > 0


def test_sampled_requests_run_and_constrained_batches_decode_plainly(tiny_engine):
    hot = SamplingParams(temperature=0.8, top_k=20, seed=3)
    # One-token suffixes match often enough in sampled noise to draft.
    config = dataclasses.replace(BASE, speculative=SpecConfig(num_draft_tokens=3, ngram=(1, 2)))
    a, stats = _serve(tiny_engine, config, _repetitive_prompts(256)[:2], [20, 20], hot)
    b, _ = _serve(tiny_engine, config, _repetitive_prompts(256)[:2], [20, 20], hot)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] and stats.spec_drafted > 0
    assert all(len(x.token_ids) == 20 and all(lp <= 0 for lp in x.logprobs) for x in a)

    class AnyToken:  # a constraint that allows every token: the batch must decode one token a step
        def next_mask(self):
            return np.full(-(-tiny_engine.config.vocab_size // 32), 0xFFFFFFFF, np.uint32)

        def accept(self, token):
            pass

        def is_terminated(self):
            return False

    server = ServingEngine(tiny_engine, config)
    server.submit(_repetitive_prompts(256)[0], max_new_tokens=8, ignore_eos=True, constraint=AnyToken())
    for _ in server.stream():
        pass
    assert server.stats.spec_drafted == 0 and server.stats.decode_steps == 7


def test_refusals(tiny_engine):
    # (draft models: tests/test_serving_draft.py; the MTP drafter: tests/test_serving_mtp.py)
    with pytest.raises(GenerationError, match="mtp needs a model with multi-token-prediction layers"):
        ServingEngine(tiny_engine, dataclasses.replace(BASE, speculative=SpecConfig("mtp")))
    with pytest.raises(GenerationError, match="not with --kernels"):
        ServingEngine(tiny_engine, dataclasses.replace(BASE, speculative=SPEC, kernels="pallas_interpret"))
    with pytest.raises(GenerationError, match="is not a SpecConfig"):
        ServingEngine(tiny_engine, dataclasses.replace(BASE, speculative="ngram"))


def test_serve_options():
    from dayzero.engine.cli import build_parser
    from dayzero.engine.server_run import ServeError, serving_config

    parse = build_parser().parse_args
    config = serving_config(parse(["serve", "--speculative", "ngram", "--num-draft-tokens", "2"]))
    assert config.speculative == SpecConfig(num_draft_tokens=2)
    assert serving_config(parse(["serve"])).speculative is None
    with pytest.raises(ServeError, match="add --speculative ngram"):
        serving_config(parse(["serve", "--num-draft-tokens", "2"]))
    assert serving_config(parse(["serve", "--swap-space", "2MiB"])).swap_bytes == 2 << 20
    assert serving_config(parse(["serve", "--swap-space", "0"])).swap_bytes == 0
    with pytest.raises(ServeError, match="--swap-space 'lots' is not a size"):
        serving_config(parse(["serve", "--swap-space", "lots"]))
