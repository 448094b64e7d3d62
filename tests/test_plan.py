"""The deployment planner: presets, storage vocabulary, per-device arithmetic (weights, scales,
cache, both steps' peaks, collectives), the engine's refusals, mesh choice and the CLI.

The planner's activation figures against XLA's compiled steps are checked by the validation
tools (``dayzero.tools.plan_check``, ``bench/plan_vs_xla.py``) and their tests; per-sequence
states (a hybrid's state rows, state snapshots) and DeepSeek-V4's pool and steps by
tests/test_plan_states.py, which imports this file's models and workloads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from tests.test_cli import _run  # the in-process CLI runner (exit status, stdout, stderr)
from dayzero.engine.runtime import RunConfigError, check_placement, resolve_run
from dayzero.model.config import Family, ModelConfig, MoEConfig, RopeConfig
from dayzero.model.footprint import DecodeFootprint, storage
from dayzero.model.hf_config import load_hf_config, parse_hf_config
from dayzero.model.presets import PRESETS, load_preset, preset_hf_config
from dayzero.model.quant import QuantError
from dayzero.sharding.planner import (
    Component, PlanError, Stage, Tensor, Workload, device_bytes, evaluate, parse_size, plan, spans_hosts,
)
from dayzero.sharding.placement import rules_for_mesh

GiB = 1 << 30


# ---- presets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, published", [
    ("deepseek-v3", 671e9),  # DeepSeek-V3's 671B (the 14B multi-token-prediction module is not decoded)
    ("kimi-k2", 1.03e12),  # Kimi-K2's ~1.03T
    ("frontier-3t-1m", 3.0e12),  # designed here to 3T
])
def test_preset_parameter_counts_match_the_published_totals(name, published):
    count = DecodeFootprint(load_preset(name), name).parameters
    assert abs(count / published - 1) < 0.01, count


def test_presets_parse_exactly_as_their_config_json_would(tmp_path):
    for name in PRESETS:
        (tmp_path / "config.json").write_text(json.dumps(preset_hf_config(name)))
        assert load_hf_config(tmp_path) == load_preset(name)
    c = load_preset("frontier-3t-1m")
    assert c.max_position_embeddings == 1 << 20 and c.dsa is not None and c.moe.num_experts == 512
    assert load_preset("kimi-k2").moe.layers[:2] == (False, True)


# ---- models and workloads -----------------------------------------------------------------------


def _llama(**changes) -> ModelConfig:
    config = ModelConfig(
        family=Family.LLAMA, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=8, num_kv_heads=8, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64,
        rope=RopeConfig(),
    )
    return dataclasses.replace(config, **changes)


# Widths that make whole and partial 128 x 128 blocks: D = 256 (two blocks), F = 384 (three).
SCALED = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=1, num_heads=4, num_kv_heads=2,
              head_dim=64, sliding_windows=(None,))


def _moe_llama(**changes) -> ModelConfig:
    """Two layers, the second a MoE of 4 experts (2 per token, width 32)."""
    moe = MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=32, layers=(False, True))
    return _llama(moe=moe, **changes)


def _work(**changes) -> Workload:
    return dataclasses.replace(Workload(devices=4, device_memory=GiB, batch=2, context=32), **changes)


def _latent(**changes) -> ModelConfig:
    raw = {"model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "num_attention_heads": 8, "kv_lora_rank": 32, "q_lora_rank": 32,
           "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 1 << 16}
    return parse_hf_config({**raw, **changes})


# ---- the storage vocabulary ---------------------------------------------------------------------


def test_every_engine_spelling_plans():
    footprint = DecodeFootprint(_llama())
    for quantize in ("none", "int8", "fp8", "fp8-block", "int4"):
        for kv_cache in ("none", "int8", "fp8"):
            for dtype in ("bfloat16", "float32"):
                p = evaluate(footprint, _work(quantize=quantize, kv_cache=kv_cache, dtype=dtype), {"tensor": 4})
                assert p.runs and p.total > 0
                assert (p.bytes["weight_scales"] > 0) == (quantize != "none")
                assert (p.bytes["kv_scales"] > 0) == (kv_cache != "none")


@pytest.mark.parametrize("argv, fragments", [
    (["--quantize", "float8"], ["weight quantization 'float8' is not a known scheme", "fp8-block"]),
    (["--quantize", "auto"], ["--quantize auto is chosen by the platform at run time", "none on GPU",
                              "int8, fp8, fp8-block, int4"]),
    (["--kv-cache", "auto"], ["--kv-cache auto is chosen by the platform", "one of none, int8, fp8"]),
    (["--kv-cache", "bfloat16"], ["KV-cache quantization 'bfloat16' is not a known scheme"]),
    (["--dtype", "float16"], ["dtype 'float16' is not planned; use one of bfloat16, float32"]),
    (["--kernels", "fast"], ["--kernels 'fast' is not a mode", "pallas"]),
])
def test_storage_spellings_outside_the_engines_are_refused_in_one_sentence(argv, fragments, capsys):
    rc, out, err = _run(["plan", "--preset", "kimi-k2", "--devices", 64, "--device-memory", "80GiB", *argv], capsys)
    assert rc == 2 and "Traceback" not in err
    line = err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("dayzero: error:"), err
    for fragment in fragments:
        assert fragment in line, line


def test_auto_is_refused_through_the_python_api_too():
    with pytest.raises(QuantError, match="auto is chosen by the platform"):
        storage(_work(quantize="auto"))


# ---- per-device bytes ------------------------------------------------------------------------------


def test_per_device_bytes_equal_a_hand_computation():
    """tensor=4, bf16 weights and KV, batch 2, 32 positions (sizes written out by hand)."""
    p = evaluate(DecodeFootprint(_llama()), _work(), {"tensor": 4})
    head = 256 // 4 * 64 * 2  # embed [V,D] and lm_head [D,V]: the vocabulary split 4 ways
    attention = 4 * (64 * 8 // 4 * 8 * 2)  # q, k, v [D,N,H] and o [N,H,D]: heads split
    mlp = 3 * (64 * 128 // 4 * 2)  # gate, up [D,F], down [F,D]: width split
    norms = 2 * 64 * 2
    assert p.bytes["weights"] == 2 * head + 64 * 2 + 2 * (attention + mlp + norms)
    # The serving pools: 2 layers x k and v [K, P, 16, H], kv heads split, P = 2 rows x 2 pages of
    # 16 (block tables and lengths are per-step host inputs: not counted).
    kv = 2 * 2 * (8 // 4 * (2 * 2) * 16 * 8 * 2)
    assert p.bytes["kv_cache"] == kv
    assert p.bytes["weight_scales"] == p.bytes["kv_scales"] == 0


def test_weight_scale_bytes_equal_the_declared_scales_counted_by_hand():
    """One layer, D=256, F=384, 4 heads and 2 kv heads of 64. fp8-block (128 x 128 blocks): on
    one device q [256 in, 256 out] has 2 x 2 scales, k and v [256, 128] 2 x 1, o 2 x 2, gate/up
    [256, 384] 2 x 3, down [384, 256] 3 x 2. On tensor=2 the engine re-blocks where a shard starts
    inside a block (weights.mesh_aligned_specs): k/v's 128 outputs split into 64 -> blocks of 64,
    2 x 2 scales, one column each; F's 192-wide shards -> blocks of 64, 2 x 6 (6 x 2) scales, half
    each; q's and o's shards are whole blocks, half of their scales each."""
    footprint = DecodeFootprint(_llama(**SCALED))
    one = evaluate(footprint, _work(quantize="fp8-block", devices=1), {})
    assert one.bytes["weight_scales"] == (4 + 2 + 2 + 4 + 6 + 6 + 6) * 4
    two = evaluate(footprint, _work(quantize="fp8-block", devices=2), {"tensor": 2})
    assert two.bytes["weight_scales"] == (2 + 2 + 2 + 2 + 6 + 6 + 6) * 4
    # Values: one byte per projection weight; embedding, head and norms stay bfloat16.
    projections = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 384
    assert one.bytes["weights"] == projections + (2 * 512 * 256 + 3 * 256) * 2
    # int8, one scale per output channel: q [1,4,64], k/v [1,2,64], o [1,1,256], gate/up [1,384],
    # down [1,256]; on tensor=2 all but o's and down's (their outputs are the unsplit embed) halve.
    int8 = evaluate(footprint, _work(quantize="int8", devices=1), {})
    assert int8.bytes["weight_scales"] == (256 + 128 + 128 + 256 + 384 + 384 + 256) * 4
    int8_two = evaluate(footprint, _work(quantize="int8", devices=2), {"tensor": 2})
    assert int8_two.bytes["weight_scales"] == (128 + 64 + 64 + 256 + 192 + 192 + 256) * 4


def test_kv_scales_are_one_per_row_and_head():
    """int8 pools on tensor=2, batch 2, 32 positions (4 pages of 16): values 1 byte, one fp32
    scale per (kv head, page, slot) for k and v."""
    footprint = DecodeFootprint(_llama(**SCALED))
    p = evaluate(footprint, _work(kv_cache="int8", devices=2), {"tensor": 2})
    assert p.bytes["kv_cache"] == 2 * (1 * 4 * 16 * 64)  # k, v [K, P, 16, H] per device (kv heads split)
    assert p.bytes["kv_scales"] == 2 * (1 * 4 * 16 * 4)


def test_split_dimensions_follow_the_rules():
    t = Tensor("w", (8, 10, 6), ("experts", "embed", "ffw"), 2, Component.WEIGHTS)
    rules = rules_for_mesh({"tensor": 2, "expert": 4})
    assert device_bytes(t, rules, {"tensor": 2, "expert": 4}) == 2 * 10 * 3 * 2
    # A dimension its mesh axis does not divide stays whole (as spec_for decides).
    assert device_bytes(t, rules_for_mesh({"tensor": 4}), {"tensor": 4}) == 8 * 10 * 6 * 2


# ---- the prefill chunk's peak --------------------------------------------------------------------


def test_prefill_chunks_are_shaped_as_the_serving_engine_shapes_them():
    """The planner's chunk limits and KV page are the serving engine's defaults; its chunk shapes are
    ``ServingConfig.chunk_shape``'s: a full chunk over what the budget allows, and the last chunk
    of a context-long prompt, halved until it fits the budget."""
    from dayzero.engine.paged_steps import ServingConfig

    from dayzero.engine.paged_steps import default_page_size

    serving, work = ServingConfig(), _work(devices=1, context=131072)
    assert (work.prefill_chunk, work.chunk_budget, work.min_chunk, work.page_size) == (
        serving.max_chunk, serving.chunk_budget, serving.min_chunk, default_page_size(_llama()))
    config = dataclasses.replace(serving, max_context=131072, page_size=1, num_pages=131072)
    last = config.chunk_shape(131072 - 512, 512)  # a full chunk at the end of the context
    assert work.prefill_shapes() == ((512, 4096), (last[0], 131072))
    assert _work(devices=1, context=1024, prefill_chunk=256).prefill_shapes() == ((256, 1024),)


def test_a_prefill_chunk_peaks_above_decode_on_its_scores():
    """Grouped-query attention, one device, 2 kv heads x 2 query heads each, a 256-token chunk over
    1024 cached positions: the dominant buffers are the fp32 scores [1, K, G*T, W+T], two copies,
    W = 512 the cache positions one block of the folded read holds (``model.cache.KEY_BLOCK``),
    beside the layer's gathered pages, keys and values [1, K, S, H] bf16."""
    footprint = DecodeFootprint(_llama(**SCALED))
    p = evaluate(footprint, _work(devices=1, batch=1, context=1024, prefill_chunk=256), {})
    dominant = 2 * (2 * 2 * 256 * (512 + 256) * 4) + 2 * (2 * 1024 * 64 * 2)
    assert p.peak_stage == "prefill: attention over the cache"
    # (the [T, S+T] visibility mask and smaller buffers add ~7% now that the scores are one block wide)
    assert dominant <= p.activation_peaks["prefill"] <= 1.1 * dominant
    assert p.bytes["activations"] == p.activation_peaks["prefill"] > 10 * p.activation_peaks["decode"]


