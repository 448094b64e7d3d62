"""Checkpoints across meshes (8 faked CPU devices): converted on one device and loaded into
tensor=8, converted for data=2 x tensor=4 and loaded on one device -- same values, same logits.
Also the CLI on a mesh: ``generate --mesh`` and ``verify --mesh`` on these checkpoints."""

from __future__ import annotations

import pytest

from tests.mesh_checks import run_part


@pytest.fixture(scope="module")
def result(hf_factory, tmp_path_factory):
    model = hf_factory.build("llama", seed=2, num_attention_heads=8, num_key_value_heads=4)
    root = tmp_path_factory.mktemp("mesh_checkpoint")
    hf_dir, one_device_dir = hf_factory.save_and_convert(model, root)
    out = run_part("checkpoint", hf_dir, one_device_dir, root / "for_mesh")
    out["dirs"] = (one_device_dir, root / "for_mesh")
    return out


def test_one_device_conversion_loads_into_tensor_parallel(result):
    assert result["tp8_q_spec"] == ["None", "tensor", "None"]
    assert result["tp8_same_values"]
    assert result["tp8_err"] < 1e-5  # fp32 summation order across shards


def test_mesh_conversion_is_laid_out_for_its_mesh(result):
    assert result["mesh"] == {"data": 2, "tensor": 4, "expert": 1, "stage": 1} and result["rules"] == "data_tensor"
    assert result["gate_spec"] == [None, "tensor"]
    # gate [64, 128] split 4 ways over tensor: chunks are (sub-divisions of) the [64, 32] shards.
    rows, cols = result["gate_chunks"]
    assert cols == 32 and 64 % rows == 0


def test_mesh_conversion_loads_on_one_device(result):
    assert len(result["one_device_devices"]) == 1
    assert result["same_values"] and result["same_logits"]
    assert result["verified_leaves"] == 21  # every leaf's bytes match the manifest checksums


def test_cli_generate_and_verify_on_a_mesh(result):
    cli = result["cli"]
    assert cli["generate_rc"] == 0 and cli["same_tokens"] and cli["logprob_diff"] < 1e-5
    assert cli["verify_rc"] == 0 and cli["verify_passed"]  # against HF, with the model on tensor=8


def test_mesh_conversion_loads_in_a_one_device_process(result):
    # This process has one device; the checkpoint records the 8-device topology it was saved from.
    import numpy as np

    from dayzero.convert import load_checkpoint, verify_checkpoint
    from dayzero.model.weights import named_leaves

    one_device_dir, mesh_dir = result["dirs"]
    assert verify_checkpoint(mesh_dir) == 21
    want = named_leaves(load_checkpoint(one_device_dir)[1])
    got = named_leaves(load_checkpoint(mesh_dir)[1])
    assert all(np.array_equal(np.asarray(want[k]), np.asarray(got[k])) for k in want)
