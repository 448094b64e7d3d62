"""gpt-oss (HF ``gpt_oss``): attention sinks, alternating sliding-window and full layers, q/k/v/o
biases, YaRN; softmax routing with a router bias, experts with biases and the clamped SwiGLU;
parity with HF transformers.

A tiny random HF GptOss model (fp32, eager attention) goes through the real converter: random
norms and biases (router and experts included), sinks of N(0.5, 1) (they take a visible share of
each softmax: removing them moves the logits far), ``swiglu_limit`` 1 (the clamp bites on about a
third of the gate/up activations: asserted on HF's own), a 24-token window under a 200-token
prompt, layers sliding then full (HF's default ``layer_types``), YaRN x8 with ``truncate`` false.
(a) logits of the 200-token prompt match HF's; (b) 32 greedy tokens through ``Engine.generate``
are HF's; (c) prefill + one-token decode steps past the window reproduce one full forward. Also:
the experts each layer picks on HF's own hidden states, with HF's weights; the converter's
de-interleaving of ``gate_up_proj``; the sinks on the Pallas kernels (interpret mode) through the
model, first prefill (flash) and a paged step; missing tensors named; strict config parsing; the
published configs as ``plan`` presets with HF's parameter counts; YaRN's frequencies against HF's.

Default suite: the fixture, (a), router checks, the clamp check, (c), the kernels, the converter,
config and preset checks. Slow (``-m slow``): (b), the paged server, ``verify``, the effect checks
(sinks, clamp, window, truncate) and the 8-device mesh (tests/mesh_checks.py ``part_gpt_oss``).

Random routers can sit near ties: the whole-model comparisons first assert that the expert cut of
the biased router logits has a gap far above fp32 rounding.
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

from dayzero.convert import ConvertError, convert_checkpoint
from dayzero.convert.transforms import deinterleave
from dayzero.kernels import KernelMode
from dayzero.model.config import AttentionKind, ConfigError, Family, ModelConfig, RopeType, RouterScore
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.moe import GroupedMatmul, moe, route
from dayzero.model.presets import load_preset, preset_hf_config
from dayzero.model.rope import static_inv_freq, yarn_attention_factor
from dayzero.model.transformer import forward
from dayzero.model.weights import MoEWeights
from tests.hf_helpers import (
    MIN_ROUTER_GAP, REL_TOL, all_logits, assert_logits_match, assert_steps_match_full, convert_case,
    copy_hf_checkpoint, greedy_vs_hf, hf_logits, hf_model, random_ids,
)

LONG, SHORT, NEW, PREFILL = 200, 20, 32, 184
WINDOW, LIMIT, TOP_K = 24, 1.0, 2

COMMON = dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=8, num_experts_per_tok=TOP_K, vocab_size=256, max_position_embeddings=512,
    sliding_window=WINDOW, swiglu_limit=LIMIT, rms_norm_eps=1e-5, initializer_range=0.1,
    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 150000.0},
    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
# Routing gaps of seed 4: 4.5e-3 (long prompt), 6.6e-3 (short prompt + its 32 greedy tokens);
# seeds 0, 5 and 10 have one below 2e-4.
SEED = 4


def build_hf_gpt_oss(seed: int):
    """A tiny random HF GptOss model: fp32, eager, random norms, biases and sinks (see the module
    docstring)."""
    model = hf_model(transformers.GptOssConfig(**COMMON), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.5, 1.0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    return model


def router_gap(logits: np.ndarray) -> float:
    """Smallest gap over tokens between the C-th and (C+1)-th biased router logit (what HF ranks)."""
    s = np.sort(logits, axis=-1)
    return float((s[:, -TOP_K] - s[:, -TOP_K - 1]).min())


def hf_min_gap(model, ids: np.ndarray) -> float:
    """The smallest routing gap over every layer of HF's forward pass over ``ids``."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    assert len(out.router_logits) == COMMON["num_hidden_layers"]
    return min(router_gap(r.numpy()) for r in out.router_logits)


pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """The converted tiny gpt-oss model with HF's logits of the long prompt."""
    hf = build_hf_gpt_oss(SEED)
    c = convert_case(hf_factory, tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", hf, LONG)
    c.hf_long = hf_logits(hf, c.long_ids)
    return c


@pytest.fixture(scope="module")
def hf_taps(case) -> dict:
    """(inputs, output) of each HF layer's router, experts and whole MoE block (``("router", i)``,
    ``("experts", i)``, ``("mlp", i)``) from one HF forward of the long prompt."""
    seen, modules = {}, {}
    for i, layer in enumerate(case.hf.model.layers):
        modules.update({("router", i): layer.mlp.router, ("experts", i): layer.mlp.experts, ("mlp", i): layer.mlp})
    hooks = [module.register_forward_hook(lambda mod, inp, out, key=key: seen.__setitem__(key, (inp, out)))
             for key, module in modules.items()]
    try:
        with torch.no_grad():
            case.hf(torch.from_numpy(case.long_ids.astype(np.int64)))
    finally:
        for h in hooks:
            h.remove()
    assert sorted(seen) == sorted(modules)
    return seen


def far_from_hf(case, config: ModelConfig, weights) -> float:
    """How far (relative to max |HF|) our logits of the long prompt move with ``config``/``weights``."""
    logits = all_logits(weights, config, case.long_ids)
    return float(np.abs(logits - case.hf_long).max() / np.abs(case.hf_long).max())


# ---- whole-model parity ------------------------------------------------------------------------


def test_converted_config(case):
    c = case.config
    assert c.family is Family.GPT_OSS and c.attention is AttentionKind.GQA and c.attention_sinks
    assert c.sliding_windows == (WINDOW, None) and c.qkv_bias and c.o_bias and not c.qk_norm
    assert (c.rope.type, c.rope.truncate, c.rope.factor, c.rope.theta) == (RopeType.YARN, False, 8.0, 150000.0)
    moe = c.moe
    assert moe.layers == (True, True) and moe.score is RouterScore.SOFTMAX and moe.renormalize
    assert moe.router_bias and moe.expert_bias and not moe.score_bias and moe.intermediate_size == 32
    assert (moe.swiglu_limit, moe.swiglu_alpha, moe.swiglu_up_shift) == (LIMIT, 1.702, 1.0)
    sinks = case.weights.layers[0].attn.sinks
    assert sinks.shape == (4,) and sinks.dtype == jnp.float32
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_router_margins_are_not_ties(case):
    """Every token of the long prompt has a clear expert choice in every layer (else (a) tests
    rounding; (b) checks its own prompt)."""
    assert hf_min_gap(case.hf, case.long_ids) > MIN_ROUTER_GAP


def test_logits_match_hf(case):
    """(a) fp32 logits of a 200-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


def test_router_choices_match_hf(case, hf_taps):
    """On the hidden states HF's own forward feeds each router, ``route`` (router bias added to
    the logits, softmax renormalised over the chosen) picks HF's experts with HF's weights (HF's
    softmax over its top-k logits). HF's top-k is sorted, as ours: compared in order."""
    for i in range(COMMON["num_hidden_layers"]):
        (x,), (logits, ref_weights, ref_experts) = hf_taps["router", i]
        w = case.weights.layers[i].mlp
        assert isinstance(w, MoEWeights)
        assert router_gap(logits.numpy()) > MIN_ROUTER_GAP
        weights, experts = route(w.router, case.config.moe, jnp.asarray(x.numpy()), None, w.router_bias)
        np.testing.assert_array_equal(np.asarray(experts), ref_experts.numpy())
        np.testing.assert_allclose(np.asarray(weights), ref_weights.numpy(), rtol=1e-5, atol=1e-6)


def test_swiglu_clamp_bites(case, hf_taps):
    """On HF's own expert inputs, a large share of the chosen experts' gate and up activations lie
    past ``swiglu_limit`` (so (a) tests the clamp, both sides of up included)."""
    hf = case.hf.model.layers
    for i in range(COMMON["num_hidden_layers"]):
        (x, indices, _), _ = hf_taps["experts", i]
        experts = hf[i].mlp.experts
        with torch.no_grad():
            gate_up = (torch.einsum("nd,ncdf->ncf", x, experts.gate_up_proj[indices])
                       + experts.gate_up_proj_bias[indices]).numpy()
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        assert 0.05 < np.mean(gate > LIMIT) < 0.5, np.mean(gate > LIMIT)
        assert np.mean(up > LIMIT) > 0.05 and np.mean(up < -LIMIT) > 0.05


