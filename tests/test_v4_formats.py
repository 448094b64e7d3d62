"""DeepSeek-V4's published checkpoint format: the MTP (next-n) module kept, FP8 and FP4 weights read.

The checkpoints are written here tensor by tensor (numpy + a raw safetensors writer, for the
F8_E4M3 / F8_E8M0 / I8 dtypes numpy's writer lacks), in DeepSeek's own names: the tiny HF model of
tests/v4_helpers.py renamed, plus an MTP module whose names and shapes are typed out below from
DeepSeek's ``MTPBlock`` (not taken from the converter's name map). Oracles:

- MTP: no implementation runs it (HF has no MTP module), so its leaves must be the stored tensors
  under their documented layouts, bit for bit, and the main model must not notice it: the same
  leaves as the checkpoint converted without MTP tensors, logits that do not move when the MTP
  weights do (one forward compile serves the module), and HF's fp32 logits;
- FP8 / FP4: every value decoded by hand from the formats' definitions (e4m3: sign, 4 exponent
  bits biased 7, 3 mantissa bits, subnormals below; e8m0: 2^(byte - 127); e2m1: sign, 2 exponent
  bits biased 1, 1 mantissa bit, two per byte low nibble first, one scale per 32 inputs); a tiny
  FP8 + FP4 checkpoint then converts, by default with both kept as stored (FP8 leaves: the
  checkpoint's e4m3 bytes and block scales; experts: its e2m1 nibbles and e8m0 bytes, only
  moved to dayzero's [in, out] layout), to the leaves of its hand-dequantized float copy, and HF
  transformers (which dequantizes such a checkpoint on CPU) gives the converted model's logits.
  The forward pass reading both formats gives the logits of the ``--quantize none`` conversion
  (every weight dequantized at conversion) to fp32 rounding, and not those of the same stored
  values read with their scales ignored.

Default suite ~15 s of CPU here (one forward compile, six tiny conversions, HF's load of the
FP8 + FP4 checkpoint); the forward pass over the quantized tree (another compile) and
``Engine.generate`` with the MTP module loaded are under ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.convert.check import check
from dayzero.convert.fp8 import V4_NAMES, Fp8DequantReader
from dayzero.convert.mxfp4 import RowFp4Reader
from dayzero.convert.name_map_v4 import refusal
from dayzero.convert.readers import SafetensorsReader
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.quant import QuantizedArray, dequantized
from dayzero.model.weights import abstract_weights, leaf_path, named_leaves, parameter_count
from tests.hf_helpers import all_logits, assert_logits_match, hf_logits, random_ids
from tests.v4_helpers import tiny_hf_config, tiny_hf_model

SEED, PROMPT = 5, 40
# Two layers, the first sliding with hash routing, the second CSA (compressor, indexer) with top-k
# routing: every kind of tensor the format has, at one forward compile of ~10 s on this machine.
LAYERS = dict(num_hidden_layers=2, layer_types=["sliding_attention", "compressed_sparse_attention"],
              mlp_layer_types=["hash_moe", "moe"])
F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
E4M3, E8M0, E2M1 = (np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu, ml_dtypes.float4_e2m1fn))
_ST_CODES = {F32: "F32", BF16: "BF16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
             np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", E4M3: "F8_E4M3", E8M0: "F8_E8M0"}


pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


# ---- writing checkpoints -------------------------------------------------------------------------


def save_raw(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of ``tensors`` in their own dtypes, written byte by byte."""
    header, blobs, offset = {}, [], 0
    for name, x in tensors.items():
        raw = np.ascontiguousarray(x).tobytes()
        header[name] = {"dtype": _ST_CODES[x.dtype], "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_checkpoint(root: Path, tensors: dict[str, np.ndarray], **config) -> Path:
    """``root`` holding ``tensors`` and the tiny two-layer config.json with ``config`` on top."""
    root.mkdir(parents=True)
    save_raw(root / "model.safetensors", tensors)
    (root / "config.json").write_text(json.dumps({**tiny_hf_config(**LAYERS).to_dict(), **config}))
    return root


def upstream_tensors(model, tmp: Path) -> dict[str, np.ndarray]:
    """The HF model's tensors under DeepSeek's own names (save_pretrained's original-format names,
    then the three it spells otherwise), fp32 numpy (tid2eid as saved)."""
    model.save_pretrained(tmp, safe_serialization=True)
    out = {}
    for name, t in load_file(tmp / "model.safetensors").items():
        name = name.replace("model.hc_head.hc_", "hc_head_").replace(".attn.norm.", ".attn.kv_norm.")
        name = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(
            name, name.removeprefix("model."))
        out[name] = t.numpy()
    return out


def mtp_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """MTP module 0 of the tiny config in DeepSeek's names: its extras, then one decoder block
    with sliding attention (no compressor, no indexer) and a MoE routed by top-k (gate.bias, no
    tid2eid). D=64, Q=32, N=4, H=64, g=2, d_g=16, E=8, F=32, 4 streams."""
    D, Q, N, H, g, dg, E, F, n = 64, 32, 4, 64, 2, 16, 8, 32, 4
    shapes = {
        "enorm.weight": (D,), "hnorm.weight": (D,), "norm.weight": (D,), "e_proj.weight": (D, D),
        "h_proj.weight": (D, D), "hc_head_fn": (n, n * D), "hc_head_base": (n,), "hc_head_scale": (1,),
        "attn_norm.weight": (D,), "ffn_norm.weight": (D,), "attn.wq_a.weight": (Q, D), "attn.q_norm.weight": (Q,),
        "attn.wq_b.weight": (N * H, Q), "attn.wkv.weight": (H, D), "attn.kv_norm.weight": (H,),
        "attn.wo_a.weight": (g * dg, N * H // g), "attn.wo_b.weight": (D, g * dg), "attn.attn_sink": (N,),
        "ffn.gate.weight": (E, D), "ffn.gate.bias": (E,), "ffn.shared_experts.w1.weight": (F, D),
        "ffn.shared_experts.w3.weight": (F, D), "ffn.shared_experts.w2.weight": (D, F),
    }
    for mix in ("attn", "ffn"):
        shapes.update({f"hc_{mix}_fn": ((2 + n) * n, n * D), f"hc_{mix}_base": ((2 + n) * n,), f"hc_{mix}_scale": (3,)})
    for e in range(E):
        shapes.update({f"ffn.experts.{e}.w1.weight": (F, D), f"ffn.experts.{e}.w3.weight": (F, D),
                       f"ffn.experts.{e}.w2.weight": (D, F)})
    return {f"mtp.0.{k}": (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in shapes.items()}


def expected_mtp_leaves(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The leaves under mtp/0 that ``t`` (from :func:`mtp_tensors`) must become: Linear weights
    transposed to input-first, q_b split per head, wo_a per group, experts stacked."""
    p, N, H, dg, E = "mtp.0.", 4, 64, 16, 8
    out = {f"mtp/0/{k}": t[p + k + ".weight"] for k in ("enorm", "hnorm", "norm")}
    out.update({f"mtp/0/{k}": t[p + k + ".weight"].T for k in ("e_proj", "h_proj")})
    out.update({f"mtp/0/hc_head/{k}": t[p + "hc_head_" + k] for k in ("fn", "base", "scale")})
    q, a = "mtp/0/layer/", p + "attn."
    out.update({q + "attn_norm": t[p + "attn_norm.weight"], q + "mlp_norm": t[p + "ffn_norm.weight"],
                q + "attn/q_a": t[a + "wq_a.weight"].T, q + "attn/q_a_norm": t[a + "q_norm.weight"],
                q + "attn/q_b": t[a + "wq_b.weight"].T.reshape(-1, N, H), q + "attn/kv": t[a + "wkv.weight"].T,
                q + "attn/kv_norm": t[a + "kv_norm.weight"], q + "attn/o_b": t[a + "wo_b.weight"].T,
                q + "attn/o_a": np.stack([w.T for w in np.split(t[a + "wo_a.weight"], 2)]),
                q + "attn/sinks": t[a + "attn_sink"], q + "mlp/router": t[p + "ffn.gate.weight"].T,
                q + "mlp/score_bias": t[p + "ffn.gate.bias"]})
    assert out[q + "attn/o_a"].shape == (2, N * H // 2, dg)
    for mix, name in (("attn_hc", "attn"), ("mlp_hc", "ffn")):
        out.update({f"{q}{mix}/{k}": t[f"{p}hc_{name}_{k}"] for k in ("fn", "base", "scale")})
    for leaf, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        out[f"{q}mlp/shared/{leaf}"] = t[f"{p}ffn.shared_experts.{w}.weight"].T
        out[f"{q}mlp/{leaf}"] = np.stack([t[f"{p}ffn.experts.{e}.{w}.weight"].T for e in range(E)])
    return out


# ---- FP8 and FP4 by hand, from the formats' definitions -------------------------------------------


def e4m3(byte: np.ndarray) -> np.ndarray:
    """float8 e4m3fn: sign, exponent bits biased 7 (0: subnormal, m/8 2^-6), 3 mantissa bits;
    S.1111.111 is NaN."""
    b = byte.astype(np.int64)
    sign, exp, man = np.where(b & 0x80, -1.0, 1.0), (b >> 3) & 0xF, b & 0x7
    value = sign * np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    return np.where((exp == 15) & (man == 7), np.nan, value)


def e2m1(nibble: np.ndarray) -> np.ndarray:
    """float4 e2m1: sign bit 3, exponent bits 2-1 biased 1 (0: subnormal, m/2), mantissa bit 0."""
    n = nibble.astype(np.int64)
    sign, exp, man = np.where(n & 0x8, -1.0, 1.0), (n >> 1) & 0x3, n & 0x1
    return sign * np.where(exp == 0, man * 0.5, 2.0 ** (exp - 1) * (1 + man / 2))


def e8m0(byte: np.ndarray) -> np.ndarray:
    """ue8m0: the power of two 2^(byte - 127)."""
    return 2.0 ** (byte.astype(np.float64) - 127)


def fp8_by_hand(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[out, in] from e4m3 bytes and the e8m0 byte of each [128, 128] block (the last partial)."""
    return e4m3(values) * np.repeat(np.repeat(e8m0(scales), 128, 0), 128, 1)[: values.shape[0], : values.shape[1]]


def fp4_by_hand(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[out, in] from bytes [out, in/2] (input 2k in the low nibble of byte k, 2k+1 in the high)
    and the e8m0 byte of each 32 inputs of a row [out, in/32]."""
    u8 = packed.view(np.uint8)
    codes = np.empty((u8.shape[0], 2 * u8.shape[1]), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = u8 & 0xF, u8 >> 4
    return e2m1(codes) * np.repeat(e8m0(scales.view(np.uint8)), 32, axis=1)


def to_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's FP8 of ``w`` [out, in]: e4m3 values and one ue8m0 scale per [128, 128] block,
    the least power of two that keeps the block's magnitudes within 448."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    amax = np.array([[np.abs(w[128 * i:128 * i + 128, 128 * j:128 * j + 128]).max() for j in range(cols)]
                     for i in range(rows)])
    k = np.ceil(np.log2(np.maximum(amax, 1e-30) / 448)).astype(np.int64)
    scale = np.repeat(np.repeat(2.0 ** k, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
    return (w / scale).astype(E4M3), (k + 127).astype(np.uint8).view(E8M0)


_E2M1_GRID = e2m1(np.arange(16))


def to_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's FP4 of ``w`` [out, in]: the nearest e2m1 codes, packed two per int8 byte (low
    nibble first), and one ue8m0 scale per 32 inputs of a row, keeping magnitudes within 6."""
    blocks = w.reshape(w.shape[0], -1, 32)
    k = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6)).astype(np.int64)
    scaled = (blocks / 2.0 ** k[..., None]).reshape(w.shape)
    codes = np.abs(scaled[..., None] - _E2M1_GRID).argmin(-1).astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8), (k + 127).astype(np.uint8).view(E8M0)


# DeepSeek's FP8 weights (as published; the compressors, indexer weights_proj, router, embedding
# and head are bf16), and its FP4 routed experts.
FP8_WEIGHTS = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight", ".attn.wo_b.weight",
               ".attn.indexer.wq_b.weight", ".shared_experts.w1.weight", ".shared_experts.w2.weight",
               ".shared_experts.w3.weight", ".e_proj.weight", ".h_proj.weight")


def published(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the published format of ``tensors``, its float32 dequantization by hand)."""
    stored, dequantized = {}, {}
    for name, w in tensors.items():
        base = name.removesuffix(".weight")
        if name.endswith(FP8_WEIGHTS):
            stored[name], stored[base + ".scale"] = to_fp8(w)
            dequantized[name] = fp8_by_hand(stored[name].view(np.uint8), stored[base + ".scale"].view(np.uint8))
        elif ".ffn.experts." in name:
            stored[name], stored[base + ".scale"] = to_fp4(w)
            dequantized[name] = fp4_by_hand(stored[name], stored[base + ".scale"])
        else:
            stored[name], dequantized[name] = w, w
    return stored, {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in dequantized.items()}


PUBLISHED_CONFIG = {"expert_dtype": "fp4", "quantization_config": {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128]}}


# ---- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(SEED, **LAYERS)


@pytest.fixture(scope="module")
def sources(hf, tmp_path_factory):
    """(main-model tensors, MTP tensors) in DeepSeek's names."""
    return upstream_tensors(hf, tmp_path_factory.mktemp("hf")), mtp_tensors(np.random.default_rng(0))


@pytest.fixture(scope="module")
def with_mtp(sources, tmp_path_factory):
    """(source, converted dir, config, weights) of the float checkpoint with its MTP module."""
    root = tmp_path_factory.mktemp("mtp")
    src = write_checkpoint(root / "src", {**sources[0], **sources[1]}, num_nextn_predict_layers=1)
    dst = convert_checkpoint(src, root / "dz", progress=False)
    return (src, dst, *load_checkpoint(dst))


@pytest.fixture(scope="module")
def ids():
    return random_ids(PROMPT, 256, seed=1)


@pytest.fixture(scope="module")
def logits(with_mtp, ids):
    """dayzero's fp32 logits of the float checkpoint (the module's one forward compile)."""
    return all_logits(with_mtp[3], with_mtp[2], ids)


# ---- the MTP module ---------------------------------------------------------------------------------


def test_mtp_is_kept_bit_exact(sources, with_mtp):
    _, _, config, weights = with_mtp
    assert config.mtp_layers == 1 and len(weights.mtp) == 1
    got = {k: np.asarray(v) for k, v in named_leaves(weights).items() if k.startswith("mtp/")}
    want = expected_mtp_leaves(sources[1])
    assert sorted(got) == sorted(want)  # no compressor, indexer or tid2eid: sliding, top-k
    for name, value in want.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_the_main_model_does_not_see_the_mtp_module(hf, sources, with_mtp, logits, ids, tmp_path):
    """Converted without its MTP tensors (num_nextn_predict_layers 0) the checkpoint gives the same
    main leaves, bit for bit; the logits are HF's, and do not move when the MTP weights do (the
    forward pass runs with them in the tree but never reads them)."""
    _, _, config, weights = with_mtp
    plain_src = write_checkpoint(tmp_path / "src", sources[0], num_nextn_predict_layers=0)
    plain_config, plain = load_checkpoint(convert_checkpoint(plain_src, tmp_path / "dz", progress=False))
    assert plain.mtp is None and plain_config == dataclasses.replace(config, mtp_layers=0)
    got = named_leaves(weights)
    for name, value in named_leaves(plain).items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)
    assert_logits_match(logits, hf_logits(hf, ids), "deepseek_v4 with an MTP module")
    garbage = jax.tree.map(lambda x: x * 3 + 1, weights.mtp)
    np.testing.assert_array_equal(all_logits(weights.replace(mtp=garbage), config, ids), logits)


