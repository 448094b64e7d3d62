"""Preemption with KV swap to host memory against recomputation, side by side in one run.

    python bench/kv_swap.py [--model DIR] [--requests 8] [--prompt-len 256] [--new-tokens 64]
        [--pool-fraction 0.5] [--repeats 2] [--json OUT]

The same greedy requests are served twice by one engine, with a page pool holding only
``--pool-fraction`` of what they need at once (so decoding preempts): once with
``swap_bytes=0`` (a preempted request is recomputed from its tokens) and once swapping its pages
to host memory (``engine/kv_swap.py``). Reported per mode: wall time of the best of
``--repeats`` runs after a warm-up run (compiles excluded), preemptions, prefill tokens run, and
the positions restored from the host. The tokens of both modes are checked equal.
Default model: the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from dayzero.engine import Engine
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.serving import ServingEngine


def serve_once(engine: Engine, config: ServingConfig, prompts: list[list[int]], new: int) -> tuple[float, list, dict]:
    """Serve ``prompts`` (``new`` greedy tokens each); (seconds, token ids, stats)."""
    server = ServingEngine(engine, config)
    start = time.perf_counter()
    ids = [server.submit(p, max_new_tokens=new, ignore_eos=True) for p in prompts]
    for _ in server.stream():
        pass
    seconds = time.perf_counter() - start
    return seconds, [server.completion(i).token_ids for i in ids], dataclasses.asdict(server.stats)


def main() -> None:
    """Run both modes and print one table (and ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pool-fraction", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    engine = Engine.load(args.model, progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.config.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
    page = 16
    per_request = -(-(args.prompt_len + args.new_tokens) // page)
    # Two pages short of the fraction: the admitted requests' last pages do not all fit, so decoding preempts.
    pages = max(per_request + 1, int(args.pool_fraction * per_request * args.requests) - 2)
    base = ServingConfig(slots=args.requests, page_size=page, num_pages=pages,
                         max_context=args.prompt_len + args.new_tokens, prefix_cache=False)
    rows, tokens = {}, {}
    for mode, swap in (("recompute", 0), ("swap", None)):
        config = dataclasses.replace(base, swap_bytes=swap)
        serve_once(engine, config, prompts, args.new_tokens)  # warm-up: compiles
        runs = [serve_once(engine, config, prompts, args.new_tokens) for _ in range(args.repeats)]
        seconds, tokens[mode], stats = min(runs, key=lambda r: r[0])
        rows[mode] = {"seconds": round(seconds, 3), "preemptions": stats["preemptions"],
                      "prefill_tokens": stats["prefill_tokens"], "swapped_tokens": stats["swapped_tokens"],
                      "generated_tokens": stats["generated_tokens"]}
    if tokens["swap"] != tokens["recompute"]:
        raise SystemExit("the two modes produced different tokens")
    rows["swap"]["speedup"] = round(rows["recompute"]["seconds"] / rows["swap"]["seconds"], 2)
    print(f"{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new), pool {pages} pages of {page}")
    print(f"{'mode':10} {'seconds':>8} {'preempt':>8} {'prefill tok':>12} {'swapped tok':>12}")
    for mode, r in rows.items():
        print(f"{mode:10} {r['seconds']:8.2f} {r['preemptions']:8d} {r['prefill_tokens']:12d} {r['swapped_tokens']:12d}")
    print(f"swap / recompute speed-up: {rows['swap']['speedup']}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "num_pages": pages, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
