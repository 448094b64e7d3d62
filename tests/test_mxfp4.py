"""MXFP4, gpt-oss's expert format: e2m1 values, one e8m0 power-of-two scale per 32 inputs.

HF's ``convert_moe_packed_tensors`` (transformers/integrations/mxfp4.py) is the oracle for what
the published blocks + scales mean. Checked here: dayzero's dequantization (the converter's numpy
path and ``QuantizedArray`` on XLA) equals it on every nibble and a spread of exponents; an MXFP4
expert stack runs through both grouped matmuls (whole and in tiles) as its dequantized float
stack does; the reader presents each blocks + scales pair as one in-major tensor, keeps it as
stored (through gpt-oss's gate/up de-interleaving) or dequantizes it, and refuses incomplete or
malformed pairs; and the bytes an MXFP4 stack holds.
"""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from dayzero.convert import ConvertError
from dayzero.convert import transforms as T
from dayzero.convert.mxfp4 import Mxfp4Reader, dequantize, unpack
from dayzero.convert.name_map import Recipe
from dayzero.convert.quantize import quant_config, quantized_leaf
from dayzero.convert.sources import open_source
from dayzero.model.moe import GroupedMatmul, _tile, grouped_swiglu, ragged_swiglu, ragged_tile
from dayzero.model.quant import (
    MXFP4_BLOCK, QuantError, QuantizedArray, ValueFormat, WeightQuant, dequantized, describe_weights, quantize,
    stored_bytes,
)
from dayzero.model.weights import MoEWeights

_quantize = jax.jit(quantize, static_argnums=(1, 2, 3))
CONFIG = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}