def test_mtp_leaves_share_the_main_layers_axes_and_count_in_the_plan(with_mtp, sources):
    """Sharding: each MTP block leaf has the logical axes of the same leaf of a main layer of its
    routing kind (layer 1: top-k). Planner: the parameters count the MTP module's (loaded)."""
    config = with_mtp[2]
    specs = named_leaves(abstract_weights(config))
    for name, spec in specs.items():
        if name.startswith("mtp/0/layer/"):
            main = specs.get("layers/1/" + name.removeprefix("mtp/0/layer/"))
            assert main is not None and (main.shape, main.axes) == (spec.shape, spec.axes), name
    assert specs["mtp/0/e_proj"].axes == specs["layers/0/attn/q_a"].axes == ("embed", None)
    mtp = sum(x.size for x in sources[1].values())
    no_mtp = parameter_count(abstract_weights(dataclasses.replace(config, mtp_layers=0)))
    assert DecodeFootprint(config).parameters == parameter_count(abstract_weights(config)) == no_mtp + mtp


def test_check_counts_mtp_tensors_as_expected(with_mtp):
    report = check(with_mtp[0])
    assert report.passed, report.all_problems
    s = report.structure
    assert s["ignored"] == s["unexpected"] == s["missing"] == [] and s["config"].endswith("+ 1 MTP kept")


