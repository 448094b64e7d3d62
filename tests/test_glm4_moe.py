"""GLM-4.5/4.6/4.7 (HF ``glm4_moe``): GQA with q/k/v biases and q/k norms, partial RoPE, DeepSeek-V3
routing; parity with HF transformers.

A tiny random HF Glm4Moe model (fp32, eager attention, random norms, q/k/v biases and selection
biases; half of each 32-wide head rotated) goes through the real converter. As in test_deepseek.py:
(a) logits of a 200-token prompt match HF's; (b) 32 greedy tokens through ``Engine.generate`` are
HF's; (c) prefill + one-token decode steps reproduce one full forward. Also: the experts each MoE
layer picks on HF's own hidden states are HF's, with HF's weights; partial RoPE against HF's
``apply_rotary_pos_emb``; the paged ``ServingEngine`` and ``dayzero verify``; a partial MTP
layer refused (the whole one: tests/test_speculative_mtp_glm.py); strict config parsing. The
8-device mesh check is tests/mesh_checks.py ``part_glm`` (the ``glm`` cases of
tests/test_mesh_engine.py).

Default suite (~30 s here): the fixture, (a), the router checks, RoPE at factor 0.5, verify, the
converter and config checks. Slow (``-m slow``; each compiles steps of its own, 15-30 s): (b),
(c), the paged server, RoPE at 0.25 and the whole-head-RoPE counter-check.

Random routers can sit near ties: the whole-model comparisons first assert that the group cut and
the expert cut of the (biased) routing choice have gaps far above fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dayzero.convert import ConvertError, convert_checkpoint
from dayzero.model.config import AttentionKind, ConfigError, Family, ModelConfig, RouterScore
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.moe import route
from dayzero.model.rope import apply_rope, rope_cos_sin
from dayzero.model.weights import MoEWeights
from tests import test_deepseek
from tests.hf_helpers import (
    MIN_ROUTER_GAP, assert_change_is_effective, assert_logits_match, assert_steps_match_full, convert_case,
    copy_hf_checkpoint, greedy_vs_hf, hf_greedy, hf_logits, hf_model, random_ids,
)

LONG, SHORT, NEW, PREFILL = 200, 20, 32, 184
HEAD_DIM = 32  # of which partial_rotary_factor 0.5 rotates the first 16

COMMON = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    attention_bias=True, use_qk_norm=True, vocab_size=256, max_position_embeddings=1024, rms_norm_eps=1e-5,
    initializer_range=0.1, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
# test_deepseek.routing_gaps reads its module constants: the same routing shape here.
assert (test_deepseek.N_GROUP, test_deepseek.TOPK_GROUP, test_deepseek.EXPERTS, test_deepseek.TOP_K) == (
    COMMON["n_group"], COMMON["topk_group"], COMMON["n_routed_experts"], COMMON["num_experts_per_tok"])
# Routing gaps of seed 2: 1.1e-3 (long prompt), 2.1e-3 (short prompt + its 32 greedy tokens);
# seeds 3 and 6 have one below 1e-4.
SEED = 2


def build_hf_glm(seed: int, **overrides):
    """A tiny random HF Glm4Moe model: fp32, eager, random norms, q/k/v biases and selection biases."""
    model = hf_model(transformers.Glm4MoeConfig(**{**COMMON, **overrides}), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def hf_min_gap(model, ids: np.ndarray) -> float:
    """The smallest routing gap (group cut, expert cut) of HF's MoE layer over ``ids``."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    biases = [layer.mlp.gate.e_score_correction_bias.numpy() for layer in model.model.layers
              if hasattr(layer.mlp, "gate")]
    assert len(biases) == len(out.router_logits) == 1
    return min(min(test_deepseek.routing_gaps(r.numpy(), b)) for r, b in zip(out.router_logits, biases))


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """The converted tiny GLM model with HF's logits of the long prompt."""
    hf = build_hf_glm(SEED)
    c = convert_case(hf_factory, tmp_path_factory.mktemp("glm4_moe"), "glm4_moe", hf, LONG)
    c.hf_long = hf_logits(hf, c.long_ids)
    return c


