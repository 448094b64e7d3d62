"""Activations times a possibly-quantized weight: the one way forward code applies a projection.

:func:`linear` multiplies ``x`` [..., In] by a weight whose leading axes (flattened) are In. A
float weight, a prefill (many rows) or a platform that fuses dequantization into the dot
(GPU/TPU) take the plain path: dequantize (``quant.dequantized``) and one dot. On single-device
XLA:CPU a decode step with a quantized weight takes the tiled path instead, because XLA:CPU does
not fuse the dequantization into the dot: it would write the whole fp32 matrix first (one
SmolLM2-135M decode step: 30 ms fp32, 232 ms int8 that way). The tiled path is a ``lax.scan``
over tiles of ``TILE_ROWS`` input rows of the stored values. A row tile of a row-major [In, Out]
matrix is contiguous, so no relayout is needed (checkpoints and placements are unchanged); each
tile is dequantized, multiplied into a float accumulator [M, Out], and its fp32 copy stays small.
Per-output-channel scales are applied once to the sum; block scales (int4 groups, fp8 blocks) per
tile, whose rows then lie inside one block.

Rows that no tile size divides go through one dequantized dot of the remaining rows (the tail).

int8 weights with per-channel scales and int4 weights with per-group scales (one per group of
inputs of each output) skip the scan where the native kernel builds (``dayzero.kernels.cpu_matvec``:
the rows converted in registers, never written as fp32); the scan stays the reference it is
tested against, and the path everywhere else. A float32 decode product there takes the native
float32 kernel too (XLA's dot, the plain path, is its reference).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dayzero.kernels import cpu_matvec
from dayzero.model.quant import QuantizedArray, dequantized

# Most activation rows (B*T) for which the tiled path is taken: a decode step (one token per row).
# Above it the matrix is read once for many rows, so the dequantized copy costs less than the scan.
TILED_MAX_ROWS = 8

# Input rows per tile, by the number of output columns (the first entry whose bound is >= Out).
# Measured on the 2-core host (one int8 matvec, M=1, per-channel scales; ms, best of 3x30, a shared
# machine so +-30%): [576 x 49152] fp32 2.5-3.6, dequantize+dot 44-114, 16 rows 2.5, 32 2.3-2.7,
# 64 2.0-2.5, 192 7-20, 288 26; [576 x 1536] fp32 0.075, dequantize+dot 0.18, 16 rows 0.085-0.09,
# 32 0.073-0.08, 64 0.071-0.076, 192 0.095; [1536 x 576] fp32 0.05-0.06, 16 rows 0.068, 32 0.08,
# 64 0.078. Column tiles (pre-blocked [Out/c, In, c]) were no faster and need a relayout; a Python
# loop over the tiles instead of the scan made XLA:CPU materialise them all again (one SmolLM2
# decode step ~950 ms). Whole SmolLM2-135M decode step (bare forward, 64-row tiles, int8 head):
# fp32 42.6 ms, int8 25.9 ms; int8 with an fp32 head 73.8 ms (load average ~12 on 2 cores).
TILE_ROWS = ((math.inf, 64),)  # one size served every shape measured
MIN_TILE_ROWS = 8  # below this a tile's dot is too thin; such sizes take the tail path whole
# Most activation rows for which a float32 product takes the native kernel. It re-reads the
# weights once per row from cache, where XLA's dot reads them once for all rows: 30 SmolLM2
# layers' products and the head, chained, min of 60 (native against XLA): 1 row 15.1-16.0 ms
# against 19.2-20.8, 2 rows 17.3 against 19.9-21.8, 4 rows 23.1-25.2 against 23.8-26.9 (even),
# 8 rows 52-58 against 41-50.
FLOAT32_NATIVE_MAX_ROWS = 2


def linear(x: jax.Array, w, n_in: int = 1, out_dtype=None) -> jax.Array:
    """``x`` [..., In] times ``w`` [*in_dims, *out_dims] (its first ``n_in`` axes, flattened, are
    In): [..., *out_dims], in ``out_dtype`` (default ``x.dtype``; the dot accumulates in it).

    ``w`` is a float array or a :class:`~dayzero.model.quant.QuantizedArray` whose ``in_axes``
    are its first ``n_in`` axes (a projection as ``weights.ParamSpec`` declares it)."""
    in_dims, out_dims = tuple(w.shape[:n_in]), tuple(w.shape[n_in:])
    n_rows_in = math.prod(in_dims)
    if x.shape[-1] != n_rows_in:
        raise ValueError(f"activations [..., {x.shape[-1]}] do not match a weight of shape {tuple(w.shape)} "
                         f"contracted over its first {n_in} axes ({n_rows_in} rows)")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    rows = math.prod(x.shape[:-1])
    if isinstance(w, QuantizedArray):
        if tuple(w.in_axes) != tuple(range(n_in)):
            raise ValueError(f"a quantized weight contracted over its first {n_in} axes must have in_axes "
                             f"{tuple(range(n_in))}, got {w.in_axes}")
        if _tiled_here() and rows <= TILED_MAX_ROWS:
            x2 = x.reshape(rows, n_rows_in)
            native = native_matrix(w, n_in)
            if native is None:
                y = _tiled(x2.astype(out_dtype), w, n_rows_in, math.prod(out_dims))
            elif native[2] == 0:
                y = cpu_matvec.matvec_int8(x2, native[0], native[1]).astype(out_dtype)
            else:
                y = cpu_matvec.matvec_int4(x2, *native).astype(out_dtype)
            return y.reshape(*x.shape[:-1], *out_dims)
    elif _native_float32(x, w, rows, n_rows_in, out_dtype):
        y = cpu_matvec.matvec_float32(x.reshape(rows, n_rows_in), w.reshape(n_rows_in, -1))
        return y.reshape(*x.shape[:-1], *out_dims)
    matrix = dequantized(w, x.dtype).reshape(n_rows_in, *out_dims)
    return jnp.tensordot(x, matrix, axes=1, preferred_element_type=out_dtype).astype(out_dtype)


def _tiled_here() -> bool:
    """Whether the tiled path runs: on single-device XLA:CPU. GPU/TPU fuse the dequantization into
    the dot's operand read, and on a mesh a scan over a sharded input axis would gather it."""
    return cpu_matvec.single_device_cpu()


