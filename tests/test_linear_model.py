"""Linear-attention hybrids through the whole model: parity with HF transformers.

Tiny random HF models of Qwen3-Next (``qwen3_next``), the Qwen3.5-MoE text model
(``qwen3_5_moe_text``) and Kimi-Linear (``kimi_linear``), sized as tests/linear_helpers.py
(GQA, two value heads per key head, 3 conv taps, dense and sparse layers), go through the real
converter. Every parameter HF initialises to a constant (A_log, dt_bias, norms, the selection
bias) is drawn here at scales that keep activations and logits O(1) and give the delta rule real
decays, strong and weak (checked on HF's own forward). Checked:

(a) fp32 logits of a 300-token prompt against HF's (five delta-rule chunks of 64);
(b) 32 greedy tokens through ``Engine.generate`` equal HF ``generate``'s (HF's own cache path);
(c) prefill then one-token decode steps equal one full pass (the recurrent form after the chunked);
(d) two ragged rows through the contiguous cache in steps of 64 and 8 tokens (chunked and
    recurrent forms, with padding; one row idle in some steps) with the delta rule's chunk at
    16, so step and chunk boundaries fall at odd positions: each row's logits are its full pass's;
(e) each distinguishing feature matters: without it our logits are far from HF's.

Default suite: the config, the router gaps, the decays, (a) and (d); (b), (c), (e), per-layer
``verify``, the chunk-16 parity and the multimodal Qwen3.5 file under ``-m slow``.

Random routers can sit near ties: the gap between the last chosen and the first unchosen choice
score is asserted on HF's own forward first (hf_helpers.MIN_ROUTER_GAP).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dayzero.convert import load_checkpoint
from dayzero.model.cache import append_to_cache, init_cache
from dayzero.model.config import AttentionKind, Family, LinearKind, ModelConfig
from dayzero.model.linear_cache import HybridCache
from dayzero.model.weights import MoEWeights
from tests import linear_helpers as L
from tests.hf_helpers import (
    MIN_ROUTER_GAP, REL_TOL, all_logits, assert_logits_match, assert_same_weights, assert_steps_match_full,
    convert_case, forward_jit, greedy_vs_hf, hf_logits, hf_model, random_ids,
)

LONG, PREFILL, SHORT, NEW = 300, 280, 40, 32

# Tiny HF configs of tests/linear_helpers.py (context raised for the 300-token prompt) and the seed
# of each model. Smallest router gaps at these seeds (long prompt; short prompt + HF's 32 greedy
# tokens; the ragged test's second prompt): qwen3_next 1.5e-3, 6.3e-3, 2.2e-3; qwen3_5_moe 7.1e-4,
# 1.3e-3, 1.2e-3; kimi_linear 1.4e-3, 2.8e-3, 3.1e-4. Lower seeds come within 2e-4 of a tie
# somewhere (qwen3_next 0 and 1, qwen3_5_moe 0 and 2, kimi_linear 0). With these, our logits
# measured 2.2e-6, 2.7e-6 and 1.4e-6 relative from HF's (HF fp32 itself 1.7e-6 - 2.2e-6 from HF
# run in float64).
FAMILIES = {
    "qwen3_next": (lambda: L.qwen_next_config(max_position_embeddings=512), 2),
    "qwen3_5_moe": (lambda: L.qwen35_moe_config(max_position_embeddings=512).text_config, 3),
    "kimi_linear": (L.kimi_config, 4),
}

# RMSNorm classes whose scale is 1 + w (HF initialises w to 0): drawn around 0, the rest around 1.
ZERO_CENTRED_NORMS = ("Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm")

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

_append = jax.jit(append_to_cache)


def randomise(model, seed: int):
    """``model`` with every parameter drawn at a sane scale (in place; returned).

    Projections normal with std fan_in**-0.5, so each keeps its input's O(1) scale; embeddings N(0, 1); norms
    N(1, 0.2), or N(0, 0.2) where the scale is 1 + w; A_log log-uniform over rates 0.01 .. 3 and
    dt_bias N(0, 1), so a token's decay exp(-rate * softplus(a + dt_bias)) ranges from ~1 (a head
    that remembers hundreds of tokens) to ~0 (one that forgets at once); selection biases N(0, 0.3),
    comparable to the sigmoid scores they shift."""
    gen = torch.Generator().manual_seed(seed)
    centred = {name for name, m in model.named_modules() if type(m).__name__ in ZERO_CENTRED_NORMS}

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = name.rsplit(".", 1)[0]
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.01), math.log(3.0), generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(normal(p.shape, 1.0))
            elif p.ndim == 1:  # norm weights
                p.copy_(normal(p.shape, 0.2, 0.0 if owner in centred else 1.0))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(normal(p.shape, 1.0))
            else:  # Linear [out, in], Conv1d [C, 1, W], fused experts [E, out, in]: fan-in last
                p.copy_(normal(p.shape, p.shape[-1] ** -0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, 0.3))
    return model


def build_hf(family: str):
    """The tiny random HF model of ``family`` (fp32, eager attention)."""
    config, seed = FAMILIES[family]
    return randomise(hf_model(config(), seed), seed)


# Qwen3.5-MoE runs Qwen3-Next's code paths (other tensor names, every layer MoE): its model checks
# run under ``-m slow``, the default suite keeps one model per linear-attention kind.
@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.slow) if f == "qwen3_5_moe" else f
                                        for f in FAMILIES])
def case(request, hf_factory, tmp_path_factory):
    """One family's converted tiny model with what HF's forward over the long prompt gives:
    ``hf_long`` (logits), ``hf_choices`` (router choice scores) and ``hf_decays`` (log decays)."""
    hf = build_hf(request.param)
    c = convert_case(hf_factory, tmp_path_factory.mktemp(request.param), request.param, hf, LONG)
    with _spy_decays(request.param) as decays:
        c.hf_long, c.hf_choices = _hf_forward(hf, c.long_ids)
    c.hf_decays = decays
    return c


# ---- HF's side: router choices and decays --------------------------------------------------------


def _hf_forward(model, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """HF's logits of ``ids`` and, per MoE layer, the scores its top-k picks from [tokens, E]:
    the router logits (Qwen: its softmax is monotonic), sigmoid + selection bias (Kimi)."""
    seen, hooks = [], []

    def record(module, _inputs, out):
        logits = out[0].float()
        bias = getattr(module, "e_score_correction_bias", None)
        seen.append((logits if bias is None else logits.sigmoid() + bias).numpy())

    for module in model.modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            hooks.append(module.register_forward_hook(record))
    assert hooks, "no router modules found"
    try:
        logits = hf_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def _min_gap(scores: list[np.ndarray], k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th score of any token in any layer."""
    return min(float(np.min(s[:, k - 1] - s[:, k])) for s in (np.sort(x, -1)[:, ::-1] for x in scores))


