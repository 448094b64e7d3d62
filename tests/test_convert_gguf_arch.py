"""GGUF conversion of every architecture dayzero converts from GGUF (llama, qwen2, qwen3,
qwen3moe, qwen2moe, minimax-m2), checked against transformers loading the same file (``gguf_file=``);
files split by gguf-split; and the quantization types the gguf package dequantizes (k-quants
included).

The GGUF files are written by the helpers of tests/test_convert_gguf.py, which name tensors with
the gguf package's own TensorNameMap, as llama.cpp's converter does.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers

from dayzero.convert import ConvertError, load_checkpoint
from dayzero.convert.readers import GGUFTensorReader
from tests.convert_helpers import assert_fails, convert, small_hf_model
from tests.hf_helpers import (
    all_logits, assert_logits_match, assert_same_weights, hf_logits, hf_model, random_ids,
)
from tests.test_convert_gguf import Q8, byte_level_vocab, write_tiny_gguf

Q = gguf.GGMLQuantizationType


def tiny_model(arch: str):
    """A tiny random HF model of ``arch`` with the byte-level test vocabulary, in the shapes
    transformers' GGUF loader can rebuild: it does not read qwen3's key_length nor the MoE
    architectures' expert_feed_forward_length (nor qwen2moe's expert_shared_feed_forward_length),
    so head_dim and the expert widths take its defaults (128; 768 for qwen3_moe; 1408 and a
    5632-wide shared expert for qwen2_moe)."""
    vocab = len(byte_level_vocab()[0])
    if arch not in ("qwen3_moe", "minimax_m2", "qwen2_moe"):
        return small_hf_model(arch, vocab_size=vocab, **({"head_dim": 128} if arch == "qwen3" else {}))
    common = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab, max_position_embeddings=1024, num_experts_per_tok=2,
                  initializer_range=0.1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=128, head_dim=128, num_experts=4,
                                             moe_intermediate_size=768, norm_topk_prob=True)
    elif arch == "qwen2_moe":  # HF's GGUF loader: norm_topk_prob False, as llama.cpp's qwen2moe
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=128, num_experts=4,
                                             moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
    else:  # half of each head rotated, experts 64 wide (a multiple of the Q4_0/Q5_1 block)
        config = transformers.MiniMaxM2Config(**common, intermediate_size=64, head_dim=32, rotary_dim=16,
                                              num_local_experts=4)
    model = hf_model(config, seed=0)
    # HF inits norms and biases (qwen2_moe's q/k/v, minimax_m2's selection bias, a buffer) to
    # constants, which hide mix-ups: with zero biases a k/v bias swap passed the qwen2_moe check.
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


# Stored quantized: Q8_0 in the dense models, Q4_0 and Q5_1 expert stacks in the MoE ones.
QUANTIZED = {arch: {"blk.0.ffn_gate_exps.weight": Q.Q4_0, "blk.0.ffn_down_exps.weight": Q.Q5_1}
             for arch in ("qwen3_moe", "minimax_m2", "qwen2_moe")}


def assert_gguf_parity(tmp_path, arch: str) -> None:
    """Convert the GGUF of a tiny ``arch`` model; assert its logits equal transformers' on the same
    file, within hf_helpers.REL_TOL (1e-4 relative). Measured: at most 1.1e-6 relative; a swapped
    pair of weights or biases in the name map moved the logits by 0.1-0.9 relative."""
    model = tiny_model(arch)
    pre = {"llama": "gpt-2", "minimax_m2": "minimax-m2"}.get(arch, "qwen2")  # as llama.cpp names them
    src = write_tiny_gguf(tmp_path / f"{arch}.gguf", model, pre=pre, quantize=QUANTIZED.get(arch, Q8))
    dst = convert(src, tmp_path / "out")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=src.name, dtype=torch.float32, attn_implementation="eager").eval()
    config, weights = load_checkpoint(dst)
    assert config.family.value == arch
    ids = random_ids(24, config.vocab_size, seed=1)
    ref = hf_logits(ref_model, ids)
    assert_logits_match(all_logits(weights, config, ids), ref, arch)
    # Both sides ran the file's rounded weights: the original model's logits differ.
    assert np.abs(ref - hf_logits(model, ids)).max() > 1e-5 * np.abs(ref).max()
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for m in messages %}")


# qwen3's attention (per-head q/k norms, key_length) runs in qwen3_moe too, so the dense qwen3,
# llama (also checked weight by weight in test_convert_gguf.py) and minimax_m2 (its metadata
# translation is checked there too) are slow, to keep the default suite short.
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "qwen2_moe"] + [pytest.param(a, marks=pytest.mark.slow)
                                                           for a in ("qwen3", "llama", "minimax_m2")])
def test_gguf_parity_with_transformers(tmp_path, arch):
    assert_gguf_parity(tmp_path, arch)


def test_gguf_qwen2moe_metadata_to_hf_config():
    """Expert widths: the keys, else llama.cpp's fallbacks (n_ff / n_expert_used, and n_ff for the
    shared expert), as in Qwen1.5-MoE files written before the keys existed; never renormalised."""
    from dayzero.model.hf_config import parse_hf_config
    from tests.test_convert_gguf import gguf_config

    experts = {"qwen2moe.expert_count": 8, "qwen2moe.expert_used_count": 4, "qwen2moe.rope.dimension_count": None}
    c = parse_hf_config(gguf_config("qwen2moe", **experts))
    assert (c.moe.intermediate_size, c.moe.shared_width, c.intermediate_size) == (32, 128, 128)
    assert c.moe.shared_gate and not c.moe.renormalize and all(c.moe.layers) and c.qkv_bias
    widths = {"qwen2moe.expert_feed_forward_length": 48, "qwen2moe.expert_shared_feed_forward_length": 96}
    c = parse_hf_config(gguf_config("qwen2moe", **experts, **widths))
    assert (c.moe.intermediate_size, c.moe.shared_width) == (48, 96)
    with pytest.raises(ConvertError, match="qwen2moe routes with softmax"):
        gguf_config("qwen2moe", **experts, **{"qwen2moe.expert_gating_func": 2})


# --- split files ------------------------------------------------------------------------------


def test_gguf_split_parts_read_together(tmp_path):
    model = small_hf_model("qwen2", vocab_size=len(byte_level_vocab()[0]), num_hidden_layers=1)
    whole = convert(write_tiny_gguf(tmp_path / "whole.gguf", model), tmp_path / "whole")
    write_tiny_gguf(tmp_path / "m.gguf", model, split_max_tensors=6)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    dst = convert(parts[1], tmp_path / "split")  # any part names the whole file
    _, got = load_checkpoint(dst)
    assert_same_weights(load_checkpoint(whole)[1], got)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert [f["name"] for f in manifest["source"]["files"]] == [p.name for p in parts]
    parts[2].unlink()
    assert_fails(parts[0], tmp_path / "broken", "m-00003-of-00003.gguf is missing")


def test_gguf_split_parts_from_different_splits(tmp_path):
    model = small_hf_model("qwen2", vocab_size=len(byte_level_vocab()[0]), num_hidden_layers=1)
    write_tiny_gguf(tmp_path / "a.gguf", model, split_max_tensors=6)
    write_tiny_gguf(tmp_path / "b.gguf", model, split_max_tensors=12)  # two parts
    (tmp_path / "b-00002-of-00002.gguf").rename(tmp_path / "a-00002-of-00003.gguf")
    assert_fails(tmp_path / "a-00001-of-00003.gguf", tmp_path / "out", "a-00002-of-00003.gguf",
                 "says it is part 2 of 2")
    (tmp_path / "a-00001-of-00003.gguf").rename(tmp_path / "renamed.gguf")
    assert_fails(tmp_path / "renamed.gguf", tmp_path / "out", "renamed.gguf is one part of a file split in 3")


# --- quantization types -------------------------------------------------------------------------

PLAIN = {"F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def stored_bytes(t: Q, values: np.ndarray, rng) -> np.ndarray:
    """What a GGUF of type ``t`` stores for ``values``: gguf's own quantization where it has one,
    else random blocks (for the types the package only dequantizes, k-quants among them)."""
    try:
        return gguf.quants.quantize(values, t)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[t]
        return rng.integers(0, 256, (values.shape[0], values.shape[1] // block * size), dtype=np.uint8)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # random blocks may hold NaN scales
def test_gguf_reads_every_type_gguf_dequantizes(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((3, 256)).astype(np.float32)
    w = gguf.GGUFWriter(tmp_path / "types.gguf", "llama")
    stored = {}
    for t in Q:
        if t.name in PLAIN:
            stored[t] = (values * 10).astype(PLAIN[t.name])
            w.add_tensor(t.name, stored[t])
        else:
            stored[t] = stored_bytes(t, values, rng)
            w.add_tensor(t.name, stored[t], raw_dtype=None if t in (Q.F32, Q.F16) else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFTensorReader(tmp_path / "types.gguf")
    read = set()
    for t in Q:
        if t.name in PLAIN:
            want = stored[t].astype(np.float32)
        else:
            try:
                want = gguf.quants.dequantize(stored[t], t)
            except NotImplementedError:
                with pytest.raises(ConvertError, match=f"quantization {t.name}, which the gguf package cannot"):
                    reader.get(t.name)
                continue
        got = reader.get(t.name)
        assert got.dtype == np.float32 and got.shape == reader.shape(t.name) == (3, 256), t.name
        np.testing.assert_array_equal(got, want, err_msg=t.name)
        read.add(t.name)
    assert {"Q4_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "BF16", "MXFP4"} <= read
    # gguf's quantizers round-trip: what we read is the tensor up to the type's rounding
    for name, tol in (("Q8_0", 0.01), ("Q5_1", 0.04), ("Q4_0", 0.1), ("BF16", 0.004)):
        np.testing.assert_allclose(reader.get(name), values, atol=tol * np.abs(values).max(), err_msg=name)
