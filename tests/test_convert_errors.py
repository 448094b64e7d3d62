"""Checkpoint conversion refuses bad inputs with an error naming the offending file or tensor
and leaves nothing behind (no destination, no temporary directory); ``verify_checkpoint`` and
``load_checkpoint`` refuse tampered or incomplete checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from dayzero.convert import ConvertError, load_checkpoint, verify_checkpoint
from tests.convert_helpers import assert_fails, convert, hf_tensors, save_hf, small_hf_model


# --- integrity -------------------------------------------------------------------------------------


def test_verify_detects_tampering(tmp_path):
    dst = convert(save_hf(small_hf_model("llama"), tmp_path / "hf"), tmp_path / "out")
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["tensors"]["layers/1/mlp/up"]["sha256"] = "0" * 64
    (dst / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match="layers/1/mlp/up"):
        verify_checkpoint(dst)


def test_sharded_index_pointing_at_wrong_file(tmp_path):
    src = save_hf(small_hf_model("llama"), tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(f for f in files if f != index["weight_map"]["model.norm.weight"])
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_fails(src, tmp_path / "out", "model.norm.weight")


# --- bad inputs ------------------------------------------------------------------------------------


@pytest.fixture()
def hf_parts(tmp_path):
    """(directory, tensors) of a tiny llama, to be edited and rewritten by a test."""
    src = save_hf(small_hf_model("llama"), tmp_path / "hf")
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
    src = save_hf(small_hf_model("llama"), tmp_path / "hf", max_shard_size="40KB")
    victim = sorted(src.glob("*.safetensors"))[1]
    victim.unlink()
    assert_fails(src, tmp_path / "out", victim.name, "missing")


def test_corrupt_torch_file(tmp_path):
    src = tmp_path / "pt"
    src.mkdir()
    small_hf_model("llama").config.to_json_file(src / "config.json")
    (src / "model.bin").write_bytes(b"PK\x03\x04 definitely not a zip archive")
    assert_fails(src / "model.bin", tmp_path / "out", "model.bin", "not a readable PyTorch checkpoint")


def test_torch_file_without_config(tmp_path):
    model = small_hf_model("llama")
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


def test_interrupt_keeps_only_the_completed_groups(tmp_path, hf_parts, monkeypatch):
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
        convert(hf_parts[0], tmp_path / "out", threads=1)  # one read thread: the 12th read is the last
    assert calls["n"] == 12
    # The globals group is kept in out.partial for --resume (tests/test_convert_resume.py); nothing else.
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out.partial"]


def test_load_rejects_non_checkpoints(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="not a complete dayzero checkpoint"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(ConvertError, match="not a directory"):
        load_checkpoint(tmp_path / "nothing")
    dst = convert(save_hf(small_hf_model("llama"), tmp_path / "hf"), tmp_path / "out")
    import shutil

    shutil.rmtree(dst / "weights" / "layer_001")
    with pytest.raises(ConvertError, match="layer_001"):
        load_checkpoint(dst)

