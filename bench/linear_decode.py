"""Decode step time and cache size against context: a linear-attention hybrid against its
full-attention twin (issue #16).

A Qwen3-Next-shaped hybrid (Gated DeltaNet linear layers, three to every full-attention layer,
gated partial-RoPE attention, zero-centred norms; a dense MLP in place of the MoE to keep it
CPU-sized) and its twin: the same config with every layer full attention (``linear=None``; same
layer count, hidden size, heads, head dim, MLP). Random weights, fp32, batch 1.

For each context C both models decode one token over a cache holding C positions: the cache is
made by ``init_cache`` for exactly C positions with ``lengths`` set to C - 1, so the step reads
every position and writes the last (attention does the same work whatever the cached values,
so nothing is prefilled). A hybrid's linear layers keep a fixed-size state instead of rows:
their cache starts as the fresh-sequence state (zeros) and each warm-up and timed step carries
on from the state the previous step produced, so it is always a state the model itself made.
After each step ``lengths`` goes back to C - 1, so every step does the same work. The timed
step is what ``Engine`` runs: the jitted ``forward`` (logits of the one token) and the jitted,
cache-donated ``append_to_cache``, until both are ready. The two models alternate step by step
(best of ``--steps`` after ``--warmup`` each), so load from others on the shared machine hits
both alike: read the ratios, not the absolute times. Cache bytes are the sum of the cache's
leaves' bytes. The host's memory read bandwidth is measured in the same run.

The hybrid's full-attention layers have the twin's dimensions, so two more columns split the
hybrid into its parts: "linear layers' growth" is the hybrid's step-time growth since the first
context less its attention layers' share (1 in ``--full-every``) of the twin's growth, what the
linear layers add as the context grows (zero within noise if their cost does not grow);
"linear states" is the hybrid's cache less that share of the twin's (the fixed states).

    python bench/linear_decode.py [--contexts 1024,8192,65536] [--steps 8] [--json PATH]

Default sizes: hidden 1024, 8 layers (linear, linear, linear, full, x2), full attention with 8
query heads and 2 key/value heads of 256 (Qwen3-Next's 2 KV heads of 256), linear layers with 8
query/key heads and 16 value heads of 128 (Qwen3-Next's proportions at half width), MLP 2816,
vocabulary 4096. The twin's KV cache is 32 KiB a token (8 layers x K and V x 2 heads x 256 x 4
bytes), 2 GiB at 65536 tokens; the hybrid's is a quarter of that plus 6 fixed states of about
1 MiB. Both are alive at once, so the largest context needs about 2.6 GiB beside the weights
(~0.6 GB each model): the default run peaks at 4.6 GB resident and takes about 1.5 minutes on
two cores, so it fits a 24 GiB machine with room to spare. The script refuses contexts
whose caches would not fit in half of this machine's memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from dayzero.model.cache import append_to_cache, cache_specs, init_cache
from dayzero.model.config import Family, LinearAttnConfig, LinearKind, ModelConfig, RopeConfig
from dayzero.model.transformer import forward
from dayzero.model.weights import Init, abstract_weights, map_specs, parameter_count

MB = 2**20


def hybrid_config(args: argparse.Namespace) -> ModelConfig:
    """The hybrid: ``args.layers`` layers, every ``args.full_every``-th one full attention."""
    pattern = tuple((i + 1) % args.full_every != 0 for i in range(args.layers))
    linear = LinearAttnConfig(LinearKind.GATED_DELTA, pattern, args.k_heads, args.v_heads,
                              args.linear_dim, args.linear_dim, conv_kernel=4, chunk=64)
    return ModelConfig(
        family=Family.QWEN3_NEXT, vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.mlp, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, rms_norm_eps=1e-6,
        max_position_embeddings=max(args.contexts), rope=RopeConfig(partial_rotary_factor=0.25),
        qk_norm=True, linear=linear, norm_weight_offset=1.0, attn_output_gate=True)


def twin_config(hybrid: ModelConfig) -> ModelConfig:
    """The hybrid with every layer full attention, all other dimensions unchanged."""
    return dataclasses.replace(hybrid, linear=None)


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (shapes or arrays)."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def planned_cache_bytes(config: ModelConfig, context: int) -> int:
    """Bytes ``init_cache(config, 1, context)`` would allocate, read off its declared shapes."""
    specs = cache_specs(config, 1, context)
    return tree_bytes(map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype or jnp.float32), specs))


def random_weights(config: ModelConfig, seed: int = 0):
    """Random fp32 weights as ``init_weights`` makes them (N(0, 1/D) matrices, ones and zeros
    where the specs say), drawn by numpy: ``init_weights`` compiles one draw per distinct leaf
    shape, about a second each on a loaded 2-core host, which a benchmark's setup need not pay."""
    rng = np.random.default_rng(seed)
    scale = config.hidden_size**-0.5  # keeps activations of order one through the layers

    def make(spec):
        dtype = spec.dtype or jnp.float32
        if spec.init is Init.NORMAL:
            return jnp.asarray((scale * rng.standard_normal(spec.shape, np.float32)).astype(dtype))
        return jnp.asarray(np.full(spec.shape, 1 if spec.init is Init.ONES else 0, dtype))

    return map_specs(make, abstract_weights(config))


