"""Each kernel op: pure-jnp reference against the compiled Pallas kernel, on this platform.

    python bench/kernels.py [--json] [--sizes small|full] [--dtype bf16|fp32] [--repeats N]

For every op (paged GQA and MLA-latent attention for decode and for a chunked-prefill chunk,
flash prefill, DSA sparse attention) and size, times the jitted reference and the jitted Pallas
kernel (median of ``--repeats`` runs after a compile-and-warm-up call), checks that they agree,
and prints a table (or one JSON object) with the ratio reference/pallas and the achieved GB/s
(decode) or TFLOP/s (prefill).

On a GPU the defaults are the realistic sizes (decode B=8, N=32, K=8, H=128 over 4k-32k
tokens in pages of 16 and 32; MLA decode with 128 heads over 512+64-wide latent rows; a prefill
chunk of 256 queries at the end of a 4k context through pages, GQA and MLA; prefill T=S=2k-8k;
DSA top-2048, per-row rows and a shared pool) in bf16. Elsewhere Pallas cannot compile (Pallas
Triton needs a GPU): the script says so, times only the reference at small sizes in fp32, checks each kernel against
its reference once in interpret mode at a tiny size (not timed), and checks that every kernel
still lowers to Pallas Triton at the full sizes. Exits 1 if any kernel disagrees with its
reference or fails to lower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dayzero import kernels
from dayzero.kernels import (KernelError, describe, flash_attention, paged_attention, paged_latent_attention,
                             resolve_mode, sparse_attention)
from dayzero.kernels.check import triton_calls

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
# Agreement bounds, as in tests/test_kernels_attention.py: summation order in fp32; about one
# bf16 ulp of the output plus the kernel's bf16 rounding of the softmax weights in bf16.
TOLERANCE = {jnp.bfloat16: 2**-6, jnp.float32: 1e-4}


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one size: ``make(key, dtype)`` builds the arrays for ``fn(*arrays, mode=...,
    **kwargs)``; ``bytes_read``/``flops`` (for dtype size 2) give GB/s or TFLOP/s."""

    op: str
    label: str
    fn: Callable
    make: Callable
    kwargs: dict
    bytes_read: float | None = None
    flops: float | None = None


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _lengths(key, batch: int, context: int, page: int) -> jax.Array:
    """Ragged lengths near ``context``: the first row full, the others end inside a page."""
    short = jax.random.randint(key, (batch,), 1, page)
    return jnp.where(jnp.arange(batch) == 0, context, context - short).astype(jnp.int32)


def _tables(key, batch: int, pages_per_seq: int) -> tuple[jax.Array, int]:
    """Scattered page ids (a shuffled pool with a few spare pages)."""
    pool = batch * pages_per_seq + 8
    return jax.random.permutation(key, pool)[: batch * pages_per_seq].reshape(batch, -1).astype(jnp.int32), pool


def _paged_rates(B, T, N, context, key_dim, value_dim, read_bytes) -> dict:
    """Decode (T=1) is rated by the cache bytes it reads (GB/s); a chunk of T queries (the last
    T keys: each sees context - T + t + 1) by its score and value products (TFLOP/s)."""
    if T == 1:
        return dict(bytes_read=read_bytes)
    return dict(flops=2.0 * B * N * (key_dim + value_dim) * T * (context - (T - 1) / 2))


