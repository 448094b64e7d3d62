"""Serving with a draft model (engine/serving_draft.py): the draft on its own page pool, addressed
by the target's block tables, its drafts verified in one paged step per decode.

Oracles: greedy output must be the same requests served without speculation (itself
``Engine.generate``'s tokens, tests/test_serving.py): ids identical and logprobs within 1e-5,
with drafts accepted and rejected (a perturbed copy of the target drafts), requests of different
lengths finishing mid-run, a pool small enough to preempt (the draft recomputes a readmitted
request) and a repeated prompt served from the prefix cache. The target drafting for itself must
have every draft accepted (fails if the catch-up or the kept length is off by one); slow: a
DeepSeek-V3 (MLA, MoE) target with a perturbed copy drafting on its latent pages. Sampled output
is checked statistically: the marginals of the second and third generated tokens, over many
seeds, against their exact distributions computed from the target's logits (HF's warpers), with a
draft whose q is far from the target's p.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dayzero.engine import Engine, SamplingParams
from dayzero.engine.cli import CommandError, build_parser
from dayzero.engine.generate import GenerationError
from dayzero.engine.paged_steps import _STEPS, ServingConfig
from dayzero.engine.serving import ServingEngine
from dayzero.engine.speculative import DraftKind, SpecConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.transformer import forward
from tests.linear_mesh_checks import random_weights
from tests.serving_models import FAMILIES
from tests.test_speculative import _hf_target, _repetitive_prompts
from tests.test_speculative_draft import _perturbed

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

K = 3
# 16 pages of 8 for 4 requests of up to 78 positions: the pool runs out, requests are preempted.
# (Every greedy test serves with it: the draft, of the target's config, shares the target's programs.)
TIGHT = ServingConfig(slots=4, page_size=8, max_context=80, num_pages=16, max_chunk=32)
NEWS = [30, 17, 24, 30]


def _prompts(vocab: int) -> list[list[int]]:
    """Four prompts of 48, 35, 20 and 48 tokens; the last repeats the first (prefix cache)."""
    prompts = _repetitive_prompts(vocab)
    return prompts + [prompts[0]]


def _serve(engine: Engine, config: ServingConfig, prompts, news, sampling=SamplingParams()):
    """(completions, server) of ``prompts`` served concurrently."""
    server = ServingEngine(engine, config)
    ids = [server.submit(p, max_new_tokens=n, ignore_eos=True, logprobs=True, sampling=sampling)
           for p, n in zip(prompts, news)]
    for _ in server.stream():
        pass
    return [server.completion(i) for i in ids], server


def _spec(draft: Engine, k: int = K) -> SpecConfig:
    return SpecConfig("draft", num_draft_tokens=k, draft=draft)


def _same(fast, plain) -> None:
    for f, p in zip(fast, plain):
        assert f.token_ids == p.token_ids
        np.testing.assert_allclose(f.logprobs, p.logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def plain(tiny_engine):
    """The requests served without speculation (the oracle of the greedy tests)."""
    return _serve(tiny_engine, TIGHT, _prompts(256), NEWS)[0]


def test_greedy_is_lossless_with_preemption(tiny_engine, plain):
    """A perturbed draft (accepted and rejected drafts) on a pool that preempts: the plain tokens."""
    fast, server = _serve(tiny_engine, dataclasses.replace(TIGHT, speculative=_spec(_perturbed(tiny_engine, 0.3))),
                          _prompts(256), NEWS)
    _same(fast, plain)
    assert [len(f.token_ids) for f in fast] == NEWS
    stats = server.stats
    assert 0 < stats.spec_accepted < stats.spec_drafted
    assert stats.preemptions > 0 and stats.cached_tokens > 0
    # A readmitted request's draft recomputes: more tokens caught up than the prompts hold.
    assert server.draft.caught_up_tokens > sum(len(p) - 1 for p in _prompts(256))


def test_a_draft_that_is_the_target_accepts_everything(tiny_engine, plain):
    """Same weights: every draft is the target's argmax, so any off-by-one in the draft's catch-up,
    pending tokens or kept length shows as a rejection."""
    same = Engine(tiny_engine.config, tiny_engine.weights, kernels="reference")
    fast, server = _serve(tiny_engine, dataclasses.replace(TIGHT, speculative=_spec(same)), _prompts(256), NEWS)
    _same(fast, plain)
    stats = server.stats
    assert stats.spec_drafted > 0 and stats.spec_accepted == stats.spec_drafted
    # Every step a verify step of K drafts (but the last ones, cut by max_new_tokens): few steps.
    assert stats.decode_steps <= sum(-(-(n - 1) // (K + 1)) for n in NEWS)


@pytest.mark.slow
def test_greedy_is_lossless_on_mla_moe():
    """A DeepSeek-V3 (MLA, MoE) target and a perturbed copy as the draft, each on its latent pages."""
    from tests.serving_models import random_engine

    engine = random_engine(FAMILIES["latent"])
    prompts = _prompts(256)
    plain_out = _serve(engine, TIGHT, prompts, NEWS)[0]
    fast, server = _serve(engine, dataclasses.replace(TIGHT, speculative=_spec(_perturbed(engine, 0.3))), prompts, NEWS)
    _same(fast, plain_out)
    assert 0 < server.stats.spec_accepted < server.stats.spec_drafted


# ---- sampled output ------------------------------------------------------------------------------

SMALL = dict(FAMILIES["dense"], vocab_size=16)  # 16 tokens: marginals countable over a few hundred seeds
HOT = SamplingParams(temperature=1.0, top_k=12)
PROMPT = [3, 1, 4, 1, 5]


def _small_engine(seed: int) -> Engine:
    config = parse_hf_config(SMALL)
    return Engine(config, random_weights(config, seed), kernels="reference")


def _exact_marginals(engine: Engine, params: SamplingParams) -> list[np.ndarray]:
    """The exact distributions of generated tokens 1 and 2 (the first two a verify step emits)
    after ``PROMPT``: sum over (t0, t1) of p(t0) p(t1 | t0) p(t2 | t0, t1), from one forward over
    every two-token continuation, each position's p as HF's warpers leave the logits."""
    V = engine.config.vocab_size
    pairs = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)
    tokens = np.concatenate([np.tile(PROMPT, (V * V, 1)), pairs], axis=1)
    logits, _ = jax.jit(forward, static_argnums=1, static_argnames="all_logits")(
        engine.weights, engine.config, jnp.asarray(tokens), all_logits=True)
    logits = np.asarray(logits, np.float64)
    P = len(PROMPT)
    p0 = _hf_target(logits[0, P - 1], params)
    p1 = np.stack([_hf_target(logits[a * V, P], params) for a in range(V)])  # [t0, t1]
    p2 = np.stack([_hf_target(row, params) for row in logits[:, P + 1]]).reshape(V, V, V)  # [t0, t1, t2]
    joint01 = p0[:, None] * p1
    return [joint01.sum(0), (joint01[..., None] * p2).sum((0, 1))]


def _chi2_pvalue(tokens: np.ndarray, expected: np.ndarray) -> float:
    """The chi-square test's p-value of ``tokens`` drawn from ``expected`` (tokens of zero
    probability must never appear)."""
    counts = np.bincount(tokens, minlength=len(expected))
    assert counts[expected == 0].sum() == 0
    live = expected > 0
    e = expected[live] * len(tokens)
    return float(stats.chi2.sf((((counts[live] - e) ** 2) / e).sum(), live.sum() - 1))


@pytest.fixture(scope="module")
def sampled_runs():
    """Generated tokens [N, 4] of ``PROMPT`` over N seeds (sampled with ``HOT``), served with
    K = 2 drafts of a sharpened target (its logits x3: q far from p, concentrated on p's likely
    tokens), with the target's exact marginals of tokens 1 and 2."""
    target = _small_engine(0)
    sharp = Engine(target.config, dataclasses.replace(target.weights, final_norm=3 * target.weights.final_norm),
                   kernels="reference")
    config = ServingConfig(slots=8, page_size=8, max_context=16, max_chunk=16, speculative=_spec(sharp, 2))
    return sample_served(ServingEngine(target, config), target)


