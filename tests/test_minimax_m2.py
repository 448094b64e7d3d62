"""MiniMax-M2 (HF ``minimax_m2``): GQA with q/k RMSNorm over all heads of a token, partial RoPE,
sigmoid routing with a selection bias in every layer; parity with HF transformers.

A tiny random HF MiniMaxM2 model (fp32, eager attention, random norms and selection biases, half
of each 32-wide head rotated (``rotary_dim`` 16), the q and k heads scaled
unevenly so that one RMS per head, or per device's share of the heads, differs from HF's one RMS
over all of them by far more than rounding) goes through the real converter. (a) logits of a
200-token prompt match HF's; (b) 32 greedy tokens through ``Engine.generate`` are HF's; (c) prefill
+ one-token decode steps reproduce one full forward. Also: the q/k norms against HF's modules (and
the per-head alternative shown far off), the experts each MoE layer picks on HF's own hidden
states, ``dayzero verify``, the fused (transformers 5) layout, MTP tensors skipped and listed,
strict config parsing, and the all-heads norm with the heads split over tensor=4 (one attention
block in a subprocess with 8 faked devices, tests/mesh_checks.py ``part_minimax_norm``). The
whole model on data=2 x tensor=4 and tensor=2 x expert=4 is ``part_minimax`` (test_mesh_engine.py,
slow).

Default suite: the fixture, (a), the norm and router checks, verify, the converter and config
checks, the mesh norm check. Slow (``-m slow``): (b), (c), the paged server, partial RoPE's effect.

Random routers can sit near ties: the whole-model comparisons first assert that the expert cut of
the (biased) choice has a gap far above fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.model.config import AttentionKind, ConfigError, Family, ModelConfig, RouterScore
from dayzero.model.hf_config import fp8_block_size, parse_hf_config
from dayzero.model.moe import route
from dayzero.model.norm import rms_norm
from dayzero.model.weights import MoEWeights, named_leaves
from tests.hf_helpers import (
    MIN_ROUTER_GAP, assert_change_is_effective, assert_logits_match, assert_steps_match_full, convert_case,
    copy_hf_checkpoint, greedy_vs_hf, hf_logits, hf_model, random_ids,
)
from tests.mesh_checks import run_part

LONG, SHORT, NEW, PREFILL = 200, 20, 32, 184
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32  # rotary_dim 16: the first half of each head rotated

COMMON = dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rotary_dim=16, num_local_experts=8, num_experts_per_tok=2,
    vocab_size=256, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1,
    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
# Per-head scales of the q and k projections: the heads' RMS then differ by up to 16x.
Q_SCALE, K_SCALE = (4.0, 1.0, 0.25, 1.0), (3.0, 0.3)
# Routing gaps of seed 9: 4.1e-4 (long prompt), 1.1e-3 (short prompt + its 32 greedy tokens);
# seeds 0, 1, 4, 6, 8 and 11 have one below 1e-4.
SEED = 9


def build_hf_minimax(seed: int):
    """A tiny random HF MiniMaxM2 model: fp32, eager, random norms and selection biases, the q/k
    heads scaled unevenly (see Q_SCALE)."""
    model = hf_model(transformers.MiniMaxM2Config(**COMMON), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
        for layer in model.model.layers:
            for proj, scales in ((layer.self_attn.q_proj, Q_SCALE), (layer.self_attn.k_proj, K_SCALE)):
                proj.weight.mul_(torch.tensor(scales).repeat_interleave(HEAD_DIM)[:, None])
    return model


def expert_cut_gap(router_logits: np.ndarray, bias: np.ndarray) -> float:
    """Smallest gap over tokens between the C-th and (C+1)-th biased sigmoid score: what MiniMax-M2
    ranks (no groups, so test_deepseek.routing_gaps' group cut does not apply)."""
    choice = np.sort(1 / (1 + np.exp(-router_logits.astype(np.float64))) + bias, axis=-1)
    C = COMMON["num_experts_per_tok"]
    return float((choice[:, -C] - choice[:, -C - 1]).min())


def hf_min_gap(model, ids: np.ndarray) -> float:
    """The smallest routing gap over every MoE layer of HF's forward pass over ``ids``."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    biases = [layer.mlp.e_score_correction_bias.numpy() for layer in model.model.layers]
    assert len(biases) == len(out.router_logits) == COMMON["num_hidden_layers"]
    return min(expert_cut_gap(r.numpy(), b) for r, b in zip(out.router_logits, biases))


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """The converted tiny MiniMax-M2 model with HF's logits of the long prompt."""
    hf = build_hf_minimax(SEED)
    c = convert_case(hf_factory, tmp_path_factory.mktemp("minimax_m2"), "minimax_m2", hf, LONG)
    c.hf_long = hf_logits(hf, c.long_ids)
    return c


# ---- whole-model parity ------------------------------------------------------------------------


def test_converted_config(case):
    c = case.config
    assert c.family is Family.MINIMAX_M2 and c.attention is AttentionKind.GQA
    assert (c.head_dim, c.num_kv_heads, c.rope.partial_rotary_factor) == (HEAD_DIM, KV_HEADS, 0.5)
    assert c.qk_norm and c.qk_norm_all_heads and not c.qkv_bias and not c.o_bias and c.mtp_layers == 0
    assert case.weights.layers[0].attn.q_norm.shape == (HEADS, HEAD_DIM)
    assert case.weights.layers[0].attn.k_norm.shape == (KV_HEADS, HEAD_DIM)
    moe = c.moe
    assert moe.layers == (True, True) and moe.score is RouterScore.SIGMOID and moe.score_bias and moe.renormalize
    assert (moe.num_groups, moe.routed_scaling, moe.shared_experts, moe.intermediate_size) == (1, 1.0, 0, 32)
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_router_margins_are_not_ties(case):
    """Every token of the long prompt has a clear expert choice in every layer (else (a) tests
    rounding; (b) checks its own prompt)."""
    assert hf_min_gap(case.hf, case.long_ids) > MIN_ROUTER_GAP


def test_logits_match_hf(case):
    """(a) fp32 logits of a 200-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


@pytest.fixture(scope="module")
def hf_taps(case) -> dict:
    """(input, output) of each HF layer's q norm, k norm and router ("q", "k", "gate" by layer
    index), from one HF forward of the long prompt."""
    seen = {}
    modules = {}
    for i, layer in enumerate(case.hf.model.layers):
        attn = layer.self_attn
        modules.update({("q", i): attn.q_norm, ("k", i): attn.k_norm, ("gate", i): layer.mlp.gate})
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


def test_qk_norm_over_all_heads_matches_hf(case, hf_taps):
    """On HF's own projections, our norm over the (-2, -1) axes of [B,T,heads,H] with the [heads,H]
    weight is HF's norm of the flat [B,T,heads*H] vector; one RMS per head (Qwen3's) or per pair of
    heads (a per-shard norm on tensor=2) is far off, so the parity above tests the choice."""
    eps = case.config.rms_norm_eps
    for (which, i), (inp, out) in hf_taps.items():
        if which == "gate":
            continue
        x = jnp.asarray(inp[0].numpy().reshape(1, LONG, -1, HEAD_DIM))
        weight = getattr(case.weights.layers[i].attn, f"{which}_norm")
        ref = out.numpy().reshape(x.shape)
        np.testing.assert_allclose(np.asarray(rms_norm(x, weight, eps, (-2, -1))), ref, rtol=1e-5, atol=1e-5)
        per_head = np.asarray(rms_norm(x, weight, eps))
        pairs = np.asarray(rms_norm(x.reshape(1, LONG, 2, -1), weight.reshape(2, -1), eps)).reshape(x.shape)
        for wrong in (per_head, pairs):
            assert np.abs(wrong - ref).max() > 0.3 * np.abs(ref).max()


def test_router_choices_match_hf(case, hf_taps):
    """On the hidden states HF's own forward feeds each router, ``route`` picks HF's experts with
    HF's weights (HF's top-k is unsorted: compared in expert order)."""
    take = np.take_along_axis
    for i in range(COMMON["num_hidden_layers"]):
        (x, bias), (_, ref_weights, ref_experts) = hf_taps["gate", i]
        w = case.weights.layers[i].mlp
        assert isinstance(w, MoEWeights)
        np.testing.assert_array_equal(np.asarray(w.score_bias), bias.numpy())
        weights, experts = route(w.router, case.config.moe, jnp.asarray(x.numpy().reshape(-1, x.shape[-1])),
                                 w.score_bias)
        ours, theirs = np.argsort(np.asarray(experts), -1), np.argsort(ref_experts.numpy(), -1)
        np.testing.assert_array_equal(take(np.asarray(experts), ours, -1), take(ref_experts.numpy(), theirs, -1))
        np.testing.assert_allclose(take(np.asarray(weights), ours, -1), take(ref_weights.numpy(), theirs, -1),
                                   rtol=1e-5, atol=1e-6)


def test_qk_norm_on_a_mesh_is_taken_over_all_heads():
    """One attention block with its heads split over tensor=4 (x data=2, 8 faked devices, ~12 s)
    equals one device: the sum of squares spans the devices. A per-shard RMS moves it by ~0.3
    relative on these unevenly scaled heads."""
    out = run_part("minimax_norm", fast_compile=True)
    assert out["q_norm_spec"] == out["k_norm_spec"] == ["tensor", "None"]  # the norm weights are split too
    assert out["dp2tp4_err"] < 1e-5
    assert out["per_shard_err"] > 1e-2


@pytest.mark.slow
def test_greedy_generation_matches_hf(case):
    """(b) 32 greedy tokens through Engine.generate are exactly HF generate's, on a prompt whose
    tokens and HF's continuation have clear expert choices."""
    prompt = random_ids(SHORT, case.config.vocab_size, seed=2)
    out, ref = greedy_vs_hf(case, prompt, NEW)
    assert hf_min_gap(case.hf, np.concatenate([prompt, np.asarray(ref, np.int32)[None]], axis=1)) > MIN_ROUTER_GAP
    assert out.token_ids == ref


