"""The memory-bandwidth roofline of decoding, measured on this machine in the same run.

A batch-1 decode step reads every weight it uses once and the KV cache up to the current
position, and does little arithmetic per byte: its speed limit is the bytes it reads over the
read bandwidth the machine achieves. ``read_bandwidth`` measures that bandwidth here and now (the
hosts this runs on differ 2x, and share their memory bus with other jobs), with the operations
decode itself runs: a jitted sum and a jitted fp32 matrix-vector product over a buffer several
times the last-level cache, best of a few runs (the least disturbed). ``roofline`` turns a
measured decode speed into the fraction of that limit reached.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dayzero.model.quant import stored_bytes

# Fallback when the last-level cache size cannot be read from sysfs.
DEFAULT_LLC_BYTES = 32 * 2**20
# The buffer read is this many times the last-level cache (at least MIN_BUFFER_BYTES), so it
# streams from memory rather than from cache.
LLC_MULTIPLE = 8
MIN_BUFFER_BYTES = 256 * 2**20


def llc_bytes() -> int:
    """The largest CPU cache of this machine in bytes (sysfs), or ``DEFAULT_LLC_BYTES``."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return max(sizes, default=DEFAULT_LLC_BYTES)


def _best_seconds(fn, x, repeats: int) -> float:
    jax.block_until_ready(fn(x))  # compile and fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(buffer_bytes: int | None = None, repeats: int = 5) -> dict[str, float]:
    """Achievable read bandwidth in bytes/s on the default device: the faster of a jitted sum and
    a jitted fp32 matrix-vector product (decode's own operation) over a ``buffer_bytes`` buffer
    (default ``LLC_MULTIPLE`` x the last-level cache), best of ``repeats`` each."""
    if buffer_bytes is None:
        buffer_bytes = max(LLC_MULTIPLE * llc_bytes(), MIN_BUFFER_BYTES)
    cols = 1024
    rows = max(1, buffer_bytes // (4 * cols))
    matrix = jnp.ones((rows, cols), jnp.float32) * 0.5  # made on the device, no host copy
    vector = jnp.ones((cols,), jnp.float32)
    total = jax.jit(jnp.sum)
    matvec = jax.jit(lambda m: m @ vector)
    nbytes = rows * cols * 4
    sum_s, matvec_s = _best_seconds(total, matrix, repeats), _best_seconds(matvec, matrix, repeats)
    del matrix
    return {"buffer_bytes": nbytes, "sum_bytes_s": nbytes / sum_s, "matvec_bytes_s": nbytes / matvec_s,
            "bytes_s": nbytes / min(sum_s, matvec_s)}


def weight_bytes_per_step(weights) -> int:
    """Bytes of weights one decode step reads: every stored weight, except the embedding table
    when the model has its own output head (then only a few rows are gathered from it) and a
    vision tower (not run while decoding). Mixture-of-experts models read only the experts they
    route to; this counts all of them (an upper bound)."""
    total = stored_bytes(weights)
    if getattr(weights, "lm_head", None) is not None:
        total -= stored_bytes(weights.embed)
    if getattr(weights, "vision", None) is not None:
        total -= stored_bytes(weights.vision)
    return total


def roofline(weights_bytes: int, kv_bytes_per_position: float, prompt_len: int, new_tokens: int,
             batch: int, decode_tok_s: float, bandwidth: float) -> dict[str, float]:
    """The decode roofline of one benchmark row: bytes read per step (weights once, plus each
    row's KV cache at the mean position of decoding: the prompt plus half the new tokens), the
    tokens/s that bandwidth allows, and the fraction of it the measured ``decode_tok_s`` reached."""
    mean_position = prompt_len + new_tokens / 2
    kv_bytes = batch * kv_bytes_per_position * mean_position
    step_bytes = weights_bytes + kv_bytes
    limit_tok_s = batch * bandwidth / step_bytes
    return {
        "weights_bytes": weights_bytes,
        "kv_bytes_at_mean_position": kv_bytes,
        "bytes_per_step": step_bytes,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tok_s": limit_tok_s,
        "fraction": decode_tok_s / limit_tok_s,
    }