def sample_served(server: ServingEngine, target: Engine, n: int = 400) -> types.SimpleNamespace:
    """``PROMPT`` served ``n`` times with seeds 0..n-1 (sampled with ``HOT``, 4 tokens each):
    the tokens [n, 4], the server's stats and the ``target``'s exact marginals of tokens 1 and 2."""
    ids = [server.submit(PROMPT, max_new_tokens=4, ignore_eos=True, sampling=dataclasses.replace(HOT, seed=s))
           for s in range(n)]
    for _ in server.stream():
        pass
    tokens = np.array([server.completion(i).token_ids for i in ids])
    return types.SimpleNamespace(tokens=tokens, stats=server.stats, exact=_exact_marginals(target, HOT))


def test_sampled_tokens_are_distributed_as_the_targets(sampled_runs):
    """Tokens 1 and 2 (the first verify step's: an accepted draft, a residual or a bonus draw)
    follow the target's marginals (p-values 0.37 and 0.41). Checked to fail when a rejection
    draws from p instead of max(0, p - q) (p-values 3e-5 and 1e-4), and when the drafts' q are
    shifted by one position (acceptance 0.99; p-values 5e-18 and 2e-18)."""
    assert_first_verified_tokens_follow_marginals(sampled_runs)


def assert_first_verified_tokens_follow_marginals(runs) -> None:
    """Both branches of the acceptance ran (0.1 < acceptance < 0.9) and tokens 1 and 2 of the
    runs (``runs.tokens`` [N, T], ``runs.exact`` the target's marginals) pass a chi-square test
    at p > 1e-3."""
    assert 0.1 < runs.stats.spec_accepted / runs.stats.spec_drafted < 0.9  # both branches of the rule ran
    for position in (1, 2):
        p = _chi2_pvalue(runs.tokens[:, position], runs.exact[position - 1])
        assert p > 1e-3, (position, p)


