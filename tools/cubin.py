"""Each Pallas kernel compiled offline to an H200 (sm_90a) cubin, its resources against the limits.

Registers per thread, spills and shared memory per block, checked against the H200's 255
registers per thread, 64K registers per SM and 227 KiB of shared memory per block.

    python -m dayzero.tools.cubin [--json]

:func:`dayzero.kernels.check.triton_modules` lowers a kernel for CUDA on any machine and captures
its Triton IR with the launch parameters Pallas chose (warps, pipelining stages). This module runs
that IR through the ``triton`` package's own NVIDIA pipeline (TTIR -> TTGIR -> LLVM IR -> PTX ->
cubin, target ``cuda`` capability 90, warp size 32) and assembles the PTX with the ``ptxas`` that
package bundles, so no GPU or CUDA driver is needed. ``ptxas -v`` gives registers per thread and
spill bytes; Triton's shared-memory allocation gives the dynamic shared memory per block.

On a GPU, jaxlib 0.10.2 hands the same IR to XLA, which compiles it with the Triton revision built
into XLA and the CUDA toolkit's ptxas: its pass pipeline follows the triton package's, but the two
revisions and ptxas versions differ, so these figures are an estimate of what the GPU will run
(they show a spill or an oversized tile; they do not pin a register count to the unit).

``triton`` is optional (``pip install 'dayzero[gpu-check]'``). The CLI walks the kernels and full
GPU sizes of ``bench/kernels.py``'s lowering check (in bf16, as there), adds the variants whose
kernel body differs (fp8 pools, gpt-oss's sinks and window) and the delta-rule kernels, prints a
table (or one JSON object, as recorded in ``bench/cubin.json``) and exits 1 if a kernel fails to
compile or exceeds a limit; a spill is flagged, not failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from dayzero.kernels.check import TritonModule, triton_modules


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-thread, per-block and per-SM resources of one GPU (CUDA occupancy figures)."""

    name: str
    capability: int
    registers_per_thread: int
    registers_per_sm: int
    shared_per_block: int  # the most a block may opt in to
    shared_per_sm: int
    shared_reserved_per_block: int  # kept by the system for each resident block
    threads_per_sm: int
    blocks_per_sm: int
    register_unit: int  # registers are given to a warp in units of this many


# Hopper (sm_90): 64K 32-bit registers and 228 KiB of shared memory per SM, of which a block may
# use 227 KiB; 2048 threads and 32 blocks per SM; 255 registers per thread.
H200 = Limits(name="H200", capability=90, registers_per_thread=255, registers_per_sm=65536,
              shared_per_block=227 * 1024, shared_per_sm=228 * 1024, shared_reserved_per_block=1024,
              threads_per_sm=2048, blocks_per_sm=32, register_unit=256)

_REGISTERS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_KERNEL_NAME = re.compile(r"tt\.func public @([\w$.]+)")