def _rewrite(src: Path, root: Path, drop=lambda name: False, **config) -> Path:
    reader = SafetensorsReader(src / "model.safetensors")
    return write_checkpoint(root, {n: reader.get(n) for n in reader.keys() if not drop(n)},
                            **{"num_nextn_predict_layers": 1, **config})


def test_a_missing_mtp_tensor_is_a_one_line_error_naming_it(with_mtp, tmp_path):
    src = with_mtp[0]
    lacking = _rewrite(src, tmp_path / "lacking", lambda n: n == "mtp.0.ffn.experts.3.w2.weight")
    with pytest.raises(ConvertError) as info:
        convert_checkpoint(lacking, tmp_path / "dz", progress=False)
    message = str(info.value)
    assert "'mtp.0.ffn.experts.3.w2.weight'" in message and len(message.splitlines()) == 1, message
    assert check(lacking).structure["missing"] == ["mtp.0.ffn.experts.3.w2.weight"]
    # No MTP tensor at all (what save_pretrained writes: HF has no MTP module): the first MTP
    # tensor is named, not a main-model tensor of another spelling.
    none = _rewrite(src, tmp_path / "none", lambda n: n.startswith("mtp."))
    with pytest.raises(ConvertError, match=r"no tensor 'mtp\.0\.enorm\.weight' \(needed for mtp/0/enorm\)"):
        convert_checkpoint(none, tmp_path / "dz", progress=False)
    # Tensors of a module past num_nextn_predict_layers are unknown.
    with pytest.raises(ConvertError, match=r"unexpected tensor 'mtp\.0\."):
        convert_checkpoint(_rewrite(src, tmp_path / "extra", num_nextn_predict_layers=0), tmp_path / "dz",
                           progress=False)


