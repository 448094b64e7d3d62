"""Pipeline parallelism: the stage split, the stacked layout, refusals, and pipelined logits and
generation equal to one device (8 faked devices in a subprocess: ``tests/pipeline_checks.py``;
two processes of one stage each through ``dayzero launch-local``)."""

from __future__ import annotations

import itertools
import json
import subprocess
from dataclasses import replace

import jax
import numpy as np
import pytest

from dayzero.model import pipeline
from dayzero.model.config import MoEConfig
from dayzero.model.parallel import Parallel
from dayzero.model.transformer import forward
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MeshError
from dayzero.sharding.placement import Placement
from dayzero.sharding.stages import balanced_stages
from tests.mesh_checks import run_part
from tests.pipeline_checks import dense_config, dense_first_config


def _largest(layer_bytes, ranges):
    return max(sum(layer_bytes[i] for i in r) for r in ranges)


def _best_by_brute_force(layer_bytes, num_stages):
    n = len(layer_bytes)
    splits = ([0, *cuts, n] for cuts in itertools.combinations(range(1, n), num_stages - 1))
    return min(max(sum(layer_bytes[a:b]) for a, b in zip(s, s[1:])) for s in splits)


def test_balanced_stages_are_contiguous_nonempty_and_optimal():
    # A DeepSeek-like profile: small dense first layers, then big MoE layers.
    profiles = [[1, 1, 1, 10, 10, 10, 10, 10], [5, 0, 0, 7, 3, 3, 9], [4] * 6, [100, 1, 1, 1, 1], [0, 0, 0]]
    for layer_bytes in profiles:
        for s in range(1, len(layer_bytes) + 1):
            ranges = balanced_stages(layer_bytes, s)
            assert len(ranges) == s and all(len(r) > 0 for r in ranges)
            assert [i for r in ranges for i in r] == list(range(len(layer_bytes)))
            assert _largest(layer_bytes, ranges) == _best_by_brute_force(layer_bytes, s), (layer_bytes, s, ranges)
    # The three small layers share a stage with one big one rather than wasting a stage.
    assert balanced_stages([1, 1, 1, 10, 10, 10, 10, 10], 4) == (range(0, 4), range(4, 6), range(6, 7), range(7, 8))


def test_balanced_stages_refuses_more_stages_than_layers():
    with pytest.raises(MeshError, match="stage=5 is more stages than the model's 4 decoder layers"):
        balanced_stages([1, 2, 3, 4], 5)
    with pytest.raises(MeshError, match="at least 1 stage"):
        balanced_stages([1, 2], 0)


def test_plan_pads_short_stages_with_inactive_slots():
    specs = abstract_weights(dense_config())  # five equal layers
    plan = pipeline.plan_stages(specs, 4)
    assert plan.ranges == ((0, 2), (2, 3), (3, 4), (4, 5)) and plan.slots == 2
    assert plan.slot_layers() == ((0, 1), (2, None), (3, None), (4, None))
    assert np.asarray(plan.active()).tolist() == [[True, True], [True, False], [True, False], [True, False]]
    staged = pipeline.staged_specs(specs, plan)
    assert staged.layers.attn.q.shape == (4, 2) + specs.layers[0].attn.q.shape
    assert staged.layers.attn.q.axes == ("stage", None, "embed", "q_heads", "head_dim")
    assert pipeline.bubble_fraction(4, 1) == 0.75 and pipeline.bubble_fraction(4, 5) == 3 / 8
    assert pipeline.micro_batches(6, 4) == 3 and pipeline.micro_batches(1, 4) == 1 and pipeline.micro_batches(8, 8) == 8


def test_dense_first_layers_sit_on_stage_zero():
    """DeepSeek-style dense first layers form a prefix stack on stage 0, which then takes fewer
    MoE layers; the split still minimises the largest stage's bytes under that constraint."""
    specs = abstract_weights(dense_first_config())
    sizes = [pipeline._spec_bytes(layer) for layer in specs.layers]
    assert sizes[0] != sizes[1] and len(set(sizes[1:])) == 1
    for stages in (2, 3, 4, 5):
        plan = pipeline.plan_stages(specs, stages)
        assert plan.prefix == 1 and plan.ranges[0][0] == 0 and plan.ranges[0][1] >= 1
        assert [i for a, b in plan.ranges for i in range(a, b)] == list(range(5))
        largest = max(sum(sizes[a:b]) for a, b in plan.ranges)
        assert largest == _best_by_brute_force(sizes, stages)  # here the constraint costs nothing
    plan = pipeline.plan_stages(specs, 2)
    assert np.asarray(plan.prefix_active()).tolist() == [[True], [False]]
    staged = pipeline.staged_specs(specs, plan)
    assert staged.prefix.mlp.gate.shape[:2] == (2, 1) and staged.layers.mlp.gate.shape[:2] == (2, plan.slots)
    with pytest.raises(MeshError, match="stage=6"):
        pipeline.plan_stages(specs, 6)


