"""Qwen2-MoE (HF ``qwen2_moe``: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention with q/k/v
biases, softmax top-k routing (not renormalised unless ``norm_topk_prob``), a shared expert
behind a sigmoid gate; parity with HF transformers.

A tiny random HF Qwen2Moe model (fp32, eager, random norms) goes through the real converter:
three layers, the middle one dense (``mlp_only_layers``), the first with a sliding window shorter
than the prompt. Checked: logits of a 100-token prompt equal HF's (after checking the router's
choices are clear of ties); the shared-expert gate and the sliding window matter (dropping either
moves the logits far past the tolerance); HF's fused expert layout converts to the same weights;
strict config parsing (HF's defaults, the published Qwen1.5-MoE-A2.7B config.json, refusals).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from dayzero.model.config import ConfigError, Family, RouterScore
from dayzero.model.hf_config import parse_hf_config
from tests.hf_helpers import (
    MIN_ROUTER_GAP, REL_TOL, all_logits, assert_change_is_effective, assert_logits_match, assert_same_weights,
    convert_case, copy_hf_checkpoint, hf_logits, hf_model,
)

LONG, WINDOW = 100, 48
COMMON = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=False, use_sliding_window=True, sliding_window=WINDOW,
    max_window_layers=1, vocab_size=256, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0), bos_token_id=None, eos_token_id=None,
    pad_token_id=None, tie_word_embeddings=False,
)
SEED = 0


def build_hf_qwen2_moe(seed: int, **changes):
    """A tiny random HF Qwen2Moe model in fp32 with random norms and q/k/v biases (HF's ones and
    zeros would hide a mix-up: a k/v bias swap, say)."""
    model = hf_model(transformers.Qwen2MoeConfig(**{**COMMON, **changes}), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def hf_min_gap(model, ids: np.ndarray) -> float:
    """Smallest gap over tokens and sparse layers between the C-th and (C+1)-th softmax probability."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    C = COMMON["num_experts_per_tok"]
    gaps = []
    for logits in out.router_logits:
        p = np.sort(torch.softmax(logits.double(), -1).numpy(), axis=-1)
        gaps.append((p[:, -C] - p[:, -C - 1]).min())
    assert len(gaps) == 2  # layers 0 and 2
    return float(min(gaps))


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """The converted tiny Qwen2-MoE model with HF's logits of the long prompt."""
    hf = build_hf_qwen2_moe(SEED)
    c = convert_case(hf_factory, tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", hf, LONG)
    c.hf_long = hf_logits(hf, c.long_ids)
    return c


def test_converted_config(case):
    c = case.config
    assert c.family is Family.QWEN2_MOE and c.qkv_bias and not c.o_bias and not c.qk_norm
    assert c.sliding_windows == (WINDOW, None, None)
    m = c.moe
    assert m.layers == (True, False, True) and m.score is RouterScore.SOFTMAX and not m.renormalize
    assert (m.shared_experts, m.shared_width, m.shared_gate, m.intermediate_size) == (1, 48, True, 32)


def test_router_margins_are_not_ties(case):
    assert hf_min_gap(case.hf, case.long_ids) > MIN_ROUTER_GAP


def test_logits_match_hf(case):
    """fp32 logits of a 100-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


@pytest.mark.slow  # three more compiles (~8 s)
def test_shared_gate_window_and_routing_are_effective(case):
    """Without the shared expert's gate, without the window, or with the top-k weights
    renormalised, the logits are far from HF's."""
    c = case.config
    layers = tuple(layer.replace(mlp=layer.mlp.replace(shared_gate=None)) if c.is_moe_layer(i) else layer
                   for i, layer in enumerate(case.weights.layers))
    ungated = all_logits(case.weights.replace(layers=layers), c, case.long_ids)
    assert np.abs(ungated - case.hf_long).max() > 100 * REL_TOL * np.abs(case.hf_long).max()
    assert_change_is_effective(case, dataclasses.replace(c, sliding_windows=(None,) * 3))
    assert_change_is_effective(case, dataclasses.replace(c, moe=dataclasses.replace(c.moe, renormalize=True)))


def test_fused_expert_layout_converts_to_the_same_weights(case, tmp_path):
    """transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (save_original_format=False)."""
    from dayzero.convert import convert_checkpoint, load_checkpoint

    case.hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    dst = convert_checkpoint(tmp_path / "fused", tmp_path / "dz", progress=False)
    assert_same_weights(case.weights, load_checkpoint(dst or tmp_path / "dz", dtype=np.float32)[1])


# ---- config parsing ----------------------------------------------------------------------------

# Qwen/Qwen1.5-MoE-A2.7B's config.json, as third-party test suites reproduce it (the hub was not
# reachable from here; copies differ on max_position_embeddings, 8192 or 32768).
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_config_parses():
    c = parse_hf_config(QWEN15_MOE)
    assert (c.num_layers, c.hidden_size, c.num_kv_heads, c.head_dim, c.rope.theta) == (24, 2048, 16, 128, 1e6)
    assert c.sliding_windows == (None,) * 24 and c.qkv_bias and c.eos_token_ids == (151643,)
    assert c.moe.layers == (True,) * 24 and (c.moe.num_experts, c.moe.experts_per_token) == (60, 4)
    assert (c.moe.intermediate_size, c.moe.shared_width, c.moe.renormalize) == (1408, 5632, False)


def test_hf_defaults_fill_missing_keys():
    """A config.json with only model_type reads as HF's Qwen2MoeConfig() does."""
    ours, hf = parse_hf_config({"model_type": "qwen2_moe"}), transformers.Qwen2MoeConfig()
    assert (ours.num_heads, ours.num_kv_heads, ours.num_layers) == (16, 16, 24) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.num_hidden_layers)
    assert ours == parse_hf_config(hf.to_dict())


@pytest.mark.parametrize("change, match", [
    ({"attention_bias": True}, "attention_bias"),  # HF's qwen2_moe never reads it
    ({"layer_types": ["sliding_attention"] + ["full_attention"] * 23}, "use_sliding_window=False"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_config_is_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        parse_hf_config({**QWEN15_MOE, **change})


def test_qkv_bias_false_and_no_experts():
    c = parse_hf_config({**QWEN15_MOE, "qkv_bias": False, "num_experts": 0})
    assert not c.qkv_bias and c.moe is None
    c = parse_hf_config({**QWEN15_MOE, "use_sliding_window": True, "num_hidden_layers": 4, "max_window_layers": 3})
    assert c.sliding_windows == (32768, None, 32768, None)  # HF: even layers below max_window_layers


def test_missing_shared_gate_tensor_is_named(case, tmp_path):
    from dayzero.convert import ConvertError, convert_checkpoint

    src = copy_hf_checkpoint(case.dir.parent / "hf", tmp_path / "broken",
                             tensors_edit=lambda t: t.pop("model.layers.2.mlp.shared_expert_gate.weight"))
    with pytest.raises(ConvertError, match="shared_expert_gate"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