def test_refusals_before_reading():
    """An MTP module of a compressed kind and int4 experts are refused from config.json alone."""
    base = {"model_type": "deepseek_v4", "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    assert refusal({**base, "compress_ratios": [0, 4, 0]}) is None
    why = refusal({**base, "compress_ratios": [0, 4, 128]})
    assert "MTP module 0" in why and "128" in why
    assert "'int4'" in refusal({**base, "expert_dtype": "int4"})
    assert "keep one" in refusal({**base, "expert_dtype": "fp4", "quantization_config": {"expert_dtype": "fp8"}})


# ---- FP8 and FP4 --------------------------------------------------------------------------------------


def test_fp8_with_ue8m0_block_scales_reads_as_by_hand(tmp_path):
    """A [200, 300] e4m3 weight (partial blocks both ways; every byte but NaN, subnormals
    included) with its [2, 3] e8m0 ``.scale`` reads as the definition says, exactly."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 256, (200, 300)).astype(np.uint8)
    values[(values & 0x7F) == 0x7F] = 0x01  # NaN codes
    scales = rng.integers(100, 150, (2, 3)).astype(np.uint8)
    save_raw(tmp_path / "w.safetensors", {"x.weight": values.view(E4M3), "x.scale": scales.view(E8M0),
                                          "x.norm.scale": np.ones(4, np.float32)})  # a .scale of no FP8 weight
    reader = Fp8DequantReader(SafetensorsReader(tmp_path / "w.safetensors"), (128, 128), "w", V4_NAMES)
    assert sorted(reader.keys()) == ["x.norm.scale", "x.weight"] and reader.shape("x.weight") == (200, 300)
    np.testing.assert_array_equal(reader.get("x.weight"), fp8_by_hand(values, scales).astype(np.float32))
    stored, per_element = reader.get_scaled("x.weight")
    assert stored.dtype == E4M3 and np.array_equal(stored.view(np.uint8), values)
    assert per_element[199, 299] == 2.0 ** (int(scales[1, 2]) - 127)


def test_fp4_experts_read_as_by_hand(tmp_path):
    """A [6, 96] FP4 weight, int8 [6, 48] with e8m0 [6, 3], reads as the definition says,
    exactly; as stored it is e2m1 values and one e8m0 scale per 32 inputs of a row."""
    rng = np.random.default_rng(1)
    packed = rng.integers(-128, 128, (6, 48)).astype(np.int8)
    scales = rng.integers(110, 140, (6, 3)).astype(np.uint8)
    save_raw(tmp_path / "w.safetensors", {"e.weight": packed, "e.scale": scales.view(E8M0)})
    reader = RowFp4Reader(SafetensorsReader(tmp_path / "w.safetensors"), "w")
    assert reader.keys() == ["e.weight"] and reader.shape("e.weight") == (6, 96) and reader.is_scaled("e.weight")
    want = fp4_by_hand(packed, scales)
    np.testing.assert_array_equal(reader.get("e.weight").astype(np.float64), want)
    values, per_element = reader.get_scaled("e.weight")
    assert values.dtype == E2M1 and per_element.dtype == E8M0 and values.shape == per_element.shape == (6, 96)
    np.testing.assert_array_equal(values.astype(np.float64) * per_element.astype(np.float64), want)
    assert np.array_equal(per_element[:, 32:64].astype(np.float64), np.repeat(e8m0(scales[:, 1:2]), 32, 1))
    scales[2, 1] = 255  # NaN
    save_raw(tmp_path / "w.safetensors", {"e.weight": packed, "e.scale": scales.view(E8M0)})
    with pytest.raises(ConvertError, match=r"'e\.weight' has scale byte 255 at \[2, 1\]"):
        RowFp4Reader(SafetensorsReader(tmp_path / "w.safetensors"), "w").get("e.weight")


@pytest.fixture(scope="module")
def published_pair(sources, tmp_path_factory):
    """(published source dir, its conversion, the hand-dequantized float copy's conversion)."""
    root = tmp_path_factory.mktemp("published")
    stored, dequantized = published({**sources[0], **sources[1]})
    src = write_checkpoint(root / "src", stored, num_nextn_predict_layers=1, **PUBLISHED_CONFIG)
    ref = write_checkpoint(root / "ref", dequantized, num_nextn_predict_layers=1)
    return src, convert_checkpoint(src, root / "dz", progress=False), convert_checkpoint(ref, root / "ref-dz",
                                                                                         progress=False)


@pytest.fixture(scope="module")
def published_none(published_pair):
    """The published checkpoint converted with ``--quantize none``: every weight dequantized."""
    src = published_pair[0]
    return convert_checkpoint(src, src.parent / "dz-none", quantize="none", progress=False)


# The leaves a V4 checkpoint keeps in each stored format (every layer, and the MTP module's block).
ROUTED = ("mlp/gate", "mlp/up", "mlp/down")
FP8_LEAVES = ("attn/q_a", "attn/q_b", "attn/kv", "attn/o_a", "attn/o_b", "mlp/shared/gate", "mlp/shared/up",
              "mlp/shared/down")


def _native(manifest: dict, how: str) -> list[str]:
    return sorted({k.rsplit("/", 1)[0] for k, e in manifest["tensors"].items() if e.get("quantized") == how})


def test_published_format_converts_to_its_dequantized_model(published_pair):
    """By default both formats stay as stored: the FP4 experts MXFP4 (their e2m1 codes and e8m0
    bytes) and the FP8 weights FP8 (their e4m3 bytes, the ue8m0 block scales as float32), only
    moved to dayzero's [in, out] layout; nothing is quantized again, the other leaves stay float;
    every leaf, dequantized, equals the hand-dequantized copy's, bit for bit."""
    src, dst, ref = published_pair
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["quantization"] == {"weights": "mxfp4+fp8-block", "block": [128, 128]}
    layers = ("layers/0/", "layers/1/", "mtp/0/layer/")
    assert _native(manifest, "mxfp4-native") == sorted(p + leaf for p in layers for leaf in ROUTED)
    assert _native(manifest, "fp8-native") == sorted([p + leaf for p in layers for leaf in FP8_LEAVES]
                                                     + ["mtp/0/e_proj", "mtp/0/h_proj"])
    assert {e.get("quantized") for e in manifest["tensors"].values()} == {None, "fp8-native", "mxfp4-native"}
    dtypes = {(e.get("quantized"), k.rsplit("/", 1)[-1], e["dtype"]) for k, e in manifest["tensors"].items()
              if e.get("quantized")}
    assert dtypes == {("fp8-native", "values", "float8_e4m3fn"), ("fp8-native", "scale", "float32"),
                      ("mxfp4-native", "values", "float4_e2m1fn"), ("mxfp4-native", "scale", "float8_e8m0fnu")}
    config, weights = load_checkpoint(dst)
    _, want = load_checkpoint(ref)
    flat, _ = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, QuantizedArray))
    got, want = {leaf_path(k): v for k, v in flat}, named_leaves(want)
    assert sorted(got) == sorted(want)
    for name, leaf in got.items():
        value = dequantized(leaf, jnp.float32) if isinstance(leaf, QuantizedArray) else leaf
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want[name]), err_msg=name)
    # Layer 1's expert 2 gate (w1 [F, D] stored [F, D/2] + [F, D/32]) as stored, transposed.
    reader = SafetensorsReader(src / "model.safetensors")
    gate = got["layers/1/mlp/gate"]
    packed, scales = reader.get("layers.1.ffn.experts.2.w1.weight"), reader.get("layers.1.ffn.experts.2.w1.scale")
    codes = np.stack([packed.view(np.uint8) & 0xF, packed.view(np.uint8) >> 4], -1).reshape(packed.shape[0], -1)
    assert np.array_equal(np.asarray(gate.values[2]).view(np.uint8) & 0xF, codes.T)
    assert np.array_equal(np.asarray(gate.scale[2]).view(np.uint8), scales.view(np.uint8).T)
    # Layer 1's q_b (wq_b [N*H, Q] = [256, 32]: two 128-row blocks) as stored, transposed to
    # [Q, N, H]; its two e8m0 block scales as the float32 powers of two they are.
    q_b = got["layers/1/attn/q_b"]
    w, scale = reader.get("layers.1.attn.wq_b.weight"), reader.get("layers.1.attn.wq_b.scale")
    assert q_b.values.dtype == E4M3 and q_b.block == (128, 128) and q_b.scale.shape == (1, 2)
    assert np.array_equal(np.asarray(q_b.values).reshape(32, 256).view(np.uint8), w.view(np.uint8).T)
    np.testing.assert_array_equal(np.asarray(q_b.scale), e8m0(scale.view(np.uint8)).T.astype(np.float32))
    report = check(dst)  # the converted directory against its manifest, both formats read back
    assert report.passed, report.all_problems


