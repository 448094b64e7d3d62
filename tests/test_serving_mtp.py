"""Serving with the MTP drafter (engine/serving_mtp.py): the model's own multi-token-prediction
module on a page pool of its own, fed the hidden states of the target's paged prefill and verify
steps, its drafts verified in one paged step per decode.

Model: test_speculative_mtp's "mirror" DeepSeek-V3 (one main layer; its MTP module computes the
main model over the sequence shifted by one token) with a vocabulary of 16 and a small random
weight on the hidden state (``_mirror``), so drafts are often but not always accepted.

Oracles:
- greedy output is plain greedy generation's (``Engine.generate`` without speculation, which
  tests/test_serving.py checks serving against; ids identical, logprobs within 1e-5), with
  requests of different lengths, a pool small enough to preempt (readmitted by swap, whose
  entries the pool recomputes, and by recompute, whose prefill hands them over) and a repeated
  prompt served from the prefix cache;
- every draft serving proposes equals the draft ``Engine.generate``'s ``MTPDrafter`` proposes
  for the same request after the same number of generated tokens (fails if the hidden-state /
  position bookkeeping is off by one: see the test);
- sampled output: the marginals of the second and third generated tokens over many seeds match
  their exact distributions from the target's logits (HF's warpers), as tests/test_serving_draft.py
  checks the draft model (p-values 0.14 and 0.57, acceptance 0.32; with each row's q reported one
  draft position late: 1e-26 and 9e-20).
"""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

import tests.test_speculative_mtp as mtp_tests
from dayzero.engine import Engine, SamplingParams
from dayzero.engine import mtp_drafter, serving_mtp
from dayzero.engine.cli import build_parser
from dayzero.engine.generate import GenerationError
from dayzero.engine.paged_steps import _STEPS, ServingConfig
from dayzero.engine.serving import ServingEngine
from dayzero.engine.speculative import DraftKind, SpecConfig
from dayzero.kernels import KernelMode
from dayzero.model.config import Family
from tests.test_serving_draft import (_serve, assert_first_verified_tokens_follow_marginals,
                                      sample_served)

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

K = 3
# 9 pages of 8 for 2 slots and prompts of 18..30 tokens growing by 14..20: the pool runs out,
# requests are preempted and readmitted. (The sampled test serves with it too: one set of programs.)
TIGHT = ServingConfig(slots=2, page_size=8, max_context=64, num_pages=9, max_chunk=16, min_table_pages=8)
NEWS = [20, 14, 18, 16]
VOCAB = 16  # tokens: the sampled test's marginals are countable over a few hundred seeds
HIDDEN_WEIGHT = 0.02  # the spread of the module's weights on the hidden state (``_mirror``)


def _mirror(**changes) -> Engine:
    """An engine over test_speculative_mtp's mirror model (its config changed by ``changes``),
    the hidden half of its module's ``eh_proj`` random instead of zero: the drafts then depend on
    the hidden states too, so that hidden states paired with the wrong positions show."""
    saved = mtp_tests.TINY
    mtp_tests.TINY = dict(saved, **changes)
    try:
        config, w = mtp_tests._mirror()
    finally:
        mtp_tests.TINY = saved
    m, D = w.mtp[0], config.hidden_size
    noise = np.random.default_rng(1).normal(0.0, HIDDEN_WEIGHT, (D, D))
    w = w.replace(mtp=(m.replace(eh_proj=m.eh_proj.at[D:].set(jnp.asarray(noise, jnp.float32))),))
    return Engine(config, w, kernels="reference")