@pytest.mark.slow  # ~28 s of compiles; the 8-device tests below cover the same code with real stages
def test_one_stage_pipeline_matches_forward():
    """The pipelined program on a one-device mesh (one stage, micro-batches and padding-free
    slots): the same logits and new keys as ``forward``. The multi-stage schedule is checked on
    8 devices below."""
    config = dense_config()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, config.vocab_size)
    ref, ref_new = forward(weights, config, tokens)
    plan = pipeline.plan_stages(abstract_weights(config), 1)
    par = Parallel(Placement(R.make_mesh({}, jax.devices()[:1]), R.single_device()))
    logits, new = jax.jit(lambda w, t: pipeline.pipeline_forward(w, config, plan, par, t, num_micro=2))(
        pipeline.stage_weights(weights, plan), tokens)
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.k[0, 3], ref_new.k[3], rtol=1e-5, atol=1e-5)


def test_pipeline_refusals_name_the_feature():
    config = dense_config()
    assert pipeline.pipeline_refusal(config, {"tensor": 8}) is None
    assert pipeline.pipeline_refusal(config, {"stage": 2, "tensor": 4}) is None
    assert "more stages than the model's 5 decoder layers" in pipeline.pipeline_refusal(config, {"stage": 8})
    mixed = replace(config, moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32,
                                          layers=(True, False, True, True, True)))
    assert "dense and MoE layers interleaved" in pipeline.pipeline_refusal(mixed, {"stage": 2})
    assert pipeline.pipeline_refusal(dense_first_config(), {"stage": 4, "expert": 2}) is None
    windows = replace(config, sliding_windows=(None, 4, None, 4, None))
    assert "different attention windows" in pipeline.pipeline_refusal(windows, {"stage": 2})
    assert "quantized KV cache" in pipeline.pipeline_refusal(config, {"stage": 2}, kv_quantized=True)


def test_pipelined_generation_matches_one_device():
    """--mesh stage=2,tensor=4 (layers 3 + 2, two prompts as two micro-batches, decoded with both
    in flight) greedy tokens and logprobs equal one device's, also when the decode loop is cut
    into calls of 2 steps; the stacked layers and cache split over stage and tensor."""
    got = run_part("generate", "dense", module="tests.pipeline_checks", fast_compile=True)
    assert got["same_tokens"] and got["logprob_diff"] < 1e-4 and got["decode_compiles"] == 0, got
    assert got["in_flight"] == 2 and got["chunked_same_tokens"], got
    assert got["k_cache_spec"][:4] == ["stage", "None", "None", "tensor"]
    assert got["layer_spec"][:1] == ["stage"] and "tensor" in got["layer_spec"]


@pytest.mark.slow
def test_pipelined_moe_generation_matches_one_device():
    """--mesh stage=4,expert=2 on five Mixtral-style MoE layers (2 + 1 + 1 + 1): the expert-parallel
    dispatch nests its shard_map inside the stage one. Two rows cannot keep four stages busy, so
    each decode step runs through the pipeline on its own."""
    got = run_part("generate", "moe", module="tests.pipeline_checks", fast_compile=True)
    assert got["same_tokens"] and got["logprob_diff"] < 1e-4 and got["decode_compiles"] == 0, got
    assert got["in_flight"] is None, got


@pytest.mark.slow
def test_pipelined_dense_first_generation_matches_one_device():
    """--mesh stage=2,tensor=2,expert=2 on a dense first layer then four MoE layers: the dense one
    runs from stage 0's prefix stack, tensor and expert parallelism within each stage."""
    got = run_part("generate", "dense_first", module="tests.pipeline_checks", fast_compile=True)
    assert got["same_tokens"] and got["logprob_diff"] < 1e-4 and got["decode_compiles"] == 0, got


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "moe"])
def test_decode_with_micro_batches_in_flight(case):
    """pipeline_decode (the last stage's sampled tokens passed round to stage 0, M >= S
    micro-batches in flight across steps) gives a one-device engine's greedy tokens."""
    got = run_part("decode", case, module="tests.pipeline_checks", fast_compile=True)
    for result in got.values():
        assert result["same_tokens"], result


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "moe", "dense_first"])
def test_pipelined_logits_over_micro_batches(case):
    """Logits equal one device's with 1, 2 and 4 micro-batches (all schedules: bubble-only to full)."""
    got = run_part("forward", case, module="tests.pipeline_checks", timeout=600)
    for m in ("m1", "m2", "m4"):
        assert got[m]["err"] < 1e-5, got


@pytest.mark.slow
def test_two_processes_one_stage_each(hf_factory, tmp_path, capsys):
    """launch-local: 2 processes x 4 devices, --mesh stage=2,tensor=4 puts one stage on each
    process (stage varies slowest); tokens equal one device's."""
    from dayzero.engine.cli import main
    from tests.test_multihost import ROOT, _dayzero

    model = hf_factory.build("llama", seed=4, num_attention_heads=8, num_key_value_heads=8)
    _, model_dir = hf_factory.save_and_convert(model, tmp_path)
    args = ["generate", "--model", str(model_dir), "--prompt-ids", "3,1,4,1,5,9,2,6", "--max-new-tokens", "6",
            "--json", "--logprobs"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    cmd = _dayzero("launch-local", "--processes", 2, "--devices-per-process", 4, "--", *args, "--mesh",
                   "stage=2,tensor=4")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    assert two["token_ids"] == one["token_ids"]
    assert max(abs(a - b) for a, b in zip(two["logprobs"], one["logprobs"])) < 1e-5