# ---- refusals, CLI, warmup -------------------------------------------------------------------------


def test_refusals(tiny_engine):
    def refused(spec, match):
        with pytest.raises(GenerationError, match=match) as e:
            ServingEngine(tiny_engine, dataclasses.replace(TIGHT, speculative=spec))
        assert "\n" not in str(e.value)

    wider = dataclasses.replace(tiny_engine.config, vocab_size=tiny_engine.config.vocab_size + 1)
    refused(_spec(Engine(wider, tiny_engine.weights, kernels="reference")), "vocabulary .* is larger than the target's")
    from tests import linear_helpers as L

    hybrid = parse_hf_config(L.qwen_next_config().to_dict())  # per-slot states: cannot roll back
    refused(_spec(Engine(hybrid, random_weights(hybrid), kernels="reference")), "draft model cannot draft: .*linear")
    on_mesh = Engine(tiny_engine.config, tiny_engine.weights, kernels="reference")
    on_mesh.run = dataclasses.replace(on_mesh.run, placement=object())  # as a --mesh run's (never used)
    refused(_spec(on_mesh), "draft model cannot draft: .*one device")
    short = Engine(dataclasses.replace(tiny_engine.config, max_position_embeddings=64), tiny_engine.weights,
                   kernels="reference")
    refused(_spec(short), r"draft model's context \(64 tokens\) is shorter than this server's max_context of 80")
    refused(SpecConfig("draft", draft="a path"), "is not an Engine")


def test_serve_option(tiny_model):
    from dayzero.engine.server_run import serving_config

    parse = build_parser().parse_args
    spec = serving_config(parse(["serve", "--speculative", f"draft:{tiny_model.dir}", "--num-draft-tokens", "2"])
                          ).speculative
    assert spec.kind is DraftKind.DRAFT and spec.num_draft_tokens == 2
    assert spec.draft.config.vocab_size == tiny_model.config.vocab_size
    with pytest.raises(CommandError, match="draft:DIR"):
        serving_config(parse(["serve", "--speculative", "draft"]))


def test_warmup_compiles_the_drafts_steps(tiny_engine):
    """After ``warmup`` serving runs no draft forward shape or draw it did not compile."""
    same = Engine(tiny_engine.config, tiny_engine.weights, kernels="reference")
    config = ServingConfig(slots=1, page_size=8, max_context=32, max_chunk=16, speculative=_spec(same, 2))
    server = ServingEngine(tiny_engine, config)
    server.warmup()
    assert server.kv_bytes == 2 * server.steps.kv_bytes  # the draft's pool, of the same model, counted
    shapes, draws = set(server.draft.steps.shapes_run), {s for s in _STEPS.signatures() if s[0] == "draft_draw"}
    prompts = [_repetitive_prompts(256)[0][:20], _repetitive_prompts(256)[2][:9]]
    for p in prompts:
        server.submit(p, max_new_tokens=10, ignore_eos=True)
    for _ in server.stream():
        pass
    assert server.stats.spec_accepted == server.stats.spec_drafted > 0
    assert server.draft.steps.shapes_run == shapes
    assert {s for s in _STEPS.signatures() if s[0] == "draft_draw"} == draws
