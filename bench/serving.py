"""Continuous batching over the paged KV cache: aggregate throughput, decode cost by table
width, and KV memory for a long context against the contiguous cache.

    python bench/serving.py [--model DIR | --config HF_CONFIG [--dtype bfloat16] [--layers N]]
        [--requests 32] [--prompt-len 64] [--new-tokens 32] [--long 3000] [--widths 8,64,512]
        [--kernels auto] [--skip SECTIONS] [--json]

1. Throughput: the same ``--requests`` prompts (``--new-tokens`` each, EOS ignored, so every
   run produces the same tokens) served concurrently by ``ServingEngine`` (one slot each),
   against ``Engine.generate`` running them one by one, and the serving engine one at a time.
   Compilation is done before timing (``warmup``, or a first request).
2. Decode step time against the block-table width (the reference path gathers and attends over
   every page of the table, so the width, not the context used, sets the cost): one decode step
   of 8 slots at each ``--widths`` pages, and of the contiguous cache at the same length.
3. Memory for one ``--long``-token prompt (+16 tokens), each engine in its own process: KV bytes
   allocated (the contiguous cache is a power-of-two bucket of the length; the pool is sized to
   the request's pages here) and the peak RSS of the generation; and, from shapes alone, the KV
   bytes of a batch mixing that long prompt with ``--requests - 1`` short ones.
4. KV formats (from shapes alone): the bytes of the page pool for that long prompt stored
   unquantized and as each quantized ``--kv-cache`` scheme (values plus fp32 scales).

With ``--kernels`` resolving to a Pallas mode (``auto`` on a GPU) the serving engine runs on the
kernels, and section 1 is followed by the same concurrent workload served on the kernels and on
the reference path side by side (tokens/s of each, and how many requests gave identical tokens).

Default model: the embedded SmolLM2-135M (set DAYZERO_CACHE to reuse a converted copy);
``--config`` serves random weights of any HF architecture instead (on a machine without the
checkpoint: the shapes, and so the timings, are the real model's; the tokens are not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.tools.bench import kv_cache_bytes
from dayzero.engine.generate import Engine, cache_length
from dayzero.tools.measure import bench_prompt, peak_rss_since_reset_mb, reset_peak_rss
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.serving import ServingEngine
from dayzero.kernels import KernelMode, resolve_mode
from dayzero.model.hf_config import load_hf_config
from dayzero.model.paged_cache import init_paged_cache
from dayzero.model.quant import KVQuant
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.model.transformer import forward
from dayzero.model.cache import append_to_cache, init_cache

PAGE = 16
LONG_NEW = 16


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def _throughput_config(requests: int, prompt_len: int, new_tokens: int, kernels: str) -> ServingConfig:
    return ServingConfig(slots=requests, page_size=PAGE, max_context=prompt_len + new_tokens,
                         num_pages=requests * _pages(prompt_len + new_tokens),
                         max_chunk=min(512, 1 << (prompt_len - 1).bit_length()), kernels=kernels)


def throughput(engine: Engine, requests: int, prompt_len: int, new_tokens: int, kernels: str) -> dict:
    """Aggregate tokens/s: concurrent serving, Engine.generate one by one, serving one by one."""
    prompts = bench_prompt(engine.config.vocab_size, prompt_len, requests, engine.eos_ids)
    total = requests * new_tokens
    server = ServingEngine(engine, _throughput_config(requests, prompt_len, new_tokens, kernels))
    start = time.perf_counter()
    shapes = server.warmup()
    out = {"warmup_s": time.perf_counter() - start, "warmup_shapes": shapes}

    start = time.perf_counter()
    served = server.run(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    out["concurrent_s"] = time.perf_counter() - start
    out["decode_steps"] = server.stats.decode_steps

    engine.generate(prompts[0], max_new_tokens=new_tokens, ignore_eos=True)  # compile
    start = time.perf_counter()
    alone = [engine.generate(p, max_new_tokens=new_tokens, ignore_eos=True) for p in prompts]
    out["generate_one_by_one_s"] = time.perf_counter() - start

    start = time.perf_counter()
    for p in prompts:
        server.run([p], max_new_tokens=new_tokens, ignore_eos=True)
    out["serving_one_by_one_s"] = time.perf_counter() - start

    out["same_tokens"] = sum(a.token_ids == b.token_ids for a, b in zip(served, alone))
    for key in ("concurrent", "generate_one_by_one", "serving_one_by_one"):
        out[f"{key}_tok_s"] = total / out[f"{key}_s"]
    out["speedup_vs_generate"] = out["concurrent_tok_s"] / out["generate_one_by_one_tok_s"]
    out["kernels"] = server.config.kernels.value
    return out


def kernels_vs_reference(engine: Engine, requests: int, prompt_len: int, new_tokens: int, kernels: str) -> dict:
    """The same concurrent workload served on the kernels and on the reference path, in one
    run: tokens/s of each (a first untimed run compiles the shapes it uses) and how many
    requests gave identical tokens."""
    prompts = bench_prompt(engine.config.vocab_size, prompt_len, requests, engine.eos_ids)
    out, tokens = {}, {}
    for mode in (kernels, "reference"):
        server = ServingEngine(engine, _throughput_config(requests, prompt_len, new_tokens, mode))
        server.run(prompts, max_new_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        tokens[mode] = [c.token_ids for c in server.run(prompts, max_new_tokens=new_tokens, ignore_eos=True)]
        out[f"{server.config.kernels.value}_tok_s"] = requests * new_tokens / (time.perf_counter() - start)
    out["same_tokens"] = sum(a == b for a, b in zip(tokens[kernels], tokens["reference"]))
    return out


def width_sweep(engine: Engine, widths: list[int], kernels: str, slots: int = 8, steps: int = 5) -> dict:
    """Median decode step (forward + cache write) ms of ``slots`` rows nearly full, at each table
    width of the paged cache and at the same length of the contiguous cache."""
    config = ServingConfig(slots=slots, page_size=PAGE, max_context=max(widths) * PAGE, max_chunk=16,
                           num_pages=max(widths), kernels=kernels)
    server = ServingEngine(engine, config)
    tables = np.tile(np.arange(config.max_table_pages, dtype=np.int32) % config.num_pages, (slots, 1))
    tokens, ones = np.ones((slots, 1), np.int32), np.ones(slots, np.int32)
    rows = np.arange(slots, dtype=np.int32)  # each row its own slot (a hybrid's state rows)
    step = jax.jit(lambda w, t, n, cache: forward(w, engine.config, t, cache, n))
    append = jax.jit(append_to_cache, donate_argnums=(0,))
    out = {}
    for width in widths:
        length = width * PAGE - 1
        lengths = np.full(slots, length, np.int32)
        paged = lambda: np.asarray(server.steps.run_step(tokens, ones, lengths, tables, width, rows))  # noqa: E731
        cache = [init_cache(engine.config, slots, width * PAGE, engine.weights.embed.dtype).replace(
            lengths=jnp.full((slots,), length, jnp.int32))]

        def contiguous():
            logits, new = step(engine.weights, jnp.asarray(tokens), jnp.asarray(ones), cache[0])
            cache[0] = append(cache[0], new).replace(lengths=jnp.full((slots,), length, jnp.int32))
            np.asarray(logits)

        out[width * PAGE] = {name: _median_ms(fn, steps) for name, fn in (("paged", paged), ("contiguous", contiguous))}
        del cache[0]
    return out


def _median_ms(fn, steps: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def load_engine(args: argparse.Namespace) -> Engine:
    """The converted model at ``--model`` (default: the embedded SmolLM2), or, with ``--config``
    (an HF config.json or its directory), random weights of that architecture in ``--dtype``
    (default: bf16 on GPU, fp32 elsewhere), its first ``--layers`` layers if given: the real
    shapes of a model whose weights are not here."""
    if args.config is None:
        return Engine.load(args.model, progress=False)
    model_config = load_hf_config(args.config, {"num_hidden_layers": args.layers} if args.layers else None)
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    return Engine(model_config, init_weights(abstract_weights(model_config), jax.random.key(0), jnp.dtype(dtype)))


def memory(args: argparse.Namespace, kind: str, length: int) -> dict:
    """KV bytes and RSS of one ``length``-token prompt (+16 new tokens) in this process: RSS
    after loading the model, and the peak after that (Linux: the high-water mark is reset once
    the model is loaded, so the figure is the generation's own peak)."""
    engine = load_engine(args)
    prompt = bench_prompt(engine.config.vocab_size, length, 1, engine.eos_ids)[0]
    dtype = engine.weights.embed.dtype
    loaded = reset_peak_rss()
    if kind == "contiguous":
        engine.generate(prompt, max_new_tokens=LONG_NEW, ignore_eos=True)
        out = {"kv_allocated_mb": kv_cache_bytes(engine.config, 1, cache_length(length, LONG_NEW), dtype) / 2**20}
    else:
        config = ServingConfig(slots=1, page_size=PAGE, max_context=length + LONG_NEW,
                               num_pages=_pages(length + LONG_NEW))
        server = ServingEngine(engine, config)
        server.run([prompt], max_new_tokens=LONG_NEW, ignore_eos=True)
        out = {"kv_allocated_mb": server.kv_bytes / 2**20,
               "kv_peak_in_use_mb": server.stats.peak_pages * server.kv_bytes / (config.num_pages * len(server.replicas))
               / 2**20}
    return {**out, "rss_after_load_mb": loaded, "peak_rss_after_load_mb": peak_rss_since_reset_mb()}




def mixed_batch_kv(engine: Engine, long: int, short: int, batch: int, new_tokens: int) -> dict:
    """KV bytes (from shapes, nothing run) for one ``long`` prompt among ``batch - 1`` of ``short``:
    ``Engine.generate``'s one contiguous cache sizes every row for the longest; pages hold what
    each row uses."""
    dtype = engine.weights.embed.dtype
    contiguous = kv_cache_bytes(engine.config, batch, cache_length(long, new_tokens), dtype)
    pages = _pages(long + new_tokens) + (batch - 1) * _pages(short + new_tokens)
    paged = kv_cache_bytes(engine.config, 1, pages * PAGE, dtype)
    return {"batch": batch, "long": long, "short": short, "contiguous_mb": contiguous / 2**20,
            "paged_mb": paged / 2**20}


def pool_bytes_by_format(engine: Engine, long: int) -> dict:
    """Bytes of the page pool that holds one ``long``-token prompt (+16 tokens) per KV-cache
    scheme, from shapes (nothing allocated), with the ratio to the unquantized pool."""
    dtype = engine.weights.embed.dtype

    def pool_bytes(scheme: KVQuant) -> int:
        pool = jax.eval_shape(lambda: init_paged_cache(engine.config, _pages(long + LONG_NEW), PAGE, dtype=dtype,
                                                       kv_quant=scheme))
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(pool) if len(x.shape) >= 3)

    sizes = {scheme.value: pool_bytes(scheme) for scheme in KVQuant}
    return {"long": long, **{f"{name}_mb": n / 2**20 for name, n in sizes.items()},
            **{f"{name}_ratio": n / sizes["none"] for name, n in sizes.items() if name != "none"}}


