"""Image prompts on meshes of faked CPU devices (tests/vision_mesh_checks.py, in a fresh
interpreter): the converted tiny Qwen3-VL-MoE on tensor=2 x expert=4 and on data=4 x tensor=2
(four serving replicas) gives one device's greedy tokens, logprobs to fp32 rounding, through
``Engine.generate`` and through the serving engine, for an image prompt beside a text prompt."""

from __future__ import annotations

import pytest

from tests.test_vision_dispatch import TOKENS
from tests.test_vision_convert import qwen3vl_case
from tests.vision_mesh_checks import MESHES, run_part

FP32_ROUNDING = 1e-4


@pytest.fixture(scope="module")
def results(hf_factory, tmp_path_factory):
    case = qwen3vl_case(hf_factory, tmp_path_factory, **TOKENS)
    return run_part("vision", str(case.dz_dir), timeout=900, fast_compile=True)


@pytest.mark.slow  # a ~1 min subprocess on 8 faked devices
@pytest.mark.parametrize("mesh", list(MESHES))
def test_image_prompts_on_a_mesh_match_one_device(results, mesh):
    assert results["ref_served_same"]
    got = results[mesh]
    assert got["same_tokens"] and got["logprob_diff"] < FP32_ROUNDING
    assert got["served_same_tokens"] and got["served_logprob_diff"] < FP32_ROUNDING
