"""Mixture-of-Experts (Mixtral, Qwen3-MoE): parity with HF transformers through the real converter.

Tiny random HF MoE models (fp32, eager attention, random norms) are saved with ``save_pretrained``,
converted and loaded. Then, as in test_parity.py: (a) logits of a 500-token prompt match HF's;
(b) 32 greedy tokens through ``Engine.generate`` are HF's; (c) prefill + one-token decode steps
reproduce one full forward. Module level: the router's choices and weights, and the whole MoE
block, against HF's modules on the same hidden states. Also: the dispatch runs only the chosen
experts, the converter's expert stacking (per-expert and fused layouts, with its checks), and
strict config parsing.

Random routers can sit near ties, where top-k is decided by rounding: every comparison here
first asserts that the gap between the C-th and (C+1)-th router logit is far above fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.model.config import ConfigError, Family, ModelConfig, MoEConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.moe import GroupedMatmul, active_experts, grouped_swiglu, moe, route, sort_by_expert
from dayzero.model.weights import MoEWeights
from tests.hf_helpers import (
    MIN_ROUTER_GAP, assert_change_is_effective, assert_logits_match, assert_same_weights, assert_steps_match_full,
    convert_case, copy_hf_checkpoint, greedy_vs_hf, hf_model, random_ids, within_moe_gates,
)

LONG, SHORT, NEW, PREFILL = 500, 20, 32, 480
# Tolerances and MIN_ROUTER_GAP (the C-th vs (C+1)-th router logit): tests.hf_helpers.

COMMON = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
    initializer_range=0.1, num_experts_per_tok=2, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
CASES = {
    # Every layer sparse, renormalised top-2; a 128-token window on every layer (Mixtral slides
    # whenever sliding_window is set).
    "mixtral": (transformers.MixtralConfig,
                dict(num_hidden_layers=2, intermediate_size=96, num_local_experts=8, sliding_window=128)),
    # Layer 1 dense (mlp_only_layers), experts 48 wide beside a 128-wide dense MLP, top-2 weights
    # NOT renormalised, head_dim 32 != 64 / 4.
    "qwen3_moe": (transformers.Qwen3MoeConfig,
                  dict(num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                       norm_topk_prob=False, mlp_only_layers=[1], head_dim=32)),
    # decoder_sparse_step=2: only layer 1 sparse; norm_topk_prob renormalises.
    "qwen3_moe_step": (transformers.Qwen3MoeConfig,
                       dict(num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                            norm_topk_prob=True, decoder_sparse_step=2)),
}
# Seeds whose long-prompt router gaps are all >= 2.5e-4 (seed 0 of qwen3_moe has a 9.5e-5 gap).
SEEDS = {"mixtral": 0, "qwen3_moe": 3, "qwen3_moe_step": 0}
EXPECTED = {  # (MoE layer flags, renormalize, expert width) the converter must read
    "mixtral": ((True, True), True, 96),
    "qwen3_moe": ((True, False, True), False, 48),
    "qwen3_moe_step": ((False, True, False), True, 48),
}


def build_hf_moe(name: str, seed: int):
    """A tiny random HF MoE model in fp32 with eager attention and non-trivial norm weights."""
    config_cls, overrides = CASES[name]
    model = hf_model(config_cls(**{**COMMON, **overrides}), seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.1)
    return model


def _router_gap(logits: np.ndarray, top_k: int) -> float:
    """Smallest gap, over tokens, between the last chosen and the first unchosen router logit."""
    s = np.sort(logits, axis=-1)
    return float((s[..., -top_k] - s[..., -top_k - 1]).min())


@pytest.fixture(scope="module", params=list(CASES))
def case(request, hf_factory, tmp_path_factory):
    """One converted tiny MoE model with HF's logits (and router logits) of the long prompt."""
    hf = build_hf_moe(request.param, SEEDS[request.param])
    c = convert_case(hf_factory, tmp_path_factory.mktemp(request.param), request.param, hf, LONG)
    with torch.no_grad():
        out = hf(torch.from_numpy(c.long_ids.astype(np.int64)), output_router_logits=True)
    c.hf_long = out.logits.float().numpy()
    c.hf_router_logits = [r.float().numpy() for r in out.router_logits]
    return c


