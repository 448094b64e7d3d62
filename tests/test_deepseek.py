"""DeepSeek-V3 / Kimi-K2: multi-head latent attention + DeepSeek MoE, parity with HF transformers.

Tiny random HF DeepseekV3 models (fp32, eager attention, random norms and selection biases,
YaRN with mscale / mscale_all_dim, interleaved RoPE) go through the real converter. As in
test_parity.py / test_moe.py: (a) logits of a 500-token prompt match HF's; (b) 32 greedy tokens
through ``Engine.generate`` are HF's; (c) prefill + one-token decode steps reproduce one full
forward. Also: the cache holds the latent rows only, the kimi_k2 alias, HF's fused expert layout,
DeepSeek's block-FP8 checkpoints (dequantized while reading), and strict config parsing.

Random routers can sit near ties: every comparison first asserts that the group cut and the
expert cut of the (biased) routing choice have gaps far above fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.convert.fp8 import dequantize_blocks
from dayzero.model.config import AttentionKind, ConfigError, Family, ModelConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.cache import LatentCache, init_cache
from tests.hf_helpers import (
    MIN_ROUTER_GAP, REL_TOL, all_logits, assert_change_is_effective, assert_logits_match, assert_same_weights,
    assert_steps_match_full, convert_case, copy_hf_checkpoint, greedy_vs_hf, hf_greedy, hf_logits, hf_model, random_ids,
    within_moe_gates,
)

LONG, SHORT, NEW, PREFILL = 500, 20, 32, 480
N_GROUP, TOPK_GROUP, EXPERTS, TOP_K = 2, 1, 8, 2

COMMON = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
    n_group=N_GROUP, topk_group=TOPK_GROUP, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=256,
    max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
    # YaRN 4x over 256 positions: the 500-token prompt runs past the original context; mscale !=
    # mscale_all_dim so both the cos/sin factor and the softmax scale's mscale^2 are exercised.
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                         mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0),
    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
CASES = {"q_lora": dict(q_lora_rank=32), "no_q_lora": dict(q_lora_rank=None)}
# Seeds whose routing gaps (long prompt; short prompt plus its 32 greedy tokens) are all >= 2.4e-4
# (seed 0 of q_lora has a 4.7e-5 gap on the long prompt).
SEEDS = {"q_lora": 9, "no_q_lora": 9}


def build_hf_deepseek(name: str, seed: int, **overrides):
    """A tiny random HF DeepseekV3 model: fp32, eager, random norm weights and selection biases."""
    model = hf_model(transformers.DeepseekV3Config(**{**COMMON, **CASES[name], **overrides}), seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def routing_gaps(router_logits: np.ndarray, bias: np.ndarray) -> tuple[float, float]:
    """Smallest gaps over tokens at the group cut (TOPK_GROUP of N_GROUP groups ranked by their
    two best choice scores) and at the expert cut (TOP_K within the kept groups)."""
    choice = 1 / (1 + np.exp(-router_logits.astype(np.float64))) + bias
    n = len(choice)
    grouped = choice.reshape(n, N_GROUP, EXPERTS // N_GROUP)
    group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)
    ranked = np.sort(group_scores, -1)
    kept = np.argsort(group_scores, -1)[:, -TOPK_GROUP:]
    in_kept = np.sort(np.take_along_axis(grouped, kept[:, :, None], 1).reshape(n, -1), -1)
    return float((ranked[:, -TOPK_GROUP] - ranked[:, -TOPK_GROUP - 1]).min()), \
        float((in_kept[:, -TOP_K] - in_kept[:, -TOP_K - 1]).min())


def hf_min_gap(model, ids: np.ndarray) -> float:
    """The smallest routing gap over every MoE layer for HF's forward pass over ``ids``."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    biases = [layer.mlp.gate.e_score_correction_bias.numpy() for layer in model.model.layers
              if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias")]
    assert len(biases) == len(out.router_logits) == COMMON["num_hidden_layers"] - COMMON["first_k_dense_replace"]
    return min(min(routing_gaps(r.float().numpy(), b)) for r, b in zip(out.router_logits, biases))


@pytest.fixture(scope="module", params=list(CASES))
def case(request, hf_factory, tmp_path_factory):
    """One converted tiny DeepSeek-V3 model with HF's logits of the long prompt."""
    hf = build_hf_deepseek(request.param, SEEDS[request.param])
    c = convert_case(hf_factory, tmp_path_factory.mktemp(request.param), request.param, hf, LONG)
    c.hf_long = hf_logits(hf, c.long_ids)
    return c


