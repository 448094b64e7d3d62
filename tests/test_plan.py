"""The memory planner: presets, per-device arithmetic, mesh choice, the CLI, and XLA's figures."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests.test_cli import _run  # the in-process CLI runner (exit status, stdout, stderr)
from dayzero.model.config import Family, ModelConfig, RopeConfig
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.hf_config import load_hf_config
from dayzero.model.presets import PRESETS, load_preset, preset_hf_config
from dayzero.sharding.planner import (
    Component, KVDtype, PlanError, Tensor, WeightDtype, Workload, device_bytes, evaluate, parse_size, plan,
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


# ---- arithmetic ----------------------------------------------------------------------------------


def _llama(**changes) -> ModelConfig:
    config = ModelConfig(
        family=Family.LLAMA, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=8, num_kv_heads=8, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64,
        rope=RopeConfig(),
    )
    return dataclasses.replace(config, **changes)


def _work(**changes) -> Workload:
    return dataclasses.replace(Workload(devices=4, device_memory=GiB, batch=2, context=32), **changes)


def test_per_device_bytes_equal_a_hand_computation():
    """tensor=4, bf16 weights and KV, batch 2, 32 positions (sizes written out by hand)."""
    p = evaluate(DecodeFootprint(_llama()), _work(), {"tensor": 4})
    head = 256 // 4 * 64 * 2  # embed [V,D] and lm_head [D,V]: the vocabulary split 4 ways
    attention = 4 * (64 * 8 // 4 * 8 * 2)  # q, k, v [D,N,H] and o [N,H,D]: heads split
    mlp = 3 * (64 * 128 // 4 * 2)  # gate, up [D,F], down [F,D]: width split
    norms = 2 * 64 * 2
    assert p.bytes["weights"] == 2 * head + 64 * 2 + 2 * (attention + mlp + norms)
    kv = 2 * 2 * (2 * 8 // 4 * 8 * 32 * 2)  # 2 layers x (k [B,K,H,S] + v [B,K,S,H]), heads split
    assert p.bytes["kv_cache"] == kv + 2 * 4 + 4  # + lengths [B] and rope_len, int32
    assert p.bytes["weight_scales"] == p.bytes["kv_scales"] == 0


def test_fp8_weights_and_one_byte_kv_count_their_scales():
    footprint = DecodeFootprint(_llama())
    base = evaluate(footprint, _work(), {"tensor": 4})
    p = evaluate(footprint, _work(weight_dtype=WeightDtype.FLOAT8, kv_dtype=KVDtype.INT8), {"tensor": 4})
    # Matrices are 1 byte; the embedding and lm_head (and norms) stay bfloat16.
    matrices = 2 * (4 * (64 * 2 * 8) + 3 * (64 * 32))
    assert p.bytes["weights"] == base.bytes["weights"] - matrices
    # One fp32 scale per 128x128 block of each device's piece: every piece here is one block
    # (q's [64, 2 heads x 8] is [64, 16] as a matrix), 7 matrices per layer.
    assert p.bytes["weight_scales"] == 2 * 7 * 4
    assert p.bytes["kv_cache"] == (base.bytes["kv_cache"] - 12) // 2 + 12
    assert p.bytes["kv_scales"] == 2 * 2 * (2 * 2 * 32 * 4)  # per cached row and kv head: [B,K,S] fp32


def test_split_dimensions_follow_the_rules():
    t = Tensor("w", (8, 10, 6), ("experts", "embed", "ffw"), 2, Component.WEIGHTS)
    rules = rules_for_mesh({"tensor": 2, "expert": 4})
    assert device_bytes(t, rules, {"tensor": 2, "expert": 4}) == 2 * 10 * 3 * 2
    # A dimension its mesh axis does not divide stays whole (as spec_for decides).
    assert device_bytes(t, rules_for_mesh({"tensor": 4}), {"tensor": 4}) == 8 * 10 * 6 * 2


def test_data_parallelism_is_preferred_when_it_fits_and_advice_when_nothing_does():
    footprint = DecodeFootprint(_llama())
    roomy = plan(footprint, _work(devices=8, batch=4, device_memory=64 << 20))
    assert roomy.fits and roomy.recommended.mesh["data"] == 4
    weights = evaluate(footprint, _work(), {"tensor": 4}).bytes["weights"]
    tight = plan(footprint, _work(devices=4, batch=2, context=4096, device_memory=int(weights * 1.3 / 0.9)))
    assert not tight.fits
    text = " ".join(tight.advice)
    assert "would fit" in text and "--context" in text
    forced = plan(footprint, _work(devices=4, batch=4, device_memory=64 << 20), {"data": 2, "tensor": 2})
    assert forced.forced and forced.recommended.mesh == {"data": 2, "tensor": 2, "expert": 1}
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
    rc, out, err = _run(["plan", "--preset", "deepseek-v3", "--devices", 64, "--device-memory", "80GiB",
                         "--batch", 16, "--context", 131072, "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert {"model", "parameters", "workload", "fits", "rule", "recommended", "candidates", "advice"} <= set(result)
    best = result["recommended"]
    assert {"mesh", "strategy", "bytes_per_device", "fits", "headroom_bytes", "peak_stage"} <= set(best)
    assert set(best["bytes_per_device"]) == {c.value for c in Component} | {"total"}
    assert result["fits"] and best["mesh"]["data"] * best["mesh"]["tensor"] * best["mesh"]["expert"] == 64


def test_cli_text_and_not_fitting_exit_status(capsys):
    rc, out, err = _run(["plan", "--preset", "frontier-3t-1m", "--devices", 64, "--device-memory", "80GiB",
                         "--context", 1 << 20], capsys)
    assert rc == 1 and "DOES NOT FIT" in out and "--weight-dtype float8" in out, out
    rc, out, err = _run(["plan", "--preset", "frontier-3t-1m", "--devices", 64, "--device-memory", "80GiB",
                         "--context", 1 << 20, "--weight-dtype", "float8"], capsys)
    assert rc == 0 and "FITS" in out and "fp8 block scales" in out


@pytest.mark.parametrize("argv, fragments", [
    (["--preset", "gpt-9"], ["unknown preset 'gpt-9'", "deepseek-v3", "kimi-k2"]),
    (["--preset", "kimi-k2", "--device-memory", "lots"], ["'lots' is not a size", "80GiB"]),
    (["--preset", "kimi-k2", "--mesh", "tensor=3"], ["has 3 devices, not 64"]),
    (["--preset", "kimi-k2", "--batch", 0], ["batch must be at least 1"]),
    (["--preset", "kimi-k2", "--mesh", "data=2,expert=32", "--batch", 2], ["data=2 x expert=32 is not supported"]),
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


# ---- against XLA ---------------------------------------------------------------------------------

# Scaled-down models of the three attention kinds, with MoE layers behind a dense one, checked on
# 64 faked CPU devices in a fresh interpreter (the device count is fixed when jax starts); the
# last case splits the experts (expert-parallel dispatch) at a short context, where MoE buffers
# are a large part of the step.
XLA_SCRIPT = r"""
import dataclasses, json
from dayzero.tools.plan_check import compare_with_xla
from dayzero.model.hf_config import parse_hf_config
from dayzero.sharding.planner import Workload, KVDtype, WeightDtype

