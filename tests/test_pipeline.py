"""Pipeline parallelism: the stage split, the stacked layout, refusals, and pipelined logits and
generation equal to one device (8 faked devices in a subprocess: ``tests/pipeline_checks.py``;
two processes of one stage each through ``dayzero launch-local``)."""

from __future__ import annotations

import itertools
import json
import subprocess
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.model import pipeline
from dayzero.model.cache import NewKV, NewLatent, append_to_cache, cache_specs, empty_from_specs, init_cache
from dayzero.model.config import MoEConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import QuantConfig, QuantizedArray, WeightQuant, stored_bytes
from dayzero.model.parallel import Parallel
from dayzero.model.transformer import attention_masks, forward
from dayzero.model.weights import abstract_weights, init_weights, quantize_weights
from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MeshError
from dayzero.sharding.placement import Placement
from dayzero.sharding.stages import balanced_stages
from tests.mesh_checks import run_part
from tests.pipeline_checks import dense_config, dense_first_config, latent_config
from tests.serving_models import DSA


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
    np.testing.assert_allclose(new.rows[0][0, 3], ref_new.k[3], rtol=1e-5, atol=1e-5)


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
    assert pipeline.pipeline_refusal(windows, {"stage": 2}) is None  # each slot picks its window's masks
    assert pipeline.pipeline_refusal(config, {"stage": 2}, kv_quantized=True) is None
    assert pipeline.pipeline_refusal(config, {"stage": 2}, quantized=True) is None
    assert pipeline.pipeline_refusal(latent_config(), {"stage": 2, "tensor": 2, "expert": 2}) is None
    sparse = parse_hf_config(dict(DSA, num_hidden_layers=4))
    assert pipeline.pipeline_refusal(sparse, {"stage": 2}) == (
        "--mesh stage=2 (pipeline parallelism) does not support DeepSeek sparse attention (DeepSeek-V3.2's indexer) "
        "yet; drop the stage axis and use tensor/expert/data parallelism")


def test_quantized_plan_counts_stored_bytes():
    """The plan balances the bytes the quantized layers hold: values and scales at their stored
    dtypes, int4 experts at half a byte (as ``quant.stored_bytes`` counts the arrays)."""
    config = dense_first_config()
    weights = jax.eval_shape(lambda: init_weights(abstract_weights(config), jax.random.key(0)))
    for name in ("int8", "fp8-block", "int4"):
        specs = abstract_weights(config, QuantConfig(WeightQuant(name)))
        layers = jax.eval_shape(lambda w: quantize_weights(w, specs), weights).layers  # shapes and dtypes only
        assert [pipeline._spec_bytes(s) for s in specs.layers] == [stored_bytes(w) for w in layers], name
    int4 = abstract_weights(config, QuantConfig(WeightQuant.INT4))
    assert pipeline._spec_bytes(int4.layers[1]) < pipeline._spec_bytes(abstract_weights(config).layers[1]) / 4


def test_quantized_layers_stack_values_and_scales():
    """A quantized leaf's values and scales both take the [S, slots] lead and the stage axis; its
    layout metadata keeps describing one layer, which the stage body computes with."""
    config = dense_config()
    specs = abstract_weights(config, QuantConfig(WeightQuant.FP8_BLOCK))
    plan = pipeline.plan_stages(specs, 2)
    q = pipeline.staged_specs(specs, plan).layers.attn.q
    one = specs.layers[0].attn.q
    assert isinstance(q, QuantizedArray) and (q.in_axes, q.block) == (one.in_axes, one.block)
    assert q.values.shape == (2, plan.slots) + one.values.shape and q.values.axes[:2] == ("stage", None)
    assert q.scale.shape == (2, plan.slots) + one.scale.shape and q.scale.axes[:2] == ("stage", None)
    weights = quantize_weights(init_weights(abstract_weights(config), jax.random.key(0), scale=0.1), specs)
    staged = pipeline.stage_weights(weights, plan)
    assert staged.layers.attn.q.values.dtype == one.values.dtype
    np.testing.assert_array_equal(staged.layers.attn.q.scale[1, 0], weights.layers[3].attn.q.scale)