def _scales_ignored(weights):
    """The wrong reading of a quantized tree: its stored values with every scale taken as 1."""
    is_quantized = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    return jax.tree.map(lambda x: x.replace(scale=jnp.ones_like(x.scale)) if is_quantized(x) else x, weights,
                        is_leaf=is_quantized)


def test_quantize_none_dequantizes_both_formats(published_pair, published_none):
    """``--quantize none``: no quantized leaf, each weight the default conversion's dequantized
    exactly (the two read the same stored numbers) and not its stored values with the scales
    ignored (what the logits test below would catch in the forward pass)."""
    manifest = json.loads((published_none / "manifest.json").read_text())
    assert manifest["quantization"]["weights"] == "none"
    assert not any(e.get("quantized") for e in manifest["tensors"].values())
    _, floats = load_checkpoint(published_none)
    _, kept = load_checkpoint(published_pair[1])
    for name in ("layers/0/attn/o_a", "layers/1/mlp/down", "mtp/0/e_proj"):
        leaf = _leaf(kept, name)
        want = np.asarray(_leaf(floats, name))
        np.testing.assert_array_equal(np.asarray(dequantized(leaf, jnp.float32)), want, err_msg=name)
        wrong = np.asarray(dequantized(_leaf(_scales_ignored(kept), name), jnp.float32))
        assert np.abs(wrong - want).max() > 10 * np.abs(want).max(), name  # scales ~2^-12 .. 2^-5


