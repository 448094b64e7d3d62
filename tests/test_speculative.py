"""Speculative decoding (engine/speculative.py): the n-gram drafter, the acceptance rule, and
lossless generation through ``Engine.generate``.

Oracles: greedy speculative output must be the plain engine's (same token ids, logprobs within
1e-5) on a dense llama, a Qwen3-MoE and a DeepSeek-V3 (MLA) model, with prompts that repeat so
drafts are proposed, accepted and rejected. The sampled acceptance rule is checked
statistically against the exact distribution of one verify step's emission, computed from
the logits with HF's own logits warpers (temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from dayzero.engine import Engine, SamplingParams
from dayzero.engine.runtime import resolve_run
from dayzero.engine.sampling import SamplingMode, batch_sampling
from dayzero.engine.speculative import (SpecConfig, SpeculativeError, accept_drafts, ngram_draft,
                                        speculative_refusal)
from dayzero.model.config import RopeType

K = 3


def _repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts whose text repeats, so the drafter finds earlier occurrences to copy from."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, vocab, 12).tolist()
    return [base * 4, base * 2 + rng.integers(0, vocab, 5).tolist() + base[:6], rng.integers(0, vocab, 20).tolist()]


def _assert_lossless(engine: Engine, prompts, new: int, spec: SpecConfig, all_accepted: bool = False) -> list:
    """Greedy speculative generation equals plain generation (ids; logprobs within 1e-5), and
    the drafter was both right and wrong somewhere (``all_accepted``: right everywhere). Returns
    the speculative completions."""
    plain = engine.generate(prompts, max_new_tokens=new, logprobs=True, ignore_eos=True)
    fast = engine.generate(prompts, max_new_tokens=new, logprobs=True, ignore_eos=True, speculative=spec)
    for p, f in zip(plain, fast):
        assert f.token_ids == p.token_ids
        np.testing.assert_allclose(f.logprobs, p.logprobs, atol=1e-5)
    accepted = sum(f.speculation.accepted for f in fast)
    drafted = sum(f.speculation.drafted for f in fast)
    if all_accepted:
        assert accepted == drafted > 0, (accepted, drafted)
    else:
        assert 0 < accepted < drafted, (accepted, drafted)
    return fast


# ---- the drafter -------------------------------------------------------------------------------


def test_ngram_draft_copies_after_the_longest_latest_match():
    seq = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    # "2 3" occurs at 1 and 5; the latest is at 5 -> proposes what followed: 4 5 7.
    assert ngram_draft(seq, 3, 1, 3).tolist() == [4, 5, 7]
    # The longest suffix wins: "7 2 3" does not occur before, "2 3" does; with min_n=max_n=3 nothing.
    assert ngram_draft(seq, 3, 3, 3).tolist() == []
    assert ngram_draft(np.array([5, 6, 5, 6, 8, 1, 5, 6]), 2, 2, 2).tolist() == [8, 1]
    # The proposal stops at the end of the sequence, and k caps it.
    assert ngram_draft(np.array([4, 8, 4]), 5, 1, 2).tolist() == [8, 4]
    assert ngram_draft(seq, 1, 1, 3).tolist() == [4]
    assert ngram_draft(np.array([7]), 3, 1, 3).tolist() == []


def test_spec_config_validation_names_the_value():
    assert SpecConfig("ngram").kind.value == "ngram"
    for kwargs, text in [(dict(kind="eagle"), "eagle"), (dict(num_draft_tokens=0), "num_draft_tokens=0"),
                         (dict(ngram=(3, 1)), "(3, 1)"), (dict(ngram=(0, 2)), "(0, 2)")]:
        with pytest.raises(SpeculativeError, match=text.replace("(", r"\(").replace(")", r"\)")):
            SpecConfig(**kwargs)


def test_refused_runs_name_the_option(tiny_model):
    config = tiny_model.config
    assert speculative_refusal(config, resolve_run(config, kernels="reference")) is None
    assert "--kernels pallas_interpret" in speculative_refusal(config, resolve_run(config, kernels="pallas_interpret"))
    dynamic = dataclasses.replace(config, rope=dataclasses.replace(config.rope, type=RopeType.DYNAMIC))
    assert "dynamic-NTK" in speculative_refusal(dynamic, resolve_run(dynamic, kernels="reference"))


# ---- the acceptance rule -----------------------------------------------------------------------


def _hf_target(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution HF's warpers (in HF's order) leave of ``logits`` [V] (float64)."""
    x = torch.tensor(logits, dtype=torch.float64)[None]
    for warper in [TemperatureLogitsWarper(p.temperature), TopKLogitsWarper(p.top_k) if p.top_k else None,
                   TopPLogitsWarper(p.top_p) if p.top_p < 1 else None, MinPLogitsWarper(p.min_p) if p.min_p else None]:
        if warper is not None:
            x = warper(None, x)
    return torch.softmax(x, -1)[0].numpy()