def paged_case(B, N, K, H, page, context, T=1) -> Case:
    def make(key, dtype):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        tables, pool = _tables(k1, B, -(-context // page))
        return (_normal(k2, (B, T, N, H), dtype), _normal(k3, (K, pool, page, H), dtype),
                _normal(k4, (K, pool, page, H), dtype), tables, _lengths(k5, B, context, page))
    # Default offsets: the T queries are each row's last T keys (a decode step, or the chunk
    # of a chunked prefill that ends the context).
    return Case("paged_attention", f"B={B} T={T} N={N} K={K} H={H} page={page} ctx={context}", paged_attention,
                make, {}, **_paged_rates(B, T, N, context, H, H, 2.0 * B * context * K * H * 2))


def latent_case(B, N, C, value_dim, page, context, T=1) -> Case:
    def make(key, dtype):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        tables, pool = _tables(k1, B, -(-context // page))
        return (_normal(k2, (B, T, N, C), dtype), _normal(k3, (pool, page, C), dtype), tables,
                _lengths(k4, B, context, page))
    return Case("paged_latent_attention", f"B={B} T={T} N={N} C={C} page={page} ctx={context}",
                paged_latent_attention, make, dict(value_dim=value_dim, sm_scale=0.07),
                **_paged_rates(B, T, N, context, C, value_dim, 2.0 * B * context * C))


def flash_case(B, N, K, H, T) -> Case:
    def make(key, dtype):
        k1, k2, k3 = jax.random.split(key, 3)
        return (_normal(k1, (B, T, N, H), dtype), _normal(k2, (B, T, K, H), dtype),
                _normal(k3, (B, T, K, H), dtype))
    # Causal: half of the T*S score matrix, two matmuls of 2*H flops per score.
    return Case("flash_attention", f"B={B} N={N} K={K} H={H} T=S={T} causal", flash_attention, make,
                dict(causal=True), flops=4.0 * B * N * H * T * T / 2)


def sparse_case(B, T, N, C, value_dim, topk, S, shared=False) -> Case:
    """Per-row rows kv [B,S,C], or with ``shared`` one pool [S,C] every row picks from (as the
    serving engine passes its flattened page pool)."""
    def make(key, dtype):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        picks = jax.random.randint(k3, (B, T, topk), 0, S)
        picks = jnp.where(jax.random.uniform(k4, picks.shape) < 0.95, picks, -1).astype(jnp.int32)
        return _normal(k1, (B, T, N, C), dtype), _normal(k2, (S, C) if shared else (B, S, C), dtype), picks
    size = f"B={B} T={T} N={N} C={C} k={topk} {'pool' if shared else 'S'}={S}"
    return Case("sparse_attention", size, sparse_attention, make,
                dict(value_dim=value_dim, sm_scale=0.07), bytes_read=2.0 * B * T * topk * C)


def full_cases() -> list[Case]:
    """The realistic sizes (for a GPU)."""
    return ([paged_case(8, 32, 8, 128, page, ctx) for page in (16, 32) for ctx in (4096, 8192, 16384, 32768)]
            + [latent_case(8, 128, 576, 512, 16, ctx) for ctx in (4096, 8192, 16384, 32768)]
            + [paged_case(2, 32, 8, 128, 16, 4096, T=256), latent_case(1, 128, 576, 512, 16, 4096, T=256)]
            + [flash_case(1, 32, 8, 128, T) for T in (2048, 4096, 8192)]
            + [sparse_case(8, 1, 128, 576, 512, 2048, S) for S in (8192, 32768)]
            + [sparse_case(8, 1, 128, 576, 512, 2048, 8 * 32768, shared=True)]
            + [sparse_case(1, 1024, 128, 576, 512, 2048, 8192)])


def small_cases() -> list[Case]:
    """Sizes a 2-core CPU times in seconds."""
    return ([paged_case(2, 8, 2, 64, 16, ctx) for ctx in (1024, 4096)]
            + [latent_case(2, 16, 576, 512, 16, ctx) for ctx in (1024, 4096)]
            + [paged_case(1, 8, 2, 64, 16, 1024, T=64), latent_case(1, 16, 576, 512, 16, 1024, T=16)]
            + [flash_case(1, 8, 2, 64, T) for T in (512, 1024)]
            + [sparse_case(2, 1, 16, 576, 512, 256, 4096), sparse_case(2, 1, 16, 576, 512, 256, 8192, shared=True)])


def tiny_cases() -> list[Case]:
    """One tiny size per op, for the interpret-mode check where Pallas cannot compile."""
    return [paged_case(2, 4, 2, 32, 16, 40), paged_case(2, 4, 2, 32, 16, 40, T=7), latent_case(2, 4, 40, 32, 8, 30),
            latent_case(2, 4, 40, 32, 8, 30, T=5), flash_case(2, 4, 2, 32, 40), sparse_case(1, 2, 4, 40, 32, 20, 50),
            sparse_case(2, 2, 4, 40, 32, 20, 50, shared=True)]


def _run(case: Case, mode: str, arrays, precision: str | None = None):
    """Jit ``case`` in ``mode``, run it once (compiling); return the function and its output."""
    fn = jax.jit(lambda *a: case.fn(*a, mode=mode, **case.kwargs))
    with jax.default_matmul_precision(precision):
        return fn, jax.block_until_ready(fn(*arrays))


def _median_seconds(fn, arrays, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*arrays))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _error(actual, expected, dtype) -> tuple[float, bool]:
    a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    tol = TOLERANCE[dtype]
    ok = bool(np.all(np.isfinite(a)) and np.all(np.abs(a - e) <= tol + tol * np.abs(e)))
    return float(np.max(np.abs(a - e))), ok


def bench_case(case: Case, dtype, repeats: int, pallas: bool) -> dict:
    """Time the reference (and the compiled kernel when ``pallas``); check they agree."""
    arrays = case.make(jax.random.key(0), dtype)
    row = {"op": case.op, "size": case.label}
    ref_fn, _ = _run(case, "reference", arrays)
    row["reference_ms"] = 1e3 * _median_seconds(ref_fn, arrays, repeats)
    if pallas:
        # Agreement against the reference in full fp32 matmul precision (no TF32).
        _, expected = _run(case, "reference", arrays, precision="float32")
        start = time.perf_counter()
        pallas_fn, actual = _run(case, "pallas", arrays)
        row["pallas_compile_s"] = time.perf_counter() - start
        row["pallas_ms"] = 1e3 * _median_seconds(pallas_fn, arrays, repeats)
        row["speedup"] = row["reference_ms"] / row["pallas_ms"]
        row["max_abs_err"], row["ok"] = _error(actual, expected, dtype)
    scale = jnp.dtype(dtype).itemsize / 2
    for path in ("reference", "pallas"):
        if f"{path}_ms" in row and case.bytes_read:
            row[f"{path}_gbps"] = case.bytes_read * scale / (row[f"{path}_ms"] * 1e6)
        if f"{path}_ms" in row and case.flops:
            row[f"{path}_tflops"] = case.flops / (row[f"{path}_ms"] * 1e9)
    return row


def interpret_check(case: Case) -> dict:
    """The kernel in interpret mode against the reference at a tiny size (fp32, not timed)."""
    arrays = case.make(jax.random.key(1), jnp.float32)
    _, expected = _run(case, "reference", arrays)
    _, actual = _run(case, "pallas_interpret", arrays)
    err, ok = _error(actual, expected, jnp.float32)
    return {"op": case.op, "size": case.label, "max_abs_err": err, "ok": ok}


def lowering_check(case: Case, dtype) -> dict:
    """Whether the compiled kernel still lowers to Pallas Triton at this size (no GPU needed)."""
    arrays = jax.eval_shape(lambda key: case.make(key, dtype), jax.random.key(0))
    try:
        compiled = getattr(kernels, f"{case.op}_pallas")  # mode="pallas" would refuse this CPU
        ok = triton_calls(lambda *a: compiled(*a, **case.kwargs), *arrays) == 1
        return {"op": case.op, "size": case.label, "ok": ok}
    except Exception as err:  # report every failure, then exit non-zero
        return {"op": case.op, "size": case.label, "ok": False, "error": f"{type(err).__name__}: {err}"}


def print_table(report: dict) -> None:
    print(f"platform {report['platform']} ({report['device']}), dtype {report['dtype']}, "
          f"--kernels auto -> {report['kernels']['resolved']}")
    if not report["pallas_compiled"]:
        print(f"pallas: {report['pallas_note']}")
    print(f"{'op':24} {'size':42} {'ref ms':>9} {'pallas ms':>9} {'ref/pal':>7} {'GB/s|TF/s':>10} {'ok':>4}")
    for r in report["results"]:
        rate = r.get("pallas_gbps", r.get("pallas_tflops", r.get("reference_gbps", r.get("reference_tflops"))))
        pallas_ms = f"{r['pallas_ms']:9.3f}" if "pallas_ms" in r else f"{'-':>9}"
        speedup = f"{r['speedup']:7.2f}" if "speedup" in r else f"{'-':>7}"
        print(f"{r['op']:24} {r['size']:42} {r['reference_ms']:9.3f} {pallas_ms} {speedup} "
              f"{rate:10.3g} {str(r.get('ok', '-')):>4}")
    for title, rows in (("interpret-mode check at a tiny size", report["interpret_check"]),
                        ("lowering to Pallas Triton at the full sizes", report["lowering"])):
        if rows:
            print(f"{title}: {sum(r['ok'] for r in rows)}/{len(rows)} ok")
        for r in rows:
            if not r["ok"]:
                print(f"  FAILED {r['op']} {r['size']} {r.get('error', '')}")
    print("all kernels agree with their references" if report["ok"] else "SOME KERNELS FAILED")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 if any kernel disagrees or fails to lower)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--sizes", choices=("small", "full"), help="default: full on GPU, small elsewhere")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on GPU, fp32 elsewhere")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per path (default 20 GPU, 3 CPU)")
    args = parser.parse_args(argv)
    try:
        resolve_mode("pallas")
        pallas, note = True, None
    except KernelError as err:
        pallas, note = False, f"cannot be compiled here ({err}); timing the reference only"
    dtype = DTYPES[args.dtype or ("bf16" if pallas else "fp32")]
    sizes = args.sizes or ("full" if pallas else "small")
    repeats = args.repeats or (20 if pallas else 3)
    results = [bench_case(c, dtype, repeats, pallas) for c in (full_cases() if sizes == "full" else small_cases())]
    interpret = [] if pallas else [interpret_check(c) for c in tiny_cases()]
    lowering = [] if pallas else [lowering_check(c, jnp.bfloat16) for c in full_cases()]
    report = {"platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
              "dtype": args.dtype or ("bf16" if pallas else "fp32"), "sizes": sizes, "repeats": repeats,
              "kernels": describe("auto"), "pallas_compiled": pallas, "pallas_note": note,
              "results": results, "interpret_check": interpret, "lowering": lowering}
    report["ok"] = all(r.get("ok", True) for r in results + interpret + lowering)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