def test_staged_cache_is_the_layer_cache_stacked():
    """The staged caches stack one layer's cache tuple as ``cache_specs`` / ``paged_cache_specs``
    declare it: keys and values, or MLA's latent rows (split over tensor by ``latent_seq``)."""
    from dayzero.model.pipeline_paged import staged_paged_specs

    for config in (dense_config(), latent_config()):
        plan = pipeline.plan_stages(abstract_weights(config), 2)
        lead = (2, plan.prefix + plan.slots)
        staged = pipeline.staged_cache_specs(config, plan, 3, 24)
        flat = cache_specs(config, 3, 24).layer(0)
        assert [s.shape for s in staged.buffers] == [lead + s.shape for s in flat]
        assert [s.axes for s in staged.buffers] == [("stage", None) + s.axes for s in flat]
        assert staged.max_len == 24 and staged.latent == (config.mla is not None)
        pages = staged_paged_specs(config, plan, num_pages=6, page_size=4)
        assert len(pages.pages) == len(flat) and pages.page_size == 4 and pages.latent == staged.latent
    latent = latent_config()
    assert [s.shape for s in staged.buffers] == [lead + (3, 24, latent.mla.kv_lora_rank + latent.mla.rope_dim)]
    assert pages.pages[0].shape == lead + (6, 4, latent.mla.kv_lora_rank + latent.mla.rope_dim)


def test_staged_writes_equal_per_layer_writes():
    """append_staged and append_staged_pages put each stage slot's rows where the flat caches'
    writes put that layer's (the prefix slot first), for keys/values and for latent rows."""
    from dayzero.model.paged_cache import append_to_pages, init_paged_cache
    from dayzero.model.pipeline_paged import StagedPagedCache, append_staged_pages, staged_paged_specs

    rng = np.random.default_rng(0)
    for config in (dense_config(), latent_config()):
        plan = pipeline.plan_stages(abstract_weights(config), 2)
        S, Pn = 2, plan.prefix + plan.slots
        lengths, num_new = np.array([3, 0], np.int32), np.array([3, 2], np.int32)
        dims = pipeline._row_dims(config)
        rows = tuple(rng.standard_normal((S, Pn, 2, 3) + d).astype(np.float32) for d in dims)
        new = pipeline.StagedNewKV(rows=rows, num_new=num_new, rope_len=np.int32(6))
        # Layer i of the flat caches gets the rows of the slot it sits in (padding slots: none).
        slots = [(s, j) for s in range(S) for j, i in enumerate(plan.prefix_layers()[s] + plan.slot_layers()[s])
                 if i is not None]
        per_layer = [tuple(r[s, j] for s, j in slots) for r in rows]
        flat_new = (NewLatent(latent=per_layer[0], num_new=num_new, rope_len=np.int32(6)) if config.mla else
                    NewKV(k=per_layer[0], v=per_layer[1], num_new=num_new, rope_len=np.int32(6)))
        empty = empty_from_specs(pipeline.staged_cache_specs, config, plan, 2, 8, jnp.float32)
        staged = jax.jit(pipeline.append_staged)(empty.replace(lengths=lengths), new)
        flat = append_to_cache(init_cache(config, 2, 8).replace(lengths=lengths), flat_new)
        for i, (s, j) in enumerate(slots):
            for got, want in zip(staged.buffers, flat.layer(i)):
                np.testing.assert_array_equal(got[s, j], want)
        tables = np.array([[4, 1, 0], [2, 5, 3]], np.int32)
        pool = init_paged_cache(config, 6, 4, batch=2, table_width=3).replace(block_tables=tables, lengths=lengths)
        flat_pages = append_to_pages(pool, flat_new)
        staged_pool = empty_from_specs(staged_paged_specs, config, plan, 6, 4, 2, 3, jnp.float32)
        staged_pool = jax.jit(append_staged_pages)(staged_pool.replace(block_tables=tables, lengths=lengths), new)
        assert isinstance(staged_pool, StagedPagedCache) and np.asarray(staged_pool.lengths).tolist() == [6, 2]
        for i, (s, j) in enumerate(slots):
            want = flat_pages.latent_pages[i:i + 1] if config.mla else (flat_pages.k_pages[i], flat_pages.v_pages[i])
            for got, w in zip(staged_pool.pages, want):
                np.testing.assert_array_equal(got[s, j], w)


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


@pytest.mark.slow  # ~25 s (suite time); quantized weights in a pipeline also run in test_pipeline_serving.py -m slow
def test_pipelined_quantized_logits_match_one_device():
    """int8 and fp8-block weights (every projection, the routed experts inside the nested
    expert-parallel block too) on stage=2,tensor=2,expert=2: pipelined logits equal the same
    quantized model's on one device, which differ from the float model's (quantization ran)."""
    got = run_part("quantized", "dense_first", module="tests.pipeline_checks", fast_compile=True)
    for name in ("int8", "fp8-block"):
        assert got[name]["err"] < 1e-5 and got[name]["vs_float"] > 1e-3, got


