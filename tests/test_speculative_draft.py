"""Speculative decoding with a draft model (engine/draft_model.py): lossless greedy generation,
the acceptance rule against a drafter with its own distribution q, the CLI, and the refusals.

Oracles: greedy speculative output must be the plain engine's (same ids, logprobs within 1e-5)
on a dense llama (default) and on a Qwen3-MoE and a DeepSeek-V3 (MLA) model (slow). The drafts
come from the target itself (every draft accepted: the cache bookkeeping when all K pass) and
from a perturbed copy of the target (agrees often, not always: rejections roll the draft's cache
back). The sampled rule is checked statistically: drafts drawn from a random q, the first emitted
token must be distributed as p0 and the second (where emitted) as p1, computed with HF's own
logits warpers (tests/test_speculative.py ``_hf_target``).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dayzero.engine import Engine, SamplingParams
from dayzero.engine.cli import main
from dayzero.engine.sampling import batch_sampling
from dayzero.engine.speculative import SpecConfig, SpeculativeError, accept_drafts
from tests.test_speculative import EMISSION_PARAMS, K, _hf_target, _repetitive_prompts
from tests.test_speculative import _assert_lossless as assert_lossless

NEW = 24


def _perturbed(engine: Engine, scale: float, seed: int = 0) -> Engine:
    """A draft: ``engine``'s model with every float weight moved by ``scale`` times its own
    spread (close enough to agree often, far enough to disagree sometimes)."""
    leaves, tree = jax.tree.flatten(engine.weights)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
             if jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1 else x for x, k in zip(leaves, keys)]
    return Engine(engine.config, jax.tree.unflatten(tree, moved), kernels="reference")


def _assert_lossless(engine: Engine, draft: Engine, prompts, partial: bool) -> None:
    """``test_speculative._assert_lossless`` with ``draft`` drafting (``partial``: drafts both
    accepted and rejected, else every draft accepted)."""
    spec = SpecConfig("draft", num_draft_tokens=K, draft=draft)
    assert_lossless(engine, prompts, NEW, spec, all_accepted=not partial)


def test_greedy_is_lossless_on_a_dense_model(tiny_engine):
    prompts = _repetitive_prompts(256)
    _assert_lossless(tiny_engine, Engine(tiny_engine.config, tiny_engine.weights, kernels="reference"), prompts,
                     partial=False)
    _assert_lossless(tiny_engine, _perturbed(tiny_engine, 0.3), prompts, partial=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["moe", "mla"])
def test_greedy_is_lossless_on_moe_and_mla(family, tiny_moe_hf, hf_factory, tmp_path):
    from dayzero.convert import convert_checkpoint

    if family == "moe":
        convert_checkpoint(tiny_moe_hf, tmp_path / "dz", progress=False)
        engine = Engine.load(tmp_path / "dz", progress=False)
    else:
        from tests.test_deepseek import SEEDS, build_hf_deepseek

        _, dz = hf_factory.save_and_convert(build_hf_deepseek("q_lora", SEEDS["q_lora"]), tmp_path)
        engine = Engine.load(dz, progress=False)
    _assert_lossless(engine, _perturbed(engine, 0.3), _repetitive_prompts(engine.config.vocab_size), partial=True)


@pytest.mark.slow  # ~16 s; the rule itself is checked by the chi-square test below
def test_sampled_generation_with_a_draft_repeats_itself(tiny_engine):
    """Sampled rows (with filters) and a greedy row in one batch, drafted by a perturbed copy:
    every row gets its tokens, a seed repeats them, and the greedy row is plain greedy output."""
    draft = _perturbed(tiny_engine, 0.3)
    prompts = _repetitive_prompts(256)
    params = [SamplingParams(temperature=0.7, top_k=20, seed=1), SamplingParams(), SamplingParams(temperature=1.0)]
    spec = SpecConfig("draft", num_draft_tokens=K, draft=draft)
    a, b = (tiny_engine.generate(prompts, max_new_tokens=12, sampling=params, speculative=spec, ignore_eos=True)
            for _ in range(2))
    assert [x.token_ids for x in a] == [x.token_ids for x in b] and all(len(x.token_ids) == 12 for x in a)
    assert a[1].token_ids == tiny_engine.generate(prompts[1], max_new_tokens=12, ignore_eos=True).token_ids
    assert sum(x.speculation.accepted for x in a) > 0


def test_sampled_emission_against_a_draft_distribution():
    """Drafts drawn from a random q per row (seeded), one verify step over many rows: the first
    emitted token is distributed as p0 and the second, where emitted, as p1 (chi-square per kind
    of row). Checked to fail when q is ignored (the point-mass rule applied to q's drafts)."""
    V, N = 8, 20000
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 1.5
    q = rng.dirichlet(np.ones(V), size=2).astype(np.float32)  # the drafter's q0, q1
    drafts = np.stack([rng.choice(V, size=2 * N, p=q[i] / q[i].sum()) for i in range(2)], axis=1).astype(np.int32)
    mode, kinds = batch_sampling(EMISSION_PARAMS)
    rows = jax.tree.map(lambda x: jnp.repeat(x, N, axis=0), kinds).replace(
        keys=jax.vmap(jax.random.key)(jnp.arange(2 * N)))
    tokens, _, accepted = jax.jit(accept_drafts, static_argnames="mode")(
        jnp.broadcast_to(jnp.asarray(logits), (2 * N, 3, V)), jnp.asarray(drafts), jnp.full((2 * N,), 2, jnp.int32),
        rows, jnp.zeros((2 * N,), jnp.int32), mode=mode, draft_probs=jnp.broadcast_to(jnp.asarray(q), (2 * N, 2, V)))
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    for kind, params in enumerate(EMISSION_PARAMS):
        p = [_hf_target(row, params) for row in logits]
        mine = slice(kind * N, (kind + 1) * N)
        for position, rows_here in [(0, np.ones(N, bool)), (1, accepted[mine] >= 1)]:
            counts = np.bincount(tokens[mine][rows_here, position], minlength=V)
            expected = p[position] * rows_here.sum()
            assert counts[expected == 0].sum() == 0  # filtered-out tokens are never emitted
            live = expected > 0
            chi2 = (((counts - expected) ** 2)[live] / expected[live]).sum()
            assert stats.chi2.sf(chi2, live.sum() - 1) > 1e-6, (params, position, chi2)


def test_refusals_name_the_problem(tiny_engine, tmp_path, capsys):
    with pytest.raises(SpeculativeError, match="needs a draft model"):
        SpecConfig("draft")
    with pytest.raises(SpeculativeError, match="only it takes one"):
        SpecConfig("ngram", draft=tiny_engine)
    wider = dataclasses.replace(tiny_engine.config, vocab_size=tiny_engine.config.vocab_size + 1)
    small = Engine(wider, tiny_engine.weights, kernels="reference")
    with pytest.raises(SpeculativeError, match="vocabulary .* is larger than the target's"):
        tiny_engine.generate([1, 2, 3], max_new_tokens=2, speculative=SpecConfig("draft", draft=small))
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--speculative", "draft"]) == 2
    assert "--speculative draft:DIR" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--speculative", "nope"]) == 2
    assert "use ngram, mtp or draft:DIR" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_draft_model(tiny_model, tiny_engine, capsys):
    """``generate --speculative draft:DIR --json``: the plain greedy tokens and the acceptance
    report (the target drafting for itself: every draft accepted)."""
    prompt = _repetitive_prompts(256)[0]
    assert main(["generate", "--model", str(tiny_model.dir), "--prompt-ids", ",".join(map(str, prompt)), "--json",
                 "--max-new-tokens", "12", "--speculative", f"draft:{tiny_model.dir}", "--num-draft-tokens", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == tiny_engine.generate(prompt, max_new_tokens=12).token_ids
    assert got["speculative"]["drafted"] > 0 and got["speculative"]["acceptance_rate"] == 1.0
