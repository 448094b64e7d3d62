"""The attention kernels over quantized pools: int8 / float8_e4m3fn values with one float32 scale
per row (per kv head, page and slot for K/V pages; per row for latent rows), read through the
block table (or the picks) with their scales and dequantized where they are used.

Each pool is ``dayzero.model.quant.quantize`` of a random float pool (absmax / 127 or / 448 per
row), as the serving cache stores it. Two checks per case:

- the Pallas kernel (interpret mode) against the reference on the same quantized pool: both
  dequantize each gathered value as ``values * scale`` in fp32 rounded to q's dtype, so they see
  the same keys and values and differ as the float kernels do (tolerances of
  tests/test_kernels_attention.py: summation order in fp32, one bf16 ulp plus the kernel's bf16
  softmax weights in bf16);
- the reference on the quantized pool against the float reference on the dequantized pool (the
  pool dequantized as a whole, in the same rounding): the same numbers, gathered in another
  order, so equal up to fp32 summation order (1e-6).

Slots that hold no token of any sequence are poisoned through their scales (NaN for keys, inf for
values, and NaN values too where fp8 has them): a stale slot must never reach the output.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import (KernelError, paged_attention, paged_attention_pallas, paged_attention_reference,
                             paged_latent_attention, paged_latent_attention_pallas, paged_latent_attention_reference,
                             sparse_attention, sparse_attention_pallas, sparse_attention_reference)
from dayzero.kernels.check import triton_calls
from dayzero.model.quant import ValueFormat, quantize
from tests.test_kernels_attention import (HEADS, PAGE, SPLITS, WIDE_SPLITS, assert_close, normal, page_table,
                                          poison_stale_slots, ragged_rows, sparse_inputs)

INTERPRET = "pallas_interpret"
DTYPES = [jnp.float32, jnp.bfloat16]
FORMATS = {"int8": ValueFormat.INT8, "fp8": ValueFormat.FP8}
# The quantized reference against the float reference on the dequantized pool: same values.
SAME = dict(rtol=1e-6, atol=1e-6)


pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` jitted as one computation, with the array keyword arguments (the
    scales, q_offsets) traced like the positional ones rather than baked in as constants."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, np.ndarray)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return jax.jit(lambda a, kw: fn(*a, **kw, **static))(args, arrays)


def quantized(pool: np.ndarray, fmt: ValueFormat, stale: np.ndarray | None, poison: float):
    """``pool`` quantized per row (its last axis), as numpy (values, scale [..., 1]); where
    ``stale`` (broadcast against the scale) the scale is ``poison`` and fp8 values are NaN."""
    q = quantize(jnp.asarray(pool, jnp.float32), fmt, (pool.ndim - 1,))
    values, scale = np.asarray(q.values), np.asarray(q.scale)
    assert values.dtype == fmt.dtype and scale.dtype == np.float32 and scale.shape == pool.shape[:-1] + (1,)
    if stale is not None:
        scale = np.where(stale, np.float32(poison), scale)
        if fmt is ValueFormat.FP8:
            values = np.where(stale, np.float32(np.nan), values.astype(np.float32)).astype(values.dtype)
    return values, scale


def dequantized(values: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    """The whole pool dequantized as the kernels dequantize each row: fp32 product, then ``dtype``
    (the poisoned stale slots become NaN or inf, as in the kernels)."""
    with np.errstate(invalid="ignore"):
        return (values.astype(np.float32) * scale).astype(jnp.dtype(dtype))


def stale_slots(tables, kv_lengths, num_pages: int) -> np.ndarray:
    """bool [P, PAGE]: the slots holding no token of any sequence."""
    return np.isnan(poison_stale_slots(np.zeros((num_pages, PAGE), np.float32), tables, kv_lengths, 0))


def quant_paged_inputs(rng, T, heads, dtype, kv_lengths, fmt):
    """q [B,T,N,H] and quantized K/V pages [K,P,PAGE,H] with scales [K,P,PAGE,1], stale slots
    poisoned (keys' scales NaN, values' inf)."""
    N, K, H = heads
    tables, P = page_table(rng, kv_lengths)
    q = normal(rng, (len(kv_lengths), T, N, H), dtype)
    stale = stale_slots(tables, kv_lengths, P)[None, :, :, None]
    k_pages, k_scales = quantized(normal(rng, (K, P, PAGE, H), np.float32), fmt, stale, np.nan)
    v_pages, v_scales = quantized(normal(rng, (K, P, PAGE, H), np.float32), fmt, stale, np.inf)
    return q, k_pages, v_pages, tables, k_scales, v_scales


def check_paged(q, k_pages, v_pages, tables, kv_lengths, k_scales, v_scales, dtype, blocks=None, mode=None, **kw):
    """Kernel against reference on the quantized pool, and reference against the float
    reference on the dequantized pool; returns the reference's output."""
    scales = dict(k_scales=k_scales, v_scales=v_scales)
    expected = run(paged_attention_reference, q, k_pages, v_pages, tables, kv_lengths, **scales, **kw)
    assert expected.shape == q.shape
    if mode is not None:
        actual = run(paged_attention, q, k_pages, v_pages, tables, kv_lengths, mode=mode, **scales, **kw)
    else:
        actual = run(paged_attention_pallas, q, k_pages, v_pages, tables, kv_lengths, interpret=True, blocks=blocks,
                     **scales, **kw)
    assert_close(actual, expected, dtype)
    k_float, v_float = dequantized(k_pages, k_scales, dtype), dequantized(v_pages, v_scales, dtype)
    assert np.isnan(k_float).any()  # the poison is there, and must not leak
    on_float = run(paged_attention_reference, q, k_float, v_float, tables, kv_lengths, **kw)
    np.testing.assert_allclose(np.asarray(expected, np.float32), np.asarray(on_float, np.float32), **SAME)
    return expected