@contextlib.contextmanager
def _spy_decays(family: str):
    """Within the context, the log decays g HF's chunked delta rule receives are appended to the
    yielded list (one [B, T, H(, d)] array per call, i.e. per linear layer of a forward)."""
    module = {"qwen3_next": transformers.models.qwen3_next.modeling_qwen3_next,
              "qwen3_5_moe": transformers.models.qwen3_5_moe.modeling_qwen3_5_moe,
              "kimi_linear": transformers.models.kimi_linear.modeling_kimi_linear}[family]
    name = "chunk_kimi_delta_attention" if family == "kimi_linear" else "torch_chunk_gated_delta_rule"
    inner, seen = getattr(module, name), []

    def spy(*args, **kwargs):
        seen.append(kwargs["g"].float().numpy())
        return inner(*args, **kwargs)

    with mock.patch.object(module, name, spy):
        yield seen


# ---- the converted model ------------------------------------------------------------------------


def test_converted_config(case):
    """The parsed config has the family's linear kind, HF's layer kinds and its features."""
    c = case.config
    family, kind = {"qwen3_next": (Family.QWEN3_NEXT, LinearKind.GATED_DELTA),
                    "qwen3_5_moe": (Family.QWEN3_5_MOE, LinearKind.GATED_DELTA),
                    "kimi_linear": (Family.KIMI_LINEAR, LinearKind.KIMI_DELTA)}[case.name]
    assert c.family is family and c.linear.kind is kind and c.linear.chunk == 64
    types = case.hf.config.layer_types
    assert c.linear.layers == tuple(t == "linear_attention" for t in types)
    if kind is LinearKind.GATED_DELTA:
        assert c.norm_weight_offset == 1.0 and c.attn_output_gate and c.moe.shared_gate
        assert c.attention is AttentionKind.GQA
    else:
        assert c.norm_weight_offset == 0.0 and not c.attn_output_gate and c.moe.score_bias
        assert c.attention is AttentionKind.MLA and c.mla.nope and c.moe.num_groups == 1
    assert ModelConfig.from_json(c.to_json()) == c


def test_router_choices_are_not_ties(case):
    """Every MoE layer has a clear top-k choice for every token of the long prompt (else (a)
    would test rounding): a gap of MIN_ROUTER_GAP, 100x the fp32 difference of the hidden states."""
    assert len(case.hf_choices) == sum(case.config.moe.layers)
    assert _min_gap(case.hf_choices, case.config.moe.experts_per_token) > MIN_ROUTER_GAP


