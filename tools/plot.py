"""PNG plots of benchmark results (matplotlib is optional: ``pip install matplotlib``)."""

from __future__ import annotations

from pathlib import Path


class PlotError(ValueError):
    """A plot that cannot be drawn."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def plot_bench(result: dict, path: Path) -> None:
    """Latency (TTFT, decode ms per token) and memory (RSS, KV cache) against context length."""
    plt = _pyplot()
    fig, (ax_lat, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in result["runs"]}):
        rows = sorted((r for r in result["runs"] if r["batch"] == batch), key=lambda r: r["prompt_len"])
        ctx = [r["prompt_len"] for r in rows]
        ax_lat.plot(ctx, [r["ttft_s"] * 1e3 for r in rows], "o-", label=f"TTFT, batch {batch}")
        ax_lat.plot(ctx, [batch * 1e3 / r["decode_tok_s"] for r in rows], "s--", label=f"decode step, batch {batch}")
        ax_mem.plot(ctx, [r["rss_mb"] for r in rows], "o-", label=f"process RSS, batch {batch}")
        ax_mem.plot(ctx, [r["kv_cache_mb"] for r in rows], "s--", label=f"KV cache, batch {batch}")
    for ax, ylabel in ((ax_lat, "milliseconds"), (ax_mem, "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_lat.set_title("latency")
    ax_mem.set_title("memory")
    fig.suptitle(f"dayzero bench ({result['dtype']}, {result['backend']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
