"""Checkpoint conversion from safetensors and PyTorch sources: tiny random HF checkpoints through
the real convert path, their weights against the layouts restated in tests.convert_helpers and
their logits against HF transformers; storage dtypes, the output layout and manifest, and loading
onto a device mesh. Bad inputs and atomicity: test_convert_errors.py; GGUF: test_convert_gguf.py.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from dayzero.convert import load_checkpoint, verify_checkpoint
from tests.convert_helpers import (
    FAMILIES, assert_leaves_equal, convert, expected_leaves, hf_tensors, our_logits, save_hf, small_hf_model,
)
from tests.hf_helpers import hf_logits


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_roundtrip_exact_and_logits(tmp_path, family):
    model = small_hf_model(family)
    src = save_hf(model, tmp_path / "hf")
    dst = convert(src, tmp_path / "out")
    config, weights = load_checkpoint(dst)
    assert config.family.value == model.config.model_type
    assert_leaves_equal(weights, expected_leaves(hf_tensors(src), model.config))
    ids = np.random.RandomState(1).randint(0, 256, (1, 500))
    ref = hf_logits(model, ids)
    np.testing.assert_allclose(our_logits(dst, ids), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_layout_and_manifest(tmp_path):
    model = small_hf_model("llama")
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


def test_sharded_safetensors(tmp_path):
    model = small_hf_model("qwen2")
    src = save_hf(model, tmp_path / "hf", max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").exists() and len(list(src.glob("*.safetensors"))) > 2
    _, weights = load_checkpoint(convert(src, tmp_path / "out"))
    assert_leaves_equal(weights, expected_leaves(hf_tensors(src), model.config))


@pytest.mark.parametrize("filename", ["model.pt", "pytorch_model.bin"])
def test_torch_state_dict(tmp_path, filename):
    model = small_hf_model("llama")
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
    model = small_hf_model("qwen3").to(torch.bfloat16)
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
    model = small_hf_model("llama")
    dst = convert(save_hf(model, tmp_path / "hf"), tmp_path / "out", dtype=dtype)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["dtype"] == dtype and manifest["tensors"]["embed"]["dtype"] == dtype
    _, weights = load_checkpoint(dst)
    want = expected_leaves(hf_tensors(tmp_path / "hf"), model.config)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    assert_leaves_equal(weights, {k: v.astype(np_dtype).astype(np.float32) for k, v in want.items()})


def test_tied_lm_head_and_inv_freq_are_ignored(tmp_path):
    model = small_hf_model("qwen2")
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

    dst = convert(save_hf(small_hf_model("llama"), tmp_path / "hf"), tmp_path / "out")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SHARDED_LOAD, str(dst)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_mixed_precision_source_is_stored_as_float32(tmp_path):
    model = small_hf_model("llama").to(torch.bfloat16)
    model.model.norm.float()  # one fp32 tensor among bf16 ones: keep both exactly
    dst = convert(save_hf(model, tmp_path / "hf"), tmp_path / "out")
    assert json.loads((dst / "manifest.json").read_text())["dtype"] == "float32"
    _, weights = load_checkpoint(dst)
    assert_leaves_equal(weights, expected_leaves(hf_tensors(tmp_path / "hf"), model.config))