@pytest.mark.slow
def test_pipelined_fp8_and_int4_logits_match_one_device():
    got = run_part("quantized", "dense_first", "fp8,int4", module="tests.pipeline_checks", fast_compile=True)
    for name in ("fp8", "int4"):
        assert got[name]["err"] < 1e-5 and got[name]["vs_float"] > 1e-3, got


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "fp8-block"])
def test_pipelined_quantized_generation_matches_one_device(fmt):
    """The engine's own path (runtime check, block scales aligned to the mesh, staged quantized
    leaves): the tokens the same quantized weights generate on one device."""
    got = run_part("quantized_generate", "dense_first", fmt, module="tests.pipeline_checks", fast_compile=True)
    assert got["same_tokens"] and got["logprob_diff"] < 1e-4 and got["decode_compiles"] == 0, got
    assert got["quantize"] == fmt and got["staged_experts"] == "QuantizedArray", got


def test_pipelined_latent_serving_matches_one_device():
    """DeepSeek-V3-like (MLA, a dense first layer then MoE) served on stage=2,tensor=2,expert=2:
    latent page pools by stage, read through block tables inside the stages, prefill chunks and
    decode steps cut into micro-batches; the tokens and logprobs one device serves."""
    served = run_part("serve", "latent", module="tests.pipeline_checks", fast_compile=True)
    assert served["same_tokens"] and served["logprob_diff"] < 1e-4, served


@pytest.mark.slow
def test_pipelined_latent_generation_matches_one_device():
    """The same model generating greedily through ``Engine`` (contiguous latent rows by stage,
    split over tensor by ``latent_seq`` and read by the split latent attention nested in the
    stage; decode with two micro-batches in flight, also cut into calls of 2 steps)."""
    generated = run_part("generate", "latent", module="tests.pipeline_checks", fast_compile=True)
    assert generated["same_tokens"] and generated["logprob_diff"] < 1e-4, generated
    assert generated["decode_compiles"] == 0 and generated["in_flight"] == 2 and generated["chunked_same_tokens"]
    assert generated["k_cache_spec"][:4] == ["stage", "None", "None", "tensor"], generated  # latent_seq split


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "moe", "latent"])
def test_decode_with_micro_batches_in_flight(case):
    """pipeline_decode (the last stage's sampled tokens passed round to stage 0, M >= S
    micro-batches in flight across steps) gives a one-device engine's greedy tokens."""
    got = run_part("decode", case, module="tests.pipeline_checks", fast_compile=True)
    for result in got.values():
        assert result["same_tokens"], result


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "moe", "dense_first", "latent"])
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


@pytest.mark.slow
def test_deepseek_v3_checkpoint_generates_pipelined_and_quantized(hf_factory, tmp_path, capsys):
    """A converted DeepSeek-V3 checkpoint (YaRN, grouped routing, a shared expert) loaded straight
    into stages (each layer read and quantized on its stage's devices) with --quantize int8 on
    --mesh stage=2,tensor=2,expert=2: the tokens and logprobs of the same run on one device."""
    import os
    import sys

    from dayzero.engine.cli import main
    from tests.mesh_checks import ROOT
    from tests.test_deepseek import build_hf_deepseek

    model = build_hf_deepseek("q_lora", 9, num_hidden_layers=4)
    _, model_dir = hf_factory.save_and_convert(model, tmp_path)
    args = ["generate", "--model", str(model_dir), "--prompt-ids", "3,1,4,1,5,9,2,6", "--max-new-tokens", "6",
            "--json", "--logprobs", "--quantize", "int8"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "dayzero.engine.cli", *args, "--mesh", "stage=2,tensor=2,expert=2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    staged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert staged["run"]["quantize"] == "int8" and staged["run"]["mesh"] == {"stage": 2, "tensor": 2, "expert": 2}
    assert staged["token_ids"] == one["token_ids"]
    assert max(abs(a - b) for a, b in zip(staged["logprobs"], one["logprobs"])) < 1e-4


def test_each_stage_slot_attends_with_its_layers_window():
    """Layers with different windows share a stack: each slot's kind indexes its layer's window
    (padding slots 0), and the masks it picks are that window's."""
    config = replace(dense_config(), sliding_windows=(None, 4, None, 4, 8))
    plan = pipeline.plan_stages(abstract_weights(config), 2)  # layers 0-2 | 3-4 (a padding slot)
    assert pipeline._windows(config) == (None, 4, 8)
    kinds = np.asarray(pipeline._window_kinds(config, plan.slot_layers()))
    assert plan.slot_layers() == ((0, 1, 2), (3, 4, None)) and kinds.tolist() == [[0, 1, 0], [1, 2, 0]]
    starts, num_new = np.array([5, 9]), np.array([3, 1])
    windows = [attention_masks(starts, num_new, 3, 16, w) for w in pipeline._windows(config)]
    for kind, window in enumerate(pipeline._windows(config)):
        want = attention_masks(starts, num_new, 3, 16, window)
        got = pipeline._pick_masks(windows, jnp.int32(kind))
        assert all(np.array_equal(g, w) for g, w in zip(got, want))