# ---- whole-model parity ------------------------------------------------------------------------


def test_converted_config(case):
    c = case.config
    assert c.family is Family.GLM4_MOE and c.attention is AttentionKind.GQA
    assert (c.head_dim, c.num_kv_heads, c.rope.partial_rotary_factor) == (HEAD_DIM, 2, 0.5)
    assert c.qkv_bias and not c.o_bias and c.qk_norm and c.mtp_layers == 1
    moe = c.moe
    assert moe.layers == (False, True) and moe.score is RouterScore.SIGMOID and moe.score_bias
    assert (moe.num_groups, moe.groups_per_token, moe.routed_scaling, moe.shared_experts) == (2, 1, 2.5, 1)
    assert moe.renormalize
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_router_margins_are_not_ties(case):
    """Every token of the long prompt, and of the short prompt with its greedy continuation, has
    a clear group and expert choice in every MoE layer (else (a) and (b) test rounding)."""
    assert hf_min_gap(case.hf, case.long_ids) > MIN_ROUTER_GAP
    prompt = random_ids(SHORT, case.config.vocab_size, seed=2)
    generated = np.asarray(hf_greedy(case.hf, prompt, NEW), np.int32)[None]
    assert hf_min_gap(case.hf, np.concatenate([prompt, generated], axis=1)) > MIN_ROUTER_GAP


def test_logits_match_hf(case):
    """(a) fp32 logits of a 200-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


def test_router_choices_match_hf(case):
    """On the hidden states HF's own forward feeds each MoE block (the long prompt), ``route``
    picks HF's experts with HF's weights (HF's top-k is unsorted: compared in expert order)."""
    seen = {}
    hooks = [layer.mlp.gate.register_forward_hook(
                 lambda mod, inp, out, i=i: seen.__setitem__(i, (inp[0].numpy(), out[1].numpy(), out[2].numpy())))
             for i, layer in enumerate(case.hf.model.layers) if case.config.is_moe_layer(i)]
    try:
        with torch.no_grad():
            case.hf(torch.from_numpy(case.long_ids.astype(np.int64)))
    finally:
        for h in hooks:
            h.remove()
    assert sorted(seen) == [1]
    take = np.take_along_axis
    for i, (x, ref_weights, ref_experts) in seen.items():
        w = case.weights.layers[i].mlp
        assert isinstance(w, MoEWeights)
        weights, experts = route(w.router, case.config.moe, jnp.asarray(x.reshape(-1, x.shape[-1])), w.score_bias)
        ours, theirs = np.argsort(np.asarray(experts), -1), np.argsort(ref_experts, -1)
        np.testing.assert_array_equal(take(np.asarray(experts), ours, -1), take(ref_experts, theirs, -1))
        np.testing.assert_allclose(take(np.asarray(weights), ours, -1), take(ref_weights, theirs, -1),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_greedy_generation_matches_hf(case):
    """(b) 32 greedy tokens through Engine.generate are exactly HF generate's."""
    out, ref = greedy_vs_hf(case, random_ids(SHORT, case.config.vocab_size, seed=2), NEW)
    assert out.token_ids == ref


@pytest.mark.slow
def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 184 tokens, decode 16 one at a time: the logits of one 200-token pass."""
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1 :], case.name)


def _whole_head_rope(config):
    return dataclasses.replace(config, rope=dataclasses.replace(config.rope, partial_rotary_factor=1.0))


@pytest.mark.slow
def test_partial_rotary_is_effective(case):
    """Rotating whole heads instead of their first half moves the logits far from HF's."""
    assert_change_is_effective(case, _whole_head_rope(case.config))


# ---- partial RoPE, module level ----------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.5, pytest.param(0.25, marks=pytest.mark.slow)])
def test_partial_rope_matches_hf(factor):
    """cos/sin tables and the rotation of the first int(H * factor) dims, against HF glm4_moe's
    rotary embedding and ``apply_rotary_pos_emb`` (the rest of each head passes unchanged)."""
    from transformers.models.glm4_moe import modeling_glm4_moe as M

    rope = dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=factor)
    hf_config = transformers.Glm4MoeConfig(**{**COMMON, "rope_parameters": rope})
    ours = parse_hf_config({**COMMON, "model_type": "glm4_moe", "rope_parameters": rope})
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 300, n, HEAD_DIM)).astype(np.float32) for n in (4, 2))
    positions = np.arange(300)[None] * 3  # up to position 897
    with torch.no_grad():
        cos, sin = M.Glm4MoeRotaryEmbedding(hf_config)(torch.zeros(1), torch.from_numpy(positions))
        ref_q, ref_k = M.apply_rotary_pos_emb(torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2),
                                              cos, sin)
    our_cos, our_sin = rope_cos_sin(ours.rope, ours.head_dim, ours.max_position_embeddings, jnp.asarray(positions))
    assert our_cos.shape[-1] == int(HEAD_DIM * factor)
    # fp32 angles up to ~900 rad carry ~6e-5 of rounding (one ulp there); HF's torch product and
    # XLA's round differently (6.1e-5 measured in a fresh install): 1e-4, far below a wrong table.
    np.testing.assert_allclose(np.asarray(our_cos), cos.numpy(), atol=1e-4)
    for x, ref in ((q, ref_q), (k, ref_k)):
        out = np.asarray(apply_rope(jnp.asarray(x), our_cos, our_sin))
        np.testing.assert_allclose(out, ref.transpose(1, 2).numpy(), atol=3e-4)
        np.testing.assert_array_equal(out[..., int(HEAD_DIM * factor):], x[..., int(HEAD_DIM * factor):])


