"""Long-context stability: decode to the model's maximum context and watch memory, latency and
compilations over time (``dayzero bench --soak``).

What a healthy run shows: resident memory flat after the first steps (the KV cache is allocated
once, at the run's full length), no compilation after warm-up, and per-step latency as the
attention predicts. This version's decode attends over the whole allocated cache every step
(masked past the current position), so its latency is flat in the position, proportional to
the allocated length rather than growing step by step.
"""

from __future__ import annotations

import time

import numpy as np

from dayzero.tools.measure import CompileCounter, bench_prompt, rss_mb
from dayzero.engine.sampling import SamplingParams


class SoakError(ValueError):
    """A soak run that cannot measure anything."""


def soak(engine, max_len: int | None = None, prompt_len: int = 16, windows: int = 16) -> dict:
    """Decode one sequence from ``prompt_len`` tokens up to ``max_len`` (default: the context).

    Returns per-window rows (position, mean step ms, RSS MiB) and a summary. The first two steps
    run once before measuring, so compilation is not counted as instability.
    """
    context = engine.config.max_position_embeddings
    max_len = min(max_len or context, context)
    new_tokens = max_len - prompt_len
    if new_tokens < windows * 2:
        raise SoakError(f"--soak-len {max_len} leaves too few steps after a {prompt_len}-token prompt; raise it")
    prompt = bench_prompt(engine.config.vocab_size, prompt_len, 1, ())
    greedy = [SamplingParams()]
    for _ in zip(range(2), engine.stream_ids(prompt, new_tokens, greedy)):
        pass  # warm-up: compiles the same shapes the measured run uses
    times = np.zeros(new_tokens)
    rss = np.zeros(new_tokens)
    with CompileCounter() as counter:
        last = time.perf_counter()
        for i, _ in enumerate(engine.stream_ids(prompt, new_tokens, greedy)):
            now = time.perf_counter()
            times[i], last = now - last, now
            rss[i] = rss_mb() if i % 16 == 0 or i == new_tokens - 1 else rss[i - 1]
    # Step 0 is the prefill; steps 1.. are decode steps.
    edges = np.linspace(1, new_tokens, windows + 1).astype(int)
    rows = [
        {"position": int(prompt_len + hi), "step_ms": float(times[lo:hi].mean() * 1e3), "rss_mb": float(rss[hi - 1])}
        for lo, hi in zip(edges[:-1], edges[1:])
    ]
    return {
        "max_len": max_len,
        "steps": new_tokens,
        "compiles_after_warmup": counter.count,
        "rss_growth_mb": rows[-1]["rss_mb"] - rows[0]["rss_mb"],
        "latency_last_over_first": rows[-1]["step_ms"] / rows[0]["step_ms"],
        "windows": rows,
    }
