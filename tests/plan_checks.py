"""Planner validation parts that need faked CPU devices, run in a fresh interpreter by
tests/test_plan_validation.py (``python -m tests.plan_checks PART [ARGS]``, started with
:func:`start`; each prints one JSON object).

- ``placed [full]``: per-device bytes of the weights the engine places and of the serving
  engine's KV page pools (reduced models) against the planner, for every model on three meshes
  with and without quantization (``full``: every storage scheme on four meshes), and of a tiny
  DeepSeek-V4's weights, its serving pool (entry pages, and rings and compressor states per
  slot) and the cache ``Engine.generate`` allocates; of a tiny Qwen3-Next (a linear-attention
  hybrid: attention pages and linear states per slot); for both, the prefix cache's state
  snapshot rows (``PagedSteps.snapshots``);
  each shard counted at the bytes per element measured for its dtype (4-bit: half a byte);
- ``recommend MODEL OPTIONS [all]``: load the mesh the planner recommends (``all``: every mesh
  it recommends as the device memory shrinks) and generate 2 tokens;
- ``staged``: pipeline (``stage``) meshes: per-device bytes of a tiny model's stage-stacked weights
  and KV cache, placed as ``model.pipeline`` places them (``staged_specs``, ``staged_cache_specs``;
  the pipeline tests' five-layer dense and MoE configs on ``stage=2,tensor=4`` and
  ``stage=4,expert=2``: padded slots included), against the planner's;
- ``activations CASE...`` / ``decode CASE...``: the planner's decode and prefill (or decode
  only) activation peaks against XLA's compiled memory analysis (``tools.plan_check.CASES``:
  fitted and held-out configurations; start it with as many devices as the largest mesh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dayzero.sharding.distributed import parse_mesh
from dayzero.tools.plan_measure import (MODELS, TINY_HYBRID, compare_placed, full_config, host_weights,
                                        recommended_meshes, reduced, run_recommendation)

MOE_MESHES = ("tensor=8", "tensor=4,expert=2", "data=2,tensor=4")
DENSE_MESHES = ("tensor=8", "data=2,tensor=4", "data=4,tensor=2")
OPTIONS = ("none/none", "fp8-block/fp8")
FULL_OPTIONS = ("none/none", "fp8-block/fp8", "int8/int8", "fp8/none", "int4/none")
# The tiny DeepSeek-V4 (tests/v4_helpers.TINY: 4 heads in 2 output groups, 8 experts), 256
# positions (16 pages of 16): the serving engine's pool and Engine.generate's cache; tensor at most
# 2 (it must divide the output groups: mesh_check.compressed_split_refusal). By default one device
# and two meshes, with both 4-bit schemes (int4 and MXFP4 experts), fp8 blocks and both KV formats.
V4 = "deepseek-v4-tiny"
V4_ROWS = (("tensor=1", "fp8-block/int8"), ("data=2,tensor=2", "mxfp4/fp8"), ("tensor=2,expert=2", "int4/int8"))
V4_MESHES = ("tensor=1", "tensor=2", "tensor=2,expert=2", "data=2,tensor=2", "expert=4")
# The tiny Qwen3-Next (plan_measure.TINY_HYBRID): its attention pages, its linear states per slot
# (value and key heads over tensor) and its state snapshots, 4 rows of 256 positions.
HYBRID = "qwen3-next-tiny"
HYBRID_ROWS = (("tensor=2", "none/none"), ("data=2,tensor=2", "int8/int8"), ("tensor=2,expert=2", "none/fp8"))


def v4_config():
    """The tiny DeepSeek-V4 of the V4 tests, as dayzero parses it."""
    from dayzero.model.hf_config import parse_hf_config
    from tests.v4_helpers import tiny_hf_config

    return parse_hf_config(tiny_hf_config().to_dict())


def hybrid_config():
    """The tiny Qwen3-Next, as dayzero parses it."""
    from dayzero.model.hf_config import parse_hf_config

    return parse_hf_config(TINY_HYBRID)


def part_placed(scope: str = "default") -> dict:
    """Placed-array rows (see the module docstring)."""
    rows = []
    for name in MODELS:
        config = reduced(full_config(name))
        meshes = MOE_MESHES if config.moe is not None else DENSE_MESHES
        if scope == "full":
            meshes += ("tensor=2,expert=4",) if config.moe is not None else ("tensor=4",)
        for option in FULL_OPTIONS if scope == "full" else OPTIONS:
            quantize, kv = option.split("/")
            weights = host_weights(config, quantize)
            rows += [compare_placed(name, config, parse_mesh(m), quantize, kv, weights=weights) for m in meshes]
    config = v4_config()
    pairs = V4_ROWS if scope != "full" else [(m, o) for o in FULL_OPTIONS + ("mxfp4/fp8",) for m in V4_MESHES]
    for mesh, option in pairs:
        quantize, kv = option.split("/")
        rows.append(compare_placed(V4, config, parse_mesh(mesh), quantize, kv))
    for mesh, option in HYBRID_ROWS:
        quantize, kv = option.split("/")
        rows.append(compare_placed(HYBRID, hybrid_config(), parse_mesh(mesh), quantize, kv))
    return {"rows": rows}


def part_recommend(name: str, option: str, scope: str = "one") -> dict:
    """Run the meshes the planner recommends for reduced ``name`` with ``option``
    (QUANTIZE/KV_CACHE): the first (the tightest memory: the most split mesh) or, with
    ``scope`` "all", each distinct one. One dense layer is kept (compile time); the plan is
    made for the same config that runs."""
    config = reduced(full_config(name), dense_layers=1)
    quantize, kv = option.split("/")
    recs = recommended_meshes(config, name, quantize, kv)
    if scope != "all":
        recs = [r for r in recs if r["mesh"]["expert"] > 1][:1] or recs[:1]
    weights = host_weights(config, quantize)
    return {"rows": [run_recommendation(name, config, r, quantize, kv, weights=weights) for r in recs]}


STAGED = (("dense", "stage=2,tensor=4"), ("moe", "stage=4,expert=2"), ("dense", "stage=4,tensor=2"))
STAGED_ROWS, STAGED_CONTEXT = 4, 64  # the cache: rows x positions (a multiple of the 16-position page)


def part_staged() -> dict:
    """Planner against placed stage-stacked arrays (module docstring): per component, the most
    any device holds (every device of a stage mesh is planned as its largest stage's)."""
    import jax
    import numpy as np

    from dayzero.model.footprint import DecodeFootprint
    from dayzero.model.pipeline import plan_stages, stage_weights, staged_cache_specs, staged_specs
    from dayzero.model.weights import abstract_weights
    from dayzero.sharding.placement import placement_for
    from dayzero.sharding.planner import Workload, evaluate
    from dayzero.tools.plan_measure import random_weights
    from tests.pipeline_checks import dense_config, moe_config

    rows = []
    for name, mesh in STAGED:
        config = dense_config() if name == "dense" else moe_config()
        axes = parse_mesh(mesh)
        placement = placement_for(axes, jax.devices()[:8])
        specs = abstract_weights(config)
        stages = plan_stages(specs, axes["stage"])
        weights = stage_weights(random_weights(specs, 0, "float32"), stages)
        placed = jax.device_put(weights, placement.shardings(staged_specs(specs, stages)))
        cache_specs = staged_cache_specs(config, stages, STAGED_ROWS, STAGED_CONTEXT)
        kv = [jax.device_put(np.zeros(s.shape, np.float32), placement.sharding(s.axes, s.shape))
              for s in cache_specs.buffers]  # lengths and rope_len: host inputs, not planned
        work = Workload(devices=8, device_memory=1 << 30, dtype="float32", batch=STAGED_ROWS, context=STAGED_CONTEXT)
        planned = evaluate(DecodeFootprint(config, name), work, axes)
        rows.append({"model": name, "mesh": mesh, "ranges": [list(r) for r in stages.ranges],
                     "planned_ranges": [list(r) for r in planned.stages],
                     "weights": {"placed": _most_per_device(jax.tree.leaves(placed)),
                                 "planned": planned.bytes["weights"]},
                     "kv_cache": {"placed": _most_per_device(kv), "planned": planned.bytes["kv_cache"]}})
    return {"rows": rows}


def _most_per_device(arrays) -> int:
    """The largest total of addressable shard bytes any one device holds over ``arrays``."""
    per: dict = {}
    for a in arrays:
        for shard in a.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def part_activations(*cases: str) -> dict:
    """Planner against XLA for the named ``tools.plan_check.CASES`` (decode and prefill)."""
    from dayzero.tools.plan_check import check_case

    return {case: check_case(case) for case in cases}


def part_decode(*cases: str) -> dict:
    """The same, decode only."""
    from dayzero.tools.plan_check import check_case

    return {case: check_case(case, ("decode",)) for case in cases}


def start(part: str, *args: str, devices: int = 8, fast_compile: bool = False) -> subprocess.Popen:
    """Start one part in a fresh interpreter with ``devices`` faked CPU devices (collect it with
    ``tests.mesh_checks.result_of``). ``fast_compile``: XLA's backend optimisations off, for parts
    that only run (never for memory analysis, which they may change)."""
    flags = f"--xla_force_host_platform_device_count={devices}" + (
        " --xla_backend_optimization_level=0" if fast_compile else "")
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([sys.executable, "-m", "tests.plan_checks", part, *map(str, args)], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


PARTS = {"placed": part_placed, "staged": part_staged, "recommend": part_recommend, "activations": part_activations,
         "decode": part_decode}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