def _triton():
    """The optional ``triton`` package, or a clear error saying how to install it."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia import compiler as nvidia
        from triton.compiler.compiler import IRSource, make_backend
        from triton._C.libtriton import ir
    except ImportError as err:
        raise RuntimeError(f"compiling a cubin needs the triton package ({err}); install it with "
                           f"pip install 'dayzero[gpu-check]'") from err
    return triton, GPUTarget, nvidia, IRSource, make_backend, ir


def tool_versions(limits: Limits = H200) -> dict:
    """The triton package's version and the first line of its bundled ptxas's ``--version``."""
    triton, _, nvidia, *_ = _triton()
    ptxas = nvidia.get_ptxas(limits.capability).path
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    release = [line for line in version.splitlines() if "release" in line]
    return {"triton": triton.__version__, "ptxas": release[0].strip() if release else version.strip()}


def _to_ptx(module: TritonModule, workdir: Path, limits: Limits) -> tuple[str, int]:
    """Run the Triton IR through every stage of triton's NVIDIA pipeline up to PTX; return the
    PTX and the shared memory per block that Triton allocated."""
    _, GPUTarget, _, IRSource, make_backend, ir = _triton()
    target = GPUTarget("cuda", limits.capability, 32)
    backend = make_backend(target)
    # fp fusion (fused multiply-add) stated, not left to triton 3.9's default, which warns that it
    # will change; warps and stages as Pallas set them.
    options = backend.parse_options(dict(num_warps=module.num_warps, num_stages=module.num_stages,
                                          num_ctas=1, enable_fp_fusion=True))
    path = workdir / "kernel.ttir"
    path.write_text(module.ir)
    context = ir.context()
    source = IRSource(str(path), context, backend)
    stages: dict[str, Callable] = {}
    backend.add_stages(stages, options, source.language)
    # triton.compile skips the first stage (TTIR clean-up: inlining, combining, CSE, unrolling)
    # for IR given as a file; XLA's pipeline runs those passes, so every stage runs here.
    metadata = {"target": target, **options.__dict__}
    ir_module = source.make_ir(target, options, None, None, context)
    for name, stage in stages.items():
        if name == "cubin":
            break  # assembled below with ptxas -v, whose report triton discards
        ir_module = stage(ir_module, metadata)
    return ir_module, int(metadata["shared"])


def _assemble(ptx: str, workdir: Path, limits: Limits) -> str:
    """Assemble ``ptx`` with the bundled ptxas and triton's flags; return ptxas's ``-v`` report."""
    _, _, nvidia, *_ = _triton()
    ptxas = nvidia.get_ptxas(limits.capability).path
    source, cubin = workdir / "kernel.ptx", workdir / "kernel.cubin"
    source.write_text(ptx)
    command = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={nvidia.sm_arch_from_capability(limits.capability)}", str(source), "-o", str(cubin)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stderr


def parse_ptxas_report(report: str) -> dict:
    """Registers per thread, stack frame and spill bytes from ``ptxas -v`` output (one kernel)."""
    registers, frame = _REGISTERS.findall(report), _FRAME.findall(report)
    if len(registers) != 1 or len(frame) != 1:
        raise ValueError(f"expected one kernel in the ptxas report, got: {report.strip()}")
    stack, stores, loads = (int(n) for n in frame[0])
    return {"registers": int(registers[0]), "stack_bytes": stack, "spill_store_bytes": stores,
            "spill_load_bytes": loads}


def compile_module(module: TritonModule, limits: Limits = H200) -> dict:
    """Compile one captured kernel to a cubin for ``limits``'s GPU and report its resources:
    kernel name, launch parameters, registers, stack and spill bytes, shared bytes."""
    name = _KERNEL_NAME.search(module.ir)
    with tempfile.TemporaryDirectory(prefix="dayzero-cubin-") as tmp:
        ptx, shared = _to_ptx(module, Path(tmp), limits)
        resources = parse_ptxas_report(_assemble(ptx, Path(tmp), limits))
    return {"kernel": name.group(1) if name else "?", "num_warps": module.num_warps,
            "num_stages": module.num_stages, "grid": list(module.grid), **resources, "shared_bytes": shared}


def blocks_per_sm(registers: int, shared_bytes: int, num_warps: int, limits: Limits = H200) -> int:
    """How many blocks of this kernel one SM holds at once (0: none fits), the least of what
    registers (allocated per warp in units), shared memory and threads allow."""
    per_warp = limits.register_unit * math.ceil(registers * 32 / limits.register_unit)
    by_registers = limits.registers_per_sm // (per_warp * num_warps)
    by_shared = (limits.shared_per_sm // (shared_bytes + limits.shared_reserved_per_block)
                 if shared_bytes <= limits.shared_per_block else 0)
    by_threads = limits.threads_per_sm // (32 * num_warps)
    return min(by_registers, by_shared, by_threads, limits.blocks_per_sm)


def limit_problems(row: dict, limits: Limits = H200) -> list[str]:
    """What in a compiled kernel's ``registers``, ``shared_bytes`` and ``num_warps`` exceeds the
    GPU's limits (empty: it launches), one sentence each."""
    problems = []
    threads = 32 * row["num_warps"]
    if row["registers"] > limits.registers_per_thread:
        problems.append(f"{row['registers']} registers per thread > {limits.registers_per_thread}")
    if row["registers"] * threads > limits.registers_per_sm:
        problems.append(f"{row['registers']} registers x {threads} threads > {limits.registers_per_sm} per SM")
    if row["shared_bytes"] > limits.shared_per_block:
        problems.append(f"{row['shared_bytes']} bytes of shared memory > {limits.shared_per_block} per block")
    if not problems and blocks_per_sm(row["registers"], row["shared_bytes"], row["num_warps"], limits) == 0:
        problems.append(f"no block fits on one SM ({threads} threads)")
    return problems