def native_matrix(w: QuantizedArray, n_in: int) -> tuple[jax.Array, jax.Array, int] | None:
    """How the native CPU kernels (``kernels.cpu_matvec``, and the decoder layer of
    ``kernels.cpu_layer``) take ``w``, whose first ``n_in`` axes are its input: (values [In, Out],
    scale, group), int8 with one scale per column (scale [Out], group 0) or int4 with one per
    ``group`` inputs of each column (scale [In/group, Out]); None where they do not (another format
    or layout, or no kernel built on this host)."""
    n_rows_in = math.prod(w.shape[:n_in])
    n_out = math.prod(w.shape[n_in:])
    if _native_int8(w, n_rows_in):
        return w.values.reshape(n_rows_in, n_out), w.scale.reshape(-1), 0
    if _native_int4(w, n_rows_in, n_out):
        return w.values.reshape(n_rows_in, n_out), w.scale.reshape(-1, n_out), w.block[0]
    return None


def _native_int8(w: QuantizedArray, n_in: int) -> bool:
    """Whether ``w`` (``n_in`` input rows) goes to the native int8 kernel
    (``kernels.cpu_matvec``): int8 values with one scale per output column, where the kernel
    builds on this host."""
    return (w.values.dtype == jnp.int8 and w.block is None and w.scale.size * n_in == w.values.size
            and cpu_matvec.available())


def _native_float32(x: jax.Array, w: jax.Array, rows: int, n_in: int, out_dtype) -> bool:
    """Whether a float32 product of ``rows`` activation rows (a decode step's few, on
    single-device CPU) goes to the native float32 kernel, which reads the weights faster than
    XLA:CPU's dot (``kernels.cpu_matvec``)."""
    return (w.dtype == jnp.float32 and x.dtype == jnp.float32 and out_dtype == jnp.float32
            and rows <= FLOAT32_NATIVE_MAX_ROWS and _tiled_here()
            and cpu_matvec.float32_fits(n_in) and cpu_matvec.available())


