"""Bytes moved per step by the expert-parallel MoE dispatch, for DeepSeek-V3-shaped layers.

DeepSeek-V3's MoE layer (D = 7168, 256 experts of width 2048, 8 per token, group-limited sigmoid
routing; bf16 rows), at decode (256 tokens) and prefill-chunk (4096 tokens) steps, on ep = 8 and
64 faked CPU devices. Per step, both directions, for:

- ``dense no-drop``: the no-drop worst-case buffers (the CPU exchange). Read from the lowered
  HLO: the operand shapes of every all-to-all / all-gather (:func:`collective_bytes`), an
  independent measurement of what the program moves, not the formula in
  ``DispatchStats.bytes_moved``.
- ``ragged``: ``jax.lax.ragged_all_to_all`` (the GPU/TPU exchange): the routed rows that leave
  their device, counted on sample tokens by the dispatch's own routing and plan
  (``moe_parallel.dispatch_stats``), times D x 2 bytes, plus the count table. Its receive buffer
  (memory, not traffic) is read from the lowered HLO.
- ``dense f=...``: capacity factors, their buffers from the HLO and their drop rates measured on
  the same routing.

Routing: the real router shape [7168, 256] with random weights on random hidden states
(near-uniform), and a skewed case (a score bias favouring the 32 experts of one ep=8 device).
Only the router is allocated; the expert weights enter the lowering as ``jax.ShapeDtypeStruct``.

    python bench/moe_dispatch.py [--tokens 256,4096] [--ep 8,64] [--factors 1.0,1.25,2.0] [--json]

Runs in about a minute on two cores. Prints a table, or with ``--json`` one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

import jax
import jax.numpy as jnp

from dayzero.model.config import MoEConfig
from dayzero.model.moe_parallel import Exchange, dispatch_stats, moe_expert_parallel
from dayzero.model.parallel import Parallel
from dayzero.model.presets import load_preset
from dayzero.model.weights import MoEWeights
from dayzero.sharding.placement import placement_for

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-to-all|all-gather|ragged-all-to-all)\(.*?"
                         r"replica_groups=\{\{([\d,]*)\}")


def collective_bytes(hlo: str) -> list[dict]:
    """Every all-to-all, all-gather and ragged-all-to-all of an HLO module's text (``Lowered.as_text
    (dialect="hlo")``, inside shard_map: per-device shapes): op, dtype, result shape, group size
    and, for the dense ones, the bytes each device sends to the others.

    A dense all-to-all's result has its operand's shape, of which a device keeps 1/g; an
    all-gather's result is g operands, each sent to the g-1 others: either way each device sends
    (g-1)/g of the result. A ragged one's traffic depends on its sizes, not its shape (None).
    """
    out = []
    for dtype, dims, op, group in _COLLECTIVE.findall(hlo):
        shape = [int(d) for d in dims.split(",") if d]
        g = len(group.split(","))
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        out.append({"op": op, "dtype": dtype, "shape": shape, "group": g,
                    "bytes_sent": None if op == "ragged-all-to-all" else nbytes * (g - 1) // g})
    return out


def lowered_hlo(config: MoEConfig, D: int, tokens: int, par: Parallel) -> str:
    """The HLO text of one MoE block (no shared experts) lowered with abstract bf16 weights and
    hidden states: nothing but the shapes is allocated."""
    E, F = config.num_experts, config.intermediate_size

    def abstract(shape, axes, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=par.placement.sharding(axes, shape))

    stack = ("experts", "embed", "ffw")
    w = MoEWeights(router=abstract((D, E), ("embed", None)), gate=abstract((E, D, F), stack),
                   up=abstract((E, D, F), stack), down=abstract((E, F, D), ("experts", "ffw", "embed")),
                   score_bias=abstract((E,), (None,), jnp.float32))
    x = jax.ShapeDtypeStruct((1, tokens, D), jnp.bfloat16, sharding=par.placement.replicated())
    return jax.jit(lambda w, x: moe_expert_parallel(w, config, x, par)).lower(w, x).as_text(dialect="hlo")


def routings(config: MoEConfig, D: int, tokens: int, skew: float) -> dict[str, tuple]:
    """(router [D,E] bf16, score bias [E], hidden states [1,T,D] bf16) per routing case: random
    (near-uniform), and skewed: the first E/8 experts' scores raised by ``skew`` for the choice."""
    E = config.num_experts
    router = (jax.random.normal(jax.random.key(0), (D, E)) * D**-0.5).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, tokens, D), jnp.bfloat16)
    hot = jnp.where(jnp.arange(E) < E // 8, skew, 0.0).astype(jnp.float32)
    return {"uniform": (router, jnp.zeros(E, jnp.float32), x), "skewed": (router, hot, x)}


def measure(config: MoEConfig, D: int, tokens: int, ep: int, factors: list[float], skew: float) -> list[dict]:
    """The table rows of one (tokens, ep): per routing, dense no-drop (HLO), ragged (routing) and
    each capacity factor (HLO bytes, measured drops)."""
    placement = placement_for({"expert": ep}, devices=jax.devices()[:ep])
    stats_of = jax.jit(dispatch_stats, static_argnums=(2, 4))
    hlo = {}  # per (factor, exchange): what the lowered block's collectives say
    for f in [None, *factors]:
        text = lowered_hlo(config, D, tokens, Parallel(placement, f, exchange=Exchange.DENSE))
        hlo[f, "dense"] = collective_bytes(text)
    ragged = Parallel(placement, exchange=Exchange.RAGGED)
    hlo[None, "ragged"] = collective_bytes(lowered_hlo(config, D, tokens, ragged))
    rows = []
    for name, (router, bias, x) in routings(config, D, tokens, skew).items():
        x = jax.device_put(x, placement.replicated())
        for f, kind in [(None, "dense"), (None, "ragged"), *((f, "dense") for f in factors)]:
            par = Parallel(placement, f, exchange=Exchange(kind))
            stats = stats_of(router, bias, config, x, par)
            ops = hlo[f, kind]
            row = {"routing": name, "tokens": tokens, "ep": ep, "exchange": kind, "capacity_factor": f,
                   **{k: v for k, v in stats.as_dict().items() if k != "exchange"}}
            if kind == "dense":  # the program's own figure: its collectives' operand shapes
                row["hlo_bytes_per_device"] = sum(op["bytes_sent"] for op in ops)
                row["hlo_bytes"] = ep * row["hlo_bytes_per_device"]
            else:
                row["receive_buffer"] = [op["shape"] for op in ops if op["op"] == "ragged-all-to-all"][0]
            row["hottest_device_share"] = stats.as_dict()["max_rows_received"] / max(1, int(stats.pairs_routed))
            rows.append(row)
    return rows


def print_table(rows: list[dict], D: int) -> None:
    """One line per row: bytes moved per step (dense: from the HLO; ragged: from the routing)."""
    mb = 2**20
    print(f"DeepSeek-V3 MoE dispatch, bytes moved per step (both directions; D={D}, bf16 rows):")
    print(f"{'routing':>8} {'tokens':>6} {'ep':>3} {'dispatch':>16} {'rows/dest':>9} {'drop %':>7} "
          f"{'total MB':>10} {'per dev MB':>10} {'x ragged':>8} {'busiest rx':>10} {'recv buffer':>11}")
    ragged = {(r["routing"], r["tokens"], r["ep"]): r["bytes_moved"] for r in rows if r["exchange"] == "ragged"}
    for r in rows:
        dense = r["exchange"] == "dense"
        total = r["hlo_bytes"] if dense else r["bytes_moved"]
        per_device = r["hlo_bytes_per_device"] if dense else r["bytes_moved_per_device"]
        what = ("dense no-drop" if r["capacity_factor"] is None else f"dense f={r['capacity_factor']}") if dense \
            else "ragged"
        buffer = r["ep"] * r["capacity"] if dense else r["receive_buffer"][0]
        ratio = total / ragged[r["routing"], r["tokens"], r["ep"]]
        print(f"{r['routing']:>8} {r['tokens']:>6} {r['ep']:>3} {what:>16} {r['capacity']:>9} "
              f"{100 * r['drop_rate']:>7.2f} {total / mb:>10.1f} {per_device / mb:>10.2f} {ratio:>7.1f}x "
              f"{r['max_rows_received']:>10} {buffer:>11}")
    print("dense: from the lowered program's all-to-all/all-gather shapes; ragged: the routed rows off their "
          "device, out and back (per dev: the device that sends most); busiest rx: rows the busiest device "
          "received; recv buffer: its rows.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="256,4096", help="comma-separated tokens per step")
    p.add_argument("--ep", default="8,64", help="comma-separated expert-axis sizes (at most the faked devices)")
    p.add_argument("--factors", default="1.0,1.25,2.0", help="comma-separated capacity factors")
    p.add_argument("--skew", type=float, default=0.1, help="score bias of the skewed case's hot experts")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    # Faked CPU devices: read when jax first starts a backend, which nothing above has done (a
    # caller that set XLA_FLAGS keeps its own; importing this module sets nothing).
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(map(int, args.ep.split(',')))}")
    config = load_preset("deepseek-v3")
    moe, D = config.moe, config.hidden_size
    factors = [float(f) for f in args.factors.split(",")]
    start = time.perf_counter()
    rows = [row for tokens in map(int, args.tokens.split(",")) for ep in map(int, args.ep.split(","))
            for row in measure(moe, D, tokens, ep, factors, args.skew)]
    if args.json:
        print(json.dumps({"hidden_size": D, "experts": moe.num_experts, "experts_per_token": moe.experts_per_token,
                          "row_dtype": "bfloat16", "seconds": time.perf_counter() - start, "rows": rows}))
    else:
        print_table(rows, D)


if __name__ == "__main__":
    main()