def test_decays_are_strong_and_weak(case):
    """The delta rule's decays are real on HF's forward: some heads keep over 95% of their state
    per token on average, some under half (so a wrong decay, or a state carried wrongly across a
    chunk, shows in the logits)."""
    g = case.hf_decays
    assert len(g) == len(case.config.linear.linear_layers)
    # Per head (and channel, KDA): the mean per-token decay over the prompt. HF's layout [B, T, H(, d)].
    means = np.concatenate([np.exp(x).mean(axis=(0, 1)).ravel() for x in g])
    assert means.max() > 0.95 and means.min() < 0.5, means


def test_logits_match_hf(case):
    """(a) fp32 logits of a 300-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


# Steps of the ragged test: (step width T, real tokens of row 0, of row 1). T = 8 runs the delta
# rule token by token, T = 64 chunked (chunk 16); a 0 leaves that row idle for the step.
RAGGED_STEPS = [(64, 37, 5), (8, 1, 8), (64, 50, 40), (8, 1, 0), (8, 1, 1), (64, 60, 64), (64, 14, 16),
                (8, 0, 3), (64, 64, 64), (64, 64, 50), (8, 8, 0)]


def test_ragged_chunks_match_full_forward(case):
    """(d) two rows (the long prompt and another, 300 and 251 tokens) fed through the contiguous
    cache in RAGGED_STEPS, the delta rule's chunk set to 16: each row's logits are those of its own
    full pass (dayzero against itself, to fp32 rounding)."""
    config = dataclasses.replace(case.config, linear=dataclasses.replace(case.config.linear, chunk=16))
    weights = case.weights
    other = random_ids(LONG, config.vocab_size, seed=7)  # its full pass reuses the long prompt's compile
    rows = [case.long_ids[0], other[0]]
    totals = [sum(s[r + 1] for s in RAGGED_STEPS) for r in range(2)]
    assert totals == [LONG, 251]
    # Committed to the device as every later cache (an output of the append) is, so the first step
    # shares its compile with the later steps of its width.
    cache = jax.device_put(init_cache(config, 2, 384), jax.devices()[0])
    assert isinstance(cache, HybridCache)
    got, done = [[], []], [0, 0]
    for T, *sizes in RAGGED_STEPS:
        tokens = np.zeros((2, T), np.int32)
        for r in range(2):
            tokens[r, :sizes[r]] = rows[r][done[r]:done[r] + sizes[r]]
        logits, new = forward_jit(weights, config, jnp.asarray(tokens), cache, jnp.asarray(sizes, jnp.int32),
                                  all_logits=True)
        cache = _append(cache, new)
        for r in range(2):
            got[r].append(np.asarray(logits[r, :sizes[r]]))
            done[r] += sizes[r]
    assert [int(n) for n in cache.lengths] == totals
    full = [case.ours_long[0], all_logits(weights, case.config, other)[0]]
    for r in range(2):
        assert_steps_match_full(np.concatenate(got[r]), full[r][:totals[r]], f"{case.name} row {r}")


# ---- each feature matters ---------------------------------------------------------------------------


def _without(config: ModelConfig, weights, feature: str):
    """(config, weights) of the model with ``feature`` removed."""
    def layers(fn):
        return weights.replace(layers=tuple(fn(i, w) for i, w in enumerate(weights.layers)))

    if feature == "norm_offset":  # RMSNorm scales w instead of 1 + w
        return dataclasses.replace(config, norm_weight_offset=0.0), weights
    if feature == "attn_output_gate":  # full attention without its sigmoid output gate
        return (dataclasses.replace(config, attn_output_gate=False),
                layers(lambda i, w: w if config.is_linear_layer(i) else w.replace(attn=w.attn.replace(gate=None))))
    if feature == "shared_expert_gate":  # the shared expert's output not scaled by sigmoid(x . w)
        return (dataclasses.replace(config, moe=dataclasses.replace(config.moe, shared_gate=False)),
                layers(lambda i, w: w.replace(mlp=w.mlp.replace(shared_gate=None))
                       if isinstance(w.mlp, MoEWeights) else w))
    if feature == "mla_nope":  # rotate the latent attention's rope part as DeepSeek does
        return dataclasses.replace(config, mla=dataclasses.replace(config.mla, nope=False)), weights
    if feature == "score_bias":  # choose experts by the sigmoid scores alone
        return (dataclasses.replace(config, moe=dataclasses.replace(config.moe, score_bias=False)),
                layers(lambda i, w: w.replace(mlp=w.mlp.replace(score_bias=None))
                       if isinstance(w.mlp, MoEWeights) else w))
    raise ValueError(feature)


FEATURES = {"qwen3_next": ("norm_offset", "attn_output_gate", "shared_expert_gate"),
            "qwen3_5_moe": ("norm_offset", "attn_output_gate", "shared_expert_gate"),
            "kimi_linear": ("mla_nope", "score_bias")}


# The feature checks run the first FEATURE_TOKENS tokens of the long prompt: the delta rule's
# token-by-token form, which compiles in about half the time of the chunked one.
FEATURE_TOKENS = 16


def _assert_feature_matters(case, feature: str) -> None:
    config, weights = _without(case.config, case.weights, feature)
    ref = case.hf_long[:, :FEATURE_TOKENS]
    err = np.abs(all_logits(weights, config, case.long_ids[:, :FEATURE_TOKENS]) - ref).max()
    assert err > 100 * REL_TOL * np.abs(ref).max(), f"{case.name} without {feature}: {err:.3g}"


@pytest.mark.slow  # 5-10 s a family: one compile of the model per feature
def test_features_are_effective(case):
    """(e) Without any one of the family's FEATURES the logits of the prompt's first 16 tokens
    are over 100x the parity tolerance from HF's: (a) really checks each."""
    for feature in FEATURES[case.name]:
        _assert_feature_matters(case, feature)