def with_length(cache, length: int):
    """``cache`` with every row's length (and ``rope_len``) set to ``length``; a hybrid's lengths
    are its attention part's (its linear states do not count positions)."""
    n = jnp.asarray(np.full((1,), length, np.int32))
    if hasattr(cache, "attn"):  # HybridCache: lengths live in the attention cache
        return cache.replace(attn=cache.attn.replace(lengths=n, rope_len=jnp.int32(length)))
    return cache.replace(lengths=n, rope_len=jnp.int32(length))


class Decoder:
    """One model's decode step over a cache of ``context`` positions (see the module docstring)."""

    def __init__(self, config: ModelConfig, weights, context: int):
        self.config, self.weights, self.context = config, weights, context
        self.cache = with_length(init_cache(config, 1, context), context - 1)
        self.cache_bytes = tree_bytes(self.cache)
        self.token = jnp.ones((1, 1), jnp.int32)
        # As Engine does: forward and the write apart, the write donated (an in-place update;
        # see dayzero.model.cache on why one jit that reads and writes the cache would copy it).
        self._forward = jax.jit(forward, static_argnums=(1,))
        self._append = jax.jit(append_to_cache, donate_argnums=(0,))
        self.times: list[float] = []

    def step(self) -> float:
        """Run one step; return its seconds and reset the length for the next."""
        start = time.perf_counter()
        logits, new = self._forward(self.weights, self.config, self.token, self.cache)
        self.cache = self._append(self.cache, new)
        jax.block_until_ready((logits, self.cache))
        seconds = time.perf_counter() - start
        if not np.isfinite(np.asarray(logits)).all():  # outside the timing: a broken state would show here
            raise RuntimeError(f"non-finite logits at context {self.context} ({self.config.family.value})")
        self.cache = with_length(self.cache, self.context - 1)
        return seconds


