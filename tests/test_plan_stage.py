"""The planner's pipeline (``stage``) meshes and host tiers: the bubble formula, a stage mesh's
per-device bytes counted by hand, the host tier's arithmetic, and the 3T / 1M-context preset's
recommendation (a multi-host pipeline where one node cannot hold it). The figures of stage meshes
against placed stage-stacked arrays: tests/test_plan_validation.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dayzero.model.footprint import DecodeFootprint
from dayzero.model.presets import load_preset
from dayzero.sharding.planner import Workload, evaluate, parse_size, plan
from dayzero.sharding.planner_pipeline import bubble_fraction, host_tier
from tests.test_plan import _llama, _work

GiB = 1 << 30


def test_bubble_is_stages_minus_one_over_micro_batches_plus_stages_minus_one():
    assert bubble_fraction(1, 1) == 0 and bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(8, 4) == pytest.approx(7 / 11)
    with pytest.raises(ValueError, match="at least 1"):
        bubble_fraction(2, 0)


def _four_layers():
    return DecodeFootprint(_llama(num_layers=4, sliding_windows=(None,) * 4))


def test_a_stage_meshs_bytes_by_hand():
    """4 layers (D 64, F 128, 8 heads of 8, vocabulary 256, bf16) on stage=2 x tensor=2: two layers
    a stage, heads and MLP width halved; the embedding, head and final norm (vocabulary halved) on
    every stage, as model.pipeline keeps them whole over stage. KV: 2 rows of 32 positions."""
    p = evaluate(_four_layers(), _work(), {"stage": 2, "tensor": 2})
    layer = (4 * 64 * 8 * 8 + 3 * 64 * 128) // 2 + 2 * 64  # q, k, v, o and gate, up, down halved; two norms
    outer = 2 * 256 * 64 // 2 + 64  # embedding and head (vocabulary halved), final norm
    assert p.stages == ((0, 2), (2, 4))
    assert p.bytes["weights"] == 2 * (2 * layer + outer)
    assert p.bytes["kv_cache"] == 2 * (2 * 2 * 32 * 8 * 8 // 2) * 2  # 2 layers x (k, v) x rows x S x K/2 x H
    # Micro-batches: one per stage (2 of the 2 rows); bubble 1/3; each decode step hands both rows'
    # residuals (D bf16) to the next stage, across hosts only when a stage's devices fill a host.
    assert p.micro_batches == 2 and p.bubble == pytest.approx(1 / 3)
    assert p.stage_send == (2 * 64 * 2, 32 * 64 * 2)  # decode rows; a prefill chunk of 32 tokens
    assert not p.stage_across_hosts and p.inter_host == 0
    split = evaluate(_four_layers(), _work(devices_per_host=2), {"stage": 2, "tensor": 2})
    assert split.stage_across_hosts and split.inter_host == 2 * 64 * 2 and split.tensor_in_host
    # Collectives: a stage runs half the layers' all-reduces, for each of its 2 micro-batches of 1 row.
    whole = evaluate(_four_layers(), _work(batch=1), {"tensor": 2}).collectives["all_reduce"]
    assert p.collectives["all_reduce"] == pytest.approx(2 * whole / 2, rel=0.05)
    assert evaluate(_four_layers(), _work(micro_batches=1), {"stage": 2, "tensor": 2}).bubble == pytest.approx(1 / 2)


def test_more_stages_than_layers_is_refused():
    p = evaluate(_four_layers(), _work(devices=8), {"stage": 8})
    assert not p.runs and "more stages than the model's 4 decoder layers" in p.refused


def test_host_tier_arithmetic():
    """A device 50 over with layers of 40/30/20 bytes and a streaming buffer of two of the largest
    (80): offloading all three still leaves it over (reported as such); ten layers of 10, 10 over:
    three go (110 - 30 + 20 = 100)."""
    t = host_tier(host_memory=10_000, reserve=0.1, bandwidth=100.0, devices_per_host=4, total=150, device_usable=100,
                  layer_weight_bytes=[20, 40, 30], pool_bytes_per_replica=600, devices_per_replica=2,
                  kv_per_device=300, rows=3)
    assert (t.offload_layers, t.offload_bytes, t.buffer_bytes) == (3, 90, 80)  # 150 - 90 + 80 = 140: still over
    assert t.swap_bytes == 600 * 4 // 2 and t.host_bytes == 90 * 4 + 1200 and t.usable == 9000 and t.fits
    assert t.step_seconds == pytest.approx(0.9) and t.swap_in_seconds == pytest.approx(1.0)
    easy = host_tier(host_memory=10_000, reserve=0.0, bandwidth=100.0, devices_per_host=1, total=110,
                     device_usable=100, layer_weight_bytes=[10] * 10, pool_bytes_per_replica=0,
                     devices_per_replica=1, kv_per_device=0, rows=1)
    assert (easy.offload_layers, easy.offload_bytes, easy.buffer_bytes) == (3, 30, 20)  # 110 - 30 + 20 = 100
    none = dataclasses.replace(easy, offload_layers=0, offload_bytes=0, buffer_bytes=0)
    assert none.step_seconds == 0


def test_offloaded_weights_make_a_mesh_fit_with_the_host():
    footprint = _four_layers()
    base = evaluate(footprint, _work(), {"tensor": 4})
    tight = _work(device_memory=int((base.total - 20_000) / 0.9), host_memory=1 << 20)
    p = evaluate(footprint, tight, {"tensor": 4})
    assert not p.fits and p.fits_with_host and p.host.offload_layers >= 1
    assert p.host.step_seconds == pytest.approx(p.host.offload_bytes / tight.host_bandwidth)
    assert plan(footprint, dataclasses.replace(tight, devices=4), {"tensor": 4}).recommended.fits_with_host


FRONTIER = dict(device_memory=parse_size("141GB"), quantize="fp8-block", kv_cache="fp8", batch=4, context=1 << 20)


def test_the_3t_preset_needs_a_multi_host_pipeline():
    """One node of 8 x 141 GB holds no mesh of the 3T / 1M-context model (its latent pools are
    whole on every device of a replica); on 8 nodes a pipeline of 8 stages across hosts with
    tensor=8 inside each host fits, where tensor=8 x expert=8 without stages does not."""
    footprint = DecodeFootprint(load_preset("frontier-3t-1m"), "frontier-3t-1m")
    node = evaluate(footprint, Workload(devices=8, **FRONTIER), {"tensor": 8})
    assert node.runs and not node.fits
    work = Workload(devices=64, **FRONTIER)
    flat = evaluate(footprint, work, {"tensor": 8, "expert": 8})
    pipe = evaluate(footprint, work, {"tensor": 8, "stage": 8})
    assert not flat.fits and pipe.fits and pipe.tensor_in_host and pipe.stage_across_hosts
    most = max(b - a for a, b in pipe.stages)  # a stage holds its layers' pools: 14 of 96 on the largest
    assert pipe.bytes["kv_cache"] * 96 == flat.bytes["kv_cache"] * most
    assert pipe.inter_host == 4 * 8192 * 2  # 4 rows' bf16 residuals per decode step across a boundary


@pytest.mark.slow
def test_plan_recommends_the_3t_pipeline():
    result = plan(DecodeFootprint(load_preset("frontier-3t-1m"), "frontier-3t-1m"), Workload(devices=64, **FRONTIER))
    best = result.recommended
    assert best.fits and best.stages and best.stage_across_hosts and best.tensor_in_host, best.mesh


def _tiny_llama_dir(tmp_path):
    raw = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 256, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_cli_shows_stages_bubble_cross_host_bytes_and_host_tier(tmp_path, capsys):
    from tests.test_cli import _run

    argv = ["plan", "--config", _tiny_llama_dir(tmp_path), "--devices", 4, "--device-memory", "1GiB",
            "--devices-per-host", 2, "--batch", 2, "--context", 32, "--mesh", "stage=2,tensor=2",
            "--host-memory", "1GiB", "--host-bandwidth", "25GB", "--micro-batches", 1]
    rc, out, err = _run(argv + ["--json"], capsys)
    assert rc == 0, err
    best = json.loads(out)["recommended"]
    pipe, host = best["pipeline"], best["host_tier"]
    assert pipe["stages"] == 2 and pipe["layers"] == [[0, 2], [2, 4]] and pipe["micro_batches"] == 1
    assert pipe["bubble_fraction"] == pytest.approx(0.5) and pipe["across_hosts"] and pipe["not_run_yet"] is None
    assert best["inter_host_bytes"]["decode"] == pipe["send_bytes_per_device"]["decode"] == 2 * 64 * 2
    assert host["bandwidth_bytes_per_s"] == 25e9 and host["fits"] and host["offload_layers"] == 0
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and "pipeline: 2 stages (layers 0-1, 2-3), 1 micro-batches" in out and "bubble" in out, out
    assert "host tier:" in out and "KV swap space" in out, out
    rc, out, err = _run(argv[:-6] + ["--host-memory", "lots"], capsys)
    assert rc == 2 and "--host-memory 'lots' is not a size" in err, err


def test_stage_split_follows_the_weights_as_the_engine_stores_them():
    """The planner splits stages over the weights as the engine holds them: under int4 the routed
    experts shrink to half a byte an element beside int8 dense layers, which moves the dense-first
    model's split (float: layers 0-2 | 3-5; int4: 0-1 | 2-5), and the plan follows the engine's."""
    from dayzero.model import pipeline
    from dayzero.model.quant import QuantConfig, WeightQuant
    from dayzero.model.weights import abstract_weights
    from tests.pipeline_checks import dense_first_config

    base = dense_first_config()
    config = dataclasses.replace(base, num_layers=6, intermediate_size=512, sliding_windows=(None,) * 6,
                                 moe=dataclasses.replace(base.moe, layers=(False,) + (True,) * 5))
    engine = pipeline.plan_stages(abstract_weights(config, QuantConfig(WeightQuant.INT4)), 2).ranges
    assert engine != pipeline.plan_stages(abstract_weights(config), 2).ranges
    ranges, _ = DecodeFootprint(config).stage_split(_work(quantize="int4"), {}, 2, 4, 2)
    assert tuple((r.start, r.stop) for r in ranges) == engine == ((0, 2), (2, 6))
