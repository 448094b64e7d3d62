"""``dayzero bench``: time to first token, prefill and decode throughput, compile time, memory.

Sweeps prompt lengths and batch sizes (``--prompt-len 128,512,2048 --batch 1,8``). Peers run
the same prompts in the same process (``--vs-hf``, ``--vs-llamacpp``), repeat by repeat in turn
with dayzero (``measure.interleaved_speeds``), and the ratios are printed: these machines are
shared and noisy, so only side-by-side ratios mean much.
For the same reason the machine's read bandwidth is measured in the same run
(``dayzero.tools.roofline``), and each row reports the fraction of the decode roofline it reached
(``roofline``: bytes read per step over that bandwidth).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from dayzero.tools import peers
from dayzero.tools.roofline import read_bandwidth, roofline, weight_bytes_per_step
from dayzero.tools.measure import bench_prompt, device_peak_mb, interleaved_speeds, peak_rss_mb, rss_mb
from dayzero.engine.sampling import SamplingParams
from dayzero.model.quant import KVQuant, describe_weights, stored_bytes
from dayzero.model.cache import init_cache
from dayzero.tools.soak import soak


class BenchError(ValueError):
    """Bad benchmark options."""


def bench_engine(engine, prompts: list[list[int]], new_tokens: int, repeats: int,
                 peer_runs: dict | None = None) -> dict[str, float]:
    """Measure dayzero on ``prompts`` (best of ``repeats`` after a compiling warm-up), with any
    ``peer_runs`` (name -> ``(run, prompts)``, as :func:`~dayzero.tools.measure.interleaved_speeds`
    takes them) measured round by round beside it; their speeds come back under their names.

    Time to first token is prefill + first sample; decode rate is between first and last token.
    """
    compile_before = engine.compile_s
    greedy = [SamplingParams()] * len(prompts)

    def run() -> tuple[float, float]:
        start = time.perf_counter()
        first = None
        for _ in engine.stream_ids(prompts, new_tokens, greedy):
            first = first or time.perf_counter()
        return first - start, time.perf_counter() - first

    measured = interleaved_speeds({"dayzero": (run, prompts), **(peer_runs or {})}, new_tokens, repeats)
    return {
        **measured.pop("dayzero"),
        **measured,
        "compile_s": engine.compile_s - compile_before,
        "rss_mb": rss_mb(),
        "peak_rss_mb": peak_rss_mb(),
        "device_peak_mb": device_peak_mb(),
        "kv_cache_mb": kv_cache_bytes(
            engine.config, len(prompts), len(prompts[0]) + new_tokens, engine.weights.embed.dtype, engine.kv_cache
        ) / 2**20,
    }


def kv_cache_bytes(config, batch: int, length: int, dtype, kv_quant: KVQuant = KVQuant.NONE) -> int:
    """Bytes of the cache buffers for ``batch`` rows of ``length`` positions (before bucket padding).

    Read off the shapes ``init_cache`` would allocate (no allocation), so per-head K/V, MLA latent
    rows, DSA indexer keys and the scales of a quantized cache are all counted as stored.
    """
    cache = jax.eval_shape(lambda: init_cache(config, batch, length, dtype, kv_quant))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache) if x.ndim >= 3)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"{flag} {text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise BenchError(f"{flag} {text!r} must list integers >= 1")
    return values


def _runs(engine, args, peer_map: dict, prompt_lens: list[int], batches: list[int],
          bandwidth: float | None = None) -> list[dict]:
    context = engine.config.max_position_embeddings
    too_long = [n for n in prompt_lens if n + args.new_tokens > context]
    if too_long:  # checked before any run, so a long sweep does not fail at its end
        raise BenchError(
            f"--prompt-len {too_long[0]} + --new-tokens {args.new_tokens} exceeds the model's context of {context}"
        )
    runs = []
    for prompt_len in prompt_lens:
        for batch in batches:
            prompts = bench_prompt(engine.config.vocab_size, prompt_len, batch, engine.eos_ids)
            row = {"prompt_len": prompt_len, "batch": batch, "new_tokens": args.new_tokens}
            # Peers run round by round with dayzero (interleaved_speeds); llama-cpp-python's API
            # runs one sequence, so it sits out batches.
            peer_runs = {name: peer.runner(prompts, args.new_tokens)
                         for name, peer in peer_map.items() if not (name == "llamacpp" and batch > 1)}
            row.update(bench_engine(engine, prompts, args.new_tokens, args.repeats, peer_runs))
            if bandwidth is not None:
                row["roofline"] = decode_roofline(engine, row, bandwidth)
            for name in peer_runs:
                row[f"ratio_{name}"] = ratios(row, row[name])
            runs.append(row)
    return runs


def decode_roofline(engine, row: dict, bandwidth: float) -> dict[str, float]:
    """The decode roofline of one benchmark ``row`` (``dayzero.tools.roofline.roofline``): the
    engine's weights read once per step plus its KV cache at the row's mean decode position."""
    per_position = kv_cache_bytes(engine.config, 1, 1, engine.weights.embed.dtype, engine.kv_cache)
    return roofline(weight_bytes_per_step(engine.weights), per_position, row["prompt_len"], row["new_tokens"],
                    row["batch"], row["decode_tok_s"], bandwidth)


def ratios(ours: dict, peer: dict) -> dict[str, float]:
    """dayzero / peer for speeds; peer / dayzero for time to first token (> 1: dayzero faster)."""
    return {
        "ttft_s": peer["ttft_s"] / ours["ttft_s"],
        "prefill_tok_s": ours["prefill_tok_s"] / peer["prefill_tok_s"],
        "decode_tok_s": ours["decode_tok_s"] / peer["decode_tok_s"],
    }


def make_peers(args) -> dict[str, object]:
    """The peers asked for, by name; constructing them checks they can run, loading is lazy."""
    made = {}
    if args.vs_hf:
        made["hf"] = peers.HFPeer(peers.hf_source(args.vs_hf, args.model))
    if args.vs_llamacpp:
        made["llamacpp"] = peers.LlamaCppPeer(Path(args.vs_llamacpp))
    return made


def _print_table(result: dict) -> None:
    print(f"dayzero bench: {result['new_tokens']} new tokens, {result['dtype']}, weights {result['quantize']} "
          f"({result['weights_mb']:.0f} MiB), kv cache {result['kv_cache']}, {result['backend']}")
    header = f"{'prompt':>7}{'batch':>6}{'ttft_s':>9}{'prefill/s':>11}{'decode/s':>10}{'compile_s':>10}{'rss_mb':>9}{'kv_mb':>8}"
    print(header)
    for r in result["runs"]:
        print(
            f"{r['prompt_len']:>7}{r['batch']:>6}{r['ttft_s']:>9.3f}{r['prefill_tok_s']:>11.1f}"
            f"{r['decode_tok_s']:>10.1f}{r['compile_s']:>10.2f}{r['rss_mb']:>9.0f}{r['kv_cache_mb']:>8.1f}"
        )
        if "roofline" in r:
            f = r["roofline"]
            print(f"{'  roofline':>13}  {f['bytes_per_step'] / 2**20:.0f} MiB read per step at "
                  f"{f['read_bandwidth_gb_s']:.1f} GB/s: {f['roofline_tok_s']:.1f} tok/s limit, "
                  f"decode at {f['fraction']:.0%} of it")
        for name in ("hf", "llamacpp"):
            if name in r:
                p, q = r[name], r[f"ratio_{name}"]
                print(
                    f"{'  ' + name:>13}{p['ttft_s']:>9.3f}{p['prefill_tok_s']:>11.1f}{p['decode_tok_s']:>10.1f}"
                    f"   ratio ttft {q['ttft_s']:.2f}x prefill {q['prefill_tok_s']:.2f}x decode {q['decode_tok_s']:.2f}x"
                )
    if any("hf" in r or "llamacpp" in r for r in result["runs"]):
        print("ratio = dayzero speed / peer speed (ttft: peer time / dayzero time); > 1 means dayzero is faster")
    if "speculative" in result:
        from dayzero.tools.bench_spec import spec_line

        print(spec_line(result["speculative"]))
    if "soak" in result:
        s = result["soak"]
        print(
            f"soak to {s['max_len']} tokens: {s['compiles_after_warmup']} compilations after warm-up, "
            f"RSS growth {s['rss_growth_mb']:.1f} MiB, last/first step latency {s['latency_last_over_first']:.2f}"
        )


def run_bench(args: argparse.Namespace, placement=None) -> int:
    """Run the benchmark described by the parsed ``dayzero bench`` arguments (on ``placement``'s
    mesh when given: a ``dayzero.sharding.placement.Placement``)."""
    from dayzero.engine.generate import Engine
    from dayzero.engine.runtime import options_from_args

    prompt_lens = _int_list(args.prompt_len, "--prompt-len")
    batches = _int_list(args.batch, "--batch")
    for name in ("new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.new_tokens < 2:
        raise BenchError("--new-tokens must be >= 2 to measure decoding")
    peer_map = make_peers(args)
    from dayzero.engine.cli import speculative_config

    spec = speculative_config(args)  # a bad --speculative fails before the model loads
    engine = Engine.load(args.model, placement=placement, **options_from_args(args))
    # Measured once per run, beside the decode figures it bounds (one device's memory).
    bandwidth = read_bandwidth() if placement is None else None
    runs = _runs(engine, args, peer_map, prompt_lens, batches, None if bandwidth is None else bandwidth["bytes_s"])
    result = {**runs[0], "runs": runs, "dtype": str(engine.weights.embed.dtype), "backend": jax.default_backend(),
              "mesh": None if placement is None else placement.axes,
              "quantize": describe_weights(engine.weights), "weights_mb": stored_bytes(engine.weights) / 2**20,
              "kv_cache": engine.kv_cache.value, "run": engine.run.describe(), "read_bandwidth": bandwidth}
    if spec is not None:
        from dayzero.tools.bench_spec import bench_speculative

        prompts = bench_prompt(engine.config.vocab_size, prompt_lens[0], batches[0], engine.eos_ids)
        result["speculative"] = bench_speculative(engine, prompts, args.new_tokens, args.repeats, spec)
    if args.soak:
        result["soak"] = soak(engine, args.soak_len)
    if args.plot:
        from dayzero.tools.plot import plot_bench

        plot_bench(result, Path(args.plot))
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0