# ---- the engine's other paths ------------------------------------------------------------------


@pytest.mark.slow
def test_paged_serving_matches_engine_alone(case):
    """Continuous batching over the paged cache: three requests on two slots (one waits, then
    joins), the 40-token prompt prefilled in 16-token chunks; each produces the tokens it
    produces alone through Engine.generate."""
    from dayzero.engine.serving import ServingConfig, ServingEngine

    serving = ServingConfig(slots=2, page_size=8, num_pages=32, max_context=128, max_chunk=16, min_chunk=16,
                            min_table_pages=8)
    prompts = [random_ids(n, 256, seed=50 + n)[0].tolist() for n in (40, 9, 14)]
    server = ServingEngine(case.engine, serving)
    served = server.run(prompts, max_new_tokens=[8, 12, 6], ignore_eos=True)
    assert server.stats.prefill_chunks > len(prompts)
    for prompt, new, out in zip(prompts, (8, 12, 6), served):
        assert out.token_ids == case.engine.generate(prompt, max_new_tokens=new, ignore_eos=True).token_ids


@pytest.mark.slow  # the verify machinery runs by default in tests/test_verify.py
def test_verify_compares_every_layer(case):
    """``dayzero verify``: each decoder layer's output and the logits against HF's, per layer."""
    from dayzero.tools.verify import verify

    report = verify(case.root / "hf", case.root / "dz", ids=case.long_ids[0, :64].tolist())
    assert report.passed and len(report.layers) == case.config.num_layers


# ---- converter: MTP tensors, missing tensors, check ------------------------------------------------


def _add_layer(index: int):
    """A tensor of layer ``index``, as GLM-4.5 stores its MTP module's (``eh_proj``)."""
    return lambda t: t.update({f"model.layers.{index}.eh_proj.weight": torch.zeros(64, 128)})