# ---- slow: generation, decode steps, verify, the chunk, the multimodal file ------------------------


@pytest.mark.slow
def test_greedy_matches_hf(case):
    """(b) 32 greedy tokens after a 40-token prompt: Engine.generate's are HF generate's, with
    clear router choices on the prompt and HF's continuation."""
    prompt = random_ids(SHORT, case.config.vocab_size, seed=3)
    ours, theirs = greedy_vs_hf(case, prompt, NEW)
    seq = np.concatenate([prompt, np.asarray(theirs, np.int32)[None]], axis=1)
    assert _min_gap(_hf_forward(case.hf, seq)[1], case.config.moe.experts_per_token) > MIN_ROUTER_GAP
    assert ours.token_ids == theirs


@pytest.mark.slow
def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 280 tokens, then 20 one at a time (the recurrent form over the chunked one's
    state): the logits of one 300-token pass."""
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1:], case.name)


@pytest.mark.slow
def test_verify_compares_every_layer(case):
    """``dayzero verify``: each decoder layer's output and the logits against HF's, on 150 tokens
    (three delta-rule chunks)."""
    from dayzero.tools.verify import verify

    report = verify(case.root / "hf", case.root / "dz", ids=case.long_ids[0, :150].tolist())
    assert report.passed, report.verdict()
    assert len(report.layers) == case.config.num_layers
    assert max(row.rel_err for row in report.layers) < 1e-4


@pytest.mark.slow
def test_small_chunk_matches_hf(case):
    """(a) with the delta rule's chunk at 16 where HF's is 64: chunk boundaries HF does not have."""
    config = dataclasses.replace(case.config, linear=dataclasses.replace(case.config.linear, chunk=16))
    assert_logits_match(all_logits(case.weights, config, case.long_ids), case.hf_long, f"{case.name} chunk 16")


@pytest.mark.slow
def test_multimodal_file_converts_to_the_text_model(case, hf_factory, tmp_path):
    """The published Qwen3.5-MoE layout (Qwen3_5MoeForConditionalGeneration: model.language_model.*
    beside a vision tower) holding the text model's weights converts to the same leaves and gives
    the same logits; HF's multimodal model gives HF's text logits on the prompt."""
    if case.name != "qwen3_5_moe":
        pytest.skip("the multimodal file is Qwen3.5's")
    mm_config = L.qwen35_moe_config(max_position_embeddings=512)

    def text_fields(c):  # without what save_pretrained and from_config note about the instance
        return {k: v for k, v in c.to_dict().items() if k not in ("architectures", "dtype")}

    assert text_fields(mm_config.text_config) == text_fields(case.hf.config)
    torch.manual_seed(0)
    mm = transformers.Qwen3_5MoeForConditionalGeneration(mm_config).float().eval()
    mm.model.language_model.load_state_dict(case.hf.model.state_dict())
    mm.lm_head.load_state_dict(case.hf.lm_head.state_dict())
    assert_logits_match(hf_logits(mm, case.long_ids), case.hf_long, "HF's multimodal against its text model")
    _, dz = hf_factory.save_and_convert(mm, tmp_path)
    config, weights = load_checkpoint(dz, dtype=jnp.float32)
    assert config.family is Family.QWEN3_5_MOE and config.linear == case.config.linear
    assert_same_weights(weights.replace(vision=None), case.weights)  # the tower: tests/test_vision_convert.py
    np.testing.assert_array_equal(all_logits(weights, config, case.long_ids), case.ours_long)