def _prompts() -> list[list[int]]:
    """Prompts of 18, 30 and 23 tokens, then the first again (served from the prefix cache)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (18, 30, 23)]
    return prompts + [prompts[0]]


def _mtp(swap: bool = True) -> ServingConfig:
    return dataclasses.replace(TIGHT, speculative=SpecConfig("mtp", num_draft_tokens=K),
                               swap_bytes=None if swap else 0)


@pytest.fixture(scope="module")
def engine():
    return _mirror(vocab_size=VOCAB)


def _recorded(engine, config, monkeypatch) -> tuple[list, list, ServingEngine]:
    """(completions, proposals, server) of ``_prompts`` served with ``config``, each proposal
    recorded as (request ids in row order, each row's generated tokens, counts, drafts)."""
    calls = []
    propose = serving_mtp.MTPPool.propose

    def recording(self, decoding, counts):
        drafts, counts_, q = propose(self, decoding, counts)
        calls.append(([r.id for r in decoding], [r.generated for r in decoding], counts.copy(), drafts.copy()))
        return drafts, counts_, q

    monkeypatch.setattr(serving_mtp.MTPPool, "propose", recording)
    out, server = _serve(engine, config, _prompts(), NEWS)
    return out, calls, server


@pytest.fixture(scope="module")
def served(engine):
    """The requests served with MTP speculation (preempted requests swapped, then recomputed),
    proposals recorded."""
    with pytest.MonkeyPatch.context() as mp:
        swapped = _recorded(engine, _mtp(swap=True), mp)
    with pytest.MonkeyPatch.context() as mp:
        recomputed = _recorded(engine, _mtp(swap=False), mp)
    return types.SimpleNamespace(swapped=swapped, recomputed=recomputed)


@pytest.fixture(scope="module")
def generated(engine):
    """``Engine.generate``'s greedy completions of the three prompts, plain and with MTP
    speculation, the latter's proposals recorded as (tokens produced, active rows, drafts)."""
    proposals = []
    propose = mtp_drafter.MTPDrafter.propose

    def recording(self, active, produced, k):
        drafts, q = propose(self, active, produced, k)
        proposals.append((produced.copy(), active.copy(), drafts.copy()))
        return drafts, q

    prompts = _prompts()[:3]
    plain = engine.generate(prompts, max_new_tokens=max(NEWS), ignore_eos=True, logprobs=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mtp_drafter.MTPDrafter, "propose", recording)
        engine.generate(prompts, max_new_tokens=max(NEWS), ignore_eos=True,
                        speculative=SpecConfig("mtp", num_draft_tokens=K))
    return plain, proposals


def test_greedy_is_lossless_with_preemption(served, generated):
    """Accepted and rejected drafts, a pool that preempts (swap and recompute), a prefix-cache
    hit: the tokens of plain greedy generation (logprobs within 1e-5)."""
    plain = generated[0]
    for out, _, server in (served.swapped, served.recomputed):
        for i, f in enumerate(out):
            p = plain[i if i < 3 else 0]  # request 3 repeats prompt 0
            assert f.token_ids == p.token_ids[: NEWS[i]], i
            np.testing.assert_allclose(f.logprobs, p.logprobs[: NEWS[i]], atol=1e-5)
        stats = server.stats
        assert 0 < stats.spec_accepted < stats.spec_drafted
        assert stats.preemptions > 0 and stats.cached_tokens > 0
    # Swapped-in requests have no hidden states: their entries are recomputed (caught up), as are
    # the prefix cache's positions.
    assert served.swapped[2].stats.swapped_in > 0 and served.swapped[2].draft.caught_up_tokens > 0
    assert served.recomputed[2].stats.swapped_in == 0


def test_drafts_are_generates(served, generated):
    """Every serving proposal equals ``Engine.generate``'s MTPDrafter's for the same request
    after the same number of generated tokens (27 of each run's proposals). Checked to fail when
    the drafting step pairs entry j with token j instead of j+1 (``r.tokens[held : ...]`` in
    ``MTPPool.propose``: the first proposal differs) and when a verify step's hidden states are
    taken one position late (``_window(hidden, row, 1)`` in ``advance``: a later one differs); the
    greedy output stayed lossless in both (only acceptance drops)."""
    want = {(b, int(p[b])): d[b] for p, a, d in generated[1] for b in range(3) if a[b]}
    for _, calls, _ in (served.swapped, served.recomputed):
        compared = 0
        for ids, steps, counts, drafts in calls:
            for row, (i, g) in enumerate(zip(ids, steps)):
                n, b = int(counts[row]), i if i < 3 else 0  # request 3 repeats prompt 0
                if n and (b, g) in want:
                    assert drafts[row, :n].tolist() == want[b, g][:n].tolist(), (i, g)
                    compared += 1
        assert compared >= 20, compared


# ---- sampled output ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampled_runs(engine):
    """Generated tokens [N, 4] of ``PROMPT`` over N seeds (sampled with ``HOT``) served with MTP
    drafts, with the target's exact marginals of tokens 1 and 2."""
    return sample_served(ServingEngine(engine, _mtp()), engine)


@pytest.mark.slow  # ~25 s; the chi-square test of serving speculation runs by default in test_serving_draft.py
def test_sampled_tokens_are_distributed_as_the_targets(sampled_runs):
    """Tokens 1 and 2 (the first verify step's: an accepted draft, a residual or a bonus draw)
    follow the target's marginals."""
    assert_first_verified_tokens_follow_marginals(sampled_runs)


# ---- refusals and the command line ----------------------------------------------------------------


def test_refusals(engine):
    def refused(target, match, **run):
        if run:
            target = Engine(target.config, target.weights, kernels="reference")
            target.run = dataclasses.replace(target.run, **run)
        with pytest.raises(GenerationError, match=match) as e:
            ServingEngine(target, _mtp())
        assert "\n" not in str(e.value)

    def changed(**fields) -> Engine:
        return Engine(dataclasses.replace(engine.config, **fields), engine.weights, kernels="reference")

    refused(changed(family=Family.LLAMA), "needs a model with multi-token-prediction layers .* not llama")
    refused(changed(mtp_kept=False), "converted without its multi-token-prediction layers")
    refused(changed(mtp_layers=0, mtp_kept=False), r"no multi-token-prediction layers \(num_nextn_predict_layers")
    refused(engine, "contiguous cache only, not with --kernels pallas_interpret", kernels=KernelMode.PALLAS_INTERPRET)


def test_serve_option():
    from dayzero.engine.server_run import serving_config

    spec = serving_config(build_parser().parse_args(["serve", "--speculative", "mtp", "--num-draft-tokens", "2"])
                          ).speculative
    assert spec.kind is DraftKind.MTP and spec.num_draft_tokens == 2


@pytest.mark.slow  # every shape of the pool's programs (~45 s alone, ~15 s after this module's other tests)
def test_warmup_compiles_the_mtp_steps(engine):
    """After ``warmup`` MTP serving (greedy and sampled rows, preemption) compiles nothing but
    the acceptance step (which no drafter's warm-up compiles yet)."""
    server = ServingEngine(engine, _mtp())
    server.warmup()
    assert server.kv_bytes > server.steps.kv_bytes  # the module's pool, counted
    before = set(_STEPS.signatures())
    sampled = SamplingParams(temperature=1.0, seed=3)
    for i, p in enumerate(_prompts()):
        server.submit(p, max_new_tokens=NEWS[i], ignore_eos=True, sampling=sampled if i % 2 else SamplingParams())
    for _ in server.stream():
        pass
    assert server.stats.spec_drafted > 0 and server.stats.preemptions > 0
    assert {s for s in set(_STEPS.signatures()) - before if s[0] != "accept"} == set()