def test_latent_prefill_scores_split_like_the_cache():
    """Latent attention on tensor=2: the chunk's scores over the cached positions are
    [1, T*N, S/2] fp32 per device, two copies (T=256, N=8, S=4096)."""
    footprint = DecodeFootprint(_latent())
    p = evaluate(footprint, _work(devices=2, batch=4, context=4096, prefill_chunk=256), {"tensor": 2})
    dominant = 2 * (256 * 8 * 2048 * 4)
    assert p.peak_stage.startswith("prefill: ")
    assert dominant <= p.activation_peaks["prefill"] <= 1.25 * dominant
    assert p.activation_peaks["prefill"] > p.activation_peaks["decode"]


# ---- collectives ---------------------------------------------------------------------------------


def test_collectives_of_tensor_and_expert_parallel_steps_by_hand():
    """Two layers (dense, then 4 experts x 2 per token), D=64, V=256, bf16, batch 4, on 2 devices.

    tensor=2, decode: ring all-reduces send 2(n-1)/n = 1x their buffer: the embedding lookup, two
    attention outputs and the dense MLP, [4,1,64] bf16 = 512 B each, the MoE's routed rows
    [8,64] = 1024 B, and each layer's page gather of keys and values from pools split by kv head,
    whole [4,8,32,8] bf16 = 16384 B each (32 positions: two 16-token pages); the fp32 logits
    [4,256] are all-gathered, (n-1)/n = half of 4096 B.
    expert=2, decode: 2 tokens per device, 4 routed rows [4,64] bf16 = 512 B, half of them off
    the device, out and back; the expert counts [2,4] int32 and the joined output [4,64] are
    all-gathered (half each)."""
    footprint = DecodeFootprint(_moe_llama())
    work = _work(devices=2, batch=4, context=32)
    tp = evaluate(footprint, work, {"tensor": 2})
    assert tp.collectives == {"all_reduce": 512 * 4 + 1024 + 2 * 2 * 16384, "all_gather": 2048, "all_to_all": 0}
    # Prefill: one row of 32 tokens: [1,32,64] bf16 = 4096 B per reduction, 64 routed rows 8192 B,
    # one row's pages [1,8,32,8] bf16 = 4096 B each.
    assert tp.collectives_prefill == {"all_reduce": 4096 * 4 + 8192 + 2 * 2 * 4096, "all_gather": 512,
                                      "all_to_all": 0}
    ep = evaluate(footprint, work, {"expert": 2})
    assert ep.collectives == {"all_reduce": 0, "all_gather": 16 + 256, "all_to_all": 2 * 256}
    # Hosts of one device: every group spans hosts; of 8: none does.
    assert evaluate(footprint, dataclasses.replace(work, devices_per_host=1), {"tensor": 2}).inter_host == 5120 + 65536
    assert tp.inter_host == 0 and tp.tensor_in_host


