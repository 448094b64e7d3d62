"""The host memory tier of the KV pool (``engine/kv_swap.py``), measured three ways in one run.

    python bench/kv_swap.py [--model DIR] [--requests 8] [--prompt-len 256] [--new-tokens 64]
        [--pool-fraction 0.5] [--repeats 2] [--contexts 1,2,4,8] [--context-len 256]
        [--rounds 2] [--tier-pool-contexts 2] [--copy-pages 16,64] [--json OUT]

1. **Swap against recompute**: the same greedy requests served twice by one engine, with a page
   pool holding only ``--pool-fraction`` of what they need at once (so decoding preempts): once
   with ``swap_bytes=0`` (a preempted request is recomputed from its tokens) and once swapping
   its pages to host memory. Per mode: wall time of the best of ``--repeats`` runs after a
   warm-up run (compiles excluded), preemptions, prefill tokens run, positions restored from the
   host. The tokens of both modes are checked equal.
2. **Host prefix tier at a fixed device pool**: N long contexts (``--context-len`` random tokens
   each: documents, or per-tenant system prompts), each asked ``--rounds`` questions (a 16-token
   tail, 8 new tokens), served in rounds (every context once, then again), on a device pool of
   ``--tier-pool-contexts`` contexts' pages (and room for the running requests' tails), with
   and without the host tier (``host_cache_bytes``: as large as the device pool, the default,
   against 0). Without the tier a context evicted between its questions is recomputed; with it
   its pages are copied back. Per N: wall time, prefill tokens computed, positions copied from
   the host, tokens checked equal. "Contexts kept warm": the largest N whose later rounds
   prefilled only the questions (every context computed once).
3. **Copy time by host memory kind**: ``--copy-pages`` pages gathered and copied to the host
   and back, rows held as ``pinned_host`` jax arrays against numpy arrays (median of 5).

Default model: the embedded SmolLM2-135M-Instruct (fp32, pages of 16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax

import numpy as np

from dayzero.engine import Engine
from dayzero.engine.kv_swap import HostSwap
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.serving import ServingEngine

PAGE = 16
QUESTION, ANSWER = 16, 8  # tokens of each question about a context, and of its answer


def serve_once(engine: Engine, config: ServingConfig, prompts: list[list[int]], new: int) -> tuple[float, list, dict]:
    """Serve ``prompts`` (``new`` greedy tokens each); (seconds, token ids, stats)."""
    server = ServingEngine(engine, config)
    start = time.perf_counter()
    ids = [server.submit(p, max_new_tokens=new, ignore_eos=True) for p in prompts]
    for _ in server.stream():
        pass
    seconds = time.perf_counter() - start
    return seconds, [server.completion(i).token_ids for i in ids], dataclasses.asdict(server.stats)


def swap_vs_recompute(engine: Engine, args) -> dict:
    """Part 1: the same requests with preempted ones recomputed, then swapped."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.config.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
    per_request = -(-(args.prompt_len + args.new_tokens) // PAGE)
    # Two pages short of the fraction: the admitted requests' last pages do not all fit, so decoding preempts.
    pages = max(per_request + 1, int(args.pool_fraction * per_request * args.requests) - 2)
    base = ServingConfig(slots=args.requests, page_size=PAGE, num_pages=pages,
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
        raise SystemExit("swap and recompute produced different tokens")
    rows["swap"]["speedup"] = round(rows["recompute"]["seconds"] / rows["swap"]["seconds"], 2)
    print(f"{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new), "
          f"pool {pages} pages of {PAGE}")
    print(f"{'mode':10} {'seconds':>8} {'preempt':>8} {'prefill tok':>12} {'swapped tok':>12}")
    for mode, r in rows.items():
        print(f"{mode:10} {r['seconds']:8.2f} {r['preemptions']:8d} {r['prefill_tokens']:12d} "
              f"{r['swapped_tokens']:12d}")
    print(f"swap / recompute speed-up: {rows['swap']['speedup']}x")
    return {"num_pages": pages, "rows": rows}


def serve_rounds(engine: Engine, config: ServingConfig, contexts: list[list[int]], rounds: int,
                 slots: int) -> tuple[float, list, dict]:
    """Part 2's workload: every context asked a fresh question, ``slots`` at a time, round after
    round; (seconds after compiling every step shape, token ids, stats)."""
    rng = np.random.default_rng(1)
    server = ServingEngine(engine, config)
    server.warmup()
    start, out = time.perf_counter(), []
    for _ in range(rounds):
        prompts = [c + rng.integers(0, engine.config.vocab_size, QUESTION).tolist() for c in contexts]
        for i in range(0, len(prompts), slots):
            out += [c.token_ids for c in server.run(prompts[i : i + slots], max_new_tokens=ANSWER, ignore_eos=True)]
    return time.perf_counter() - start, out, dataclasses.asdict(server.stats)


def host_tier(engine: Engine, args) -> dict:
    """Part 2: N long contexts asked in rounds over a fixed device pool, with and without the host tier."""
    slots, length = 4, args.context_len
    per_context = -(-length // PAGE)
    # The pool: --tier-pool-contexts contexts' pages, plus every slot's question and answer page.
    pages = args.tier_pool_contexts * per_context + slots * (-(-(QUESTION + ANSWER) // PAGE) + 1)
    base = ServingConfig(slots=slots, page_size=PAGE, num_pages=pages, max_context=length + QUESTION + ANSWER)
    rng = np.random.default_rng(2)
    counts = [int(n) for n in args.contexts.split(",")]
    contexts = [rng.integers(0, engine.config.vocab_size, length).tolist() for _ in range(max(counts))]
    rows = []
    for n in counts:
        row = {"contexts": n}
        for mode, tier in (("without", 0), ("with", None)):
            seconds, tokens, stats = serve_rounds(engine, dataclasses.replace(base, host_cache_bytes=tier),
                                                  contexts[:n], args.rounds, slots)
            row[mode] = {"seconds": round(seconds, 3), "prefill_tokens": stats["prefill_tokens"],
                         "host_cached_tokens": stats["host_cached_tokens"],
                         "requests_per_s": round(n * args.rounds / seconds, 3),
                         "warm": stats["prefill_tokens"] == n * (length + args.rounds * QUESTION)}
            row[mode + "_tokens"] = tokens
        if row.pop("with_tokens") != row.pop("without_tokens"):
            raise SystemExit(f"{n} contexts: the host tier changed the tokens")
        rows.append(row)
    warm = {mode: max([r["contexts"] for r in rows if r[mode]["warm"]], default=0) for mode in ("without", "with")}
    print(f"\n{len(counts)} sizes of N contexts x {length} tokens, {args.rounds} rounds of {QUESTION}-token questions, "
          f"{slots} slots, device pool {pages} pages of {PAGE} ({args.tier_pool_contexts} contexts)")
    print(f"{'N':>3} {'s without':>10} {'s with':>8} {'prefill without':>16} {'prefill with':>13} {'from host':>10}")
    for r in rows:
        a, b = r["without"], r["with"]
        print(f"{r['contexts']:3d} {a['seconds']:10.2f} {b['seconds']:8.2f} {a['prefill_tokens']:16d} "
              f"{b['prefill_tokens']:13d} {b['host_cached_tokens']:10d}")
    print(f"contexts kept warm (no recomputation): {warm['without']} without the tier, {warm['with']} with it")
    return {"num_pages": pages, "slots": slots, "rows": rows, "contexts_kept_warm": warm}


def copy_times(engine: Engine, args) -> dict:
    """Part 3: seconds to copy pages to the host and back, by host memory kind."""
    counts = [int(n) for n in args.copy_pages.split(",")]
    config = ServingConfig(slots=1, page_size=PAGE, num_pages=max(counts) + 1, max_context=max(counts) * PAGE)
    server = ServingEngine(engine, dataclasses.replace(config, swap_bytes=0, host_cache_bytes=0))
    out = {}
    for kind in ("pinned_host", "numpy"):
        swap = HostSwap(server.steps, 0, kind=kind)
        for n in counts:
            pages, times = list(range(n)), {"out": [], "in": []}
            for _ in range(6):  # the first compiles
                start = time.perf_counter()
                rows = jax.block_until_ready(swap._rows_out(pages))
                times["out"].append(time.perf_counter() - start)
                start = time.perf_counter()
                swap._rows_in(pages, rows)
                jax.block_until_ready(server.steps.pool)
                times["in"].append(time.perf_counter() - start)
            mb = n * swap._page_bytes / 1e6
            out[f"{kind}/{n}"] = {"pages": n, "mb": round(mb, 2), **{
                f"{d}_ms": round(1e3 * statistics.median(t[1:]), 2) for d, t in times.items()}}
    print(f"\ncopy of pages of {swap._page_bytes / 1e6:.2f} MB to the host and back (median ms)")
    for key, r in out.items():
        print(f"{key:16} {r['mb']:8.1f} MB  out {r['out_ms']:8.2f}  in {r['in_ms']:8.2f}")
    return out


def main() -> None:
    """Run the three parts and print their tables (and ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pool-fraction", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--contexts", default="1,2,4,8", help="numbers of long contexts served in rounds (part 2)")
    ap.add_argument("--context-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tier-pool-contexts", type=int, default=2, help="contexts' pages the device pool holds")
    ap.add_argument("--copy-pages", default="16,64")
    ap.add_argument("--parts", default="1,2,3")
    ap.add_argument("--json")
    args = ap.parse_args()
    engine = Engine.load(args.model, progress=False)
    parts = {"1": ("swap_vs_recompute", swap_vs_recompute), "2": ("host_tier", host_tier), "3": ("copy", copy_times)}
    result = {"args": vars(args), "backend": jax.default_backend()}
    for part in args.parts.split(","):
        name, run = parts[part]
        result[name] = run(engine, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
