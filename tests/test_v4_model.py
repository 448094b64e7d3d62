"""DeepSeek-V4 (HF ``deepseek_v4``) through the whole model: parity with HF transformers.

The tiny random model of tests/v4_helpers.py (layers sliding, CSA (ratio 4), HCA (ratio 16), CSA;
hash-routed then top-k MoE; 4 hyper-connection streams; randomised sinks, position biases, hc
mixes, score biases and hash tables) goes through the real converter. Checked:

(a) fp32 logits of a 300-token prompt against HF's: past the 16-token window, 18 HCA windows,
    75 CSA windows, so the indexer's top-8 is a real choice;
(b) 32 greedy tokens through ``Engine.generate`` equal HF ``generate``'s (HF's own cache path);
(c) prefill then one-token decode steps equal one full pass (window ring, entries, compressor
    states and indexer keys through the contiguous cache);
(d) a ragged batch of two rows fed in chunks of odd sizes (windows closing mid-chunk, one-token
    chunks, padding) equals each row's full pass.

Default suite: the config, the tie gaps, (a) and (d); (b), (c) and per-layer ``verify`` under
``-m slow``.

Random routers and indexers can sit near ties: the router's C-th/(C+1)-th score gap on the
top-k layers and the indexer's k-th/(k+1)-th score gap are asserted on HF's own forward first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dayzero.model.cache import append_to_cache, init_cache
from dayzero.model.config import AttentionKind, CompressKind, Family, ModelConfig
from dayzero.model.transformer import forward
from tests.hf_helpers import (
    MIN_ROUTER_GAP, all_logits, assert_logits_match, assert_steps_match_full, convert_case, greedy_vs_hf, hf_logits,
    random_ids,
)
from tests.v4_helpers import tiny_hf_model

LONG, PREFILL, NEW = 300, 280, 32
# Smallest relative choice gaps on the long prompt (k-th vs (k+1)-th score over max |score|), seed
# 5: indexers 2.0e-4 and 1.2e-4, routers 3.4e-2 and 4.4e-4; seeds 0-4, 6 and 7 each have one below 1e-4.
SEED = 5


pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """The converted tiny V4 model with HF's logits of the long prompt."""
    hf = tiny_hf_model(SEED)
    c = convert_case(hf_factory, tmp_path_factory.mktemp("v4"), "deepseek_v4", hf, LONG)
    c.hf_long = hf_logits(hf, c.long_ids)
    return c


def _hf_taps(model, ids: np.ndarray) -> dict:
    """Outputs of every top-k router and indexer scorer of HF's forward over ``ids``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer, DeepseekV4TopKRouter

    seen, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, (DeepseekV4TopKRouter, DeepseekV4IndexerScorer)):
            hooks.append(module.register_forward_hook(
                lambda mod, inp, out, name=name: seen.__setitem__(name, (mod, out))))
    try:
        with torch.no_grad():
            model(torch.from_numpy(ids.astype(np.int64)))
    finally:
        for h in hooks:
            h.remove()
    return seen


def _gap(scores: np.ndarray, k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th finite score of a row, relative to the row's
    largest |score|, over the rows of ``scores`` (indexer scores are O(1e-2), router ones O(1))."""
    gaps = []
    for row in scores.reshape(-1, scores.shape[-1]):
        row = np.sort(row[np.isfinite(row)])[::-1]
        if row.size > k:
            gaps.append((row[k - 1] - row[k]) / np.abs(row).max())
    return min(gaps)


def test_converted_config(case):
    c = case.config
    assert c.family is Family.DEEPSEEK_V4 and c.attention is AttentionKind.COMPRESSED
    assert c.compressed.kinds == (CompressKind.SLIDING, CompressKind.CSA, CompressKind.HCA, CompressKind.CSA)
    assert c.hyper.mult == 4 and c.moe.hash_layers == (True, True, False, False)
    assert ModelConfig.from_json(c.to_json()) == c