def _leaf(weights, name: str):
    flat, _ = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, QuantizedArray))
    return {leaf_path(k): v for k, v in flat}[name]


def test_fp8_kept_only_where_every_fp8_leaf_is_stored_fp8_and_fp8_block_keeps_it(published_pair, tmp_path):
    """No --quantize keeps the FP8 weights only when every leaf fp8-block would store is FP8 in
    the source: with one of them (layer 0's wq_a) float, the experts alone stay as stored
    (mxfp4), so that no float weight is rounded unasked. ``--quantize fp8-block`` keeps the FP8
    weights as stored too (the experts quantized from their exact dequantization)."""
    src = published_pair[0]
    reader = SafetensorsReader(src / "model.safetensors")
    tensors = {n: reader.get(n) for n in reader.keys() if n != "layers.0.attn.wq_a.scale"}
    tensors["layers.0.attn.wq_a.weight"] = reader.get("layers.0.attn.wq_a.weight").astype(np.float32)
    mixed = write_checkpoint(tmp_path / "mixed", tensors, num_nextn_predict_layers=1, **PUBLISHED_CONFIG)
    manifest = json.loads((convert_checkpoint(mixed, tmp_path / "dz", progress=False) / "manifest.json").read_text())
    assert manifest["quantization"]["weights"] == "mxfp4" and not _native(manifest, "fp8-native")
    assert len(_native(manifest, "mxfp4-native")) == 9
    blocked = convert_checkpoint(src, tmp_path / "fp8", quantize="fp8-block", progress=False)
    manifest = json.loads((blocked / "manifest.json").read_text())
    assert manifest["quantization"] == {"weights": "fp8-block", "block": [128, 128]}
    assert len(_native(manifest, "fp8-native")) == 3 * len(FP8_LEAVES) + 2
    assert _native(manifest, "quantized") == sorted(p + leaf for p in ("layers/0/", "layers/1/", "mtp/0/layer/")
                                                    for leaf in ROUTED)


