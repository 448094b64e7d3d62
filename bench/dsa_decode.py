"""Decode step time against context length: DeepSeek sparse attention (DSA) against dense latent attention.

One jitted ``forward`` of one token over a cache filled to the context length (random latent
rows and indexer keys; the cache write is a separate jit, O(1), and not timed), for the same
tiny model with and without the indexer. Dense MLA reads every latent row for every head, so
its step grows with the context. DSA's main attention gathers ``index_topk`` rows whatever the
context; what still grows is the indexer, which reads one small key per token (``index_head_dim``
values, against ``kv_lora_rank + rope_dim``) with few heads, and the top-k over its scores. So
DSA's step grows far more slowly, flat until the indexer's scan dominates.

    python bench/dsa_decode.py [--contexts 1024,4096,16384,65536] [--steps 10] [--plot bench/dsa_decode.png]

Prints a table (context, DSA and dense median ms per step, their ratio) and writes a PNG plot.
The defaults keep the run to a couple of minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dayzero.model.config import AttentionKind, DSAConfig, Family, MLAConfig, ModelConfig, RopeConfig
from dayzero.model.transformer import forward
from dayzero.model.cache import init_cache
from dayzero.model.weights import abstract_weights, init_weights


def tiny_config(args: argparse.Namespace, sparse: bool) -> ModelConfig:
    """A small DeepSeek-V3.2-shaped model (dense MLPs), with or without the indexer."""
    mla = MLAConfig(q_lora_rank=64, kv_lora_rank=args.kv_lora, nope_dim=32, rope_dim=32, v_head_dim=32)
    return ModelConfig(
        family=Family.DEEPSEEK_V32, vocab_size=1024, hidden_size=args.hidden, intermediate_size=512,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads, head_dim=mla.rope_dim,
        rms_norm_eps=1e-6, max_position_embeddings=max(args.contexts) + 1, rope=RopeConfig(),
        attention=AttentionKind.MLA, mla=mla,
        dsa=DSAConfig(args.topk, args.index_heads, args.index_dim) if sparse else None,
    )


def filled_cache(config: ModelConfig, context: int):
    """A batch-1 cache holding ``context`` tokens of random rows (room for one more)."""
    cache = init_cache(config, 1, context + 1)
    keys = iter(jax.random.split(jax.random.key(context), 2 * config.num_layers))
    fill = lambda a: jax.random.normal(next(keys), a.shape, a.dtype)  # noqa: E731
    return cache.replace(
        latent=tuple(fill(a) for a in cache.latent),
        index_keys=None if cache.index_keys is None else tuple(fill(a) for a in cache.index_keys),
        lengths=jnp.full((1,), context, jnp.int32), rope_len=jnp.int32(context))


def time_decode(config: ModelConfig, context: int, steps: int) -> float:
    """Median seconds of one jitted decode forward over ``context`` cached tokens, after a warm-up."""
    weights = init_weights(abstract_weights(config), jax.random.key(0))
    cache = filled_cache(config, context)
    step = jax.jit(forward, static_argnums=(1,))
    token = jnp.ones((1, 1), jnp.int32)
    jax.block_until_ready(step(weights, config, token, cache))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(weights, config, token, cache))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ctx = [r["context"] for r in rows]
    ax.plot(ctx, [r["dense_ms"] for r in rows], "o-", label="dense MLA (reads every latent row)")
    ax.plot(ctx, [r["dsa_ms"] for r in rows], "s-", label=f"DSA (indexer + top-{args.topk} gathered rows)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step, ms (median)")
    ax.set_title(f"decode step vs context ({jax.default_backend()}, fp32, {args.layers} layers, "
                 f"D={args.hidden}, {args.heads} heads)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=lambda s: [int(c) for c in s.split(",")], default=[1024, 4096, 16384, 65536])
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per point (median reported)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora", type=int, default=64)
    p.add_argument("--topk", type=int, default=256, help="index_topk")
    p.add_argument("--index-heads", type=int, default=8)
    p.add_argument("--index-dim", type=int, default=32)
    p.add_argument("--plot", type=Path, default=Path(__file__).with_name("dsa_decode.png"))
    p.add_argument("--json", action="store_true", help="also print one JSON line per context")
    args = p.parse_args()
    rows = []
    for context in args.contexts:
        dsa = time_decode(tiny_config(args, True), context, args.steps)
        dense = time_decode(tiny_config(args, False), context, args.steps)
        rows.append({"context": context, "dsa_ms": 1e3 * dsa, "dense_ms": 1e3 * dense})
        if args.json:
            print(json.dumps(rows[-1]))
    c = tiny_config(args, True)
    print(f"decode step, {jax.default_backend()}, fp32, batch 1: {c.num_layers} layers, D={c.hidden_size}, "
          f"{c.num_heads} heads, kv_lora {c.mla.kv_lora_rank} + rope {c.mla.rope_dim}; DSA: index_topk "
          f"{c.dsa.topk}, {c.dsa.heads} index heads of {c.dsa.head_dim}; median of {args.steps} steps")
    print(f"{'context':>8} {'DSA ms':>8} {'dense ms':>9} {'dense/DSA':>10}")
    for r in rows:
        print(f"{r['context']:>8} {r['dsa_ms']:>8.2f} {r['dense_ms']:>9.2f} {r['dense_ms'] / r['dsa_ms']:>9.2f}x")
    plot(rows, args, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