def test_groups_span_hosts_in_the_engines_device_order():
    """The mesh lays devices out tensor fastest, then expert, then data (``rules.DEVICE_ORDER``):
    consecutive devices (one host's) form the tensor groups."""
    assert not spans_hosts({"tensor": 8}, "tensor", 8)
    assert not spans_hosts({"tensor": 8, "expert": 2}, "tensor", 8)  # devices 0-7, then 8-15
    assert spans_hosts({"tensor": 8, "expert": 2}, "expert", 8)  # expert pairs 0 and 8, ...
    assert not spans_hosts({"data": 2, "tensor": 4}, "tensor", 4) and spans_hosts({"data": 2, "tensor": 4}, "data", 4)
    assert not spans_hosts({"tensor": 4, "expert": 2}, "tensor", 4) and spans_hosts({"tensor": 4, "expert": 2}, "expert", 4)


def test_the_mesh_is_laid_out_as_the_planner_assumes():
    """``rules.make_mesh`` over a host-ordered device list puts each tensor group on consecutive
    devices (the planner's ``spans_hosts`` reads the same ``device_grid``), and ``grid_devices``
    gives the list back."""
    import numpy as np
    from dayzero.sharding.rules import device_grid, grid_devices

    grid = device_grid({"data": 2, "tensor": 2, "expert": 2, "stage": 1}, list(range(8)))
    assert grid.shape == (2, 2, 2, 1) and grid[1, :, 0, 0].tolist() == [4, 5] and grid[0, 0, :, 0].tolist() == [0, 2]
    assert grid_devices(grid) == list(range(8))
    assert np.array_equal(grid_devices(grid[1:]), [4, 5, 6, 7])