def check_row(row: dict, limits: Limits = H200) -> dict:
    """``row`` with the verdicts added: ``problems`` (limits exceeded), ``fits``, ``spills`` (any
    spill bytes: the kernel runs, slower) and ``blocks_per_sm``."""
    problems = limit_problems(row, limits)
    spills = row["spill_store_bytes"] + row["spill_load_bytes"] > 0
    occupancy = blocks_per_sm(row["registers"], row["shared_bytes"], row["num_warps"], limits)
    return {**row, "blocks_per_sm": occupancy, "fits": not problems, "spills": spills, "problems": problems}


def compile_report(fn: Callable, *avals: jax.ShapeDtypeStruct, limits: Limits = H200) -> list[dict]:
    """Lower ``fn`` for CUDA from abstract inputs ``avals``, compile each Pallas Triton kernel in
    it to a cubin for ``limits``'s GPU, and return one checked row per kernel (see
    :func:`compile_module` and :func:`check_row`). Needs the optional ``triton`` package."""
    _triton()  # fail before lowering if triton is missing
    return [check_row(compile_module(module, limits), limits) for module in triton_modules(fn, *avals)]


# --- the kernels and sizes the CLI walks ---


@functools.lru_cache(maxsize=None)
def _bench_kernels():
    """``bench/kernels.py`` of this source tree (its case list is the lowering check's)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"
    if not path.exists():
        raise RuntimeError(f"{path} not found: run this from a source checkout of dayzero")
    spec = importlib.util.spec_from_file_location("dayzero_bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


Case = tuple[str, str, Callable, tuple]  # (op, sizes, fn, avals)


def _call(kernel: Callable, kwargs: dict, scale_names: tuple[str, ...] = (), extra: dict | None = None) -> Callable:
    """``kernel`` over positional arrays, the last ``len(scale_names)`` passed by those names."""
    count = len(scale_names)

    def fn(*arrays):
        named = dict(zip(scale_names, arrays[len(arrays) - count:]))
        return kernel(*arrays[:len(arrays) - count], **kwargs, **(extra or {}), **named)
    return fn


def bench_cases() -> list[Case]:
    """Each full-size case of the lowering check, in bf16, calling the compiled kernel as that
    check does; then each op's first case of each query length again over an fp8 pool."""
    from dayzero import kernels
    cases, seen = [], set()
    for case in _bench_kernels().full_cases():
        avals = jax.eval_shape(lambda key, case=case: case.make(key, jnp.bfloat16), jax.random.key(0))
        kernel = getattr(kernels, f"{case.op}_pallas")
        cases.append((case.op, case.label, _call(kernel, case.kwargs), avals))
        if case.op in QUANTIZED_POOLS and (case.op, avals[0].shape[1]) not in seen:
            seen.add((case.op, avals[0].shape[1]))
            cases.append(_quantized(case.op, case.label, kernel, case.kwargs, avals))
    return cases


# The pool operands (by position) of the ops that read quantized pools, and their scales' names.
QUANTIZED_POOLS = {"paged_attention": ((1, "k_scales"), (2, "v_scales")),
                   "paged_latent_attention": ((1, "latent_scales"),), "sparse_attention": ((1, "kv_scales"),)}


def _quantized(op: str, sizes: str, kernel: Callable, kwargs: dict, avals: tuple) -> Case:
    """The same call over a float8_e4m3fn pool with one fp32 scale per row (``--kv-cache fp8``)."""
    avals, scales = list(avals), []
    for index, _ in QUANTIZED_POOLS[op]:
        scales.append(jax.ShapeDtypeStruct(avals[index].shape[:-1] + (1,), jnp.float32))
        avals[index] = jax.ShapeDtypeStruct(avals[index].shape, jnp.float8_e4m3fn)
    names = tuple(name for _, name in QUANTIZED_POOLS[op])
    return op, f"{sizes} fp8 pool", _call(kernel, kwargs, names), (*avals, *scales)


def sink_cases() -> list[Case]:
    """gpt-oss's shapes (64 query heads, 8 kv heads, 64 wide) with its attention sinks: flash
    prefill with a 128-token window, and paged decode."""
    from dayzero import kernels
    bench = _bench_kernels()
    sinks = jax.ShapeDtypeStruct((64,), jnp.float32)
    cases = []
    for case, extra in ((bench.flash_case(1, 64, 8, 64, 4096), dict(window=128)),
                        (bench.paged_case(8, 64, 8, 64, 16, 8192), {})):
        avals = jax.eval_shape(lambda key, case=case: case.make(key, jnp.bfloat16), jax.random.key(0))
        kernel = getattr(kernels, f"{case.op}_pallas")
        window = f" window={extra['window']}" if extra else ""
        cases.append((case.op, f"{case.label}{window} sinks", _call(kernel, case.kwargs, ("sinks",), extra),
                      (*avals, sinks)))
    return cases