def test_choices_are_not_ties(case):
    """Every top-k router and every indexer has a clear choice on the long prompt (else (a)
    would test rounding): a relative gap of 1e-4, 100x the relative fp32 difference of our
    hidden states from HF's."""
    taps = _hf_taps(case.hf, case.long_ids)
    ratio = case.hf.config.compress_rates["compressed_sparse_attention"]
    positions = np.arange(LONG)
    for name, (module, out) in taps.items():
        if name.endswith("scorer"):
            scores = out.numpy()[0]  # [T, entries]
            visible = np.arange(scores.shape[-1])[None, :] < ((positions + 1) // ratio)[:, None]
            assert _gap(np.where(visible, scores, -np.inf), case.config.compressed.index_topk) > MIN_ROUTER_GAP, name
        else:
            logits = out[0]
            biased = torch.sqrt(torch.nn.functional.softplus(logits)) + module.e_score_correction_bias
            assert _gap(biased.numpy(), case.config.moe.experts_per_token) > MIN_ROUTER_GAP, name


def test_logits_match_hf(case):
    """(a) fp32 logits of a 300-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


@pytest.mark.slow  # 25 s; (d) below steps one-token chunks through the same cache in the default suite
def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 280 tokens, then 20 one at a time (HCA windows close at 287 and 303, CSA ones
    every 4th step): the logits of one 300-token pass."""
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1:], case.name)


def test_ragged_chunks_match_full_forward(case):
    """(d) two rows at different positions fed in chunks of 1 to 64 tokens (one compiled step
    of 64, the rest padding) give each row's full-pass logits."""
    config, weights = case.config, case.weights
    other = random_ids(260, config.vocab_size, seed=7)
    rows = [case.long_ids[0], other[0]]
    chunks = [[37, 1, 64, 13, 1, 1, 64, 64, 55], [5, 40, 1, 16, 3, 64, 64, 60, 7]]
    T = 64
    step = jax.jit(forward, static_argnums=(1,), static_argnames=("all_logits",))
    append = jax.jit(append_to_cache)
    cache = init_cache(config, 2, LONG)
    got = [[], []]
    done = [0, 0]
    for i in range(len(chunks[0])):
        sizes = [chunks[r][i] for r in range(2)]
        tokens = np.zeros((2, T), np.int32)
        for r in range(2):
            tokens[r, :sizes[r]] = rows[r][done[r]:done[r] + sizes[r]]
        logits, new = step(weights, config, jnp.asarray(tokens), cache, jnp.asarray(sizes, jnp.int32),
                           all_logits=True)
        cache = append(cache, new)
        for r in range(2):
            got[r].append(np.asarray(logits[r, :sizes[r]]))
            done[r] += sizes[r]
    full_other = all_logits(weights, config, other)
    for r, full in enumerate([case.ours_long[0], full_other[0]]):
        assert_steps_match_full(np.concatenate(got[r]), full, f"row {r}")


@pytest.mark.slow  # 20 s; (a) and (d) imply it up to ties (asserted absent on the long prompt)
def test_greedy_matches_hf(case):
    """(b) 32 greedy tokens after a 40-token prompt: Engine.generate's are HF generate's."""
    prompt = random_ids(40, case.config.vocab_size, seed=3)
    ours, theirs = greedy_vs_hf(case, prompt, NEW)
    assert ours.token_ids == theirs


@pytest.mark.slow  # 15 s (HF and dayzero forwards with per-layer hooks); the logits test covers the whole model
def test_verify_compares_every_layer(case):
    """``dayzero verify``: each decoder layer's output (the 4 hyper-connection streams) and the
    logits against HF's, per layer, on 120 tokens (past the window and several HCA windows)."""
    from dayzero.tools.verify import verify

    report = verify(case.root / "hf", case.root / "dz", ids=case.long_ids[0, :120].tolist())
    assert report.passed and len(report.layers) == case.config.num_layers