# ---- what runs, and the choice -------------------------------------------------------------------


def test_refusals_are_the_engines_own():
    """Each refused mesh carries the sentence the engine raises for it."""
    moe = DecodeFootprint(_moe_llama())  # 4 experts
    work = _work(devices=4, batch=2)

    class Placed:
        def __init__(self, axes):
            self.axes = {"data": 1, "tensor": 1, "expert": 1, **axes}

    for axes, fragment in (({"data": 2, "expert": 2}, "data=2 x expert=2 is not supported"),
                           ({"expert": 8}, "4 experts do not split evenly over expert=8")):
        reason = evaluate(moe, work, axes).refused
        with pytest.raises(RunConfigError) as raised:
            check_placement(moe.config, Placed(axes))
        assert reason == str(raised.value) and fragment in reason
    assert evaluate(moe, work, {"tensor": 2, "expert": 2}).refused is None
    assert "no experts" in evaluate(DecodeFootprint(_llama()), work, {"expert": 4}).refused
    # Kernels named: each device needs whole heads (6 heads do not split over tensor=4).
    odd = DecodeFootprint(_llama(num_heads=6, num_kv_heads=6))
    refused = evaluate(odd, _work(kernels="pallas_interpret"), {"tensor": 4}).refused
    with pytest.raises(RunConfigError) as raised:
        resolve_run(odd.config, kernels="pallas_interpret", placement=Placed({"tensor": 4}))
    assert refused == str(raised.value) and "6 query heads to split evenly over tensor=4" in refused
    assert evaluate(odd, _work(), {"tensor": 4}).refused is None  # auto: the reference path there