def _delta_avals(B, T, Hk, Hv, d, per_channel):
    """q, k, v, g, beta, state, num_new of a delta-rule call (dk = dv = d, bf16 activations)."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    g = sds((B, T, Hv, d) if per_channel else (B, T, Hv), jnp.float32)
    return (sds((B, T, Hk, d), bf16), sds((B, T, Hk, d), bf16), sds((B, T, Hv, d), bf16), g,
            sds((B, T, Hv), bf16), sds((B, Hv, d, d), jnp.float32), sds((B,), jnp.int32))


def delta_cases() -> list[Case]:
    """The delta-rule kernels (not in bench/kernels.py) at Qwen3-Next's GDN (16 q/k heads, 32
    value heads, 128 wide) and Kimi-Linear's KDA (32 heads, per-channel decay) sizes."""
    from dayzero import kernels
    chunked, step = kernels.chunked_delta_rule_pallas, kernels.recurrent_delta_step_pallas
    return [("chunked_delta_rule", "GDN B=2 T=1024 Hk=16 Hv=32 d=128 chunk=64", chunked,
             _delta_avals(2, 1024, 16, 32, 128, False)),
            ("chunked_delta_rule", "KDA B=1 T=1024 H=32 d=128 chunk=64", chunked,
             _delta_avals(1, 1024, 32, 32, 128, True)),
            ("recurrent_delta_step", "GDN decode B=64 Hk=16 Hv=32 d=128", step, _delta_avals(64, 1, 16, 32, 128, False)),
            ("recurrent_delta_step", "KDA decode B=64 H=32 d=128", step, _delta_avals(64, 1, 32, 32, 128, True))]


def report_all(limits: Limits = H200) -> dict:
    """Every case compiled and checked: one JSON-ready object (tools, limits, rows, ok)."""
    rows = []
    for op, sizes, fn, avals in bench_cases() + sink_cases() + delta_cases():
        try:
            rows += [{"op": op, "sizes": sizes, **row} for row in compile_report(fn, *avals, limits=limits)]
        except Exception as err:  # report every failure, then exit non-zero
            rows.append({"op": op, "sizes": sizes, "fits": False, "error": f"{type(err).__name__}: {err}"})
    return {"target": f"{limits.name} sm_{limits.capability}a", "limits": dataclasses.asdict(limits),
            "jax": jax.__version__, **tool_versions(limits), "kernels": rows,
            "spilling": [f"{r['op']} {r['sizes']}" for r in rows if r.get("spills")],
            "ok": all(r["fits"] for r in rows)}


def print_table(report: dict) -> None:
    """The report as a table, with failures and spills listed under it."""
    print(f"{report['target']}: triton {report['triton']}, ptxas {report['ptxas']}")
    print(f"{'op':22} {'sizes':44} {'warps':>5} {'stg':>3} {'regs':>4} {'spill st/ld':>11} "
          f"{'smem KiB':>8} {'blk/SM':>6} fits")
    for r in report["kernels"]:
        if "error" in r:
            print(f"{r['op']:22} {r['sizes']:44} FAILED {r['error']}")
            continue
        spill = f"{r['spill_store_bytes']}/{r['spill_load_bytes']}"
        print(f"{r['op']:22} {r['sizes']:44} {r['num_warps']:5} {r['num_stages']:3} {r['registers']:4} "
              f"{spill:>11} {r['shared_bytes'] / 1024:8.1f} {r['blocks_per_sm']:6} {'yes' if r['fits'] else 'NO'}")
        for problem in r["problems"]:
            print(f"  exceeds: {problem}")
    print("spills: " + ("; ".join(report["spilling"]) if report["spilling"] else "none"))
    print("every kernel fits the limits" if report["ok"] else "SOME KERNELS FAILED OR EXCEED THE LIMITS")


def main(argv: list[str] | None = None) -> int:
    """Compile and check every kernel; returns the exit status (1: a failure or a limit exceeded)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    try:
        _triton()
        report = report_all()
    except RuntimeError as err:  # triton missing, or no bench/kernels.py beside this package
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