# --- paged attention (GQA / MQA) ---


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mqa"]], ids=["gqa", "mqa"])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_paged_attention_quantized_chunk(fmt, heads, dtype):
    """5 queries per row at ragged offsets (kv lengths 0, one full page, mid-page, past the
    table), the page list split three ways, quantized pages with poisoned stale slots."""
    rng = np.random.default_rng(20)
    kv_lengths, q_offsets = ragged_rows(5)
    q, k_pages, v_pages, tables, k_scales, v_scales = quant_paged_inputs(rng, 5, heads, dtype, kv_lengths, fmt)
    expected = check_paged(q, k_pages, v_pages, tables, kv_lengths, k_scales, v_scales, dtype, blocks=SPLITS,
                           q_offsets=q_offsets)
    assert not np.asarray(expected[0], np.float32).any()  # the row without keys gives zeros


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_paged_attention_quantized_decode(fmt):
    """Decode (T=1, default offsets: each row's last key) through ``paged_attention``'s
    dispatch, GQA, bf16 queries, the interpret table's tiling."""
    rng = np.random.default_rng(21)
    kv_lengths, _ = ragged_rows(1)
    q, k_pages, v_pages, tables, k_scales, v_scales = quant_paged_inputs(rng, 1, HEADS["gqa"], jnp.bfloat16,
                                                                         kv_lengths, fmt)
    check_paged(q, k_pages, v_pages, tables, kv_lengths, k_scales, v_scales, jnp.bfloat16, mode=INTERPRET)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_paged_attention_quantized_window(fmt):
    """A chunk of 16 queries with a sliding window of 5 keys (the loop skips the first tiles),
    MQA, four pages per tile in 32-row blocks, two splits."""
    rng = np.random.default_rng(22)
    kv_lengths, q_offsets = ragged_rows(16)
    q, k_pages, v_pages, tables, k_scales, v_scales = quant_paged_inputs(rng, 16, HEADS["mqa"], jnp.float32,
                                                                         kv_lengths, fmt)
    check_paged(q, k_pages, v_pages, tables, kv_lengths, k_scales, v_scales, jnp.float32, blocks=WIDE_SPLITS,
                q_offsets=q_offsets, window=5, sm_scale=0.3)