deepseek = {"model_type": "deepseek_v3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1,
            "num_attention_heads": 16, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
            "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
            "v_head_dim": 32, "max_position_embeddings": 1 << 20}
sparse = dict(deepseek, model_type="deepseek_v32", index_topk=512, index_n_heads=16, index_head_dim=64)
llama = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 8}
cases = [("mla", deepseek, {"data": 4, "tensor": 16}, 8, 262144),
         ("dsa", sparse, {"tensor": 64}, 8, 262144),
         ("gqa", llama, {"data": 8, "tensor": 8}, 64, 32768),
         ("mla-ep", deepseek, {"tensor": 8, "expert": 8}, 64, 1024)]
out = {}
for name, raw, mesh, batch, context in cases:
    work = Workload(64, 80 << 30, WeightDtype.FLOAT32, KVDtype.FLOAT32, batch, context)
    out[name] = compare_with_xla(parse_hf_config(raw), name, work, mesh)
print(json.dumps(out))
"""


def test_planner_agrees_with_xla_memory_analysis_on_64_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=64", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", XLA_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, result in results.items():
        rows = result["components"]
        # Weights and cache: the same shardings on both sides, so the bytes are equal exactly.
        assert rows["weights"]["planner"] == rows["weights"]["xla"], (name, rows)
        assert rows["kv_cache"]["planner"] == rows["kv_cache"]["xla"], (name, rows)
        # Activations: the planner's formula against XLA's temporaries plus outputs.
        assert abs(rows["activations"]["ratio"] - 1) < 0.1, (name, rows)
        assert abs(rows["total"]["ratio"] - 1) < 0.1, (name, rows)


# ---- the split latent attention the checked step runs -------------------------------------------

SHARDED_MLA_SCRIPT = r"""
import json
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


def test_latent_attention_over_a_position_split_cache_matches_one_device():
    """With the cache's positions split over tensor (``mla_parallel`` in the forward pass, as the
    engine runs it), decode gives the one-device logits, dense and sparse."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARDED_MLA_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(errors) == {"mla", "dsa", "dsa-scan"} and max(errors.values()) < 1e-5, errors