@pytest.mark.parametrize("impl", [GroupedMatmul.EXPERT_LOOP, GroupedMatmul.RAGGED_DOT])
def test_moe_block_matches_hf(case, hf_taps, impl):
    """The whole MoE block (router bias, expert biases, clamped SwiGLU) on HF's own input equals
    HF's block output, on the expert loop and on the ragged_dot path (its biases per sorted row)."""
    block = jax.jit(moe, static_argnums=(1, 3))
    for i in (0, 1):
        (x,), (ref, _) = hf_taps["mlp", i]
        ours = np.asarray(block(case.weights.layers[i].mlp, case.config.moe, jnp.asarray(x.numpy()), impl))
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-4, atol=1e-5 * np.abs(ref.numpy()).max())


def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 184 tokens, decode 16 one at a time, all past the 24-token window: the logits
    of one 200-token pass."""
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1 :], case.name)


def test_sinks_on_the_kernels_through_the_model(case):
    """The interpreted Pallas kernels with the model's sinks: a first prefill on the flash kernel
    (rows of 32 and 27 real tokens of the long prompt, past the window), its keys/values written
    to pages, then a step of 2 (1) tokens on the paged kernel: each real token's logits are those
    of the one full pass over the long prompt (reference path, checked against HF's)."""
    from dayzero.model.paged_cache import append_to_pages, init_paged_cache, kernel_view

    config, weights, ids = case.config, case.weights, case.long_ids[0]
    mode = KernelMode.PALLAS_INTERPRET
    lengths, steps = np.array([32, 27]), np.array([2, 1])
    first = jnp.asarray(np.stack([ids[:32], ids[:32]]))  # the second row's last 5 tokens are padding
    step = jnp.asarray(np.stack([ids[n : n + 2] for n in lengths]))
    run = jax.jit(forward, static_argnums=(1,), static_argnames=("all_logits", "kernels"))
    logits, new = run(weights, config, first, None, jnp.asarray(lengths, jnp.int32), all_logits=True, kernels=mode)
    pages = init_paged_cache(config, num_pages=12, page_size=8, batch=2, table_width=6)
    pages = append_to_pages(pages.replace(block_tables=jnp.arange(12, dtype=jnp.int32).reshape(2, 6)), new)
    view = kernel_view(pages, jnp.asarray(steps, jnp.int32), mode, config.sliding_windows)
    step_logits, _ = run(weights, config, step, view, jnp.asarray(steps, jnp.int32), all_logits=True)
    for row, (n, s) in enumerate(zip(lengths, steps)):
        got = np.concatenate([np.asarray(logits)[row, :n], np.asarray(step_logits)[row, :s]])
        np.testing.assert_allclose(got, case.ours_long[0, : n + s], rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_greedy_generation_matches_hf(case):
    """(b) 32 greedy tokens through Engine.generate are exactly HF generate's, on a prompt whose
    tokens and HF's continuation have clear expert choices."""
    prompt = random_ids(SHORT, case.config.vocab_size, seed=2)
    out, ref = greedy_vs_hf(case, prompt, NEW)
    assert hf_min_gap(case.hf, np.concatenate([prompt, np.asarray(ref, np.int32)[None]], axis=1)) > MIN_ROUTER_GAP
    assert out.token_ids == ref


@pytest.mark.slow
def test_each_feature_is_effective(case):
    """Without the sinks, the clamp, the window or YaRN's untruncated ramp, our logits move over
    100x the tolerance from HF's: the parity check (a) tests each."""
    c, w = case.config, case.weights
    no_sinks = dataclasses.replace(w, layers=tuple(
        dataclasses.replace(layer, attn=layer.attn.replace(sinks=None)) for layer in w.layers))
    changes = {
        "sinks": (c, no_sinks),
        "clamp": (dataclasses.replace(c, moe=dataclasses.replace(c.moe, swiglu_limit=None)), w),
        "window": (dataclasses.replace(c, sliding_windows=(None, None)), w),
        "truncate": (dataclasses.replace(c, rope=dataclasses.replace(c.rope, truncate=True)), w),
    }
    for name, (config, weights) in changes.items():
        assert far_from_hf(case, config, weights) > 100 * REL_TOL, name


@pytest.mark.slow
def test_paged_serving_matches_engine_alone(case):
    """Continuous batching over the paged cache: three requests on two slots, the 40-token prompt
    (past the window) prefilled in 16-token chunks, then a fourth whose first 32 tokens hit the
    prefix cache; each produces the tokens it produces alone."""
    from dayzero.engine.serving import ServingConfig, ServingEngine

    serving = ServingConfig(slots=2, page_size=8, num_pages=48, max_context=128, max_chunk=16, min_chunk=16,
                            min_table_pages=8)
    prompts = [random_ids(n, 256, seed=50 + n)[0].tolist() for n in (40, 9, 14)]
    prompts.append(prompts[0][:32] + random_ids(5, 256, seed=7)[0].tolist())
    new = [8, 12, 6, 6]
    server = ServingEngine(case.engine, serving)
    served = server.run(prompts, max_new_tokens=new, ignore_eos=True)
    assert server.stats.prefill_chunks > len(prompts) and server.stats.cached_tokens >= 32
    for prompt, n, out in zip(prompts, new, served):
        assert out.token_ids == case.engine.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids


@pytest.mark.slow
def test_verify_compares_every_layer(case):
    """``dayzero verify``: each decoder layer's output and the logits against HF's, per layer."""
    from dayzero.tools.verify import verify

    report = verify(case.root / "hf", case.root / "dz", ids=case.long_ids[0, :64].tolist())
    assert report.passed and len(report.layers) == case.config.num_layers


@pytest.mark.slow
def test_mesh_matches_one_device():
    """8 faked devices (tests/mesh_checks.py ``part_gpt_oss``): logits on data=2 x tensor=4 (sinks
    split with the heads) and tensor=2 x expert=4 (expert biases split with the experts and their
    width, the down bias counted once), generation on tensor=2 x expert=4, and the flash kernel
    per device's heads inside shard_map, all as on one device."""
    from tests.mesh_checks import run_part

    out = run_part("gpt_oss", fast_compile=True)
    assert out["router_gap"] > MIN_ROUTER_GAP
    assert out["sinks_spec"] == ["tensor"]
    for mesh in ("dp2tp4", "tp2ep4", "dp2tp4_kernels"):
        assert out[mesh]["err"] < 1e-5, (mesh, out[mesh])
    assert out["tp2ep4"]["generate"]["same_tokens"] and out["tp2ep4"]["generate"]["logprob_diff"] < 1e-5


# ---- converter ----------------------------------------------------------------------------------


def test_experts_are_deinterleaved(case):
    """HF's gate_up_proj [E,D,2F] keeps gate in the even columns and up in the odd ones (its bias
    alike): the converted stacks are those columns, already input-major; down as stored."""
    hf, w = case.hf.model.layers[1].mlp.experts, case.weights.layers[1].mlp
    gate_up, bias = hf.gate_up_proj.detach().numpy(), hf.gate_up_proj_bias.detach().numpy()
    for ours, theirs in ((w.gate, gate_up[..., 0::2]), (w.up, gate_up[..., 1::2]), (w.gate_bias, bias[..., 0::2]),
                         (w.up_bias, bias[..., 1::2]), (w.down, hf.down_proj.detach().numpy()),
                         (w.down_bias, hf.down_proj_bias.detach().numpy())):
        np.testing.assert_array_equal(np.asarray(ours), theirs)
    x = np.arange(24).reshape(2, 12)
    np.testing.assert_array_equal(deinterleave(x, axis=1, part=1), x[:, 1::2])
    np.testing.assert_array_equal(deinterleave(x, axis=0, part=0), x[:1])
    with pytest.raises(ValueError, match="even axis"):
        deinterleave(x[:, :5], axis=1, part=0)


@pytest.mark.parametrize("tensor", ["model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                                    "model.layers.0.mlp.experts.gate_up_proj_bias",
                                    "model.layers.1.mlp.experts.down_proj_bias", "model.layers.0.self_attn.o_proj.bias"])
def test_missing_tensor_is_named(case, tmp_path, tensor):
    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "src", tensors_edit=lambda t: t.pop(tensor))
    with pytest.raises(ConvertError, match=f"no tensor '{tensor}'"):
        convert_checkpoint(src, tmp_path / "dz", progress=False)


def test_check_names_a_missing_sink(case, tmp_path):
    """``dayzero check`` lists the missing sink tensor (and nothing else) before any conversion."""
    from dayzero.convert.check import check_source

    victim = "model.layers.1.self_attn.sinks"
    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "src", tensors_edit=lambda t: t.pop(victim))
    report = check_source(src)
    assert report.structure["missing"] == [victim] and not report.structure["unexpected"]
    assert f"missing tensor '{victim}'" in report.problems


