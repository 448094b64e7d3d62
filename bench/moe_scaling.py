"""Time of one jitted MoE block (``dayzero.model.moe.moe``) as the number of experts grows.

The dispatch sorts the T*C (token, expert) pairs by expert and runs each expert on its rows only,
so the expert FLOPs are O(T*C*D*F) whatever E is; only the router (O(T*E*D)) and the histogram
(O(E)) grow with E. What does grow is memory traffic: every expert that some token chose has its
weights read once, and with T*C pairs spread over E experts about min(E, T*C) of them are active.
So with 256 tokens the time follows the active experts' weight bytes, and with a few
(decode-sized) tokens it stays flat. For contrast, ``--impl ragged_dot`` times
``jax.lax.ragged_dot``, which XLA:CPU expands into a product with every expert.

    python bench/moe_scaling.py [--tokens 256,4] [--width 256] [--ffw 256] [--top-k 2]
                                [--experts 8,64,256] [--impl expert_loop|ragged_dot] [--repeats 20]

Prints one table per token count (experts, weights MB, active experts and their weights MB,
median and best ms per call, ratio to the first row) and, with ``--json``, one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from dayzero.model.config import MoEConfig
from dayzero.model.moe import GroupedMatmul, moe, route
from dayzero.model.weights import MoEWeights


def random_block(num_experts: int, width: int, ffw: int, key: jax.Array) -> MoEWeights:
    """Random fp32 MoE weights with O(1) activations (scale 1/sqrt(fan-in))."""
    k = jax.random.split(key, 4)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape) * fan_in**-0.5  # noqa: E731
    return MoEWeights(
        router=normal(k[0], (width, num_experts), width),
        gate=normal(k[1], (num_experts, width, ffw), width),
        up=normal(k[2], (num_experts, width, ffw), width),
        down=normal(k[3], (num_experts, ffw, width), ffw),
    )


def time_block(num_experts: int, tokens: int, args: argparse.Namespace) -> dict:
    """Median and best wall time of one jitted call, after a compiling warm-up call."""
    config = MoEConfig(num_experts, args.top_k, args.ffw, (True,))
    w = random_block(num_experts, args.width, args.ffw, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, tokens, args.width))
    active = len(set(route(w.router, config, x[0])[1].ravel().tolist()))
    step = jax.jit(moe, static_argnums=(1, 3))
    impl = GroupedMatmul(args.impl)
    step(w, config, x, impl).block_until_ready()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step(w, config, x, impl).block_until_ready()
        times.append(time.perf_counter() - start)
    expert_mb = (w.gate.nbytes + w.up.nbytes + w.down.nbytes) / num_experts / 2**20
    return {"tokens": tokens, "experts": num_experts, "weights_mb": round(expert_mb * num_experts, 1),
            "active_experts": active, "active_mb": round(expert_mb * active, 1),
            "median_ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="256,4", help="comma-separated token counts, one table each")
    p.add_argument("--width", type=int, default=256, help="D, the model width")
    p.add_argument("--ffw", type=int, default=256, help="F, the width of one expert")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts", default="8,64,256", help="comma-separated numbers of experts")
    p.add_argument("--impl", default=GroupedMatmul.EXPERT_LOOP.value, choices=[g.value for g in GroupedMatmul])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = [time_block(int(e), tokens, args) for e in args.experts.split(",")]
        if args.json:
            for row in rows:
                print(json.dumps(row))
            continue
        print(f"MoE block, {jax.default_backend()}, impl={args.impl}: T={tokens} D={args.width} "
              f"F={args.ffw} top-{args.top_k}, fp32")
        print(f"{'experts':>8} {'weights MB':>11} {'active':>7} {'active MB':>10} {'median ms':>10} "
              f"{'best ms':>8} {'vs first':>9}")
        for row in rows:
            ratio = row["median_ms"] / rows[0]["median_ms"]
            print(f"{row['experts']:>8} {row['weights_mb']:>11.1f} {row['active_experts']:>7} "
                  f"{row['active_mb']:>10.1f} {row['median_ms']:>10.2f} {row['best_ms']:>8.2f} {ratio:>8.2f}x")
        print()


if __name__ == "__main__":
    main()