@pytest.mark.slow
def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 184 tokens, decode 16 one at a time: the logits of one 200-token pass."""
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1 :], case.name)


@pytest.mark.slow
def test_partial_rotary_is_effective(case):
    """Rotating whole heads instead of their first half moves the logits far from HF's."""
    whole = dataclasses.replace(case.config, rope=dataclasses.replace(case.config.rope, partial_rotary_factor=1.0))
    assert_change_is_effective(case, whole)


@pytest.mark.slow
def test_paged_serving_matches_engine_alone(case):
    """Continuous batching over the paged cache: three requests on two slots, the 40-token prompt
    prefilled in 16-token chunks; each produces the tokens it produces alone."""
    from dayzero.engine.serving import ServingConfig, ServingEngine

    serving = ServingConfig(slots=2, page_size=8, num_pages=32, max_context=128, max_chunk=16, min_chunk=16,
                            min_table_pages=8)
    prompts = [random_ids(n, 256, seed=50 + n)[0].tolist() for n in (40, 9, 14)]
    server = ServingEngine(case.engine, serving)
    served = server.run(prompts, max_new_tokens=[8, 12, 6], ignore_eos=True)
    assert server.stats.prefill_chunks > len(prompts)
    for prompt, new, out in zip(prompts, (8, 12, 6), served):
        assert out.token_ids == case.engine.generate(prompt, max_new_tokens=new, ignore_eos=True).token_ids