class _Stub:
    """A footprint of one [64, 64] weight split by ``ffw``, refusing the most data-parallel mesh."""

    name, parameters, num_experts = "stub", 4096, 4

    def storage_options(self):
        return {"quantize": ("none",), "kv_cache": ("none",)}

    def page_size(self, work):
        return work.page_size

    def refusal(self, work, axes):
        return "refused for the test" if axes["data"] == work.devices else None

    def weights(self, work, ways):
        return [Tensor("w", (64, 64), ("embed", "ffw"), 2, Component.WEIGHTS)]

    def cache(self, work, axes):
        return []

    def activations(self, work, axes):
        return {"decode": [Stage("s", ())], "prefill": [Stage("s", ())]}

    def collectives(self, work, axes):
        return {"decode": [], "prefill": []}


def test_a_refused_mesh_is_never_recommended_even_where_it_would_win():
    result = plan(_Stub(), _work(devices=4, batch=4))
    refused = {c.mesh["data"]: c.refused for c in result.candidates if not c.runs}
    assert refused[4] == "refused for the test"  # (and data=2 x expert=2, which has no rules table)
    assert result.recommended.runs and result.recommended.mesh["data"] == 2  # data=4 would have won
    with pytest.raises(PlanError, match="the engine refuses --mesh data=4: refused for the test"):
        plan(_Stub(), _work(devices=4, batch=4), {"data": 4})


