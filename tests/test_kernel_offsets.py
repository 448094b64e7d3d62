"""Offsets into page pools larger than 2^31 elements (an H200 holds them: 8 kv heads x 2^17
pages x 16 slots x 128 = 2^31), checked without allocating one.

- The wrappers' own index arithmetic counts rows, never elements: ``page_rows`` (k * P + page)
  and ``picked_rows`` (b * S + pick) against numpy int64 oracles at those sizes, and the
  reference's gather lowered for such a pool reads whole rows of a [K*P, page*H] view.
- Inside the kernels, Pallas Triton computes each operand's element offsets itself: int64 for an
  operand above 2^32 bytes, else int32 (jax 0.10). The kernels are lowered for CUDA from
  ``jax.ShapeDtypeStruct`` pools of up to 4.8 GB and the emitted Triton IR is read
  (``dayzero.kernels.check.offset_types``): every pool operand of more than 2^31 elements must
  be addressed with i64 offsets. That holds for 2- and 4-byte pools; a 1-byte (int8/fp8) pool of
  2^31 to 2^32 elements gets i32 offsets that wrap, which ``tiles.pallas_offsets_fit`` predicts
  and the Pallas wrappers refuse (``KernelError``); the IR of the unguarded kernel shows why.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import (KernelError, paged_attention_pallas, paged_attention_reference,
                             paged_latent_attention_pallas, sparse_attention_pallas)
from dayzero.kernels import tiles
from dayzero.kernels.check import offset_overflows, offset_types, triton_modules
from dayzero.kernels.paged_attention import gather_pages, page_rows
from dayzero.kernels.sparse_attention import picked_rows

SDS = jax.ShapeDtypeStruct
I32, F32, BF16, I8, FP8 = jnp.int32, jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn
PAGE, H, C = 16, 128, 576


@pytest.fixture
def triton():
    """The Pallas Triton lowering and the private entry point ``kernels.check`` wraps to read its
    IR (present in jax 0.10's CPU wheels; skip, naming it, where a jax release moved them)."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    lowering = pytest.importorskip("jax._src.pallas.triton.lowering")
    if not hasattr(lowering, "lower_jaxpr_to_triton_module"):
        pytest.skip("this jax has no jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module to read IR from")


# --- the wrappers' index arithmetic: rows, checked against int64 ---


def _tables(rng, P: int) -> np.ndarray:
    """Block tables hitting the extremes: -1 and past-the-end entries (clamped), 0, P-1, random."""
    tables = rng.integers(0, P, (3, 6))
    tables[0, :4] = [-1, 0, P - 1, P + 5]
    return tables.astype(np.int32)


@pytest.mark.parametrize("P", [2**17, 2**18, 2**28 - 1])
def test_page_rows_match_int64_oracle(P):
    """k * P + clamped page for 8 kv heads of 2^17, 2^18 and almost 2^28 pages: exact as int64
    (the element offset of the same row, row * 16 * 128, would not fit int32 from 2^18 pages)."""
    rng = np.random.default_rng(0)
    K, tables = 8, _tables(rng, P)
    rows = np.asarray(page_rows(jnp.asarray(tables), K, P))
    assert rows.dtype == np.uint32
    oracle = np.arange(K, dtype=np.int64)[None, :, None] * P + np.clip(tables, 0, P - 1).astype(np.int64)[:, None, :]
    np.testing.assert_array_equal(rows.astype(np.int64), oracle)
    assert oracle.max() == K * P - 1  # the last page of the last kv head is among them
    assert (oracle.max() * PAGE * H > 2**31 - 1) == (P > 2**17)


def test_page_rows_refuse_more_rows_than_a_gather_index_holds():
    """JAX gathers with int32 indices, so 8 heads of 2^28 + 1 pages (beyond any memory) raise."""
    page_rows(jnp.zeros((1, 2), I32), 8, 2**28)  # exactly 2^31 rows: fine
    with pytest.raises(KernelError, match="2\\^31 rows"):
        page_rows(jnp.zeros((1, 2), I32), 8, 2**28 + 1)


@pytest.mark.parametrize("S", [2**21, 2**28 - 1])
def test_sparse_picked_rows_match_int64_oracle(S):
    """Per-row picks b * S + pick (invalid picks -> row 0 of their batch row) for 8 rows of up
    to almost 2^28 rows each, against int64; a shared pool's picks are the picks."""
    rng = np.random.default_rng(1)
    B = 8
    idx = rng.integers(0, S, (B, 2, 5))
    idx[0, 0, :4] = [-1, S, S - 1, 0]
    idx[B - 1, 1, 0] = S - 1
    idx = jnp.asarray(idx.astype(np.int32))
    valid, rows = picked_rows(idx, S, batch_rows=True)
    idx = np.asarray(idx).astype(np.int64)
    ok = (idx >= 0) & (idx < S)
    oracle = np.arange(B, dtype=np.int64)[:, None, None] * S + np.where(ok, idx, 0)
    np.testing.assert_array_equal(np.asarray(valid), ok)
    np.testing.assert_array_equal(np.asarray(rows).astype(np.int64), oracle)
    assert oracle.max() == B * S - 1
    _, shared = picked_rows(jnp.asarray(idx.astype(np.int32)), B * S, batch_rows=False)
    np.testing.assert_array_equal(np.asarray(shared).astype(np.int64), np.where((idx >= 0) & (idx < B * S), idx, 0))


def test_reference_gathers_rows_of_a_large_pool():
    """The reference over int8 pages of 8 heads x (2^17 + 1) pages (2^31 + 2^14 elements),
    lowered without data: every gather reads whole rows of the [K*P, page*H] view (values) or
    [K*P, page] view (scales), with row indices, so no element offset is computed in int32."""
    P = 2**17 + 1
    pool, scales = SDS((8, P, PAGE, H), I8), SDS((8, P, PAGE, 1), F32)
    fn = lambda q, k, v, t, n, ks, vs: paged_attention_reference(q, k, v, t, n, k_scales=ks, v_scales=vs)
    text = jax.jit(fn).lower(SDS((4, 1, 32, H), BF16), pool, pool, SDS((4, 64), I32), SDS((4,), I32),
                             scales, scales).as_text()
    gathers = [line for line in text.splitlines() if "stablehlo.gather" in line]
    assert len(gathers) == 4  # k, k scales, v, v scales
    assert all(f"(tensor<{8 * P}x{PAGE * H}xi8>, tensor<{4 * 8 * 64}x1xi32>)" in g or
               f"(tensor<{8 * P}x{PAGE}xf32>, tensor<{4 * 8 * 64}x1xi32>)" in g for g in gathers), gathers
    # The same gather serves the scales: [K,P,page,1] -> [B,K,W*page,1].
    assert jax.eval_shape(gather_pages, scales, SDS((4, 64), I32)).shape == (4, 8, 64 * PAGE, 1)


# --- inside the kernels: the offsets Pallas Triton emits ---


@pytest.mark.parametrize("shape, dtype, fits", [
    ((8, 2**17, PAGE, H), BF16, True),       # 2^31 elements, 2^32 bytes: i32, largest offset 2^31 - 1
    ((8, 2**17 + 1, PAGE, H), BF16, True),   # above 2^32 bytes: i64
    ((8, 2**17, PAGE, H), I8, True),         # 2^31 elements in 2^31 bytes: i32, fits
    ((8, 2**17 + 1, PAGE, H), I8, False),    # i32 past 2^31
    ((8, 2**18 + 1, PAGE, H), FP8, True),    # above 2^32 bytes: i64
    ((2**22, C), F32, True),
    ((2**30, 1), F32, True),
])
def test_pallas_offsets_fit(shape, dtype, fits):
    assert tiles.pallas_offsets_fit(shape, dtype) == fits
    if not fits:
        with pytest.raises(KernelError, match="int32 offsets that overflow"):
            tiles.check_pallas_offsets("op", "pool", SDS(shape, dtype))


def _paged(P, dtype):
    """paged_attention_pallas (decode, 32 heads over 8 kv heads of 128) over a pool of P pages."""
    pool = SDS((8, P, PAGE, H), dtype)
    args = [SDS((4, 1, 32, H), BF16), pool, pool, SDS((4, 64), I32), SDS((4,), I32)]
    if dtype in (I8, FP8):
        scales = SDS((8, P, PAGE, 1), F32)
        return (lambda q, k, v, t, n, ks, vs: paged_attention_pallas(q, k, v, t, n, k_scales=ks, v_scales=vs),
                *args, scales, scales)
    return (lambda q, k, v, t, n: paged_attention_pallas(q, k, v, t, n), *args)


def _latent(P, dtype):
    """paged_latent_attention_pallas (decode, 128 heads, 512 + 64 columns) over P pages."""
    args = [SDS((4, 1, 128, C), BF16), SDS((P, PAGE, C), dtype), SDS((4, 64), I32), SDS((4,), I32)]
    if dtype in (I8, FP8):
        return (lambda q, p, t, n, s: paged_latent_attention_pallas(q, p, t, n, value_dim=512, sm_scale=0.1,
                                                                    latent_scales=s), *args, SDS((P, PAGE, 1), F32))
    return (lambda q, p, t, n: paged_latent_attention_pallas(q, p, t, n, value_dim=512, sm_scale=0.1), *args)


def _sparse(S, dtype):
    """sparse_attention_pallas (top-2048 of a shared pool of S latent rows of 576)."""
    args = [SDS((4, 1, 128, C), BF16), SDS((S, C), dtype), SDS((4, 1, 2048), I32)]
    if dtype in (I8, FP8):
        return (lambda q, kv, i, s: sparse_attention_pallas(q, kv, i, value_dim=512, sm_scale=0.1, kv_scales=s),
                *args, SDS((S, 1), F32))
    return (lambda q, kv, i: sparse_attention_pallas(q, kv, i, value_dim=512, sm_scale=0.1), *args)


# (kernel, size, dtype, pool operand indices in the kernel's arguments)
LARGE_POOLS = {
    "paged bf16 2^31": (_paged, 2**17, BF16, (4, 5)),
    "paged bf16 2^31+2^27": (_paged, 2**17 + 2**13, BF16, (4, 5)),
    "paged int8 2^31": (_paged, 2**17, I8, (4, 6)),
    "paged fp8 2^32+2^28": (_paged, 2**18 + 2**14, FP8, (4, 6)),
    "latent bf16 2.4e9": (_latent, 2**18, BF16, (4,)),
    "sparse bf16 2.4e9": (_sparse, 2**22, BF16, (2,)),
    "sparse int8 4.8e9": (_sparse, 2**23, I8, (2,)),
}


@pytest.mark.parametrize("case", LARGE_POOLS.values(), ids=LARGE_POOLS.keys())
def test_large_pools_are_addressed_safely(case, triton):
    """Each kernel over a pool of 2^31 elements or more, lowered for CUDA: no operand of more
    than 2^31 elements is addressed with i32 offsets, and the pool's offsets are i64 exactly
    when it is larger than 2^32 bytes (the rule ``pallas_offsets_fit`` mirrors)."""
    make, size, dtype, pools = case
    fn, *avals = make(size, dtype)
    [module] = triton_modules(fn, *avals)
    types = offset_types(module)
    assert offset_overflows(module) == []
    assert set(types) == set(range(len(module.operands)))  # every operand's addressing was traced
    for index in pools:
        pool = module.operands[index]
        assert pool.dtype == jnp.dtype(dtype) and np.prod(pool.shape, dtype=np.int64) >= 2**31
        wide = np.prod(pool.shape, dtype=np.int64) * jnp.dtype(dtype).itemsize > 2**32
        assert types[index] == ({"i64"} if wide else {"i32"}), (pool, types[index])


# 1-byte pools of 2^31 to 2^32 elements: what the wrappers refuse.
ONE_BYTE_OVERFLOW = {
    "paged int8 3*2^30": (_paged, 2**17 + 2**16, I8, (4, 6)),
    "paged fp8 2^31+2^14": (_paged, 2**17 + 1, FP8, (4, 6)),
    "latent int8 2.4e9": (_latent, 2**18, I8, (4,)),
    "sparse fp8 2.4e9": (_sparse, 2**22, FP8, (2,)),
}


@pytest.mark.parametrize("case", ONE_BYTE_OVERFLOW.values(), ids=ONE_BYTE_OVERFLOW.keys())
def test_one_byte_pools_pallas_would_overflow_are_refused(case, monkeypatch, triton):
    """An int8/fp8 pool of more than 2^31 elements in at most 2^32 bytes: the wrapper raises
    KernelError; with that check switched off, the emitted IR shows why (the pool addressed
    with i32 offsets, whose largest value would be past 2^31 - 1)."""
    make, size, dtype, pools = case
    fn, *avals = make(size, dtype)
    with pytest.raises(KernelError, match="int32 offsets that overflow"):
        jax.eval_shape(fn, *avals)
    monkeypatch.setattr(tiles, "check_pallas_offsets", lambda *args: None)
    [module] = triton_modules(fn, *avals)
    assert all(offset_types(module)[index] == {"i32"} for index in pools)
    assert [line.split(":")[0] for line in offset_overflows(module)] == [
        f"operand {index} {jnp.dtype(dtype)}{list(module.operands[index].shape)}" for index in pools]