@pytest.mark.slow  # the verify machinery is exercised on every push by tests/test_verify.py and GLM's
def test_verify_compares_every_layer(case):
    """``dayzero verify``: each decoder layer's output and the logits against HF's, per layer."""
    from dayzero.tools.verify import verify

    report = verify(case.root / "hf", case.root / "dz", ids=case.long_ids[0, :64].tolist())
    assert report.passed and len(report.layers) == case.config.num_layers


# ---- converter: the fused layout, MTP tensors, missing tensors ----------------------------------


def test_fused_layout_converts_to_the_same_weights(case, tmp_path):
    """transformers 5's own layout (``mlp.gate``, ``mlp.experts.gate_up_proj``,
    ``mlp.e_score_correction_bias``) gives the same weights as the published per-expert one."""
    case.hf.save_pretrained(tmp_path / "hf", save_original_format=False)
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
        assert "model.layers.0.mlp.e_score_correction_bias" in set(f.keys())
    convert_checkpoint(tmp_path / "hf", tmp_path / "dz", progress=False)
    _, fused = load_checkpoint(tmp_path / "dz", dtype=jnp.float32)
    ours, theirs = named_leaves(case.weights), named_leaves(fused)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(theirs[name]), err_msg=name)


def _with_mtp(raw: dict) -> None:
    raw.update(use_mtp=True, num_mtp_modules=1, mtp_transformer_layers=1)


def _add_layer(index: int):
    """A tensor of layer ``index``, where MTP modules are stored after the last layer."""
    return lambda t: t.update({f"model.layers.{index}.self_attn.q_proj.weight": torch.zeros(128, 64)})


def test_mtp_layer_is_skipped_explicitly_and_others_refused(case, tmp_path):
    """With ``use_mtp`` and one module of one layer, layer num_layers is not converted and
    ``dayzero check`` lists it as ignored; layer num_layers + 1 is refused by name."""
    from dayzero.convert.check import check_source

    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "mtp", _with_mtp, _add_layer(2))
    report = check_source(src)
    assert report.structure["ignored"] == ["model.layers.2.self_attn.q_proj.weight"]
    assert not report.structure["unexpected"] and not report.structure["missing"]
    convert_checkpoint(src, tmp_path / "dz", progress=False)
    bad = copy_hf_checkpoint(case.root / "hf", tmp_path / "extra", _with_mtp, _add_layer(3))
    with pytest.raises(ConvertError, match=r"model\.layers\.3\.self_attn\.q_proj\.weight"):
        convert_checkpoint(bad, tmp_path / "dz2", progress=False)