# ---- whole-model parity ------------------------------------------------------------------------


def test_converted_config(case):
    c = case.config
    assert c.family is Family.DEEPSEEK_V3 and c.attention is AttentionKind.MLA
    assert c.mla.q_lora_rank == CASES[case.name]["q_lora_rank"] and c.mla.rope_interleave
    assert c.head_dim == 16 and c.num_kv_heads == 4 and c.mtp_layers == 1
    assert c.moe.layers == (False, True, True) and c.moe.score_bias and c.moe.shared_experts == 1
    assert (c.moe.num_groups, c.moe.groups_per_token, c.moe.routed_scaling) == (2, 1, 2.5)
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_router_margins_are_not_ties(case):
    """Every token of the long prompt, and of the short prompt with its greedy continuation, has
    a clear group and expert choice in every MoE layer (else (a) and (b) test rounding)."""
    assert hf_min_gap(case.hf, case.long_ids) > MIN_ROUTER_GAP
    prompt = random_ids(SHORT, case.config.vocab_size, seed=2)
    generated = np.asarray(hf_greedy(case.hf, prompt, NEW), np.int32)[None]
    assert hf_min_gap(case.hf, np.concatenate([prompt, generated], axis=1)) > MIN_ROUTER_GAP


def test_logits_match_hf(case):
    """(a) fp32 logits of a 500-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


# Greedy tokens without the q LoRA are -m slow: its logits and prefill/decode are checked by default.
@pytest.mark.parametrize("case", ["q_lora", pytest.param("no_q_lora", marks=pytest.mark.slow)], indirect=True)
def test_greedy_generation_matches_hf(case):
    """(b) 32 greedy tokens through Engine.generate are exactly HF generate's."""
    out, ref = greedy_vs_hf(case, random_ids(SHORT, case.config.vocab_size, seed=2), NEW)
    assert out.token_ids == ref


def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 480 tokens, decode 20 one at a time: the logits of one 500-token pass."""
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1 :], case.name)


def _without_mscale_all_dim(config):
    """The softmax scale without mscale^2, the cos/sin factor pinned to its value."""
    from dayzero.model.rope import yarn_attention_factor

    rope = dataclasses.replace(config.rope, mscale_all_dim=None, attention_factor=yarn_attention_factor(config.rope))
    return dataclasses.replace(config, rope=rope)


def _half_split_rope(config):
    return dataclasses.replace(config, mla=dataclasses.replace(config.mla, rope_interleave=False))


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
@pytest.mark.parametrize("change", [_without_mscale_all_dim, _half_split_rope])
def test_mscale_and_interleave_are_effective(case, change):
    """Dropping mscale^2 from the softmax scale, or rotating half-split pairs instead of
    DeepSeek's interleaved ones, moves the logits far from HF's (so (a) really tests both)."""
    assert_change_is_effective(case, change(case.config))


@pytest.mark.parametrize("case, scheme, kv", [
    ("q_lora", "fp8-block", "none"),
    # the int8 KV latent cache against HF: -m slow (tests/test_quant.py checks it against fp32 by default)
    *(pytest.param("q_lora", s, k, marks=pytest.mark.slow)
      for s, k in (("none", "int8"), ("int8", "none"), ("fp8", "none"), ("int4", "none"), ("none", "fp8"))),
], indirect=["case"])
def test_quantized_model_against_hf(case, scheme, kv, quantized_vs_hf):
    """Quantized weights or latent cache against HF fp32: KL over the 500-token prompt and greedy
    agreement over HF's 32 tokens, within tests.hf_helpers.MOE_GATES (bounds justified there)."""
    result = quantized_vs_hf(case, scheme, kv, SHORT, NEW)
    assert within_moe_gates(result, scheme, kv), result


# ---- the latent cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_cache_holds_only_the_latent(case):
    """Bytes per token = num_layers * (kv_lora_rank + qk_rope_head_dim) * itemsize, from the shapes."""
    c, batch, slots = case.config, 3, 64
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = init_cache(c, batch, slots, dtype)
        assert isinstance(cache, LatentCache) and cache.max_len == slots
        arrays = [x for x in jax.tree.leaves(cache) if x.ndim > 1]
        per_token = sum(math.prod(x.shape) * x.dtype.itemsize for x in arrays) / (batch * slots)
        assert per_token == c.num_layers * (c.mla.kv_lora_rank + c.mla.rope_dim) * jnp.dtype(dtype).itemsize