def _emission_distribution(logits: np.ndarray, drafts: np.ndarray, params: SamplingParams) -> dict:
    """The exact distribution of one verify step's emission over logits [3,V] with drafts [2]:
    x (first draft rejected) p0(x); (d1, y) p0(d1) p1(y); (d1, d2, z) p0(d1) p1(d2) p2(z),
    where p is what HF's warpers leave (rejected drafts come back only through a rejection)."""
    p = [_hf_target(row, params) for row in logits]
    d1, d2 = (int(d) for d in drafts)
    expected = {}
    for x in range(logits.shape[1]):
        expected[(x,)] = p[0][x] if x != d1 else 0.0
        expected[(d1, x)] = p[0][d1] * (p[1][x] if x != d2 else 0.0)
        expected[(d1, d2, x)] = p[0][d1] * p[1][d2] * p[2][x]
    return expected


# Rows of both kinds in one batch (one compile of the filtered mode): plain temperature 1, and
# temperature with every filter.
EMISSION_PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)]


def test_sampled_emission_has_the_target_distribution():
    """One verify step over many rows (same logits, seeds 0..N-1): the joint distribution of
    what a row emits must be the target model's (``_emission_distribution``), by a chi-square
    test per kind of row. Checked to fail when drafts are accepted naively (always: p-value 0)
    and when a rejected position draws from p instead of the residual (a just-rejected draft
    then comes back: 4915 of 20000 rows emitted a zero-probability cell)."""
    V, N = 8, 20000
    logits = np.array([[2.0, 1.2, 0.5, 2.4, -1.0, 0.3, 1.0, -0.5],   # d1 = 0: p0(d1) ~ 0.3-0.4
                       [0.1, 1.5, 2.0, -0.3, 0.8, 1.9, -2.0, 0.0],   # d2 = 5
                       [1.0, -1.0, 0.5, 0.2, 2.2, 0.0, 1.7, -0.4]], np.float32)
    drafts = np.array([0, 5], np.int32)
    mode, kinds = batch_sampling(EMISSION_PARAMS)
    # N rows of each kind with seeds 0..2N-1 (batch_sampling makes keys one by one: slow).
    rows = jax.tree.map(lambda x: jnp.repeat(x, N, axis=0), kinds).replace(
        keys=jax.vmap(jax.random.key)(jnp.arange(2 * N)))
    tokens, _, accepted = jax.jit(accept_drafts, static_argnames="mode")(
        jnp.broadcast_to(jnp.asarray(logits), (2 * N, 3, V)), jnp.broadcast_to(jnp.asarray(drafts), (2 * N, 2)),
        jnp.full((2 * N,), 2, jnp.int32), rows, jnp.zeros((2 * N,), jnp.int32), mode=mode)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    for kind, params in enumerate(EMISSION_PARAMS):
        expected = _emission_distribution(logits, drafts, params)
        index = {c: i for i, c in enumerate(expected)}
        counts = np.zeros(len(expected))
        for row, a in zip(tokens[kind * N:(kind + 1) * N], accepted[kind * N:(kind + 1) * N]):
            counts[index[tuple(int(t) for t in row[: a + 1])]] += 1
        probs = np.array(list(expected.values()))
        assert counts[probs == 0].sum() == 0  # filtered-out tokens are never emitted
        live = probs > 0
        chi2 = (((counts - N * probs) ** 2)[live] / (N * probs[live])).sum()
        assert stats.chi2.sf(chi2, live.sum() - 1) > 1e-6, (params, chi2)


