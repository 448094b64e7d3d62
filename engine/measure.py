"""Small measuring tools shared by the benchmarks: prompts, timers, memory, compile counts."""

from __future__ import annotations

import resource
import time

import jax
import numpy as np
import psutil


def bench_prompt(vocab_size: int, length: int, batch: int, avoid: tuple[int, ...] = ()) -> list[list[int]]:
    """Deterministic random prompts (``avoid`` ids, e.g. EOS, replaced) so runs measure the same work."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(batch):
        ids = rng.integers(0, vocab_size, size=length)
        rows.append([int(i) if i not in avoid else 0 for i in ids])
    return rows


def best_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def speeds(prompts: list[list[int]], new_tokens: int, ttft: float, total: float) -> dict[str, float]:
    """TTFT and throughputs from the time to one token and the time to ``new_tokens`` tokens."""
    batch, prompt_len = len(prompts), len(prompts[0])
    return {
        "ttft_s": ttft,
        "prefill_tok_s": batch * prompt_len / ttft,
        "decode_tok_s": batch * (new_tokens - 1) / max(total - ttft, 1e-9),
    }


def rss_mb() -> float:
    """Current resident memory of this process in MiB."""
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_peak_mb() -> float | None:
    """Peak memory in use on the first device (None where the backend does not report it)."""
    stats = jax.devices()[0].memory_stats()
    return stats["peak_bytes_in_use"] / 2**20 if stats and "peak_bytes_in_use" in stats else None


class CompileCounter:
    """Counts XLA backend compilations inside a ``with`` block (a ``jax.monitoring`` listener)."""

    _EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == self._EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)