def test_a_moe_model_is_never_planned_on_data_by_expert_or_uneven_experts():
    """6 experts on 4 devices, batch 4: data x expert and expert=4 are listed, refused, not chosen."""
    moe = dataclasses.replace(_moe_llama().moe, num_experts=6)
    result = plan(DecodeFootprint(_llama(moe=moe)), _work(devices=4, batch=4, device_memory=64 << 20))
    reasons = {json.dumps(c.mesh, sort_keys=True): c.refused for c in result.candidates if not c.runs}
    assert "is not supported" in reasons['{"data": 2, "expert": 2, "stage": 1, "tensor": 1}']
    assert "6 experts do not split evenly over expert=4" in reasons['{"data": 1, "expert": 4, "stage": 1, "tensor": 1}']
    assert result.recommended.runs and result.fits


def test_tensor_groups_inside_a_host_come_first():
    """8 devices, 2 per host, one row (no data parallelism): tensor=8, 4 put their tensor groups
    across hosts; tensor <= 2 keep them inside one. A tensor-in-host mesh wins though meshes with
    tensor across hosts have more room."""
    moe = dataclasses.replace(_moe_llama().moe, num_experts=8)
    footprint = DecodeFootprint(_llama(moe=moe))
    result = plan(footprint, _work(devices=8, batch=1, devices_per_host=2, device_memory=64 << 20))
    assert result.recommended.mesh["tensor"] <= 2 and result.recommended.tensor_in_host
    roomier = [c for c in result.candidates if c.fits and c.headroom > result.recommended.headroom]
    # (pipelines have room too, but a bubble; this model's mixed dense and MoE layers they do not run)
    assert roomier and all(c.mesh["tensor"] > 2 and not c.tensor_in_host for c in roomier if not c.stages)


def test_data_parallelism_is_preferred_when_it_fits_and_advice_when_nothing_does():
    footprint = DecodeFootprint(_llama())
    roomy = plan(footprint, _work(devices=8, batch=4, device_memory=64 << 20))
    assert roomy.fits and roomy.recommended.mesh["data"] == 4
    # Four layers of the SCALED widths, 8 rows of 1024 positions on 2 devices, a device 15% of the
    # bf16 cache too small for the better mesh: a shorter context fits, and so does a quantized
    # cache (the serving decode dequantizes one layer's gathered pages at a time).
    deeper = DecodeFootprint(_llama(**{**SCALED, "num_layers": 4, "sliding_windows": (None,) * 4}))
    work = _work(devices=2, batch=8, context=1024, prefill_chunk=16)
    base = min((evaluate(deeper, work, axes) for axes in ({"tensor": 2}, {"data": 2}, {"stage": 2})),
               key=lambda p: p.total)
    memory = int((base.total - 0.15 * base.bytes["kv_cache"]) / 0.9)
    tight = plan(deeper, dataclasses.replace(work, device_memory=memory))
    assert not tight.fits
    text = " ".join(tight.advice)
    assert "(--context " in text and "--kv-cache int8 would fit" in text, text
    forced = plan(footprint, _work(devices=4, batch=4, device_memory=64 << 20), {"data": 2, "tensor": 2})
    assert forced.forced and forced.recommended.mesh == {"data": 2, "tensor": 2, "expert": 1, "stage": 1}
    with pytest.raises(PlanError, match="has 2 devices"):
        plan(footprint, _work(), {"tensor": 2})


def test_parse_size():
    assert parse_size("80GiB") == 80 * GiB and parse_size("141GB") == 141 * 10**9
    assert parse_size("96G") == 96 * GiB and parse_size("1024") == 1024
    for bad in ("80 gigs", "-1GB", "GiB", ""):
        with pytest.raises(PlanError, match="e.g. 80GiB"):
            parse_size(bad)


