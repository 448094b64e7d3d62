"""The deployment planner against what the engine places and what XLA compiles.

    python bench/plan_vs_xla.py [--case NAME ...] [--quick] [--json]
    python bench/plan_vs_xla.py --model MODEL --mesh AXIS=N,... --batch B --context S [--cut]
        [--size full|reduced] [--kv-cache none|int8|fp8] [--prefill-chunk T] [--json]

For each configuration (``dayzero.tools.plan_check.CASES``; default: all of them, ``--quick``:
the held-out ones only), labelled "fitted" (the planner's copy counts were fitted on ``Engine``'s
decode step: the README's full-size rows and the former 64-device test cases; the serving
decode compared now has no fitted count) or "held out":

1. Weights and KV, per device: the planner's arithmetic against arrays the engine actually places
   (``tools/plan_measure``: ``Engine(...)`` on the same mesh of faked CPU devices, bf16, and the
   KV page pools a ``ServingEngine`` over it allocates for the same rows and positions, the
   deployment's cache; bytes summed over each array's addressable shards). Always at
   reduced size (``plan_measure.reduced``), at a context of at most 1024 positions: a full-size
   model cannot be allocated here, so full-size weight and KV figures are the planner's
   arithmetic only, checked by this at reduced size.
2. Activations, per device: the planner's decode and prefill-chunk peaks against XLA's compiled
   memory analysis (temporaries + outputs) of the serving engine's steps (a replica's decode
   over the widest block table, and prefill chunks, on the reference path) lowered from
   ``jax.ShapeDtypeStruct`` inputs carrying the engine's shardings (``tools/plan_check``), in
   fp32 (XLA:CPU's bf16 matmuls convert their operands to fp32 copies no GPU makes). Full-size
   cases compile one layer of each kind (``cut``: both sides on the cut model).
3. The planner's total per device at the planned storage (bf16) against 80 GiB.

The process fakes as many CPU devices as the largest mesh (64); each mesh takes the first ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", help="a name of tools.plan_check.CASES (repeatable; default: all)")
    p.add_argument("--quick", action="store_true", help="the held-out cases only (8 devices, ~3 minutes)")
    p.add_argument("--json", action="store_true", help="one JSON object per case")
    p.add_argument("--model", help="one configuration instead: a tools.plan_measure.MODELS name")
    p.add_argument("--mesh", default="tensor=8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--kv-cache", default="none")
    p.add_argument("--size", default="full", choices=("full", "reduced"))
    p.add_argument("--cut", action="store_true", help="compile one layer of each kind")
    return p.parse_args()


def placed_row(case) -> dict:
    """Placed-array bytes against the planner for the case's model, reduced, on its mesh."""
    from dayzero.tools.plan_measure import compare_placed, full_config, reduced

    config = case.config() if case.size == "reduced" or case.model.startswith("test-") else reduced(
        full_config(case.model))
    return compare_placed(case.model, config, case.axes, "none", case.kv_cache, "bfloat16", case.batch,
                          min(case.context, 1024))


def run_case(name: str) -> dict:
    """Every figure of one case (module docstring)."""
    from dayzero.model.footprint import DecodeFootprint
    from dayzero.sharding.planner import evaluate
    from dayzero.tools.plan_check import CASES, check_case

    case = CASES[name]
    start = time.perf_counter()
    out = check_case(name)
    out["compile_s"] = round(time.perf_counter() - start, 1)
    out["placed"] = placed_row(case)
    planned = evaluate(DecodeFootprint(case.config(), case.model), case.workload("bfloat16"), case.axes)
    out["planned_bf16"] = {"total": planned.total, "fits_80GiB": planned.fits, "size": case.size}
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def row_text(r: dict) -> str:
    """One line of the table: the README's columns."""
    p = r["placed"]["components"]
    weights = "equal" if p["weights"]["placed"] == p["weights"]["planner"] else (
        f"{p['weights']['planner']} vs {p['weights']['placed']}")
    kv = "equal" if all(p[c]["placed"] == p[c]["planner"] for c in ("kv_cache", "kv_scales")) else (
        f"{p['kv_cache']['planner'] + p['kv_scales']['planner']} vs {p['kv_cache']['placed'] + p['kv_scales']['placed']}")
    mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1)
    acts = " | ".join(f"{_mib(r[s]['planner'])} / {_mib(r[s]['xla'])} MiB ({r[s]['ratio']:.3f})"
                      for s in ("decode", "prefill"))
    size = "full, cut" if r["cut"] else r["planned_bf16"]["size"]
    return (f"| {r['case']} ({r['model']}, {size}) | {r['label']} | {mesh} | B{r['batch']} S{r['context']} "
            f"T{r['prefill_chunk']} KV {r['kv_cache']} | {weights} | {kv} | "
            f"{acts} | "
            f"{_mib(r['planned_bf16']['total'])} MiB |")


HEADER = ("| case | label | mesh | workload | weights planner = placed (reduced) "
          "| KV: serving page pools planner = placed (reduced) | decode activations planner / XLA | prefill chunk "
          "| planned per device (bf16) |\n|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    args = _parse()
    # The device count is fixed when jax first initialises: set it before anything imports jax.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from dayzero.tools.plan_check import CASES, Case

    if args.model:
        CASES["given"] = Case(args.model, args.mesh, args.batch, args.context, args.prefill_chunk, args.kv_cache,
                              args.size, args.cut)
        args.case = ["given"]
    names = args.case or [n for n, c in CASES.items() if not (args.quick and c.fitted)]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if not args.json:
        print(HEADER, flush=True)
    start = time.perf_counter()
    for name in names:
        r = run_case(name)
        print(json.dumps(r) if args.json else row_text(r), flush=True)
    if not args.json:
        print(f"\n{len(names)} cases in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
