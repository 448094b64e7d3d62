"""DeepSeek-V4 on a mesh of 8 faked CPU devices: the same logits and greedy tokens as one device.

Layout (the weights' logical axes): query heads, sinks and o_a's output groups split over
``tensor`` (o_b's g*d_g input with them); the one key=value head, the compressors, the indexer and
the hyper-connection mixes whole on every device; experts over ``expert`` (hash-routed layers'
token ids travel through the expert-parallel dispatch, their table ``tid2eid`` whole on every
device). The contiguous cache: rows over ``data``; window rings and compressor states never split
otherwise; entries and index keys split over their positions (``latent_seq``), never over their
channels.

Default suite: the mesh refusal (device-free) and the CSA attention block through its cache on
data=4 x tensor=2 (~15 s here, its own subprocess). Slow (~3.5 min here, one subprocess): the tiny HF
model of tests/v4_helpers.py (seed 5, converted) on tensor=2 x expert=4 and data=4 x tensor=2,
``Engine.generate`` over four ragged prompts and the all-position logits of each prompt with its
greedy tokens. data=2 x tensor=4 is refused for that model (tensor=4 does not divide its 2 output
groups); ``test_refusal`` checks that.
"""

from __future__ import annotations

import json

import pytest

from dayzero.model.hf_config import parse_hf_config
from dayzero.model.mesh_check import mesh_refusal
from dayzero.model.presets import load_preset
from tests.v4_mesh_checks import run_part
from tests.v4_helpers import tiny_hf_config, tiny_hf_model

FP32_ROUNDING = 1e-5  # relative: same maths, different summation order across shards
MESHES = ["tp2ep4", "dp4tp2"]


@pytest.fixture(scope="module")
def config():
    return parse_hf_config(tiny_hf_config().to_dict())


@pytest.mark.parametrize("axes, refused", [
    ({"data": 2, "tensor": 4}, True), ({"tensor": 8}, True), ({"tensor": 2, "expert": 4}, False),
    ({"data": 4, "tensor": 2}, False), ({"expert": 8}, False), ({"data": 8}, False),
])
def test_refusal(config, axes, refused):
    """A tensor size that does not divide the 2 output groups (4 heads) is refused in one line
    naming both sizes; the others run."""
    reason = mesh_refusal(config, axes)
    if not refused:
        assert reason is None
        return
    assert reason is not None and "\n" not in reason
    assert f"tensor={axes['tensor']}" in reason and "2 output groups" in reason and "4 query heads" in reason


@pytest.mark.parametrize("name, tensor, ok", [("deepseek-v4-flash", 8, True), ("deepseek-v4-pro", 16, True),
                                              ("deepseek-v4-flash", 16, False)])
def test_refusal_of_published_configs(name, tensor, ok):
    """V4-Flash's 8 output groups split over tensor=8, not 16; V4-Pro's 16 over tensor=16."""
    assert (mesh_refusal(load_preset(name), {"tensor": tensor}) is None) == ok


@pytest.mark.slow  # a 17 s subprocess on 8 faked devices (CI suite time); the whole-model mesh tests are slow too
def test_attention_block_on_mesh_matches_one_device(config):
    """The CSA block (indexer, compressor, window ring) through its cache on data=4 x tensor=2,
    a ragged chunk then another reading what the first wrote: one device's outputs."""
    out = run_part("deepseek_v4_attention", json.dumps(config.to_json()), fast_compile=True)
    assert out["dp4tp2"]["err"] < FP32_ROUNDING
    assert out["dp4tp2"]["entries_spec"][0] == "data" and out["dp4tp2"]["entries_spec"][2] == "None"


@pytest.fixture(scope="module")
def v4(hf_factory, tmp_path_factory):
    """The whole-model mesh results (tests/v4_mesh_checks.py ``part_deepseek_v4``) of the converted
    tiny model."""
    _, dz = hf_factory.save_and_convert(tiny_hf_model(5), tmp_path_factory.mktemp("v4_mesh"))
    return run_part("deepseek_v4", str(dz), timeout=1200, fast_compile=True)


@pytest.mark.slow
def test_choices_are_not_ties(v4):
    """The one-device run's routers (top-k layers) and indexers choose with clear margins over
    every real token (else the comparisons below would test rounding)."""
    assert v4["gaps"]["router"] > 1e-4 and v4["gaps"]["indexer"] > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_logits_match_one_device(v4, mesh):
    assert v4[mesh]["err"] < FP32_ROUNDING


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_generation_matches_one_device(v4, mesh):
    """Greedy tokens equal and logprobs to fp32 rounding; no compile after the first decode step."""
    assert v4[mesh]["same_tokens"] and v4[mesh]["logprob_diff"] < FP32_ROUNDING
    assert v4[mesh]["decode_compiles"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_serving_matches_one_device(v4, mesh):
    """The paged serving engine on the mesh (entry pages and slot states laid out by their
    logical axes; data=4 serves four replicas): one device's greedy tokens, logprobs to fp32
    rounding."""
    assert v4[mesh]["served"] and v4[mesh]["served_logprob_diff"] < FP32_ROUNDING


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_layout(v4, mesh):
    """o_a's groups over tensor, the key=value projection whole; the cache's rows over data only,
    window ring and compressor state whole otherwise, entries and index keys never split over their
    channels; no decode step gathers the hash layers' [256, 2] token table."""
    out, batch = v4[mesh], "data" if mesh.startswith("dp") else "None"
    assert out["o_a_spec"] == ["tensor", "None", "None"] and out["kv_spec"] == ["None", "None"]
    cache = out["cache"]
    assert cache["window"] == cache["state"] == [batch, "None", "None"] and cache["lengths"] == [batch]
    for name in ("entries", "index_keys"):
        assert cache[name][0] == batch and cache[name][2] == "None"
    assert not any(shape.startswith("s32[256,2]") for shape in out["decode_all_gathers"])