@pytest.mark.slow  # latent rows of different lengths run by default in tests/test_dsa.py's batch test
@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_batched_rows_of_different_lengths(case):
    """Two rows with different prompt lengths decode as each would alone (per-row cache writes)."""
    prompts = [random_ids(n, 256, seed=s)[0].tolist() for n, s in ((17, 5), (9, 6))]
    together = case.engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
    alone = [case.engine.generate(p, max_new_tokens=6, ignore_eos=True) for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_verify_compares_every_latent_attention_layer(case):
    """``dayzero verify`` reads each MLA layer's output (forward's hidden_out) beside HF's."""
    from dayzero.tools.verify import verify

    report = verify(case.root / "hf", case.root / "dz", ids=case.long_ids[0, :64].tolist())
    assert report.passed and len(report.layers) == case.config.num_layers


# ---- converter: alias, fused layout, MTP tensors -----------------------------------------------------


def _copy_hf(case, dst, config_edit=None, tensors_edit=None):
    """A copy of the case's HF checkpoint with its config and/or tensors edited."""
    return copy_hf_checkpoint(case.root / "hf", dst, config_edit, tensors_edit)


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_kimi_k2_alias_converts_and_matches(case, tmp_path):
    """Kimi-K2 ships the DeepSeek-V3 architecture as model_type "kimi_k2" (with its remote-code
    auto_map): the same weights, the same logits."""
    def kimi(raw):
        raw.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})

    src = _copy_hf(case, tmp_path / "kimi", config_edit=kimi)
    convert_checkpoint(src, tmp_path / "dz", progress=False)
    config, weights = load_checkpoint(tmp_path / "dz", dtype=jnp.float32)
    assert config.family is Family.KIMI_K2 and config.attention is AttentionKind.MLA
    assert_same_weights(case.weights, weights)
    err = np.abs(all_logits(weights, config, case.long_ids) - case.hf_long).max()
    assert err <= REL_TOL * np.abs(case.hf_long).max()


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_fused_expert_layout_converts_to_the_same_weights(case, tmp_path):
    """transformers' own layout (save_original_format=False): experts.gate_up_proj / down_proj."""
    case.hf.save_pretrained(tmp_path / "hf", save_original_format=False)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in load_file(tmp_path / "hf" / "model.safetensors"))
    convert_checkpoint(tmp_path / "hf", tmp_path / "dz", progress=False)
    assert_same_weights(case.weights, load_checkpoint(tmp_path / "dz", dtype=jnp.float32)[1])


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_mtp_layer_tensors_are_all_required_once_present_and_others_refused(case, tmp_path):
    """Layer num_layers is the MTP module of num_nextn_predict_layers=1: a checkpoint with any of
    its tensors keeps it (for ``--speculative mtp``; tests/test_speculative_mtp.py converts a
    whole one), so a lone eh_proj is refused naming a missing tensor of the module. Layer
    num_layers + 1 is not part of the architecture and is refused by name."""
    def add(index):
        return lambda t: t.update({f"model.layers.{index}.eh_proj.weight": torch.zeros(64, 128)})

    with pytest.raises(ConvertError, match=r"model\.layers\.3\.enorm\.weight"):
        convert_checkpoint(_copy_hf(case, tmp_path / "mtp", tensors_edit=add(3)), tmp_path / "dz", progress=False)
    with pytest.raises(ConvertError, match=r"model\.layers\.4\.eh_proj\.weight"):
        convert_checkpoint(_copy_hf(case, tmp_path / "extra", tensors_edit=add(4)), tmp_path / "dz2", progress=False)


# ---- FP8 block-quantized checkpoints ----------------------------------------------------------------