# ---- whole-model parity ------------------------------------------------------------------------


def test_converted_config_matches_case(case):
    layers, renormalize, width = EXPECTED[case.name]
    moe_cfg = case.config.moe
    assert (moe_cfg.layers, moe_cfg.renormalize, moe_cfg.intermediate_size) == (layers, renormalize, width)
    assert (moe_cfg.num_experts, moe_cfg.experts_per_token) == (8, 2)
    kinds = [type(layer.mlp).__name__ for layer in case.weights.layers]
    assert kinds == ["MoEWeights" if sparse else "MLPWeights" for sparse in layers]
    assert len(case.hf_router_logits) == sum(layers)


def test_router_margins_are_not_ties(case):
    """Every token of the long prompt has a clear top-2 in every MoE layer (else (a) tests rounding)."""
    for layer_logits in case.hf_router_logits:
        assert _router_gap(layer_logits, 2) > MIN_ROUTER_GAP


def test_logits_match_hf(case):
    """(a) fp32 logits of a 500-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_step"], indirect=True)
def test_renormalisation_is_effective(case):
    """Flipping norm_topk_prob moves the logits far from HF's (so (a) really tests it)."""
    moe_cfg = dataclasses.replace(case.config.moe, renormalize=not case.config.moe.renormalize)
    assert_change_is_effective(case, dataclasses.replace(case.config, moe=moe_cfg))


def test_greedy_generation_matches_hf(case):
    """(b) 32 greedy tokens through Engine.generate are exactly HF generate's."""
    prompt = random_ids(SHORT, case.config.vocab_size, seed=2)
    out, ref = greedy_vs_hf(case, prompt, NEW)
    assert len(out.token_ids) == NEW
    assert out.token_ids == ref


def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 480 tokens, decode 20 one at a time: the logits of one 500-token pass."""
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1 :], case.name)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("case, scheme, kv", [
    ("mixtral", "int8", "none"), ("qwen3_moe", "int4", "none"), ("qwen3_moe_step", "none", "int8"),
    *(pytest.param(name, s, k, marks=SLOW) for name in CASES
      for s, k in (("int8", "none"), ("fp8", "none"), ("fp8-block", "none"), ("int4", "none"),
                   ("none", "int8"), ("none", "fp8"))
      if (name, s, k) not in (("mixtral", "int8", "none"), ("qwen3_moe", "int4", "none"),
                              ("qwen3_moe_step", "none", "int8"))),
], indirect=["case"])
def test_quantized_model_against_hf(case, scheme, kv, quantized_vs_hf):
    """Quantized weights or KV cache against HF fp32: KL over the 500-token prompt and greedy
    agreement over HF's 32 tokens, within tests.hf_helpers.MOE_GATES (bounds justified there)."""
    result = quantized_vs_hf(case, scheme, kv, SHORT, NEW)
    assert within_moe_gates(result, scheme, kv), result


# ---- module-level parity: router and MoE block ----------------------------------------------------


def _moe_layers(case):
    """(HF sparse block, our MoEWeights) for each MoE layer."""
    return [(hf_layer.mlp, ours.mlp) for hf_layer, ours in zip(case.hf.model.layers, case.weights.layers)
            if isinstance(ours.mlp, MoEWeights)]