@pytest.mark.parametrize("tensor", ["model.layers.1.block_sparse_moe.e_score_correction_bias",
                                    "model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                                    "model.layers.0.block_sparse_moe.experts.7.w3.weight"])
def test_missing_tensor_is_named(case, tmp_path, tensor):
    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "src", tensors_edit=lambda t: t.pop(tensor))
    with pytest.raises(ConvertError, match=f"no tensor '{tensor}'"):
        convert_checkpoint(src, tmp_path / "dz", progress=False)


def test_per_head_sized_norm_is_refused(case, tmp_path):
    """A q norm of one head's width (a per-head checkpoint under this model_type) is refused by shape."""
    edit = lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(HEAD_DIM)})  # noqa: E731
    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "src", tensors_edit=edit)
    with pytest.raises(ConvertError, match=r"q_norm\.weight' .*has shape \[32\], expected \[128\]"):
        convert_checkpoint(src, tmp_path / "dz", progress=False)


# ---- config parsing ---------------------------------------------------------------------------------


def _published() -> dict:
    """MiniMax-M2's config.json as published (its keys and values), shrunk to tiny sizes."""
    return {
        "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1, 1], "auto_map": {},
        "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32,
        "max_position_embeddings": 196608, "model_type": "minimax_m2", "mtp_transformer_layers": 1,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_mtp_modules": 3, "output_router_logits": False, "qk_norm_type": "per_layer",
        "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 16, "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
        "shared_moe_mode": "sigmoid", "tie_word_embeddings": False, "transformers_version": "4.46.1",
        "use_cache": True, "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 256,
        "torch_dtype": "bfloat16", "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "sliding_window": None,
    }


def test_published_config_parses():
    c = parse_hf_config(_published())
    assert c.family is Family.MINIMAX_M2 and c.rope.partial_rotary_factor == 0.5 and c.rope.theta == 5e6
    assert c.qk_norm_all_heads and c.mtp_layers == 3 and c.sliding_windows == (None, None)
    assert c.moe.score_bias and c.moe.renormalize and c.moe.num_groups == 1 and not c.moe.shared_experts
    assert not parse_hf_config({**_published(), "use_mtp": False}).mtp_layers
    # The published FP8 weights: DeepSeek's block scheme, its format spelled as the dtype's name.
    fp8 = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
           "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    assert fp8_block_size({**_published(), "quantization_config": fp8}) == (128, 128)


def test_hf_defaults_fill_missing_keys():
    """Keys a config may leave out take HF MiniMaxM2Config's defaults, not the generic ones
    (head_dim 128, not hidden_size / heads; RoPE theta 5e6; whole heads rotated without rotary_dim)."""
    drop = ("head_dim", "rope_theta", "rotary_dim", "num_local_experts", "num_experts_per_tok",
            "max_position_embeddings")
    c = parse_hf_config({k: v for k, v in _published().items() if k not in drop})
    hf = transformers.MiniMaxM2Config(**{k: v for k, v in COMMON.items() if k not in drop})
    assert c.head_dim == hf.head_dim == 128 and c.rope.theta == hf.rope_parameters["rope_theta"] == 5e6
    assert c.rope.partial_rotary_factor == hf.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0
    assert (c.moe.num_experts, c.moe.experts_per_token) == (hf.num_local_experts, hf.num_experts_per_tok) == (256, 8)
    assert c.max_position_embeddings == hf.max_position_embeddings


@pytest.mark.parametrize("change, match", [
    ({"some_new_key": 1}, "some_new_key"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type"),
    ({"use_qk_norm": False}, "use_qk_norm"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"use_routing_bias": False}, "use_routing_bias"),
    ({"shared_intermediate_size": 32}, "shared_intermediate_size"),
    ({"attention_bias": True}, "attention_bias"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"attn_type_list": [1, 0]}, "attn_type_list"),
    ({"attn_type_list": [1]}, "attn_type_list"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"partial_rotary_factor": 0.25}, "rotary_dim=16 and partial_rotary_factor=0.25 disagree"),
    ({"rotary_dim": 15}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_bad_minimax_config_is_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        parse_hf_config({**_published(), **change})


def test_other_families_refuse_minimax_keys():
    llama = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=256)
    for key, value in (("rotary_dim", 8), ("qk_norm_type", "per_layer"), ("attn_type_list", [1, 1])):
        with pytest.raises(ConfigError, match=key):
            parse_hf_config({**llama, key: value})