@pytest.mark.slow  # the forward pass over FP8 and MXFP4 leaves is another compile, ~10 s here
def test_forward_reads_both_formats_as_the_dequantized_conversion(published_pair, published_none, ids):
    """The forward pass, reading FP8 leaves block by block and MXFP4 experts tile by tile, gives
    the ``--quantize none`` conversion's logits to fp32 rounding (the same stored numbers,
    dequantized at another time), and not those of the stored values with the scales ignored."""
    config, kept = load_checkpoint(published_pair[1])
    _, floats = load_checkpoint(published_none)
    want = all_logits(floats, config, ids)
    got = all_logits(kept, config, ids)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 1e-5 * scale, np.abs(got - want).max() / scale
    assert np.abs(all_logits(_scales_ignored(kept), config, ids) - want).max() > 0.1 * scale


def test_published_format_matches_hf_and_passes_check(published_pair, hf, logits, ids):
    """HF transformers loads the published checkpoint on CPU by dequantizing it (its fine-grained
    FP8 integration, FP4 experts included): its fp32 logits are ours of the converted checkpoint,
    run with its MXFP4 experts dequantized on the host (exact, as the forward pass's own
    dequantization; the float tree reuses the module's one compile)."""
    from transformers import DeepseekV4ForCausalLM

    src, dst, _ = published_pair
    config, weights = load_checkpoint(dst)
    is_quantized = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    floats = jax.tree.map(lambda x: dequantized(x, jnp.float32) if is_quantized(x) else x, weights,
                          is_leaf=is_quantized)
    ours = all_logits(floats, config, ids)
    hf_published = DeepseekV4ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert_logits_match(ours, hf_logits(hf_published, ids), "deepseek_v4 FP8 + FP4")
    # The quantization moved the logits (else the comparison above would not test the readers).
    assert np.abs(ours - logits).max() > 1e-3 * np.abs(logits).max()
    report = check(src)
    assert report.passed, report.all_problems
    assert report.structure["not_float"] == report.structure["unexpected"] == []