def _quantize_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's scheme by hand: per [bo, bi] block, scale_inv = max|w| / 448, q = fp8(w / scale_inv)."""
    bo, bi = block
    rows, cols = math.ceil(w.shape[0] / bo), math.ceil(w.shape[1] / bi)
    scale_inv = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            blk = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi]
            scale_inv[r, c] = max(np.abs(blk).max(), 1e-12) / 448.0
            q[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = (blk / scale_inv[r, c]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv


def _dequantize_by_loops(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The reference: every element times the scale of the block its (row, col) falls in."""
    out = np.zeros(q.shape, np.float32)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = np.float32(q[i, j]) * scale_inv[i // block[0], j // block[1]]
    return out


def test_fp8_blocks_dequantize_to_the_reference_values():
    """A [300, 200] weight in 128x128 blocks: full, partial-row, partial-column and corner blocks."""
    w = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
    w[:128, :128] *= 100  # blocks of very different magnitude each keep their own scale
    q, scale_inv = _quantize_fp8(w, (128, 128))
    assert scale_inv.shape == (3, 2)
    out = dequantize_blocks(q, scale_inv, (128, 128))
    np.testing.assert_array_equal(out, _dequantize_by_loops(q, scale_inv, (128, 128)))
    # e4m3 rounds to 3 mantissa bits (error <= 2^-4 relative), or in its subnormal range to
    # steps of 2^-9 (error <= 2^-10 of the block's scale).
    scale = dequantize_blocks(np.ones_like(w), scale_inv, (128, 128))
    assert (np.abs(out - w) <= 2.0**-4 * np.abs(w) + 2.0**-10 * scale * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match="expected"):
        dequantize_blocks(q, scale_inv[:, :1], (128, 128))


def _is_fp8_linear(name: str) -> bool:
    """The tensors DeepSeek stores in FP8: attention and MLP/expert projections (not the router)."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def _fp8_source(case, dst, block: tuple[int, int]):
    """A copy of the case's checkpoint with its linear weights in DeepSeek's block FP8 ([out, in]
    blocks); returns it and the exact dequantized weights by source name."""
    reference = {}

    def quantize(tensors):
        for name in [n for n in tensors if _is_fp8_linear(n)]:
            q, scale_inv = _quantize_fp8(tensors[name].numpy(), block)
            reference[name] = torch.from_numpy(_dequantize_by_loops(q, scale_inv, block))
            tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name.replace(".weight", ".weight_scale_inv")] = torch.from_numpy(scale_inv)

    def fp8_config(raw):
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}

    return _copy_hf(case, dst, config_edit=fp8_config, tensors_edit=quantize), reference


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_fp8_checkpoint_converts_to_dequantized_weights(case, tmp_path):
    """Linear weights stored as FP8 + weight_scale_inv (16x24 blocks, so the tiny projections have
    several blocks, partial ones included) convert to exactly the dequantized weights."""
    src, reference = _fp8_source(case, tmp_path / "fp8", (16, 24))
    assert len(reference) > 20
    convert_checkpoint(src, tmp_path / "dz", progress=False)
    _, fp8_weights = load_checkpoint(tmp_path / "dz", dtype=jnp.float32)
    ref_src = _copy_hf(case, tmp_path / "deq", tensors_edit=lambda t: t.update(reference))
    convert_checkpoint(ref_src, tmp_path / "dz_ref", progress=False)
    assert_same_weights(load_checkpoint(tmp_path / "dz_ref", dtype=jnp.float32)[1], fp8_weights)
    # Without its scale an FP8 tensor cannot be read: the error names it.
    name = next(iter(reference)).replace(".weight", ".weight_scale_inv")
    dst = tmp_path / "noscale"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors[name]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ConvertError, match=name.removesuffix("_scale_inv").replace(".", r"\.")):
        convert_checkpoint(dst, tmp_path / "dz_bad", progress=False)


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_fp8_checkpoint_kept_native_with_fp8_block(case, tmp_path):
    """``--quantize fp8-block`` keeps a block-FP8 checkpoint's e4m3 values and block scales: with
    [16 out, 24 in] blocks every quantized leaf maps block to block (each head's 16 key rows of
    kv_b_proj are one block), the stored bytes are the source's transposed, and the weights
    dequantize to exactly those of the dequantizing conversion."""
    from dayzero.model.quant import QuantizedArray, dequantized

    src, _ = _fp8_source(case, tmp_path / "fp8", (16, 24))
    convert_checkpoint(src, tmp_path / "native", progress=False, quantize="fp8-block")
    manifest = json.loads((tmp_path / "native" / "manifest.json").read_text())
    assert manifest["quantization"] == {"weights": "fp8-block", "block": [24, 16]}
    kept = {n: e["quantized"] for n, e in manifest["tensors"].items() if "quantized" in e}
    assert len(kept) > 40 and set(kept.values()) == {"fp8-native"}
    _, native = load_checkpoint(tmp_path / "native")
    q_a = native.layers[0].attn.q_a
    stored = load_file(src / "model.safetensors")
    assert isinstance(q_a, QuantizedArray) and q_a.values.dtype == jnp.float8_e4m3fn
    source_q_a = stored["model.layers.0.self_attn.q_a_proj.weight"].view(torch.uint8).numpy()
    np.testing.assert_array_equal(np.asarray(q_a.values).view(np.uint8), source_q_a.T)
    np.testing.assert_array_equal(np.asarray(q_a.scale), stored["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].numpy().T)
    convert_checkpoint(src, tmp_path / "deq", progress=False)
    _, dequantized_weights = load_checkpoint(tmp_path / "deq")
    as_float = jax.tree.map(lambda x: dequantized(x, jnp.float32), native,
                            is_leaf=lambda x: isinstance(x, QuantizedArray))
    assert_same_weights(dequantized_weights, as_float)


@pytest.mark.parametrize("case", ["q_lora"], indirect=True)
def test_fp8_blocks_that_do_not_map_are_requantized(case, tmp_path):
    """With [24 out, 16 in] source blocks a block of k_up/v_up would mix rows of two source blocks
    (each head has 16 key then 16 value rows): those two leaves are dequantized and quantized
    again in [16 in, 24 out] blocks (within e4m3's rounding of the source's values), the rest is
    kept exactly."""
    from dayzero.model.quant import QuantizedArray, dequantized

    src, _ = _fp8_source(case, tmp_path / "fp8", (24, 16))
    convert_checkpoint(src, tmp_path / "native", progress=False, quantize="fp8-block")
    tensors = json.loads((tmp_path / "native" / "manifest.json").read_text())["tensors"]
    how = {n.rsplit("/", 2)[-2]: e["quantized"] for n, e in tensors.items() if n.endswith("/values")}
    assert how.pop("k_up") == how.pop("v_up") == "quantized" and set(how.values()) == {"fp8-native"}
    convert_checkpoint(src, tmp_path / "deq", progress=False)
    native, deq = load_checkpoint(tmp_path / "native")[1], load_checkpoint(tmp_path / "deq")[1]
    for layer, ref_layer in zip(native.layers, deq.layers):
        for name in ("k_up", "v_up", "q_b", "o"):
            q, ref = getattr(layer.attn, name), np.asarray(getattr(ref_layer.attn, name))
            assert isinstance(q, QuantizedArray) and q.block == (16, 24)
            ours = np.asarray(dequantized(q, jnp.float32))
            if name in ("k_up", "v_up"):
                scale = np.asarray(dequantized(q.replace(values=jnp.ones(q.shape, jnp.float32)), jnp.float32))
                assert (np.abs(ours - ref) <= 2.0**-4 * np.abs(ref) + 2.0**-10 * scale * (1 + 1e-6)).all()
                assert not np.array_equal(ours, ref)  # really requantized
            else:
                np.testing.assert_array_equal(ours, ref)


# ---- config parsing ---------------------------------------------------------------------------------


def _published() -> dict:
    """DeepSeek-V3's config.json as published (remote-code era keys), shrunk to tiny sizes."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
        "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "kv_lora_rank": 32,
        "max_position_embeddings": 1024, "model_type": "deepseek_v3", "moe_intermediate_size": 32,
        "moe_layer_freq": 1, "n_group": 2, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 256, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 16, "vocab_size": 256,
    }


def test_published_config_parses():
    c = parse_hf_config(_published())
    assert c.family is Family.DEEPSEEK_V3 and c.mla.rope_interleave and c.mla.q_lora_rank == 32
    assert c.rope.mscale_all_dim == 1.0 and c.rope.original_max_position == 256 and c.mtp_layers == 1
    assert c.moe.layers == (False, True, True) and c.eos_token_ids == (1,)
    kimi = parse_hf_config({**_published(), "model_type": "kimi_k2", "n_group": 1, "topk_group": 1,
                            "num_nextn_predict_layers": 0, "q_lora_rank": None})
    assert kimi.family is Family.KIMI_K2 and kimi.mla.q_lora_rank is None and kimi.moe.num_groups == 1


@pytest.mark.parametrize("change, match", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"head_dim": 32}, "head_dim"),
    ({"attention_bias": True}, "attention_bias"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     "quantization_config"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantization_config"),
    ({"index_topk": 2048}, "index_topk"),  # the indexer belongs to model_type deepseek_v32 (test_dsa.py)
])
def test_bad_deepseek_config_is_refused(change, match):
    raw = {k: v for k, v in {**_published(), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(raw)


def test_dense_family_refuses_mla_keys():
    raw = {**_published(), "model_type": "llama"}
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        parse_hf_config(raw)
