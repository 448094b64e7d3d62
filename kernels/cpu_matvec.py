"""Native int8, int4 and float32 matrix-vector products for XLA:CPU decode, through the XLA FFI.

Why: a decode step reads every weight once and does two flops per weight, so it is limited by
the bytes it reads; int8 weights should decode up to 4x faster than fp32, int4 up to 8x. XLA:CPU
cannot get there: its dot of int8 values (converted in the dot's operand) first writes the whole
fp32 matrix, an int8 x int8 dot is ~10x slower than fp32, it converts int4 ~10x slower than int8,
and ``model.quant_matmul``'s tiled scan (each 64-row tile converted, then a dot) spends most of
its time converting. ``cpu_matvec.cc`` streams the rows (eight at a time, so the partial sums are
read and written once per eight rows) and converts them in registers:

- ``dayzero_matvec_i8``: int8 with one scale per output column. Measured on the 2-core host
  (best of 25, quiet): 30 [576 x 1536] products 1.3 ms against 3.4 ms for XLA's fp32 dot of the
  same shape, 30 [1536 x 576] 1.0 against 3.3, the [576 x 49152] head 2.1 against 5.3 (four rows
  at a time: 1.6 / 1.4 / 2.1; the first version, 64-column register tiles, 4.7 ms: a strided
  read).
- ``dayzero_matvec_i4``: int4 with one scale per group of inputs of each output column (the
  ``int4-all`` scheme's groups of 32, the experts' groups of 128). XLA hands an int4 array over
  packed, two values per byte; with AVX-512 each byte is widened to a 32-bit lane and its two
  nibbles looked up as floats in a 16-entry table (``vpermps``), and the next pass's rows are
  prefetched. 30 layers of SmolLM2's projections and the head, chained, all weights read from
  memory (min of 100): int4 5.0-5.6 ms, int8 7.1-7.9 ms, fp32 17-19 ms. With AVX2 (no
  AVX-512) the nibbles are sign-extended with integer ops instead of the table; with neither, a
  scalar loop does the same sums.
- ``dayzero_matvec_f32``: float32 weights, each 32 columns' sums held in two registers through
  a pass; the same chain 12.5-15.0 ms against XLA's dot 16.9-17.5 (min of 60).

The int8 and float32 kernels and the decode attention are written once against a small vector
type (``cpu_simd.h``: 16 lanes with AVX-512, 8 with AVX2 and FMA), so a machine without AVX-512
(AMD's Zen 2 and 3) runs the same code at half width, not a scalar fallback. On such a machine
(AMD EPYC, 2 cores, 2026-12-03) the scalar fallbacks had decoded SmolLM2 fp32 at 8.8 tok/s after
a 2048-token prompt (llama.cpp f32 24.6); at half width 21.9 (llama.cpp 28.2), and int8 went from
1.45x to 1.88x fp32 (``bench/quant.py``).

The kernels are compiled on first use with the host's C++ compiler (``$CXX``, else ``g++``) for
this CPU (``-march=native``) and kept under the dayzero cache (``native/``), keyed by their
source, flags, compiler, CPU flags and jaxlib version, then registered as the FFI targets above.
Where that cannot be done (no compiler, a failed build, ``DAYZERO_NATIVE_CPU=0``),
:func:`available` says False once with the reason in the log and callers keep the pure-jnp path
(``quant_matmul``'s tiled scan and XLA's dot are the references the tests compare the kernels
with). ``engine.step_cache`` registers the targets before it loads a stored executable and puts
:func:`fingerprint` in its key.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_matvec.cc")
# Built into the same library: the decode attention (``kernels.cpu_attention``), the decoder layer
# (``kernels.cpu_layer``) and their shared headers.
SOURCES = (SOURCE, SOURCE.with_name("cpu_attention.cc"), SOURCE.with_name("cpu_layer.cc"))
HEADERS = tuple(SOURCE.with_name(name) for name in ("cpu_parallel.h", "cpu_simd.h", "cpu_kernels.h"))
TARGET = "dayzero_matvec_i8"
TARGET_INT4 = "dayzero_matvec_i4"
TARGET_FLOAT32 = "dayzero_matvec_f32"
TARGET_ATTENTION = "dayzero_cached_attention"
TARGET_ATTENTION_IN_PLACE = "dayzero_attention_in_place"
TARGET_DECODER_LAYER = "dayzero_decoder_layer"
# -fopenmp-simd: the kernels' ``omp simd`` loops (reductions vectorized without -ffast-math); no
# OpenMP runtime is linked. -fno-trapping-math: GCC otherwise keeps a loop one element at a time
# where it converts floats to integers (the attention's exp: no vector conversion in the library
# at all without it); the arithmetic is unchanged (no reassociation, no fast math).
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-fno-trapping-math", "-shared", "-fPIC", "-w")
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_state: dict = {"ready": None, "reason": None}  # ready: None untried, True registered, False refused


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _library_key(cxx: str) -> str:
    """The build's key for compiler ``cxx``: sources, flags, compiler, CPU and jaxlib, none of
    which change while a process runs (computed once: ``fingerprint`` is in every step's key)."""
    import jaxlib

    sources = tuple(path.read_bytes() for path in SOURCES + HEADERS)
    return hashlib.sha256(repr((sources, FLAGS, os.path.realpath(cxx), _cpu_flags(), platform.machine(),
                                jaxlib.__version__)).encode()).hexdigest()[:20]


def _library_path() -> Path | None:
    """Where the built kernel for this source, compiler and CPU lives (None: no compiler)."""
    from dayzero.engine.default_model import cache_root

    cxx = _compiler()
    return None if cxx is None else cache_root() / "native" / f"cpu_matvec-{_library_key(cxx)}.so"


def _disabled() -> bool:
    return os.environ.get("DAYZERO_NATIVE_CPU", "1").lower() in ("0", "off", "false", "no")


def fingerprint() -> str:
    """What the compiled steps depend on: off, or the library they call. (A stored step that
    calls a library which later fails to load is rebuilt: ``StepCache`` recompiles what it
    cannot load, and the new trace takes the jnp path.)"""
    if _disabled() or jax.default_backend() != "cpu":
        return "off"
    path = _library_path()
    return "off" if path is None else path.name


def _build(path: Path) -> None:
    """Compile the kernel to ``path`` (complete or absent: written under another name, then moved)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.partial")
    command = [_compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-800:]}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _register(path: Path) -> None:
    library = ctypes.cdll.LoadLibrary(str(path))
    for target in (TARGET, TARGET_INT4, TARGET_FLOAT32, TARGET_ATTENTION, TARGET_ATTENTION_IN_PLACE,
                   TARGET_DECODER_LAYER):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")


def available(build: bool = True) -> bool:
    """Whether the native kernel is registered in this process, building it first if it is not
    built yet and ``build`` (once per machine; a few seconds). False on other platforms, without
    a compiler, after a failed build or with ``DAYZERO_NATIVE_CPU=0``."""
    if _disabled():
        return False
    if _state["ready"] is not None:
        return _state["ready"]
    with _lock:
        if _state["ready"] is not None:
            return _state["ready"]
        if jax.default_backend() != "cpu":
            return False  # decided per call: the backend may not be chosen yet
        path = _library_path()
        try:
            if path is None:
                raise RuntimeError("no C++ compiler (set CXX or install g++)")
            if not path.exists():
                if not build:
                    return False
                _build(path)
            _register(path)
            _state["ready"] = True
        except Exception as e:  # noqa: BLE001 - any failure leaves the pure-jnp path, said once
            _state["ready"], _state["reason"] = False, str(e)
            log.warning("the native CPU matvec kernels are unavailable (%s); int8, int4 and fp32 decode "
                        "on CPU take the slower jnp path", e)
        return _state["ready"]


def single_device_cpu() -> bool:
    """Whether this process runs on one XLA:CPU device, where the native kernels may stand in for
    XLA's ops. On a mesh a custom call has no sharding rule, so XLA would gather its operands."""
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def unavailable_reason() -> str | None:
    """Why :func:`available` said False after trying (None if it did not try or succeeded)."""
    return _state["reason"]


def matvec_int8(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    """``x`` [M, K] float32 times int8 ``values`` [K, N] scaled per column by ``scale`` [N]:
    [M, N] float32, on the native kernel (call only where :func:`available` is True)."""
    M, K = x.shape
    if values.shape[0] != K or values.dtype != jnp.int8 or scale.shape != (values.shape[1],):
        raise ValueError(f"matvec_int8 takes x [M,K], int8 values [K,N] and scale [N]; got {x.shape}, "
                         f"{values.dtype}{values.shape}, {scale.shape}")
    # Under vmap (a caller batching layers or experts) each product is its own call: correct, and
    # the rows of one call stay few, as the kernel wants.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, values.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), values, scale.astype(jnp.float32))


def float32_fits(n_in: int) -> bool:
    """Whether a float32 [n_in, N] weight fits :func:`matvec_float32`: whole eight-row passes."""
    return n_in % 8 == 0


def matvec_float32(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x`` [M, K] float32 times float32 ``w`` [K, N]: [M, N] float32, on the native kernel (call
    only where :func:`available` is True and :func:`float32_fits`)."""
    M, K = x.shape
    if w.shape[0] != K or w.dtype != jnp.float32 or x.dtype != jnp.float32 or not float32_fits(K):
        raise ValueError(f"matvec_float32 takes float32 x [M,K] and w [K,N] with K a multiple of 8; got "
                         f"{x.dtype}{x.shape}, {w.dtype}{w.shape}")
    call = jax.ffi.ffi_call(TARGET_FLOAT32, jax.ShapeDtypeStruct((M, w.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(x, w)


def int4_fits(n_in: int, n_out: int, group: int) -> bool:
    """Whether an int4 [n_in, n_out] weight with one scale per ``group`` inputs of each output
    fits :func:`matvec_int4`: whole eight-row passes, each inside one group, and whole bytes per row."""
    return n_in % 8 == 0 and group % 8 == 0 and n_out % 2 == 0


def matvec_int4(x: jax.Array, values: jax.Array, scale: jax.Array, group: int) -> jax.Array:
    """``x`` [M, K] float32 times int4 ``values`` [K, N] whose row k is scaled by ``scale``
    [ceil(K / group), N] row k // group: [M, N] float32, on the native kernel (call only where
    :func:`available` is True and :func:`int4_fits`)."""
    M, K = x.shape
    N = values.shape[1]
    if (values.shape[0] != K or values.dtype != jnp.int4 or scale.shape != (-(-K // group), N)
            or not int4_fits(K, N, group)):
        raise ValueError(f"matvec_int4 takes x [M,K], int4 values [K,N] with K and group multiples of 8 and N "
                         f"even, and scale [ceil(K/group),N]; got {x.shape}, {values.dtype}{values.shape}, "
                         f"{scale.shape}, group {group}")
    call = jax.ffi.ffi_call(TARGET_INT4, jax.ShapeDtypeStruct((M, N), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), values, scale.astype(jnp.float32), group=np.int64(group))