# ---- config parsing and presets ---------------------------------------------------------------------


def _published(**changes) -> dict:
    """gpt-oss-120b's config.json as published (the preset), with ``changes``."""
    return {**preset_hf_config("gpt-oss-120b"), **changes}


def test_published_config_parses():
    c = parse_hf_config(_published())
    assert c.family is Family.GPT_OSS and c.attention_sinks and c.qkv_bias and c.o_bias
    assert c.sliding_windows == (128, None) * 18 and c.eos_token_ids == (200002,) and c.head_dim == 64
    assert (c.rope.type, c.rope.factor, c.rope.original_max_position, c.rope.truncate) == (RopeType.YARN, 32.0,
                                                                                          4096, False)
    assert c.rope.theta == 150000.0 and c.max_position_embeddings == 131072
    assert (c.moe.num_experts, c.moe.experts_per_token, c.moe.intermediate_size) == (128, 4, 2880)
    assert (c.moe.swiglu_limit, c.moe.swiglu_alpha, c.moe.swiglu_up_shift) == (7.0, 1.702, 1.0)
    # The published MXFP4 experts are accepted here (the converter's reader checks the layout),
    # for gpt-oss only.
    assert _published()["quantization_config"]["quant_method"] == "mxfp4"
    llama = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=256)
    with pytest.raises(ConfigError, match="quantization_config"):
        parse_hf_config({**llama, "quantization_config": _published()["quantization_config"]})


