"""Small measuring tools shared by the benchmarks: prompts, timers, memory, compile counts."""

from __future__ import annotations

import resource

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


def timed_speeds(run, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, float]:
    """TTFT, prefill and decode speed from ``run() -> (ttft_s, decode_s)``, one generation each.

    ``run`` generates ``new_tokens`` tokens and returns the time to the first token and the time
    from the first to the last. One warm-up run (compilation), then the best of ``repeats`` for
    each figure (the least disturbed by other load on a shared machine). Measuring both inside
    one run avoids subtracting two long runs, which is noise-dominated when prefill is long.
    """
    return interleaved_speeds({"run": (run, prompts)}, new_tokens, repeats)["run"]


def interleaved_speeds(runs: dict, new_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """:func:`timed_speeds` of several implementations side by side: ``runs`` maps a name to
    ``(run, prompts)``. Each is warmed up, then the repeats go round by round (one run of each per
    round), so every implementation samples the same stretch of time: this host's memory
    bandwidth drifts by a third over seconds, which made a whole block of one implementation's
    repeats, then the other's, compare different machines."""
    timings = {name: [] for name in runs}
    for run, _ in runs.values():
        run()
    for _ in range(repeats):
        for name, (run, _) in runs.items():
            timings[name].append(run())
    return {name: _best_speeds(timings[name], prompts, new_tokens) for name, (_, prompts) in runs.items()}


def _best_speeds(timings: list[tuple[float, float]], prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """TTFT, prefill and decode speed from the best of ``timings`` [(ttft_s, decode_s)]."""
    ttft = min(t for t, _ in timings)
    decode = min(d for _, d in timings)
    batch, prompt_len = len(prompts), len(prompts[0])
    return {
        "ttft_s": ttft,
        "prefill_tok_s": batch * prompt_len / ttft,
        "decode_tok_s": batch * (new_tokens - 1) / max(decode, 1e-9),
    }


def rss_mb() -> float:
    """Current resident memory of this process in MiB."""
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak_rss() -> float:
    """Reset this process's RSS high-water mark (Linux ``clear_refs``); returns the current RSS, MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def peak_rss_since_reset_mb() -> float:
    """RSS high-water mark since the last :func:`reset_peak_rss`, MiB (``ru_maxrss`` never resets)."""
    return _status_mb("VmHWM")


def device_peak_mb() -> float | None:
    """Peak memory in use on this process's first device (None where the backend does not report it)."""
    stats = jax.local_devices()[0].memory_stats()
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