@pytest.mark.slow  # the engine's prefill and decode steps over both conversions, ~30 s here
def test_engine_loads_both_formats_and_generates_the_dequantized_conversions_tokens(published_pair, published_none):
    """``Engine.load`` of the checkpoint with both formats kept generates the ``--quantize none``
    conversion's greedy tokens."""
    from dayzero.engine import Engine

    prompt = random_ids(12, 256, seed=3)[0].tolist()
    want = Engine.load(published_none, progress=False).generate(prompt, max_new_tokens=6, ignore_eos=True)
    got = Engine.load(published_pair[1], progress=False).generate(prompt, max_new_tokens=6, ignore_eos=True)
    assert got.token_ids == want.token_ids


@pytest.mark.slow  # two more compiles (the engine's prefill and decode steps), ~25 s here
def test_engine_generates_hfs_tokens_with_the_mtp_module_loaded(hf, with_mtp):
    """``Engine`` holds, places and passes the whole tree, MTP module included, through its steps."""
    from dayzero.engine import Engine
    from tests.hf_helpers import hf_greedy

    _, _, config, weights = with_mtp
    prompt = random_ids(24, config.vocab_size, seed=2)
    out = Engine(config, weights).generate(prompt[0].tolist(), max_new_tokens=8, ignore_eos=True)
    assert out.token_ids == hf_greedy(hf, prompt, 8)
