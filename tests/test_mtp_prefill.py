"""The MTP drafter's prompt entries come from the engine's own prefill: ``Engine._prefill_chunks``
(engine/generate.py) returns the main model's post-final-norm hidden states when asked
(``hidden=True``), and ``MTPDrafter`` (engine/mtp_drafter.py) writes its entries from them, so the
main model runs over the prompt once.

Oracles: the main model's hidden states in one unchunked pass over each prompt
(``test_speculative_mtp._main_hidden``), and the plain engine's greedy output. The prompts are
cut into several prefill chunks (``PREFILL_CHUNK`` lowered to 16) and have ragged lengths, so a
chunk mix-up (wrong order, wrong row, a chunk missing) shows.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.engine import Engine
from dayzero.engine import generate as generate_module
from dayzero.engine.mtp_drafter import mtp_chain, mtp_entries
from dayzero.engine.sampling import SamplingParams, batch_sampling
from dayzero.engine.speculative import SpecConfig, append_verified, verify_step
from tests.test_speculative_mtp import _close, _main_hidden, _mirror

CHUNK, LENGTHS, NEW, K = 16, (3, 20, 40), 8, 3  # 40 tokens: three chunks of 16

pytestmark = pytest.mark.usefixtures("quick_compiles")


@pytest.fixture(scope="module")
def setup():
    config, w = _mirror()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in LENGTHS]
    return config, w, Engine(config, w, kernels="reference"), prompts


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", CHUNK)


def test_prefill_returns_the_main_models_hidden_states(setup):
    """``hidden=True``: one [B,16,D] array per chunk, equal at every real position to the main
    model's hidden states over the whole prompt in one pass; the tokens and log-probabilities
    are the default prefill's, and the default returns what it always did (no hidden states)."""
    config, w, engine, prompts = setup
    lengths = np.array(LENGTHS, np.int32)
    mode, rows = batch_sampling([SamplingParams()] * len(prompts))
    plain = engine._prefill_chunks(prompts, lengths, NEW, rows, mode)
    assert len(plain) == 3 and not any("hidden" in key for key in engine._steps.signatures())
    tok, lp, cache, hidden = engine._prefill_chunks(prompts, lengths, NEW, rows, mode, hidden=True)
    assert [h.shape for h in hidden] == [(len(prompts), CHUNK, config.hidden_size)] * 3
    np.testing.assert_array_equal(tok, plain[0])
    np.testing.assert_allclose(lp, plain[1], atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, plain[2].lengths)
    got = np.concatenate([np.asarray(h) for h in hidden], axis=1)
    # One causal pass over the prompts padded at the end: the padding cannot reach a real position.
    padded = np.zeros((len(prompts), max(LENGTHS)), np.int32)
    for b, row in enumerate(prompts):
        padded[b, : len(row)] = row
    want = np.asarray(_main_hidden(w, config, jnp.asarray(padded)))
    for b, n in enumerate(LENGTHS):
        assert _close(got[b, :n], want[b, :n]), b


def test_mtp_generation_runs_the_main_model_over_the_prompt_once(setup, monkeypatch):
    """Greedy MTP speculation over chunked ragged prompts is plain greedy output, and every
    compiled step it runs is one of the known ones: the main model meets the prompt's chunks in
    exactly three steps (the prefill's), and no step is a second prefill for the drafter (the
    drafter's former ``mtp_prompt`` steps, or any new one)."""
    config, w, engine, prompts = setup
    plain = engine.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    calls = []
    call = engine._steps.call

    def recording(fn, signature, *args, **kwargs):
        calls.append((fn, signature))
        return call(fn, signature, *args, **kwargs)

    monkeypatch.setattr(engine._steps, "call", recording)
    spec = SpecConfig("mtp", num_draft_tokens=K)
    fast = engine.generate(prompts, max_new_tokens=NEW, ignore_eos=True, speculative=spec)
    assert [f.token_ids for f in fast] == [p.token_ids for p in plain]
    assert sum(f.speculation.drafted for f in fast) > 0
    known = {engine._prefill, engine._decode, engine._append, verify_step, append_verified, mtp_entries, mtp_chain}
    assert all(fn in known for fn, _ in calls), [s for fn, s in calls if fn not in known]
    assert not [s for _, s in calls if "mtp_prompt" in repr(s)]
    main_over_prompt = [s for fn, s in calls if fn in (engine._prefill, engine._decode)
                        and s[0] == (len(prompts), CHUNK)]
    assert len(main_over_prompt) == 3 and all("hidden" in s for s in main_over_prompt), main_over_prompt