# --- paged latent attention (MLA) ---


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_paged_latent_attention_quantized(fmt, T, dtype):
    """Quantized latent rows [P,PAGE,40] (32 value + 8 rope columns, one scale per row) shared
    by 4 heads: decode with the default offsets, a chunk of 5 with ragged ones; the page list
    split three ways; stale rows' scales NaN."""
    rng = np.random.default_rng(23)
    kv_lengths, q_offsets = ragged_rows(T)
    tables, P = page_table(rng, kv_lengths)
    q = normal(rng, (len(kv_lengths), T, 4, 40), dtype)
    latent, scales = quantized(normal(rng, (P, PAGE, 40), np.float32), fmt,
                               stale_slots(tables, kv_lengths, P)[:, :, None], np.nan)
    kw = dict(value_dim=32, sm_scale=0.15, q_offsets=None if T == 1 else q_offsets)
    expected = run(paged_latent_attention_reference, q, latent, tables, kv_lengths, latent_scales=scales, **kw)
    assert expected.shape == (4, T, 4, 32)
    actual = run(paged_latent_attention_pallas, q, latent, tables, kv_lengths, latent_scales=scales,
                 interpret=True, blocks=SPLITS, **kw)
    assert_close(actual, expected, dtype)
    on_float = run(paged_latent_attention_reference, q, dequantized(latent, scales, dtype), tables, kv_lengths, **kw)
    np.testing.assert_allclose(np.asarray(expected, np.float32), np.asarray(on_float, np.float32), **SAME)
    assert not np.asarray(expected[0], np.float32).any()


# --- sparse (DSA) attention ---


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_sparse_attention_quantized(fmt, dtype):
    """Per-row quantized rows [B,S,40], 20 picks per query (two blocks of 16), -1 and
    out-of-range picks, one query with nothing picked; rows nobody picks have NaN scales."""
    rng = np.random.default_rng(24)
    q, kv_float, idx = sparse_inputs(rng, 2, 3, 30, 20, dtype)
    picked = np.zeros(kv_float.shape[:2], bool)
    for b in range(2):
        picked[b, idx[b][(idx[b] >= 0) & (idx[b] < 30)]] = True
    kv, scales = quantized(kv_float.astype(np.float32), fmt, ~picked[..., None], np.nan)
    kw = dict(value_dim=32, sm_scale=0.2)
    expected = run(sparse_attention_reference, q, kv, idx, kv_scales=scales, **kw)
    assert expected.shape == (2, 3, 4, 32)
    assert_close(run(sparse_attention, q, kv, idx, kv_scales=scales, mode=INTERPRET, **kw), expected, dtype)
    on_float = run(sparse_attention_reference, q, dequantized(kv, scales, dtype), idx, **kw)
    np.testing.assert_allclose(np.asarray(expected, np.float32), np.asarray(on_float, np.float32), **SAME)
    assert not np.asarray(expected[0, 0], np.float32).any()


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_sparse_attention_quantized_shared_pool(fmt):
    """A shared quantized pool [B*S, C] with scales [B*S, 1] and each row's picks moved to its
    part of it (as the serving engine passes its flattened page pool) equals the per-row form,
    in the kernel and the reference."""
    rng = np.random.default_rng(25)
    q, kv_float, idx = sparse_inputs(rng, 2, 3, 30, 20, jnp.float32)
    kv, scales = quantized(kv_float, fmt, None, 0.0)
    kw = dict(value_dim=32, sm_scale=0.2)
    valid = (idx >= 0) & (idx < 30)
    pool_idx = np.where(valid, idx + 30 * np.arange(2)[:, None, None], -1).astype(np.int32)
    expected = run(sparse_attention_reference, q, kv, idx, kv_scales=scales, **kw)
    for mode in ("reference", INTERPRET):
        actual = run(sparse_attention, q, kv.reshape(60, 40), pool_idx, kv_scales=scales.reshape(60, 1),
                     mode=mode, **kw)
        assert_close(actual, expected, jnp.float32)