def test_greedy_rule_accepts_the_argmax_prefix_then_corrects():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4, 16)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = np.stack([best[0, :3], [best[1, 0], (best[1, 1] + 1) % 16, best[1, 2]]]).astype(np.int32)
    mode, rows = batch_sampling([SamplingParams()] * 2)
    tokens, logprobs, accepted = accept_drafts(logits, jnp.asarray(drafts), jnp.array([3, 3]), rows,
                                               jnp.zeros(2, jnp.int32), mode)
    assert np.asarray(accepted).tolist() == [3, 1]
    assert np.asarray(tokens)[0].tolist() == best[0].tolist()  # all accepted, then the bonus token
    assert np.asarray(tokens)[1, :2].tolist() == best[1, :2].tolist()  # the argmax replaces the miss
    np.testing.assert_allclose(np.asarray(logprobs)[0], np.asarray(jax.nn.log_softmax(logits[0]))[
        np.arange(4), best[0]], atol=1e-6)


# ---- through Engine.generate -----------------------------------------------------------------


def test_greedy_is_lossless_on_a_dense_model(tiny_engine, monkeypatch):
    prompts = _repetitive_prompts(256)
    _assert_lossless(tiny_engine, prompts, 40, SpecConfig(num_draft_tokens=K))
    # One verify program per cache bucket and batch, whatever the rows accepted.
    assert [k for k in tiny_engine._steps.signatures() if k[0] == "verify" and k[3] is SamplingMode.GREEDY] == \
        [("verify", (3, K + 1), 256, SamplingMode.GREEDY)]
    # Stopping inside an accepted run: at max_new_tokens, and after an EOS (tokens after it
    # dropped). The same batch, so no new shapes compile.
    plain = [p.token_ids for p in tiny_engine.generate(prompts, max_new_tokens=40, ignore_eos=True)]
    out = tiny_engine.generate(prompts, max_new_tokens=13, speculative=SpecConfig(num_draft_tokens=K))
    assert [o.token_ids for o in out] == [p[:13] for p in plain]
    eos = next(t for i, t in enumerate(plain[0]) if i >= 8 and t not in plain[0][:i])
    monkeypatch.setattr(tiny_engine, "eos_ids", (eos,))
    out = tiny_engine.generate(prompts, max_new_tokens=40, speculative=SpecConfig(num_draft_tokens=K))
    for o, p in zip(out, plain):
        assert o.token_ids == (p[: p.index(eos) + 1] if eos in p else p)
        assert o.finish_reason == ("stop" if eos in p else "length")


@pytest.mark.slow  # the rule itself is checked by test_sampled_emission_has_the_target_distribution
def test_sampled_speculation_through_the_engine(tiny_engine):
    """Filtered sampling with speculation runs per row; a greedy row in a sampled batch is still
    exactly the plain greedy output."""
    prompts = _repetitive_prompts(256)
    params = [SamplingParams(temperature=0.7, top_k=20, seed=1), SamplingParams(), SamplingParams(temperature=1.0)]
    out = tiny_engine.generate(prompts, max_new_tokens=20, sampling=params, logprobs=True,
                               speculative=SpecConfig(num_draft_tokens=K), ignore_eos=True)
    greedy = tiny_engine.generate(prompts[1], max_new_tokens=20, logprobs=True, ignore_eos=True)
    assert out[1].token_ids == greedy.token_ids
    assert all(len(o.token_ids) == 20 and all(lp <= 0 for lp in o.logprobs) for o in out)