def _native_int4(w: QuantizedArray, n_in: int, n_out: int) -> bool:
    """Whether ``w`` ([n_in, n_out] as a matrix) goes to the native int4 kernel: int4 values with
    one scale per group of inputs of each output column, in a shape the kernel takes."""
    return (w.values.dtype == jnp.int4 and w.block is not None and w.block[1] == 1
            and cpu_matvec.int4_fits(n_in, n_out, w.block[0]) and cpu_matvec.available())


def tile_rows(n_in: int, n_out: int, block_rows: int | None = None) -> int:
    """Input rows per tile for an [n_in, n_out] weight: the table's size for ``n_out``, lowered to
    a divisor of ``n_in`` (and of ``block_rows``, the rows of a scale block) when one of at least
    half of it exists, so that no tail is left; 0 when even the tail would be the whole matrix."""
    target = next(rows for bound, rows in TILE_ROWS if n_out <= bound)
    unit = n_in if block_rows is None else math.gcd(n_in, block_rows)
    if block_rows is not None:
        # Every tile must lie inside one scale block: its size divides the block's rows.
        target = max(d for d in range(1, min(target, block_rows) + 1) if block_rows % d == 0)
    divisors = [d for d in range(target // 2, target + 1) if d >= 1 and unit % d == 0]
    rows = max(divisors) if divisors else target
    return rows if rows >= MIN_TILE_ROWS and n_in >= rows else 0


def _tiled(x: jax.Array, w: QuantizedArray, n_in: int, n_out: int) -> jax.Array:
    """x [M, In] times the quantized [In, Out] matrix, one tile of rows at a time: [M, Out]."""
    values = w.values.reshape(n_in, n_out)
    block_rows = None if w.block is None else w.block[0]
    rows = tile_rows(n_in, n_out, block_rows)
    n_tiles = n_in // rows if rows else 0
    main = n_tiles * rows
    scales = _row_scales(w, n_in, n_out)  # [1, Out] per channel, or [In/bi, Out] per block
    y = jnp.zeros((x.shape[0], n_out), x.dtype)
    if n_tiles:
        xs = x[:, :main].reshape(x.shape[0], n_tiles, rows).transpose(1, 0, 2)
        tiles = values[:main].reshape(n_tiles, rows, n_out)
        if w.block is None:
            y = _scan_sum(y, (xs, tiles), x.dtype) * scales
        else:
            # Tile t's rows lie in block (t * rows) // bi: its scales are that block's row.
            y = _scan_sum(y, (xs, tiles, scales[(jnp.arange(n_tiles) * rows) // block_rows]), x.dtype)
    if main < n_in:  # the tail: rows no tile covers, dequantized whole (small)
        tail = values[main:].astype(x.dtype)
        if w.block is None:
            y = y + (x[:, main:] @ tail) * scales
        else:
            y = y + x[:, main:] @ (tail * scales[jnp.arange(main, n_in) // block_rows])
    return y


def _scan_sum(y: jax.Array, tiles: tuple, dtype) -> jax.Array:
    """y + the sum over tiles of x_t @ values_t (times the tile's scales [Out] when given)."""
    def step(acc, tile):
        part = tile[0] @ tile[1].astype(dtype)
        return acc + (part if len(tile) == 2 else part * tile[2]), None
    return jax.lax.scan(step, y, tiles)[0]


def _row_scales(w: QuantizedArray, n_in: int, n_out: int) -> jax.Array:
    """The scales as rows over the output columns: [1, Out] for channel scales, [ceil(In/bi), Out]
    for block scales (each block's scale repeated over its columns, a partial last block cut)."""
    scale = w.scale.astype(jnp.float32)
    if w.block is None:
        return scale.reshape(1, n_out)
    return jnp.repeat(scale.reshape(-1, scale.shape[-1]), w.block[1], axis=-1)[:, :n_out]