# --- validation: scales iff quantized, their shape and dtype (both paths) ---


def _paged_args(k_dtype=np.int8, v_dtype=None, q_dtype=np.float32, scale_shape=(2, 5, 8, 1), scale_dtype=np.float32,
                k_scales=True, v_scales=True):
    q = np.zeros((1, 1, 4, 16), q_dtype)
    k = np.zeros((2, 5, 8, 16), k_dtype)
    v = np.zeros((2, 5, 8, 16), v_dtype or k_dtype)
    scale = np.ones(scale_shape, scale_dtype)
    return (q, k, v, np.zeros((1, 2), np.int32), np.ones((1,), np.int32)), dict(
        k_scales=scale if k_scales else None, v_scales=scale if v_scales else None)


PAGED_ERRORS = {
    "no k_scales": (_paged_args(k_scales=False), "k_scales is required"),
    "no v_scales": (_paged_args(v_scales=False), "v_scales is required"),
    "float pool with scales": (_paged_args(k_dtype=np.float32), "k_scales was given but k_pages is float32"),
    "scale shape": (_paged_args(scale_shape=(2, 5, 8)), "k_scales has shape (2, 5, 8), expected (2, 5, 8, 1)"),
    "scale dtype": (_paged_args(scale_dtype=jnp.bfloat16), "k_scales must be float32, got bfloat16"),
    "mixed pools": (_paged_args(v_dtype=jnp.float8_e4m3fn), "v_pages has dtype float8_e4m3fn but k_pages has int8"),
    "int16 pool": (_paged_args(k_dtype=np.int16, k_scales=False, v_scales=False),
                   "or int8 or float8_e4m3fn with k_scales"),
    "int8 q": (_paged_args(q_dtype=np.int8), "q must be float32, bfloat16 or float16"),
}


@pytest.mark.parametrize("mode", ["reference", INTERPRET])
@pytest.mark.parametrize("case", PAGED_ERRORS.values(), ids=PAGED_ERRORS.keys())
def test_paged_attention_quant_validation(case, mode):
    (args, kwargs), message = case
    with pytest.raises(KernelError, match="^paged_attention: .*" + re.escape(message)):
        paged_attention(*args, mode=mode, **kwargs)


def _latent_args(pool_dtype=np.int8, scale_shape=(5, 8, 1), scale_dtype=np.float32, scales=True):
    return (np.zeros((1, 1, 4, 40), np.float32), np.zeros((5, 8, 40), pool_dtype), np.zeros((1, 2), np.int32),
            np.ones((1,), np.int32)), dict(latent_scales=np.ones(scale_shape, scale_dtype) if scales else None)


def _sparse_args(kv_shape=(1, 30, 40), kv_dtype=np.int8, scale_shape=(1, 30, 1), scale_dtype=np.float32, scales=True):
    return (np.zeros((1, 2, 4, 40), np.float32), np.zeros(kv_shape, kv_dtype), np.zeros((1, 2, 4), np.int32)), dict(
        kv_scales=np.ones(scale_shape, scale_dtype) if scales else None)