def _memory_in_subprocess(args, kind: str) -> dict:
    cmd = [sys.executable, __file__, "--memory-only", kind, "--long", str(args.long)]
    for flag in ("model", "config", "dtype", "layers"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="converted model directory (default: embedded SmolLM2)")
    source.add_argument("--config", default=None,
                        help="HF config.json (or its directory): random weights of that architecture")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="weights of --config (default: bfloat16 on GPU, float32 elsewhere)")
    parser.add_argument("--layers", type=int, default=None, help="serve only the first N layers of --config")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--long", type=int, default=3000, help="prompt tokens of the memory comparison")
    parser.add_argument("--widths", default="8,64,512", help="table widths (pages) of the decode sweep")
    parser.add_argument("--kernels", default="auto", help="how serving attends: auto|reference|pallas|pallas_interpret")
    parser.add_argument("--skip", default="",
                        help="comma-separated sections to skip: throughput,kernels,widths,memory,formats")
    parser.add_argument("--memory-only", choices=["contiguous", "paged"], help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.memory_only:
        print(json.dumps(memory(args, args.memory_only, args.long)))
        return
    skip = set(args.skip.split(","))
    result = {}

    def report(name: str, value: dict) -> None:  # each section as it ends: a long run keeps what it measured
        result[name] = value
        print(json.dumps({name: value}), file=sys.stderr, flush=True)

    on_kernels = resolve_mode(args.kernels) is not KernelMode.REFERENCE
    if not {"throughput", "kernels", "widths"} <= skip:
        engine = load_engine(args)
        sizes = (engine, args.requests, args.prompt_len, args.new_tokens, args.kernels)
        if "throughput" not in skip:
            report("throughput", throughput(*sizes))
        if "kernels" not in skip and on_kernels:
            report("kernels_vs_reference", kernels_vs_reference(*sizes))
        if "widths" not in skip:
            report("decode_ms_by_context", width_sweep(engine, [int(w) for w in args.widths.split(",")], args.kernels))
    if "memory" not in skip:
        report("memory", {kind: _memory_in_subprocess(args, kind) for kind in ("contiguous", "paged")})
        engine = load_engine(args)
        report("mixed_batch_kv", mixed_batch_kv(engine, args.long, args.prompt_len, args.requests, args.new_tokens))
    if "formats" not in skip:
        report("kv_formats", pool_bytes_by_format(load_engine(args), args.long))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