def _hidden(seed: int, n: int = 1000, width: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def test_router_matches_hf_gate(case):
    """``route`` picks HF's experts, in HF's order, with HF's weights, on the same hidden states."""
    for i, (hf_block, ours) in enumerate(_moe_layers(case)):
        x = _hidden(seed=10 + i)
        with torch.no_grad():
            ref_logits, ref_weights, ref_experts = hf_block.gate(torch.from_numpy(x))
        assert _router_gap(ref_logits.numpy(), 2) > MIN_ROUTER_GAP
        weights, experts = route(ours.router, case.config.moe, jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(experts), ref_experts.numpy())
        np.testing.assert_allclose(np.asarray(weights), ref_weights.numpy(), rtol=1e-5, atol=1e-6)
        if case.config.moe.renormalize:
            np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
        else:  # the raw softmax probabilities of the two chosen experts: their sum is below 1
            assert np.asarray(weights).sum(-1).max() < 1.0


@pytest.mark.parametrize("impl", list(GroupedMatmul))
def test_moe_block_matches_hf(case, impl):
    """The whole block (route, dispatch, grouped SwiGLU, combine) equals HF's sparse block."""
    for i, (hf_block, ours) in enumerate(_moe_layers(case)):
        x = _hidden(seed=20 + i, n=300).reshape(3, 100, 64)
        with torch.no_grad():
            ref = hf_block(torch.from_numpy(x)).numpy()
            assert _router_gap(hf_block.gate(torch.from_numpy(x))[0].numpy(), 2) > MIN_ROUTER_GAP
        out = np.asarray(jax.jit(moe, static_argnums=(1, 3))(ours, case.config.moe, jnp.asarray(x), impl))
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


# ---- DeepSeek-V3 routing, module level (no deepseek_v3 model yet: it needs MLA attention) ----------


def _deepseek_moe(seed: int = 0):
    """HF's DeepseekV3MoE with 16 experts in 4 groups, 2 groups and 4 experts per token, a random
    selection bias, scaling 2.5 and two shared experts; and the same weights as MoEWeights."""
    from dayzero.convert import transforms as T
    from dayzero.model.config import RouterScore
    from dayzero.model.weights import MLPWeights
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_config = transformers.DeepseekV3Config(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=2)
    torch.manual_seed(seed)
    block = DeepseekV3MoE(hf_config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.1)
        block.gate.e_score_correction_bias.normal_(0.0, 0.1)
    config = MoEConfig(16, 4, 32, (True,), score=RouterScore.SIGMOID, renormalize=True, score_bias=True,
                       num_groups=4, groups_per_token=2, routed_scaling=2.5, shared_experts=2)
    t = lambda x: jnp.asarray(x.detach().numpy())  # noqa: E731
    gate_up, shared = block.experts.gate_up_proj.detach().numpy(), block.shared_experts
    w = MoEWeights(
        router=t(block.gate.weight).T, score_bias=t(block.gate.e_score_correction_bias),
        gate=jnp.asarray(T.split_gate_up(gate_up, 0)), up=jnp.asarray(T.split_gate_up(gate_up, 1)),
        down=jnp.asarray(T.transpose_experts(block.experts.down_proj.detach().numpy())),
        shared=MLPWeights(gate=t(shared.gate_proj.weight).T, up=t(shared.up_proj.weight).T,
                          down=t(shared.down_proj.weight).T),
    )
    return block, config, w


def _deepseek_gaps(block, x: np.ndarray) -> tuple[float, float]:
    """Smallest gaps, over tokens, at the group cut (2 of 4 groups) and at the expert cut (4 of
    the 8 experts in the kept groups), on the biased choice scores."""
    with torch.no_grad():
        choice = (torch.sigmoid(block.gate(torch.from_numpy(x))[0]) + block.gate.e_score_correction_bias).numpy()
    grouped = choice.reshape(len(x), 4, 4)
    group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)  # [N, 4]
    ranked = np.sort(group_scores, -1)
    kept = np.argsort(group_scores, -1)[:, -2:]
    in_kept = np.sort(np.take_along_axis(grouped, kept[:, :, None], 1).reshape(len(x), 8), -1)
    return float((ranked[:, -2] - ranked[:, -3]).min()), float((in_kept[:, -4] - in_kept[:, -5]).min())