def _packed(rng, e: int, out: int, n_in: int, exponents=None) -> tuple[np.ndarray, np.ndarray]:
    """Random published-layout blocks uint8 [e, out, n_in/32, 16] (every byte value, so every
    nibble in both halves, when there are 256 or more bytes) and scales uint8 [e, out, n_in/32]
    drawn from ``exponents`` (bytes; default 120..129, the range real weights use)."""
    n = e * out * n_in // 2
    blocks = rng.permutation(np.resize(np.arange(256, dtype=np.uint8), n)).reshape(e, out, n_in // 32, 16)
    choices = np.arange(120, 130) if exponents is None else np.asarray(exponents)
    scales = rng.choice(choices, size=(e, out, n_in // 32)).astype(np.uint8)
    return blocks, scales


def _hf(blocks: np.ndarray, scales: np.ndarray, dtype=torch.float32) -> np.ndarray:
    return convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype).float().numpy()


def _stack(blocks: np.ndarray, scales: np.ndarray) -> QuantizedArray:
    values, s = unpack(blocks, scales)
    return QuantizedArray(jnp.asarray(values), jnp.asarray(s), ValueFormat.MXFP4, (1,), MXFP4_BLOCK)


def test_dequantization_equals_hf_on_every_nibble_and_exponent():
    """Every byte of blocks, every scale byte 0..254: numpy's dequantization equals HF's exactly
    (2^127 x 6 overflows to inf in both); XLA's (``dequantized``) too for scale bytes 2 and up.
    XLA:CPU flushes subnormals to zero: the scale 2^-127 itself (byte 0) and results below
    2^-126 (byte 1), an error of at most 6 x 2^-127."""
    rng = np.random.default_rng(0)
    blocks, _ = _packed(rng, 2, 128, 64)
    scales = rng.permutation(np.resize(np.arange(255, dtype=np.uint8), 2 * 128 * 2)).reshape(2, 128, 2)
    hf = _hf(blocks, scales)
    assert hf.shape == (2, 64, 128) and np.isinf(hf).any()  # in-major [E, in, out]
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(dequantize(*unpack(blocks, scales)), hf)

    ours = np.asarray(dequantized(_stack(blocks, scales), jnp.float32))
    normal = np.repeat(np.swapaxes(scales, 1, 2), 32, axis=1) >= 2  # each element's scale byte
    np.testing.assert_array_equal(ours[normal], hf[normal])
    assert np.abs(ours[~normal] - hf[~normal]).max() <= 6 * 2.0**-127
    # bfloat16 holds every value exactly: the same numbers as HF's bfloat16 dequantization.
    ours_bf16 = np.asarray(dequantized(_stack(blocks, scales), jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(ours_bf16[normal], _hf(blocks, scales, torch.bfloat16)[normal])


def test_quantize_gives_power_of_two_scales_and_round_trips():
    """``quantize`` to MXFP4: e8m0 scales, the least power of two putting the block's absmax
    within 6; MXFP4 values quantized again come back unchanged; channel layout is refused."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96, 8)).astype(np.float32) * np.logspace(-3, 3, 8, dtype=np.float32)
    q = _quantize(x, ValueFormat.MXFP4, (1,), MXFP4_BLOCK)
    assert q.values.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e8m0fnu and q.scale.shape == (3, 3, 8)
    ratio = np.abs(x).reshape(3, 3, 32, 8).max(axis=2) / np.asarray(q.scale.astype(jnp.float32))
    assert ratio.max() <= 6 and ratio.min() > 3  # the least power of two: twice smaller would exceed 6
    stored = np.asarray(dequantized(q, jnp.float32))
    again = _quantize(stored, ValueFormat.MXFP4, (1,), MXFP4_BLOCK)
    np.testing.assert_array_equal(np.asarray(dequantized(again, jnp.float32)), stored)
    with pytest.raises(QuantError, match="block"):
        quantize(x, ValueFormat.MXFP4, (1,), None)


def test_stored_bytes_of_an_mxfp4_stack():
    """An MXFP4 stack holds 0.5 + 1/32 bytes per weight (values packed by XLA, e8m0 scales)."""
    blocks, scales = _packed(np.random.default_rng(2), 4, 64, 128)
    w = _stack(blocks, scales)
    per_weight = stored_bytes(w) / (4 * 128 * 64)
    assert per_weight == 0.5 + 1 / 32 == (blocks.nbytes + scales.nbytes) / (4 * 128 * 64)
    assert describe_weights(w) == "mxfp4/32x1"


# ---- through the MoE block ----------------------------------------------------------------------

E, D, F = 4, 160, 72  # D: 5 blocks of 32, one whole 128-row tile and a partial one; F: 2.25 blocks
SIZES = [3, 0, 5, 2]


@pytest.fixture(scope="module")
def pair() -> tuple[MoEWeights, MoEWeights]:
    """Random MXFP4 expert stacks (magnitudes 16x apart between halves of each axis, so a tile
    read with another tile's scales is far off) and the same stacks dequantized in float32."""
    rng = np.random.default_rng(3)

    def one(shape):
        spread = np.outer(np.where(np.arange(shape[1]) < shape[1] // 2, 0.25, 4.0),
                          np.where(np.arange(shape[2]) < shape[2] // 2, 4.0, 0.25))
        x = 0.3 * rng.standard_normal(shape).astype(np.float32) * spread.astype(np.float32)
        return _quantize(x, ValueFormat.MXFP4, (1,), MXFP4_BLOCK)

    q = MoEWeights(router=jnp.asarray(rng.standard_normal((D, E)), jnp.float32), gate=one((E, D, F)),
                   up=one((E, D, F)), down=one((E, F, D)))
    return q, q.replace(**{n: dequantized(getattr(q, n), jnp.float32) for n in ("gate", "up", "down")})


def test_expert_and_tile_slices_stay_mxfp4(pair):
    """``w[e]`` and the ragged path's tiles (``_tile`` along rows and columns) are MXFP4 arrays
    whose dequantization is the matching slice of the whole stack's."""
    q, f = pair
    np.testing.assert_array_equal(np.asarray(dequantized(q.gate[2], jnp.float32)), np.asarray(f.gate[2]))
    assert ragged_tile(q.gate, 1, E * 128 * F * 4) == 128 and ragged_tile(q.down, 2, E * F * 32 * 4) == 128
    for w, full, axis, start, size in ((q.gate, f.gate, 1, 128, 32), (q.down, f.down, 2, 32, 96)):
        tile = _tile(w, axis, start, size)
        assert tile.fmt is ValueFormat.MXFP4 and tile.values.dtype == jnp.float4_e2m1fn
        expected = jax.lax.slice_in_dim(full, start, start + size, axis=axis)
        np.testing.assert_array_equal(np.asarray(dequantized(tile, jnp.float32)), np.asarray(expected))


def test_mxfp4_stack_through_grouped_swiglu_equals_float_stack(pair):
    """Both grouped matmuls, and the ragged one in two tiles along D, give on MXFP4 stacks what
    they give on the dequantized float stacks."""
    q, f = pair
    xs = jnp.asarray(np.random.default_rng(4).standard_normal((sum(SIZES), D)), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    ref = np.asarray(grouped_swiglu(f, xs, sizes, GroupedMatmul.EXPERT_LOOP))
    atol = 1e-5 * np.abs(ref).max()
    runs = {impl.value: grouped_swiglu(q, xs, sizes, impl) for impl in GroupedMatmul}
    runs["tiled"] = ragged_swiglu(q, xs, sizes, E * 128 * F * 4)
    for name, out in runs.items():
        np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=atol, err_msg=name)


# ---- the converter's reader ---------------------------------------------------------------------

EXPERTS = "model.layers.0.mlp.experts."


def _checkpoint(tmp_path, tensors: dict[str, np.ndarray], config: dict | None = None):
    """An HF-style directory with ``tensors`` and an MXFP4 config.json, opened as a source."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return open_source(tmp_path)


def _gpt_oss_experts(rng) -> dict[str, np.ndarray]:
    """gate_up [E, 2F, D] and down [E, D, F] in the published layout, with a bf16 bias."""
    gu_b, gu_s = _packed(rng, E, 2 * F, D)
    dn_b, dn_s = _packed(rng, E, D, 2 * 32)
    bias = rng.standard_normal((E, 2 * F)).astype(ml_dtypes.bfloat16)
    return {EXPERTS + "gate_up_proj_blocks": gu_b, EXPERTS + "gate_up_proj_scales": gu_s,
            EXPERTS + "gate_up_proj_bias": bias, EXPERTS + "down_proj_blocks": dn_b, EXPERTS + "down_proj_scales": dn_s}


def test_reader_presents_pairs_as_hf_dequantizes_them(tmp_path):
    """Each blocks + scales pair reads as one in-major bf16 tensor equal to HF's dequantization;
    other tensors pass through; the stored e2m1 values and e8m0 scales are there too."""
    tensors = _gpt_oss_experts(np.random.default_rng(5))
    source = _checkpoint(tmp_path, tensors)
    reader = source.reader
    assert isinstance(reader, Mxfp4Reader)
    assert sorted(reader.keys()) == sorted([EXPERTS + "gate_up_proj", EXPERTS + "gate_up_proj_bias",
                                            EXPERTS + "down_proj"])
    assert reader.shape(EXPERTS + "gate_up_proj") == (E, D, 2 * F) and reader.shape(EXPERTS + "down_proj") == (E, 64, D)
    assert reader.dtype(EXPERTS + "gate_up_proj") == ml_dtypes.bfloat16
    for name in ("gate_up_proj", "down_proj"):
        hf = _hf(tensors[EXPERTS + name + "_blocks"], tensors[EXPERTS + name + "_scales"], torch.bfloat16)
        np.testing.assert_array_equal(reader.get(EXPERTS + name).astype(np.float32), hf)
    np.testing.assert_array_equal(reader.get(EXPERTS + "gate_up_proj_bias"), tensors[EXPERTS + "gate_up_proj_bias"])
    values, per_element = reader.get_scaled(EXPERTS + "gate_up_proj")
    assert values.dtype == ml_dtypes.float4_e2m1fn and per_element.dtype == ml_dtypes.float8_e8m0fnu
    assert values.shape == per_element.shape == (E, D, 2 * F)


def test_converter_keeps_mxfp4_through_deinterleave_or_dequantizes(tmp_path):
    """No --quantize keeps MXFP4 (gate = the even columns of gate_up, values and per-column scales
    alike, as stored); --quantize none asks for float, and reads the pair dequantized."""
    tensors = _gpt_oss_experts(np.random.default_rng(6))
    source = _checkpoint(tmp_path, tensors)
    assert quant_config(None, source).weights is WeightQuant.MXFP4
    assert quant_config("none", source).weights is WeightQuant.NONE
    node = QuantizedArray(None, None, ValueFormat.MXFP4, (1,), MXFP4_BLOCK)
    hf = _hf(tensors[EXPERTS + "gate_up_proj_blocks"], tensors[EXPERTS + "gate_up_proj_scales"])
    for part in (0, 1):
        recipe = Recipe(f"layers/0/mlp/{'gate' if part == 0 else 'up'}", EXPERTS + "gate_up_proj", (E, D, 2 * F),
                        (partial(T.deinterleave, axis=-1, part=part),))
        arrays, how = quantized_leaf(recipe, source, node, (E, D, F), lambda: pytest.fail("read as float"))
        assert how == "mxfp4-native" and arrays["scale"].shape == (E, D // 32, F)
        leaf = QuantizedArray(jnp.asarray(arrays["values"]), jnp.asarray(arrays["scale"]), ValueFormat.MXFP4, (1,),
                              MXFP4_BLOCK)
        np.testing.assert_array_equal(np.asarray(dequantized(leaf, jnp.float32)), hf[..., part::2])


@pytest.mark.parametrize("drop, change, message", [
    ("gate_up_proj_scales", None, "'model.layers.0.mlp.experts.gate_up_proj_blocks' .* without its .*_scales'"),
    ("gate_up_proj_blocks", None, "'model.layers.0.mlp.experts.gate_up_proj_scales' .* without its .*_blocks'"),
    (None, ("gate_up_proj_blocks", lambda b: b[..., :15]), r"blocks \[4, 144, 5, 15\] and scales \[4, 144, 5\]"),
    (None, ("down_proj_scales", lambda s: s[:, :, :1]), r"blocks \[4, 160, 2, 16\] and scales \[4, 160, 1\]"),
    (None, ("down_proj_scales", lambda s: s.astype(np.int16)), "not uint8"),
])
def test_reader_refuses_malformed_pairs(tmp_path, drop, change, message):
    """A half-missing pair, blocks of other than 32 values, scales that do not match the blocks,
    or other dtypes: a one-line ConvertError naming the tensor and its shapes, before any read."""
    tensors = _gpt_oss_experts(np.random.default_rng(7))
    if drop:
        tensors.pop(EXPERTS + drop)
    if change:
        tensors[EXPERTS + change[0]] = np.ascontiguousarray(change[1](tensors[EXPERTS + change[0]]))
    with pytest.raises(ConvertError, match=message) as e:
        _checkpoint(tmp_path, tensors)
    assert "\n" not in str(e.value)


def test_reader_refuses_nan_scales_and_unknown_config(tmp_path):
    """Scale byte 255 (NaN in e8m0) is refused when read, naming the tensor and the position; a
    quantization_config key MXFP4 does not have is refused when the source is opened."""
    tensors = _gpt_oss_experts(np.random.default_rng(8))
    tensors[EXPERTS + "down_proj_scales"][1, 2, 0] = 255
    reader = _checkpoint(tmp_path, tensors).reader
    with pytest.raises(ConvertError, match=r"'model.layers.0.mlp.experts.down_proj' has scale byte 255 at \[1, 2, 0\]"):
        reader.get(EXPERTS + "down_proj")
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ConvertError, match="MXFP4 quantization_config key 'group_size'"):
        _checkpoint(other, tensors, {"quantization_config": {"quant_method": "mxfp4", "group_size": 16}})


# ---- end to end: a tiny gpt-oss checkpoint in the published MXFP4 layout --------------------------

GPT_OSS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=8, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0))
# gpt-oss-20b's list; dayzero reads which tensors are MXFP4 from their names instead.
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _mxfp4_gpt_oss(root):
    """A tiny random HF gpt-oss whose experts are MXFP4 (random nibbles, scale bytes 122..125),
    saved with them in the published layout (blocks + scales, quantization_config mxfp4); also
    returns HF's fp32 model holding the same experts dequantized."""
    from transformers import GptOssConfig

    from tests.hf_helpers import hf_model

    hf = hf_model(GptOssConfig(**GPT_OSS), seed=0)
    rng = np.random.default_rng(9)
    packed = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):  # HF inits these to constants
                p.copy_(torch.from_numpy(rng.normal(1.0 if "norm" in name else 0.0, 0.1, p.shape).astype(np.float32)))
        for i, layer in enumerate(hf.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                e, n_in, n_out = getattr(layer.mlp.experts, proj).shape
                blocks, scales = _packed(rng, e, n_out, n_in, exponents=range(122, 126))
                getattr(layer.mlp.experts, proj).copy_(torch.from_numpy(_hf(blocks, scales)))
                packed[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
    hf.save_pretrained(root / "float")
    (root / "mxfp4").mkdir()
    tensors = load_file(str(root / "float" / "model.safetensors"))
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(root / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (root / "mxfp4" / "config.json").write_text(json.dumps(config))
    return hf, root / "mxfp4"


@pytest.mark.slow
def test_converted_mxfp4_gpt_oss_matches_hf(tmp_path):
    """The MXFP4 checkpoint converted as stored (experts MXFP4) and with --quantize none (float):
    logits equal HF's, which loads the same files with ``Mxfp4Config(dequantize=True)`` on CPU;
    the float conversion holds exactly the MXFP4 one's dequantized experts."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from dayzero.convert import convert_checkpoint, load_checkpoint, verify_checkpoint
    from tests.hf_helpers import all_logits, assert_logits_match, hf_logits, random_ids

    hf, src = _mxfp4_gpt_oss(tmp_path)
    hf_mxfp4 = AutoModelForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True),
                                                    dtype=torch.float32, attn_implementation="eager").eval()
    ids = random_ids(40, GPT_OSS["vocab_size"], seed=1)
    ref = hf_logits(hf_mxfp4, ids)
    np.testing.assert_array_equal(ref, hf_logits(hf, ids))  # HF read the blocks as we wrote them

    runs = {}
    for label, quantize in (("mxfp4", None), ("none", "none")):
        dst = convert_checkpoint(src, tmp_path / f"dz_{label}", quantize=quantize, progress=False)
        assert verify_checkpoint(dst) > 0  # e2m1 values and e8m0 scales read back bit for bit
        config, weights = load_checkpoint(dst, dtype=jnp.float32)
        runs[label] = weights
        assert_logits_match(all_logits(weights, config, ids), ref, label)
    kept, floats = runs["mxfp4"].layers[0].mlp, runs["none"].layers[0].mlp
    assert isinstance(kept.gate, QuantizedArray) and kept.gate.fmt is ValueFormat.MXFP4
    assert not isinstance(floats.gate, QuantizedArray)
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(np.asarray(dequantized(getattr(kept, name), jnp.float32)),
                                      np.asarray(getattr(floats, name)), err_msg=name)