# ---- CLI -----------------------------------------------------------------------------------------


def test_cli_json(capsys):
    # fp8 blocks and an fp8 cache: the serving pools of latent rows are whole on every device, so
    # 16 rows of 131072 positions fit only with both (bf16 needs 113 GiB per device at best).
    rc, out, err = _run(["plan", "--preset", "deepseek-v3", "--devices", 64, "--device-memory", "80GiB",
                         "--batch", 16, "--context", 131072, "--quantize", "fp8-block", "--kv-cache", "fp8",
                         "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert {"model", "parameters", "workload", "fits", "rule", "recommended", "candidates", "advice"} <= set(result)
    best = result["recommended"]
    assert {"mesh", "strategy", "bytes_per_device", "fits", "headroom_bytes", "peak_stage", "activation_peaks",
            "collectives_per_decode_step", "collectives_per_prefill_chunk", "inter_host_bytes", "refused",
            "tensor_in_host", "collective_detail"} <= set(best)
    assert set(best["bytes_per_device"]) == {c.value for c in Component} | {"total"}
    assert best["bytes_per_device"]["activations"] == max(best["activation_peaks"].values())
    assert result["fits"] and math.prod(best["mesh"].values()) == 64
    assert all(c["refused"] for c in result["candidates"] if c["mesh"]["data"] > 1 and c["mesh"]["expert"] > 1)


def test_cli_text_and_not_fitting_exit_status(capsys):
    # 65536 positions: the latent pools (whole on every device) leave room for fp8 weights only.
    argv = ["plan", "--preset", "frontier-3t-1m", "--devices", 64, "--device-memory", "80GiB", "--context", 1 << 16]
    rc, out, err = _run(argv, capsys)
    assert rc == 1 and "DOES NOT FIT" in out and "--quantize fp8-block would fit" in out, out
    rc, out, err = _run(argv + ["--quantize", "fp8-block"], capsys)
    assert rc == 0 and "FITS" in out and "quantization scales" in out, out
    assert "per decode step" in out and "per prefill chunk" in out and "prefill chunk of 512 tokens" in out


@pytest.mark.parametrize("argv, fragments", [
    (["--preset", "gpt-9"], ["unknown preset 'gpt-9'", "deepseek-v3", "kimi-k2"]),
    (["--preset", "kimi-k2", "--device-memory", "lots"], ["'lots' is not a size", "80GiB"]),
    (["--preset", "kimi-k2", "--mesh", "tensor=3"], ["has 3 devices, not 64"]),
    (["--preset", "kimi-k2", "--batch", 0], ["batch must be at least 1"]),
    (["--preset", "kimi-k2", "--mesh", "data=2,expert=32", "--batch", 2],
     ["the engine refuses --mesh data=2,expert=32", "data=2 x expert=32 is not supported"]),
    (["--preset", "kimi-k2", "--mesh", "tensor=2,expert=32", "--devices", 64, "--prefill-chunk", 0],
     ["prefill_chunk must be at least 1"]),
    (["--config", "/nonexistent/dir"], ["no config.json"]),
])
def test_cli_errors_are_one_sentence(argv, fragments, capsys):
    base = {"--devices": "64", "--device-memory": "80GiB"}
    for i in range(0, len(argv) - 1):
        if argv[i] in base:
            base.pop(argv[i])
    rc, out, err = _run(["plan", *argv, *[x for kv in base.items() for x in kv]], capsys)
    assert rc == 2 and "Traceback" not in err
    line = err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("dayzero: error:"), err
    for fragment in fragments:
        assert fragment in line, line


# ---- the split latent attention the planned step runs -------------------------------------------

SHARDED_MLA_SCRIPT = r"""
import json
import math
import jax, jax.numpy as jnp, numpy as np
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.parallel import Parallel
from dayzero.model.transformer import forward
from dayzero.model.cache import cache_specs, init_cache
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.sharding.placement import placement_for

raw = {"model_type": "deepseek_v32", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 32, "num_hidden_layers": 1, "first_k_dense_replace": 1,
       "num_attention_heads": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 32,
       "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
       "index_topk": 16, "index_n_heads": 16, "index_head_dim": 32}
out = {}
# dsa-scan: a top-k above the 33 visible rows, so sparse attention scans the split cache densely.
for name, extra in (("mla", {"model_type": "deepseek_v3"}), ("dsa", {}), ("dsa-scan", {"index_topk": 64})):
    merged = {**raw, **extra}
    config = parse_hf_config({k: v for k, v in merged.items()
                              if merged["model_type"] == "deepseek_v32" or not k.startswith("index_")})
    specs = abstract_weights(config)
    weights = init_weights(specs, jax.random.key(0), scale=0.1)
    token = jax.random.randint(jax.random.key(1), (2, 1), 0, config.vocab_size)
    # A cache of random rows, filled to 23 and 17 positions (the DSA top-k of 16 then gathers).
    cache = init_cache(config, 2, 32)
    fill = lambda a, i: jax.random.normal(jax.random.key(2 + i), a.shape, a.dtype)  # noqa: E731
    cache = cache.replace(latent=tuple(fill(a, i) for i, a in enumerate(cache.latent)),
                          index_keys=None if cache.index_keys is None else tuple(fill(a, 9) for a in cache.index_keys),
                          lengths=jnp.array([23, 17], jnp.int32), rope_len=jnp.int32(23))
    decode = jax.jit(lambda w, c, t: forward(w, config, t, c)[0])
    ref = np.asarray(decode(weights, cache, token))
    placement = placement_for({"tensor": 8})
    sharded_cache = jax.device_put(cache, placement.shardings(cache_specs(config, 2, 32)))
    sharded = jax.device_put(weights, placement.shardings(specs))
    par = Parallel(placement)
    got = np.asarray(jax.jit(lambda w, c, t: forward(w, config, t, c, parallel=par)[0])(sharded, sharded_cache, token))
    out[name] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
print(json.dumps(out))
"""


@pytest.mark.slow  # the engine runs this split in tests/test_mesh_engine.py's latent generation
def test_latent_attention_over_a_position_split_cache_matches_one_device():
    """With the cache's positions split over tensor (``mla_parallel`` in the forward pass, as the
    engine runs it), decode gives the one-device logits, dense and sparse."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARDED_MLA_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(errors) == {"mla", "dsa", "dsa-scan"} and max(errors.values()) < 1e-5, errors


# ---- 4-bit values ---------------------------------------------------------------------------------


def test_four_bit_values_are_counted_as_xla_holds_them():
    """XLA packs int4 and float4_e2m1fn two to a byte (footprint.held_itemsize; measured against
    RSS by the validation), although their numpy itemsize is 1: the 4 x [64, 32] expert stacks
    (gate, up, down) of the MoE layer cost half a byte per value as int4 (the rest int8) or MXFP4
    (the rest bf16), and an odd piece rounds up."""
    from dayzero.model.footprint import held_itemsize

    assert held_itemsize("int4") == held_itemsize("float4_e2m1fn") == 0.5 and held_itemsize("int8") == 1
    footprint = DecodeFootprint(_moe_llama())
    experts = 3 * 4 * 64 * 32
    one = lambda q: evaluate(footprint, _work(quantize=q, devices=1), {}).bytes["weights"]  # noqa: E731
    assert one("int8") - one("int4") == experts // 2
    assert one("none") - one("mxfp4") == experts * 2 - experts // 2
    odd = Tensor("w", (3, 5), (None, None), 0.5, Component.WEIGHTS, count=2)
    assert device_bytes(odd, rules_for_mesh({}), {}) == 2 * 8