def test_partial_mtp_layer_and_layers_past_it_are_refused(case, tmp_path):
    """Layer num_layers holds the MTP module (num_nextn_predict_layers=1, HF's default), which is
    converted whole when present (tests/test_speculative_mtp_glm.py): a source with only part of
    it is refused naming a missing tensor of it; layer num_layers + 1 is refused by name."""
    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "mtp", tensors_edit=_add_layer(2))
    with pytest.raises(ConvertError, match=r"no tensor 'model\.layers\.2\."):
        convert_checkpoint(src, tmp_path / "dz", progress=False)
    bad = copy_hf_checkpoint(case.root / "hf", tmp_path / "extra", tensors_edit=_add_layer(3))
    with pytest.raises(ConvertError, match=r"model\.layers\.3\.eh_proj\.weight"):
        convert_checkpoint(bad, tmp_path / "dz2", progress=False)


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.gate.e_score_correction_bias",
                                    "model.layers.1.self_attn.k_proj.bias", "model.layers.0.self_attn.q_norm.weight"])
def test_missing_tensor_is_named(case, tmp_path, tensor):
    src = copy_hf_checkpoint(case.root / "hf", tmp_path / "src", tensors_edit=lambda t: t.pop(tensor))
    with pytest.raises(ConvertError, match=f"no tensor '{tensor}'"):
        convert_checkpoint(src, tmp_path / "dz", progress=False)


# ---- config parsing ---------------------------------------------------------------------------------


def _published() -> dict:
    """GLM-4.5's config.json as published (transformers 4.54 era keys), shrunk to tiny sizes."""
    return {
        "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 32, "hidden_act": "silu",
        "hidden_size": 64, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 32,
        "norm_topk_prob": True, "num_attention_heads": 4, "n_group": 1, "topk_group": 1, "n_routed_experts": 8,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 2, "first_k_dense_replace": 3,
        "num_hidden_layers": 5, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True,
        "vocab_size": 256,
    }


def test_published_config_parses():
    c = parse_hf_config(_published())
    assert c.family is Family.GLM4_MOE and c.rope.partial_rotary_factor == 0.5 and c.rope.theta == 1e6
    assert c.qkv_bias and not c.o_bias and c.qk_norm and c.mtp_layers == 1
    assert c.eos_token_ids == (151329, 151336, 151338)
    assert c.moe.layers == (False,) * 3 + (True,) * 2 and c.moe.routed_scaling == 2.5 and c.moe.renormalize
    # GLM-4.5-Air: no q/k norms.
    assert not parse_hf_config({**_published(), "use_qk_norm": False}).qk_norm


def test_hf_defaults_fill_missing_keys():
    """Keys a config may leave out take HF Glm4MoeConfig's defaults, not the generic ones."""
    drop = ("partial_rotary_factor", "norm_topk_prob", "n_shared_experts", "first_k_dense_replace",
            "num_nextn_predict_layers")
    c = parse_hf_config({k: v for k, v in _published().items() if k not in drop})
    hf = transformers.Glm4MoeConfig()
    assert c.rope.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5
    assert c.moe.renormalize is hf.norm_topk_prob is True
    assert c.moe.shared_experts == hf.n_shared_experts == 1
    assert c.moe.layers[:2] == (False, True) and hf.first_k_dense_replace == 1
    assert c.mtp_layers == hf.num_nextn_predict_layers == 1


@pytest.mark.parametrize("change, match", [
    ({"some_new_key": 1}, "some_new_key"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),  # 9.6 of 32 dims
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     "disagree"),
    ({"n_group": 3}, "n_group"),
    ({"first_k_dense_replace": 6}, "first_k_dense_replace"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"kv_lora_rank": 32}, "kv_lora_rank"),
])
def test_bad_glm_config_is_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        parse_hf_config({**_published(), **change})


def test_other_families_refuse_partial_rotary_and_glm_keys():
    llama = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=256)
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5"):
        parse_hf_config({**llama, "partial_rotary_factor": 0.5})
    with pytest.raises(ConfigError, match="use_qk_norm"):
        parse_hf_config({**llama, "use_qk_norm": True})
