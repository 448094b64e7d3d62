"""The engine on a mesh of 8 faked CPU devices: same tokens, logprobs and logits as one device.

Dense: tensor=8 and data=2 x tensor=4 generation; multi-head latent attention on tensor=8 with its
latent cache split over positions (never gathered). MoE (8 experts, top-2): expert=8 and
tensor=2 x expert=4 logits through the expert-parallel dispatch, each device holding and
computing only its own experts, generation on expert=8, and the capacity policy. GLM-4.5's blocks
(q/k/v biases, q/k norms, partial RoPE, DeepSeek-V3 routing with shared experts; slow: its own
subprocess, ~75 s here): logits and generation on tensor=2 x expert=4. MiniMax-M2's blocks (q/k
norms over all heads, split over tensor; slow, likewise): logits on data=2 x tensor=4 and
tensor=2 x expert=4, generation on data=2 x tensor=4 (the cheap one-block norm check is in
test_minimax_m2.py). Every mesh
engine: no compilation during decode steps after the first. The checks run in one subprocess per
model (``tests/mesh_checks.py``), since the device count is fixed when jax starts.
"""

from __future__ import annotations

import pytest

from tests.mesh_checks import run_part

FP32_ROUNDING = 1e-5  # relative: same maths, different summation order across shards


@pytest.fixture(scope="module")
def dense():
    return run_part("dense")


@pytest.fixture(scope="module")
def moe():
    return run_part("moe")


@pytest.fixture(scope="module")
def glm():
    return run_part("glm", fast_compile=True)


@pytest.fixture(scope="module")
def minimax():
    return run_part("minimax", fast_compile=True)


def _moe_case(request, name: str) -> dict:
    """The results of ``name``: a mesh of the 8-expert model, or "glm/<mesh>" ("minimax/<mesh>")
    of the GLM (MiniMax-M2) model."""
    model, _, mesh = name.rpartition("/")
    return request.getfixturevalue(model)[mesh] if model else request.getfixturevalue("moe")[mesh]


@pytest.mark.parametrize("mesh", ["tp8", "dp2tp4"])
def test_dense_generation_matches_one_device(dense, mesh):
    assert dense["devices"] == 8
    assert dense[mesh]["same_tokens"]
    assert dense[mesh]["logprob_diff"] < 1e-5


@pytest.mark.parametrize("mesh", ["tp8", "dp2tp4"])
def test_decode_steps_do_not_recompile(dense, mesh):
    assert dense[mesh]["decode_compiles"] == 0


def test_kv_cache_is_laid_out_by_its_logical_axes(dense):
    assert dense["tp8"]["k_cache_spec"] == ["None", "tensor", "None", "None"]
    assert dense["dp2tp4"]["k_cache_spec"] == ["data", "tensor", "None", "None"]


# The test models' router margins (no ties): fixed seeds, checked with -m slow (suite time).
@pytest.mark.slow
@pytest.mark.parametrize("model", ["moe", pytest.param("glm", marks=pytest.mark.slow),
                                   pytest.param("minimax", marks=pytest.mark.slow)])
def test_moe_router_has_clear_choices(request, model):
    # A near-tie would be decided by rounding and test nothing about the dispatch.
    assert request.getfixturevalue(model)["router_gap"] > 1e-4


@pytest.mark.parametrize("mesh", ["ep8", "tp2ep4", pytest.param("glm/tp2ep4", marks=pytest.mark.slow),
                                  pytest.param("minimax/dp2tp4", marks=pytest.mark.slow),
                                  pytest.param("minimax/tp2ep4", marks=pytest.mark.slow)])
def test_expert_parallel_logits_match_one_device(request, mesh):
    assert _moe_case(request, mesh)["err"] < FP32_ROUNDING


def test_each_device_holds_and_computes_only_its_experts(moe):
    local = moe["local"]
    assert local["shard_maps"] == 2 and local["all_to_all"]  # one dispatch per MoE layer
    tokens, valid, router, gate, up, down = local["arg_shapes"]
    assert tokens == [16, 64] and valid == [16]  # 64 tokens split over expert=4
    assert router == [64, 8]  # every device routes with the whole router
    # 8 experts over expert=4, their width 32 over tensor=2: 2 experts of width 16 per device.
    assert gate == up == [2, 64, 16] and down == [2, 16, 64]


@pytest.mark.parametrize("mesh", ["ep8", pytest.param("glm/tp2ep4", marks=pytest.mark.slow),
                                  pytest.param("minimax/dp2tp4", marks=pytest.mark.slow)])
def test_expert_parallel_generation_matches_one_device(request, mesh):
    gen = _moe_case(request, mesh)["generate"]
    assert gen["same_tokens"] and gen["logprob_diff"] < 1e-5
    assert gen["decode_compiles"] == 0


def test_small_capacity_drops_pairs(moe):
    # capacity_factor 0.25 leaves less room than the busiest destination needs: the dropped pairs
    # change the output (the default, no-drop capacity matched above).
    assert moe["ep8"]["tight_err"] > 1e-2


def test_latent_attention_generation_matches_one_device(dense):
    mla = dense["mla_tp8"]
    assert mla["same_tokens"] and mla["logprob_diff"] < 1e-5
    assert mla["decode_compiles"] == 0


def test_latent_cache_stays_split_over_its_positions(dense):
    mla = dense["mla_tp8"]
    assert mla["latent_spec"] == ["None", "tensor", "None"]
    # Each device attends over its own cache rows: a decode step gathers queries and per-row
    # sampling results, never a layer's [2, 256, 40] cache.
    assert mla["decode_all_gathers"], "expected some all-gather (the queries) in the decode step"
    assert not any("256" in shape for shape in mla["decode_all_gathers"]), mla["decode_all_gathers"]