def test_refused_on_the_kernels_before_generating(tiny_model):
    engine = Engine(tiny_model.config, tiny_model.weights, kernels="pallas_interpret")
    with pytest.raises(SpeculativeError, match="--kernels pallas_interpret"):
        engine.generate([1, 2, 3], speculative=SpecConfig())


@pytest.mark.slow
def test_greedy_is_lossless_on_moe(tiny_moe_hf, tmp_path):
    from dayzero.convert import convert_checkpoint

    engine = Engine.load(convert_checkpoint(tiny_moe_hf, tmp_path / "dz", progress=False))
    _assert_lossless(engine, _repetitive_prompts(256), 32, SpecConfig(num_draft_tokens=K))


@pytest.mark.slow
def test_greedy_is_lossless_on_mla(hf_factory, tmp_path):
    from tests.test_deepseek import SEEDS, build_hf_deepseek

    _, dz = hf_factory.save_and_convert(build_hf_deepseek("q_lora", SEEDS["q_lora"]), tmp_path)
    _assert_lossless(Engine.load(dz), _repetitive_prompts(256), 32, SpecConfig(num_draft_tokens=K))


# ---- the command line ----------------------------------------------------------------------------


def test_cli_refusals_are_one_line(tiny_model, capsys):
    from tests.test_cli import _assert_one_line_error, _run

    base = ["generate", "--model", tiny_model.dir, "--prompt-ids", "1,2,1,2"]
    _assert_one_line_error(*_run([*base, "--num-draft-tokens", "3"], capsys), "--speculative ngram")
    _assert_one_line_error(*_run([*base, "--speculative", "ngram", "--ngram", "1-3"], capsys), "1-3")
    _assert_one_line_error(*_run([*base, "--speculative", "ngram", "--num-draft-tokens", "0"], capsys),
                           "num_draft_tokens=0")
    _assert_one_line_error(*_run([*base, "--speculative", "ngram", "--kernels", "pallas_interpret"], capsys),
                           "--kernels reference")


@pytest.mark.slow
def test_cli_generate_speculative_json(tiny_model, tiny_engine, capsys):
    import json

    from tests.test_cli import _run

    prompt = _repetitive_prompts(256)[0]
    rc, out, err = _run(["generate", "--model", tiny_model.dir, "--prompt-ids", ",".join(map(str, prompt)),
                         "--speculative", "ngram", "--num-draft-tokens", "3", "--ngram", "1,2", "--json",
                         "--max-new-tokens", "24"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    plain = tiny_engine.generate(prompt, max_new_tokens=24)
    assert got["token_ids"] == plain.token_ids
    assert got["speculative"]["accepted"] > 0 and set(got["speculative"]) == {
        "steps", "drafted", "accepted", "acceptance_rate"}


def test_bench_speculative_reports_acceptance_and_speed(tiny_engine):
    """``dayzero.tools.bench_spec``: plain and speculative runs of the same batch side by side,
    the same tokens, the draft counts summed over the rows, and positive rates."""
    from dayzero.tools.bench_spec import bench_speculative, spec_line

    prompts = _repetitive_prompts(256)[:2]
    got = bench_speculative(tiny_engine, prompts, 12, 1, SpecConfig(num_draft_tokens=K))
    spec = tiny_engine.generate(prompts, max_new_tokens=12, ignore_eos=True, speculative=SpecConfig(num_draft_tokens=K))
    assert got["same_tokens"] and got["drafter"] == "ngram" and got["num_draft_tokens"] == K
    assert (got["drafted"], got["accepted"]) == tuple(sum(getattr(o.speculation, k) for o in spec)
                                                      for k in ("drafted", "accepted"))
    assert got["acceptance_rate"] == round(got["accepted"] / got["drafted"], 4)
    assert got["tokens_per_step"] == round(2 * 11 / sum(o.speculation.steps for o in spec), 2)
    assert got["decode_tok_s"] > 0 and got["plain_decode_tok_s"] > 0 and got["speedup"] > 0
    assert "acceptance" in spec_line(got)
