"""The memory planner against XLA's compiled memory analysis of the sharded decode step.

    python bench/plan_vs_xla.py --preset deepseek-v3 --devices 64 --batch 16 --context 131072 \
        [--device-memory 80GiB --weight-dtype bfloat16 --kv-dtype bfloat16] [--mesh AXIS=N,...] \
        [--check-dtype float32] [--cut] [--json]

1. ``dayzero plan``'s arithmetic recommends a mesh for the workload given (device memory,
   weight and KV dtypes, batch, context), unless ``--mesh`` fixes one.
2. On that mesh, faked with ``--xla_force_host_platform_device_count`` CPU devices, the engine's
   decode step (``generate.engine_step`` with the engine's ``Parallel``: one token per row over
   a cache of ``--context`` positions, latent attention in ``shard_map`` over the
   position-split cache, expert-parallel MoE dispatch when the mesh has ``expert`` > 1, greedy
   sampling) is lowered from ``jax.ShapeDtypeStruct`` weights, cache and host inputs carrying
   the engine's shardings -- nothing is allocated -- and compiled; ``memory_analysis()`` gives
   per-device argument, output and temporary bytes.
3. The whole model is compiled (DeepSeek-V3: ~1 minute and 1 GB here). XLA's per-device bytes
   of each weight and cache leaf are read from the compiled input shardings (their sum is
   checked against the argument size). ``--cut`` compiles one decoder layer of each kind
   (dense MLP, MoE) plus embedding and head instead: weights and cache are then scaled by the
   layer counts, and activations compared on the cut model (part of them grows with depth:
   XLA holds some buffers of every layer for the whole step).
4. The planner, evaluated on the same mesh at ``--check-dtype`` (weights, cache and compute),
   is compared per component: ratio = planner / XLA.

The check runs in fp32 by default: XLA:CPU computes bf16 matmuls by converting their operands
to fp32, so a bf16 lowering's temporary bytes hold fp32 copies of weights that no GPU or TPU
makes. Weights and cache scale exactly with the element size, which ``--check-dtype bfloat16``
shows (its argument bytes agree; its temporary bytes are CPU-specific).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset")
    src.add_argument("--config", help="HF config.json (or its directory)")
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--device-memory", default="80GiB")
    p.add_argument("--weight-dtype", default="bfloat16")
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--mesh", help="AXIS=N,... (default: the planner's recommendation)")
    p.add_argument("--check-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--cut", action="store_true", help="compile one layer of each kind, not the whole model")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def main() -> int:
    args = _parse()
    # The device count is fixed when jax first initialises: set it before anything imports jax.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from dayzero.tools.plan import load_model, workload_from_args
    from dayzero.tools.plan_check import compare_with_xla
    from dayzero.sharding.distributed import parse_mesh
    from dayzero.sharding.planner import format_size, plan

    name, config = load_model(args.preset, args.config)
    work = workload_from_args(args)
    recommendation = plan(_footprint(config, name), work, parse_mesh(args.mesh) or None)
    mesh = recommendation.recommended.mesh
    start = time.perf_counter()
    result = compare_with_xla(config, name, work, mesh, args.check_dtype, whole=not args.cut)
    result["compile_s"] = round(time.perf_counter() - start, 1)
    result["recommended_for"] = recommendation.to_json()["workload"]
    result["recommended_fits"] = recommendation.fits
    result["recommended_bytes"] = recommendation.recommended.to_json()["bytes_per_device"]
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{name}: mesh {result['mesh_text']} ({result['strategy']}), batch {work.batch}, context {work.context}, "
          f"checked in {args.check_dtype} ({'one layer of each kind, scaled' if args.cut else 'whole model'}; "
          f"{result['compile_s']} s)")
    print(f"{'component':<12} {'planner':>12} {'XLA':>12} {'ratio':>7}")
    for comp, row in result["components"].items():
        print(f"{comp:<12} {format_size(row['planner']):>12} {format_size(row['xla']):>12} {row['ratio']:>7.3f}")
    verdict = "fits" if recommendation.fits else "does not fit"
    total = recommendation.recommended.total
    print(f"planned at {work.weight_dtype.value} weights / {work.kv_dtype.value} KV on "
          f"{format_size(work.device_memory)} devices: {format_size(total)} per device, {verdict}")
    return 0


def _footprint(config, name):
    from dayzero.model.footprint import DecodeFootprint

    return DecodeFootprint(config, name)


if __name__ == "__main__":
    sys.exit(main())