def test_deepseek_router_matches_hf():
    """Sigmoid scores, bias for the choice only, best 2 of 4 groups, renormalise, scale 2.5."""
    block, config, w = _deepseek_moe()
    x = _hidden(seed=39, n=500)  # gaps 9e-4 (groups), 6e-4 (experts); seed 30's are 1.0e-4
    assert min(_deepseek_gaps(block, x)) > MIN_ROUTER_GAP
    with torch.no_grad():
        _, ref_weights, ref_experts = block.gate(torch.from_numpy(x))
    weights, experts = route(w.router, config, jnp.asarray(x), w.score_bias)
    # HF's top-k is unsorted: compare the (expert, weight) pairs in expert order.
    order, ref_order = np.argsort(np.asarray(experts), -1), np.argsort(ref_experts.numpy(), -1)
    take = np.take_along_axis
    np.testing.assert_array_equal(take(np.asarray(experts), order, -1), take(ref_experts.numpy(), ref_order, -1))
    np.testing.assert_allclose(take(np.asarray(weights), order, -1), take(ref_weights.numpy(), ref_order, -1),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 2.5, rtol=1e-5)
    without_bias, _ = route(w.router, dataclasses.replace(config, score_bias=False), jnp.asarray(x))
    assert not np.allclose(np.asarray(without_bias), np.asarray(weights))  # the bias changes the choice


@pytest.mark.parametrize("impl", list(GroupedMatmul))
def test_deepseek_moe_block_matches_hf(impl):
    """Routed experts plus the two shared experts, as HF's DeepseekV3MoE computes them."""
    block, config, w = _deepseek_moe()
    x = _hidden(seed=38, n=200)  # gaps 6e-4 (groups), 3e-3 (experts)
    assert min(_deepseek_gaps(block, x)) > MIN_ROUTER_GAP
    with torch.no_grad():
        ref = block(torch.from_numpy(x.reshape(2, 100, 64))).numpy()
    out = np.asarray(moe(w, config, jnp.asarray(x.reshape(2, 100, 64)), impl))
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


# ---- dispatch: only the chosen experts run ------------------------------------------------------------


def _random_moe(num_experts: int, width: int = 16, ffw: int = 24, seed: int = 0) -> MoEWeights:
    k = jax.random.split(jax.random.key(seed), 4)
    return MoEWeights(
        router=jax.random.normal(k[0], (width, num_experts)),
        gate=0.3 * jax.random.normal(k[1], (num_experts, width, ffw)),
        up=0.3 * jax.random.normal(k[2], (num_experts, width, ffw)),
        down=0.3 * jax.random.normal(k[3], (num_experts, ffw, width)),
    )


def test_group_sizes_are_a_histogram_of_tokens_times_top_k():
    """The grouped matmul sees T*C rows, grouped by expert: not T*E."""
    tokens, top_k, num_experts = 50, 3, 64
    config = MoEConfig(num_experts, top_k, 24, (True,))
    x = jax.random.normal(jax.random.key(1), (tokens, 16))
    _, experts = route(_random_moe(num_experts).router, config, x)
    order, sizes = sort_by_expert(experts, num_experts)
    assert int(sizes.sum()) == tokens * top_k
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(np.asarray(experts).ravel(), minlength=num_experts))
    sorted_experts = np.asarray(experts).ravel()[np.asarray(order)]
    assert (np.diff(sorted_experts) >= 0).all()


@pytest.mark.parametrize("sizes", [[0, 5, 0, 17, 1, 0, 0, 9], [130, 0, 0, 0, 0, 0, 0, 0], [1] * 8, [0] * 7 + [3]])
def test_expert_loop_handles_any_group_sizes(sizes):
    """Empty groups, one group with every row (chunks of 64, 8 and 1), single rows: each row goes
    through its own expert, and the loop visits only the experts that have rows."""
    sizes = np.array(sizes)
    w = _random_moe(len(sizes))
    xs = jax.random.normal(jax.random.key(3), (int(sizes.sum()), 16))
    owner = np.repeat(np.arange(len(sizes)), sizes)
    ref = np.stack([np.asarray((jax.nn.silu(x @ w.gate[e]) * (x @ w.up[e])) @ w.down[e]) for x, e in zip(xs, owner)])
    out = grouped_swiglu(w, xs, jnp.asarray(sizes, jnp.int32), GroupedMatmul.EXPERT_LOOP)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    ids, count = active_experts(jnp.asarray(sizes))
    np.testing.assert_array_equal(np.asarray(ids)[: int(count)], np.flatnonzero(sizes))


