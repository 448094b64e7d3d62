"""Pipeline bubble against micro-batch count (``dayzero.model.pipeline``, 8 faked CPU devices).

The GPipe schedule runs M micro-batches through S stages in M + S - 1 ticks; at every tick each
stage computes (SPMD), so (S - 1) / (M + S - 1) of the stage-ticks are bubble: work on no
micro-batch. This bench prints that fraction beside the measured time of one jitted pipelined
prefill and one decode step of a batch for M = 1, 2, 4, 8, and the time of the same prefill on
one device for scale. For M >= S it also times ``pipeline_decode``, which keeps the micro-batches
in flight across decode steps (bubble (S - 1) / (steps * M + S - 1)), per decode step of the
whole batch. ``--serve`` adds the serving engine on the same mesh (``ServingEngine`` with
``ServingConfig(micro_batches=M)``): B requests of the prompt and ``--steps`` new tokens, served
after a warm-up run, its generated tokens per second (prefill chunks included) with plain decode
steps (each cuts its rows into M micro-batches and drains the pipeline at its end) and, for
M >= S, with decode steps in flight (``engine/serving_inflight.py``, up to 8 a call).

On faked CPU devices all stages share the host's cores, so the time does not show stages running
in parallel; it shows the work done: each tick runs B/M rows through every stage, so the step
time follows (M + S - 1) / M ticks-of-a-full-batch, i.e. it falls with M as the bubble's wasted
work does, until the micro-batches get too small to use the matmuls well.

    python bench/pipeline.py [--stages 4] [--tensor 2] [--layers 8] [--batch 8] [--prompt-len 64]
                             [--micro 1,2,4,8] [--steps 16] [--repeats 5] [--serve] [--json bench/pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dayzero.model import pipeline, pipeline_inflight  # noqa: E402
from dayzero.model.cache import empty_from_specs  # noqa: E402
from dayzero.model.config import Family, ModelConfig, RopeConfig  # noqa: E402
from dayzero.model.parallel import Parallel  # noqa: E402
from dayzero.model.transformer import forward  # noqa: E402
from dayzero.model.weights import abstract_weights, init_weights  # noqa: E402
from dayzero.sharding.placement import placement_for  # noqa: E402


def bench_config(layers: int) -> ModelConfig:
    """A small Llama-style model: width 256, 8 heads of 32, MLP 1024, vocabulary 1024."""
    return ModelConfig(family=Family.LLAMA, vocab_size=1024, hidden_size=256, intermediate_size=1024,
                       num_layers=layers, num_heads=8, num_kv_heads=8, head_dim=32, rms_norm_eps=1e-5,
                       max_position_embeddings=4096, rope=RopeConfig())


def timed(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def served(config, weights, placement, prompts: np.ndarray, new_tokens: int, micro: int, in_flight: bool) -> dict:
    """Generated tokens per second of the serving engine on ``placement`` with ``micro``
    micro-batches a decode step, every prompt a request (timed after a warm-up run): plain
    decode steps, or (``in_flight``) several a call with the micro-batches in flight."""
    from dayzero.engine import Engine, ServingConfig, ServingEngine
    from dayzero.engine import serving_inflight

    default = serving_inflight.IN_FLIGHT_STEPS
    serving_inflight.IN_FLIGHT_STEPS = default if in_flight else 1

    B, T = prompts.shape
    serving = ServingConfig(slots=B, max_context=T + new_tokens, max_chunk=max(16, 1 << (T - 1).bit_length()),
                            prefix_cache=False, micro_batches=micro)
    server = ServingEngine(Engine(config, weights, placement=placement), serving)
    ids = prompts.tolist()
    server.run(ids, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = server.run(ids, max_new_tokens=new_tokens, ignore_eos=True)
    serving_inflight.IN_FLIGHT_STEPS = default
    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return {"serve_in_flight_tok_s" if in_flight else "serve_tok_s": rate}


def main(argv=None) -> int:
    """Run the sweep; print a table and optionally write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--tensor", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--micro", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per in-flight loop")
    ap.add_argument("--serve", action="store_true", help="also time the serving engine per micro-batch count")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    config = bench_config(args.layers)
    specs = abstract_weights(config)
    weights = init_weights(specs, jax.random.key(0), scale=0.05)
    axes = {"stage": args.stages, "tensor": args.tensor}
    placement = placement_for(axes)
    plan = pipeline.plan_stages(specs, args.stages)
    staged = jax.device_put(pipeline.stage_weights(weights, plan),
                            placement.shardings(pipeline.staged_specs(specs, plan)))
    par = Parallel(placement)
    B, T = args.batch, args.prompt_len
    tokens = placement.replicate(np.random.default_rng(0).integers(0, config.vocab_size, (B, T), dtype=np.int32))
    one_device = jax.jit(lambda w, t: forward(w, config, t)[0])
    host_tokens = np.asarray(tokens)
    rows = [{"micro_batches": 0, "what": "one device (no pipeline)",
             "prefill_ms": 1e3 * timed(one_device, weights, host_tokens, repeats=args.repeats)}]
    step_tokens = placement.replicate(host_tokens[:, :1])
    for m in [int(x) for x in args.micro.split(",")]:
        if B % m:
            continue
        prefill = jax.jit(lambda w, t, m=m: pipeline.pipeline_forward(w, config, plan, par, t, num_micro=m))
        logits, new = prefill(staged, tokens)
        shape = (config, plan, B, 2 * T + args.steps)
        cache = empty_from_specs(pipeline.staged_cache_specs, *shape, jax.numpy.float32,
                                 shardings=placement.shardings(pipeline.staged_cache_specs(*shape)))
        cache = jax.jit(pipeline.append_staged)(cache, new)
        decode = jax.jit(lambda w, t, c, m=m: pipeline.pipeline_forward(w, config, plan, par, t, c, num_micro=m)[0])
        inflight = {}
        if m >= args.stages:  # micro-batches kept in flight across steps (pipeline_inflight.pipeline_decode)
            loop = jax.jit(lambda w, f, c, m=m: pipeline_inflight.pipeline_decode(w, config, plan, par, f, c, args.steps, m)[:2])
            first = placement.replicate(host_tokens[:, 0])
            inflight = {"inflight_steps": args.steps,
                        "inflight_bubble_fraction": round((args.stages - 1) / (args.steps * m + args.stages - 1), 4),
                        "inflight_decode_ms": 1e3 * timed(loop, staged, first, cache, repeats=args.repeats) / args.steps}
        rows.append({
            "micro_batches": m,
            "ticks": m + args.stages - 1,
            "bubble_fraction": round(pipeline.bubble_fraction(args.stages, m), 4),
            "prefill_ms": 1e3 * timed(prefill, staged, tokens, repeats=args.repeats),
            "decode_ms": 1e3 * timed(decode, staged, step_tokens, cache, repeats=args.repeats),
            **inflight,
            **(served(config, weights, placement, host_tokens, args.steps, m, False) if args.serve else {}),
            **(served(config, weights, placement, host_tokens, args.steps, m, True)
               if args.serve and m >= args.stages else {}),
        })
    print(f"stage={args.stages} tensor={args.tensor}, {args.layers} layers {[list(r) for r in plan.ranges]}, "
          f"batch {B}, prompt {T} (8 faked CPU devices on {os.cpu_count()} cores)")
    print(f"{'M':>3} {'ticks':>5} {'bubble':>7} {'prefill ms':>11} {'decode ms':>10} "
          f"{'in-flight bubble':>17} {'in-flight decode ms':>20} {'serve tok/s':>12} {'in flight':>10}")
    for r in rows:
        print(f"{r['micro_batches']:>3} {r.get('ticks', '-'):>5} {r.get('bubble_fraction', '-'):>7} "
              f"{r['prefill_ms']:>11.1f} {r.get('decode_ms', float('nan')):>10.2f} "
              f"{r.get('inflight_bubble_fraction', '-'):>17} {r.get('inflight_decode_ms', float('nan')):>20.2f} "
              f"{r.get('serve_tok_s', float('nan')):>12.1f} {r.get('serve_in_flight_tok_s', float('nan')):>10.1f}")
    if args.json:
        record = {"stages": args.stages, "tensor": args.tensor, "layers": args.layers, "batch": B, "prompt_len": T,
                  "ranges": [list(r) for r in plan.ranges], "cpu_count": os.cpu_count(), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