def test_hf_defaults_fill_missing_keys():
    """Keys a config may leave out take HF GptOssConfig's defaults, not the generic ones (head_dim
    64, not hidden_size / heads; alternating layer types; YaRN x32 at theta 150000; biases on)."""
    sizes = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_hidden_layers=4,
                 vocab_size=1000)
    c = parse_hf_config({"model_type": "gpt_oss", **sizes})
    hf = transformers.GptOssConfig(**sizes)
    rope = hf.rope_parameters
    assert c.head_dim == hf.head_dim == 64 and c.num_kv_heads == hf.num_key_value_heads == 8
    assert c.sliding_windows == tuple(hf.sliding_window if t == "sliding_attention" else None
                                      for t in hf.layer_types) == (128, None, 128, None)
    assert (c.rope.theta, c.rope.factor, c.rope.original_max_position, c.rope.truncate) == (
        rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"], rope["truncate"])
    assert (c.moe.num_experts, c.moe.experts_per_token) == (hf.num_local_experts, hf.num_experts_per_tok)
    assert (c.moe.swiglu_alpha, c.moe.swiglu_limit) == (hf.swiglu_alpha, hf.swiglu_limit)
    assert c.qkv_bias and c.o_bias and hf.attention_bias and c.rms_norm_eps == hf.rms_norm_eps
    assert c.max_position_embeddings == hf.max_position_embeddings


def test_yarn_frequencies_match_hf():
    """The published YaRN (x32, 4096 positions, truncate false): our inverse frequencies and cos/sin
    scale are HF's; truncating the ramp (the default) would change them."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    rope = parse_hf_config(_published()).rope
    inv_freq, factor = _compute_yarn_parameters(transformers.GptOssConfig.from_dict(_published()))
    np.testing.assert_allclose(static_inv_freq(rope, 64), inv_freq.numpy(), rtol=1e-6)
    assert abs(yarn_attention_factor(rope) - factor) < 1e-7
    truncated = static_inv_freq(dataclasses.replace(rope, truncate=True), 64)
    assert np.abs(truncated / inv_freq.numpy() - 1).max() > 1e-2


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b"])
def test_preset_parameter_count_is_hfs(name):
    """The plan presets count exactly the parameters of HF's model at that config (meta device)."""
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig.from_dict(preset_hf_config(name)))
    assert DecodeFootprint(load_preset(name), name).parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("change, match", [
    ({"some_new_key": 1}, "some_new_key"),
    ({"experts_per_token": 2}, "experts_per_token"),
    ({"initial_context_length": 8192}, "initial_context_length"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 18}, "chunked_attention"),
    ({"layer_types": ["sliding_attention"] * 35}, "35 layer types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 32.0}}, "longrope"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
])
def test_bad_gpt_oss_config_is_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(_published(**change))


def test_other_families_refuse_gpt_oss_keys():
    llama = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=256)
    for key, value in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702), ("experts_per_token", 4),
                       ("initial_context_length", 4096)):
        with pytest.raises(ConfigError, match=key):
            parse_hf_config({**llama, key: value})