def read_bandwidth_gb_s(mb: int, repeats: int = 5) -> float:
    """Host memory read bandwidth: the best of ``repeats`` jitted sums over ``mb`` MiB of fp32."""
    x = jnp.asarray(np.ones((mb * MB // 4,), np.float32))
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return mb * MB / best / 1e9


def measure(context: int, models: dict, steps: int, warmup: int) -> dict:
    """Both models' step times (interleaved) and cache bytes at ``context``."""
    decoders = {name: Decoder(config, weights, context) for name, (config, weights) in models.items()}
    for _ in range(warmup):  # the first compiles
        for d in decoders.values():
            d.step()
    for _ in range(steps):
        for d in decoders.values():
            d.times.append(d.step())
    row = {"context": context}
    for name, d in decoders.items():
        row[f"{name}_ms"] = 1e3 * min(d.times)
        row[f"{name}_median_ms"] = 1e3 * statistics.median(d.times)
        row[f"{name}_cache_bytes"] = d.cache_bytes
        row[f"{name}_cache_mb"] = d.cache_bytes / MB
    row["full_over_hybrid"] = row["full_ms"] / row["hybrid_ms"]
    return row


def growth(rows: list[dict]) -> dict:
    """Per model, the last context's step time and cache size over the first's."""
    first, last = rows[0], rows[-1]
    return {f"{name}_{what}": last[f"{name}_{key}"] / first[f"{name}_{key}"]
            for name in ("full", "hybrid") for what, key in (("ms", "ms"), ("cache", "cache_bytes"))}


def linear_share(rows: list[dict], attention_share: float) -> None:
    """Add to each row what the hybrid's linear layers account for, beside its attention layers.

    The hybrid's full-attention layers have the twin's dimensions, so they cost
    ``attention_share`` (their fraction of the layers) of the twin's attention growth and hold
    that fraction of its cache. What is left is the linear layers': ``linear_growth_ms``, the
    hybrid's step-time growth since the first context that its attention layers do not explain
    (near zero, within noise, if the linear layers' cost does not grow), and ``linear_state_mb``,
    its cache beyond its attention layers' rows (the fixed states: the same at every context).
    """
    first = rows[0]
    for r in rows:
        attention_growth = attention_share * (r["full_ms"] - first["full_ms"])
        r["linear_growth_ms"] = r["hybrid_ms"] - first["hybrid_ms"] - attention_growth
        r["linear_state_mb"] = (r["hybrid_cache_bytes"] - attention_share * r["full_cache_bytes"]) / MB


def table(result: dict) -> str:
    """The results as a markdown table, with a header line on the setting and a growth line."""
    s = result["settings"]
    lines = [
        f"decode step, batch 1, fp32, {s['backend']} ({s['cpus']} CPUs), best of {s['steps']} steps; "
        f"{s['layers']} layers, D={s['hidden']}, attention {s['heads']}q/{s['kv_heads']}kv x {s['head_dim']}, "
        f"linear {s['k_heads']}qk/{s['v_heads']}v x {s['linear_dim']} (1 full in {s['full_every']}); "
        f"params full {s['full_params'] / 1e6:.0f}M, hybrid {s['hybrid_params'] / 1e6:.0f}M; "
        f"read bandwidth {result['bandwidth_gb_s']:.1f} GB/s",
        "",
        "| context | full ms/token | hybrid ms/token | full/hybrid | full cache MB | hybrid cache MB "
        "| linear layers' growth ms | linear states MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['context']} | {r['full_ms']:.2f} | {r['hybrid_ms']:.2f} | {r['full_over_hybrid']:.2f}x "
                     f"| {r['full_cache_mb']:.1f} | {r['hybrid_cache_mb']:.1f} "
                     f"| {r['linear_growth_ms']:+.2f} | {r['linear_state_mb']:.2f} |")
    g, first, last = result["growth"], result["rows"][0]["context"], result["rows"][-1]["context"]
    lines += ["", f"growth {first} -> {last} tokens: full attention {g['full_ms']:.2f}x time, {g['full_cache']:.1f}x "
                  f"cache; hybrid {g['hybrid_ms']:.2f}x time, {g['hybrid_cache']:.1f}x cache",
              "linear layers' growth: the hybrid's step-time growth since the first context less its "
              "attention layers' share of the twin's; linear states: its cache less their rows"]
    return "\n".join(lines)


def _contexts(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers; e.g. 1024,8192,65536")
    if not values or values[0] < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one context, each at least 2 tokens")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (sizes positive, the caches within half the host's memory)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=_contexts, default=[1024, 8192, 65536], help="cached tokens, comma-separated")
    p.add_argument("--steps", type=int, default=8, help="timed steps per model and context (best reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model and context (the first compiles)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--mlp", type=int, default=2816, help="dense MLP width")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--full-every", type=int, default=4, help="every n-th layer is full attention (Qwen3-Next: 4)")
    p.add_argument("--heads", type=int, default=8, help="full-attention query heads")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--k-heads", type=int, default=8, help="linear-attention query/key heads")
    p.add_argument("--v-heads", type=int, default=16, help="linear-attention value heads")
    p.add_argument("--linear-dim", type=int, default=128, help="linear-attention key and value head dim")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--bandwidth-mb", type=int, default=512, help="MiB read by the bandwidth probe")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    for name in ("steps", "warmup", "hidden", "mlp", "layers", "heads", "kv_heads", "head_dim", "k_heads",
                 "v_heads", "linear_dim", "vocab", "bandwidth_mb"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if not 2 <= args.full_every <= args.layers:
        p.error(f"--full-every {args.full_every} must be between 2 and --layers {args.layers} "
                "(at least one linear and one full-attention layer)")
    try:
        hybrid = hybrid_config(args)
    except ValueError as e:
        p.error(f"these sizes make no valid model: {e}")
    largest = max(args.contexts)
    need = planned_cache_bytes(hybrid, largest) + planned_cache_bytes(twin_config(hybrid), largest)
    room = psutil.virtual_memory().total // 2
    if need > room:
        p.error(f"the caches at {largest} tokens need {need / 2**30:.1f} GiB, more than half this machine's "
                f"memory ({room / 2**30:.1f} GiB); give smaller --contexts, --kv-heads or --head-dim")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Measure both models at every context; print the table, write the JSON; return the results."""
    args = parse_args(argv)
    hybrid = hybrid_config(args)
    models = {}
    for name, config in (("full", twin_config(hybrid)), ("hybrid", hybrid)):
        models[name] = (config, random_weights(config))
    params = {name: parameter_count(abstract_weights(config)) for name, (config, _) in models.items()}
    bandwidth = read_bandwidth_gb_s(args.bandwidth_mb)
    rows = [measure(context, models, args.steps, args.warmup) for context in args.contexts]
    linear_share(rows, len(hybrid.linear.attention_layers) / hybrid.num_layers)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    settings |= {"backend": jax.default_backend(), "cpus": len(os.sched_getaffinity(0)),
                 "full_params": params["full"], "hybrid_params": params["hybrid"]}
    result = {"settings": settings, "bandwidth_gb_s": bandwidth, "rows": rows, "growth": growth(rows)}
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