LATENT_SPARSE_ERRORS = {
    "latent no scales": (paged_latent_attention, _latent_args(scales=False), "latent_scales is required"),
    "latent float pool with scales": (paged_latent_attention, _latent_args(pool_dtype=np.float32),
                                      "latent_scales was given but latent_pages is float32"),
    "latent scale shape": (paged_latent_attention, _latent_args(scale_shape=(5, 8, 40)),
                           "latent_scales has shape (5, 8, 40), expected (5, 8, 1)"),
    "latent scale dtype": (paged_latent_attention, _latent_args(scale_dtype=np.float16),
                           "latent_scales must be float32, got float16"),
    "sparse no scales": (sparse_attention, _sparse_args(scales=False), "kv_scales is required"),
    "sparse float kv with scales": (sparse_attention, _sparse_args(kv_dtype=np.float32),
                                    "kv_scales was given but kv is float32"),
    "sparse shared pool scale shape": (sparse_attention, _sparse_args(kv_shape=(30, 40), scale_shape=(1, 30, 1)),
                                       "kv_scales has shape (1, 30, 1), expected (30, 1)"),
    "sparse scale dtype": (sparse_attention, _sparse_args(scale_dtype=jnp.bfloat16),
                           "kv_scales must be float32, got bfloat16"),
}


@pytest.mark.parametrize("mode", ["reference", INTERPRET])
@pytest.mark.parametrize("case", LATENT_SPARSE_ERRORS.values(), ids=LATENT_SPARSE_ERRORS.keys())
def test_latent_and_sparse_quant_validation(case, mode):
    op, (args, kwargs), message = case
    with pytest.raises(KernelError, match=f"^{op.__name__}: .*" + re.escape(message)):
        op(*args, value_dim=32, sm_scale=0.1, mode=mode, **kwargs)


# --- lowering to Pallas Triton at realistic sizes (no GPU needed) ---

SDS = jax.ShapeDtypeStruct
I32, F32, BF16 = jnp.int32, jnp.float32, jnp.bfloat16


def _lowering_cases(dt):
    return {
        "paged h128 page16": (
            lambda q, k, v, t, n, ks, vs: paged_attention_pallas(q, k, v, t, n, k_scales=ks, v_scales=vs),
            SDS((8, 1, 32, 128), BF16), SDS((8, 600, 16, 128), dt), SDS((8, 600, 16, 128), dt), SDS((8, 70), I32),
            SDS((8,), I32), SDS((8, 600, 16, 1), F32), SDS((8, 600, 16, 1), F32)),
        "paged chunk T256": (
            lambda q, k, v, t, n, ks, vs: paged_attention_pallas(q, k, v, t, n, k_scales=ks, v_scales=vs),
            SDS((2, 256, 32, 128), BF16), SDS((8, 600, 16, 128), dt), SDS((8, 600, 16, 128), dt),
            SDS((2, 256), I32), SDS((2,), I32), SDS((8, 600, 16, 1), F32), SDS((8, 600, 16, 1), F32)),
        "latent 512+64": (
            lambda q, p, t, n, s: paged_latent_attention_pallas(q, p, t, n, value_dim=512, sm_scale=0.1,
                                                                latent_scales=s),
            SDS((4, 1, 128, 576), BF16), SDS((300, 16, 576), dt), SDS((4, 70), I32), SDS((4,), I32),
            SDS((300, 16, 1), F32)),
        "sparse per-row": (
            lambda q, kv, i, s: sparse_attention_pallas(q, kv, i, value_dim=512, sm_scale=0.1, kv_scales=s),
            SDS((1, 4, 128, 576), BF16), SDS((1, 5000, 576), dt), SDS((1, 4, 2048), I32), SDS((1, 5000, 1), F32)),
        "sparse shared pool": (
            lambda q, kv, i, s: sparse_attention_pallas(q, kv, i, value_dim=512, sm_scale=0.1, kv_scales=s),
            SDS((4, 1, 128, 576), BF16), SDS((300 * 16, 576), dt), SDS((4, 1, 2048), I32),
            SDS((300 * 16, 1), F32)),
    }


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_quantized_kernels_lower_for_gpu(fmt):
    """Every op over an int8 / fp8 pool, at GPU-table tile sizes, lowers to one Pallas Triton call."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    for name, (fn, *avals) in _lowering_cases(fmt.dtype).items():
        assert triton_calls(fn, *avals) == 1, name