def test_unchosen_experts_are_never_computed():
    """Experts no token picked may hold NaN weights without touching the output: they never run.

    (A dense product over all experts, masked afterwards, would turn the output NaN.)
    """
    num_experts, config = 64, MoEConfig(64, 2, 24, (True,))
    w = _random_moe(num_experts)
    x = jax.random.normal(jax.random.key(2), (1, 5, 16))
    _, experts = route(w.router, config, x.reshape(5, 16))
    unused = np.setdiff1d(np.arange(num_experts), np.asarray(experts))
    assert len(unused) >= num_experts - 10
    poisoned = w.replace(gate=w.gate.at[unused].set(jnp.nan), down=w.down.at[unused].set(jnp.nan))
    clean = moe(w, config, x, GroupedMatmul.EXPERT_LOOP)
    out = moe(poisoned, config, x, GroupedMatmul.EXPERT_LOOP)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


# ---- converter ------------------------------------------------------------------------------------------


def test_fused_expert_layout_converts_to_the_same_weights(case, tmp_path):
    """HF's fused layout (save_original_format=False: gate_up_proj [E,2F,D], down_proj [E,D,F])."""
    case.hf.save_pretrained(tmp_path / "hf", save_original_format=False)
    names = load_file(tmp_path / "hf" / "model.safetensors").keys()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    convert_checkpoint(tmp_path / "hf", tmp_path / "dz", progress=False)
    _, fused = load_checkpoint(tmp_path / "dz", dtype=jnp.float32)
    assert_same_weights(case.weights, fused)


def _expert_tensor(case, e: int = 3) -> str:
    names = load_file(case.root / "hf" / "model.safetensors").keys()
    return next(n for n in sorted(names) if f".experts.{e}." in n)


@pytest.mark.parametrize("case", ["mixtral"], indirect=True)
@pytest.mark.parametrize("problem", ["nan", "missing", "shape", "extra"])
def test_bad_expert_tensor_is_named(case, tmp_path, problem):
    """One bad expert among the stacked ones: the error names that tensor."""
    name = _expert_tensor(case)
    extra = name.replace(".experts.3.", ".experts.8.")

    def edit(t):
        if problem == "nan":
            t[name][0, 0] = float("nan")
        elif problem == "missing":
            del t[name]
        elif problem == "shape":
            t[name] = t[name][:-1].clone()
        else:
            t[extra] = t[name].clone()

    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "edited", tensors_edit=edit)
    with pytest.raises(ConvertError) as err:
        convert_checkpoint(src, tmp_path / "dz", progress=False)
    assert (extra if problem == "extra" else name) in str(err.value)
    assert not (tmp_path / "dz").exists()


# ---- config parsing ---------------------------------------------------------------------------------


def _raw(name: str) -> dict:
    config_cls, overrides = CASES[name]
    return json.loads(config_cls(**{**COMMON, **overrides}).to_json_string())


def test_published_config_keys_parse():
    """Keys as on the hub: Qwen3-30B-A3B's num_experts / max_window_layers, Mixtral's training knobs."""
    qwen = {**_raw("qwen3_moe"), "num_experts": 8, "max_window_layers": 3, "use_sliding_window": False,
            "router_aux_loss_coef": 0.001, "output_router_logits": False}
    c = parse_hf_config(qwen)
    assert c.family is Family.QWEN3_MOE and c.moe.num_experts == 8 and c.qk_norm
    mixtral = {**_raw("mixtral"), "router_jitter_noise": 0.1, "output_router_logits": True}
    assert parse_hf_config(mixtral).moe.renormalize
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


@pytest.mark.parametrize("name, change, match", [
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers"),
    ("qwen3_moe", {"num_experts": 16}, "disagree"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("mixtral", {"num_local_experts": None}, "num_local_experts"),
    ("mixtral", {"norm_topk_prob": False}, "norm_topk_prob"),  # not a Mixtral key: HF ignores it
    ("mixtral", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
])
def test_bad_moe_config_is_refused(name, change, match):
    raw = {k: v for k, v in {**_raw(name), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(raw)


def test_dense_family_refuses_moe_keys():
    raw = {**_raw("mixtral"), "model_type": "mistral"}
    with pytest.raises(ConfigError, match="num_local_experts"):
        parse_hf_config(raw)
