"""Each Pallas kernel, run in interpret mode, against its pure-jnp reference; and each reference
against the model code it will replace (or, for paged attention, against flash attention).

Interpret mode is slow on CPU, so sizes are tiny (head dims 16-40, a few heads, tens of keys).
Tolerances: fp32 paths differ only in summation order (1e-5). In bf16 both paths read the same
bf16 inputs and accumulate in fp32; the kernel rounds the softmax weights to bf16 before the
value product (as GPU flash kernels and the model do) and both round the output to bf16, so they
may differ by about one bf16 ulp of the output (2^-8 relative) plus the weights' rounding:
rtol = atol = 2^-6 bounds that with margin for outputs of size ~1.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dayzero.kernels import (flash_attention, flash_attention_pallas, flash_attention_reference, paged_attention,
                             paged_attention_pallas, paged_attention_reference, paged_latent_attention,
                             paged_latent_attention_pallas, paged_latent_attention_reference, sparse_attention,
                             sparse_attention_reference)
from dayzero.kernels.flash_attention import FlashBlocks
from dayzero.kernels.paged_attention import PagedBlocks
from dayzero.model import mla, transformer

INTERPRET = "pallas_interpret"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2**-6}
DTYPES = [jnp.float32, jnp.bfloat16]
# (query heads, kv heads, head dim): GQA, MQA, MHA; 24 = 16 + 8 exercises the head-dim parts.
HEADS = {"gqa": (4, 2, 16), "mqa": (4, 1, 32), "mha": (2, 2, 24)}


pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` jitted as one computation (eager op-by-op dispatch of the
    references and the interpreted kernels costs seconds in compiles of tiny ops)."""
    return jax.jit(functools.partial(fn, **kwargs))(*args)


def normal(rng, shape, dtype):
    """Standard-normal numpy data in ``dtype`` (numpy setup keeps tiny eager XLA compiles out)."""
    return rng.standard_normal(shape, dtype=np.float32).astype(jnp.dtype(dtype))


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype == jnp.dtype(dtype)
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert not np.isnan(actual).any()
    np.testing.assert_allclose(actual, expected, rtol=TOL[dtype], atol=TOL[dtype])


# --- flash attention (prefill) ---


def flash_inputs(rng, B, T, S, heads, dtype, kv_lengths):
    """q, k, v with NaN in every key slot past its row's kv_length (must never leak)."""
    N, K, H = heads
    q, k, v = normal(rng, (B, T, N, H), dtype), normal(rng, (B, S, K, H), dtype), normal(rng, (B, S, K, H), dtype)
    pad = (np.arange(S)[None, :] >= np.asarray(kv_lengths)[:, None])[:, :, None, None]
    return q, np.where(pad, np.nan, k).astype(k.dtype), np.where(pad, np.nan, v).astype(v.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_flash_causal_chunked_ragged(heads, dtype):
    """Causal chunked prefill: rows with keys 0 (nothing visible), full, and a chunk whose
    queries start at offset 8 with keys ending mid-block (S = 37, blocks of 16)."""
    rng = np.random.default_rng(0)
    B, T, S = 4, 20, 37
    q_offsets = np.array([0, 0, 8, 17], np.int32)
    kv_lengths = np.array([0, 37, 28, 37], np.int32)
    q, k, v = flash_inputs(rng, B, T, S, heads, dtype, kv_lengths)
    kw = dict(causal=True, q_offsets=q_offsets, kv_lengths=kv_lengths)
    expected = run(flash_attention_reference, q, k, v, **kw)
    assert_close(run(flash_attention, q, k, v, mode=INTERPRET, **kw), expected, dtype)
    assert not np.asarray(expected[0], np.float32).any()  # the row without keys gives zeros


def test_flash_not_causal_and_defaults():
    """Non-causal over ragged keys, and the defaults (offset 0, all S keys) with causal."""
    rng = np.random.default_rng(1)
    kv_lengths = np.array([5, 16, 0], np.int32)
    q, k, v = flash_inputs(rng, 3, 9, 16, HEADS["gqa"], jnp.float32, kv_lengths)
    kw = dict(causal=False, kv_lengths=kv_lengths)
    assert_close(run(flash_attention, q, k, v, mode=INTERPRET, **kw), run(flash_attention_reference, q, k, v, **kw),
                 jnp.float32)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    assert_close(run(flash_attention, q, k, v, mode=INTERPRET), run(flash_attention_reference, q, k, v), jnp.float32)


def test_flash_sliding_window_larger_blocks():
    """A sliding window of 11 keys (not a multiple of the block) with 32-wide key blocks over
    S = 70, so the loop's first block is computed from the window."""
    rng = np.random.default_rng(2)
    kv_lengths = np.array([70, 45], np.int32)
    q, k, v = flash_inputs(rng, 2, 40, 70, HEADS["mqa"], jnp.float32, kv_lengths)
    kw = dict(q_offsets=np.array([30, 5], np.int32), kv_lengths=kv_lengths, window=11)
    expected = run(flash_attention_reference, q, k, v, **kw)
    actual = run(flash_attention_pallas, q, k, v, interpret=True, blocks=FlashBlocks(block_q=16, block_k=32), **kw)
    assert_close(actual, expected, jnp.float32)


def test_flash_reference_matches_model_attend():
    """The reference computes what the model's ``transformer.attend`` does for new tokens
    after a full cache (keys = cached then new, queries at offset = cache length)."""
    rng = np.random.default_rng(3)
    B, T, Sc, N, K, H = 2, 6, 10, 4, 2, 16
    q, k_new, v_new = (normal(rng, shape, jnp.float32) for shape in [(B, T, N, H), (B, T, K, H), (B, T, K, H)])
    k_cache, v_cache = normal(rng, (B, Sc, K, H), jnp.float32), normal(rng, (B, Sc, K, H), jnp.float32)
    num_new, starts = np.array([6, 4], np.int32), np.full((B,), Sc, np.int32)
    for window in (None, 5):
        masks = run(transformer.attention_masks, starts, num_new, T=T, max_len=Sc, window=window)
        model = run(transformer.attend, q, k_cache.transpose(0, 2, 3, 1), v_cache.transpose(0, 2, 1, 3),
                    k_new, v_new, masks)
        ours = run(flash_attention_reference, q, np.concatenate([k_cache, k_new], 1),
                   np.concatenate([v_cache, v_new], 1), q_offsets=starts, kv_lengths=Sc + num_new, window=window)
        real = np.arange(T)[None, :] < np.asarray(num_new)[:, None]  # padding queries are undefined in the model
        np.testing.assert_allclose(np.asarray(ours)[real], np.asarray(model)[real], rtol=1e-5, atol=1e-5)


# --- ragged paged attention (GQA/MQA and MLA latent): decode (T=1) and chunked prefill ---

# Pages of 8 tokens, 6 per sequence (48 keys), in a pool with spare pages.
PAGE, PAGES_PER_SEQ = 8, 6
# More pages than one tile per split: every program's page list split three ways (one tile of
# two pages each), so causal ranges leave some splits empty and the merge sees them.
SPLITS = PagedBlocks(tokens_per_tile=16, block_rows=16, min_programs=1 << 20)
# Four pages per tile, 32-row blocks, two splits.
WIDE_SPLITS = PagedBlocks(tokens_per_tile=32, block_rows=32, min_programs=1 << 20)


def ragged_rows(T):
    """kv_lengths and q_offsets for T queries in 4 rows: no keys at all; one full page whose
    last T keys are the queries (positions below 0 when T > 8 see nothing); a chunk at
    positions 5.. that straddles pages; a chunk at 2.. in a sequence longer than its table
    (50 keys, clamped to 48), whose later keys are in the queries' future."""
    kv_lengths = np.array([0, PAGE, min(5 + T, PAGE * PAGES_PER_SEQ), 50], np.int32)
    return kv_lengths, np.array([0, PAGE - T, 5, 2], np.int32)


def page_table(rng, kv_lengths):
    """Scattered page ids; entries past each sequence's pages are -1, which must be ignored."""
    B = len(kv_lengths)
    P = B * PAGES_PER_SEQ + 3
    tables = rng.permutation(P)[: B * PAGES_PER_SEQ].reshape(B, PAGES_PER_SEQ)
    used = np.arange(PAGES_PER_SEQ)[None, :] < -(-np.minimum(kv_lengths, PAGE * PAGES_PER_SEQ)[:, None] // PAGE)
    return np.where(used, tables, -1).astype(np.int32), P


def poison_stale_slots(pages, tables, kv_lengths, axis_offset: int):
    """NaN in every slot of the pool that holds no token of any sequence."""
    stale = np.ones(pages.shape[axis_offset:axis_offset + 2], bool)  # [P, page]
    for b, length in enumerate(np.minimum(kv_lengths, PAGE * PAGES_PER_SEQ)):
        for t in range(int(length)):
            stale[int(tables[b, t // PAGE]), t % PAGE] = False
    shape = (1,) * axis_offset + stale.shape + (1,) * (pages.ndim - axis_offset - 2)
    return np.where(stale.reshape(shape), np.nan, pages).astype(pages.dtype)


def paged_inputs(rng, T, heads, dtype, kv_lengths):
    """q [B,T,N,H], poisoned k/v pages [K,P,PAGE,H] and the block tables."""
    N, K, H = heads
    tables, P = page_table(rng, kv_lengths)
    q = normal(rng, (len(kv_lengths), T, N, H), dtype)
    k_pages, v_pages = (poison_stale_slots(normal(rng, (K, P, PAGE, H), dtype), tables, kv_lengths, 1)
                        for _ in range(2))
    return q, k_pages, v_pages, tables


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_paged_attention_ragged_chunk(heads, dtype):
    """5 queries per row at ragged offsets (see ``ragged_rows``), the page list split three
    ways, NaN in every stale slot; the row without keys gives zeros."""
    rng = np.random.default_rng(4)
    kv_lengths, q_offsets = ragged_rows(5)
    q, k_pages, v_pages, tables = paged_inputs(rng, 5, heads, dtype, kv_lengths)
    kw = dict(q_offsets=q_offsets)
    expected = run(paged_attention_reference, q, k_pages, v_pages, tables, kv_lengths, **kw)
    assert expected.shape == q.shape
    actual = run(paged_attention_pallas, q, k_pages, v_pages, tables, kv_lengths, interpret=True, blocks=SPLITS, **kw)
    assert_close(actual, expected, dtype)
    assert not np.asarray(expected[0], np.float32).any()


@pytest.mark.parametrize("offsets", ["default", "ragged"])
@pytest.mark.parametrize("T", [1, 16, 37])
def test_paged_attention_query_counts(T, offsets):
    """Decode (T=1) and chunks of 16 and 37 queries (GQA: 32 and 74 rows, several row blocks
    of 32 rows, the last partial), with the default offsets (the last T keys) or ragged ones;
    four pages per tile, two splits."""
    rng = np.random.default_rng(5)
    kv_lengths, q_offsets = ragged_rows(T)
    q, k_pages, v_pages, tables = paged_inputs(rng, T, HEADS["gqa"], jnp.float32, kv_lengths)
    kw = dict(q_offsets=None if offsets == "default" else q_offsets)
    expected = run(paged_attention_reference, q, k_pages, v_pages, tables, kv_lengths, **kw)
    actual = run(paged_attention_pallas, q, k_pages, v_pages, tables, kv_lengths, interpret=True,
                 blocks=WIDE_SPLITS, **kw)
    assert_close(actual, expected, jnp.float32)


@pytest.mark.parametrize("T, blocks", [(1, None), (37, SPLITS)], ids=["decode-table", "chunk-splits"])
def test_paged_attention_sliding_window(T, blocks):
    """A window of 5 keys: for decode with the interpret table's tiling; for a chunk of 37
    with splits, where later row blocks start past the first tiles (the loop skips them)."""
    rng = np.random.default_rng(6)
    kv_lengths, q_offsets = ragged_rows(T)
    q, k_pages, v_pages, tables = paged_inputs(rng, T, HEADS["mqa"], jnp.float32, kv_lengths)
    kw = dict(q_offsets=q_offsets, window=5, sm_scale=0.3)
    expected = run(paged_attention_reference, q, k_pages, v_pages, tables, kv_lengths, **kw)
    if blocks is None:
        actual = run(paged_attention, q, k_pages, v_pages, tables, kv_lengths, mode=INTERPRET, **kw)
    else:
        actual = run(paged_attention_pallas, q, k_pages, v_pages, tables, kv_lengths, interpret=True,
                     blocks=blocks, **kw)
    assert_close(actual, expected, jnp.float32)


@pytest.mark.parametrize("T", [1, 5])
def test_paged_attention_is_flash_on_gathered_keys(T):
    """Paged attention (reference and kernel) of T queries equals flash attention, causal, of
    the same queries over each sequence's keys gathered into a contiguous array; T=1 with
    the default offsets is decode at the last position."""
    rng = np.random.default_rng(7)
    kv_lengths, q_offsets = ragged_rows(T)
    q, k_pages, v_pages, tables = paged_inputs(rng, T, HEADS["gqa"], jnp.float32, kv_lengths)
    safe = np.clip(tables, 0, None)
    k, v = (pages[:, safe].reshape(pages.shape[0], len(safe), -1, pages.shape[3]).transpose(1, 2, 0, 3)
            for pages in (k_pages, v_pages))  # [B,S,K,H]
    clamped = np.minimum(kv_lengths, k.shape[1])
    paged_kw = dict(q_offsets=None) if T == 1 else dict(q_offsets=q_offsets)
    flash_offsets = clamped - 1 if T == 1 else q_offsets
    expected = run(flash_attention_reference, q, k, v, causal=True, q_offsets=flash_offsets, kv_lengths=kv_lengths)
    for mode in ("reference", INTERPRET):
        actual = run(paged_attention, q, k_pages, v_pages, tables, kv_lengths, mode=mode, **paged_kw)
        np.testing.assert_allclose(actual, expected, rtol=1e-6 if mode == "reference" else 1e-5,
                                   atol=1e-6 if mode == "reference" else 1e-5, err_msg=mode)


def latent_inputs(rng, T, dtype, kv_lengths, N=4, C=40):
    """Absorbed queries [B,T,N,C] and poisoned latent pages [P,PAGE,C] (32 value + 8 rope columns)."""
    tables, P = page_table(rng, kv_lengths)
    q = normal(rng, (len(kv_lengths), T, N, C), dtype)
    return q, poison_stale_slots(normal(rng, (P, PAGE, C), dtype), tables, kv_lengths, 0), tables


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 5])
def test_paged_latent_attention_ragged(T, dtype):
    """MLA latent pages, 4 heads sharing the rows: decode with the default offsets, a chunk of
    5 with ragged ones; the page list split three ways."""
    rng = np.random.default_rng(8)
    kv_lengths, q_offsets = ragged_rows(T)
    q, latent, tables = latent_inputs(rng, T, dtype, kv_lengths)
    kw = dict(value_dim=32, sm_scale=0.15, q_offsets=None if T == 1 else q_offsets)
    expected = run(paged_latent_attention_reference, q, latent, tables, kv_lengths, **kw)
    assert expected.shape == (4, T, 4, 32)
    actual = run(paged_latent_attention_pallas, q, latent, tables, kv_lengths, interpret=True, blocks=SPLITS, **kw)
    assert_close(actual, expected, dtype)
    assert not np.asarray(expected[0], np.float32).any()


def test_paged_latent_attention_long_chunk():
    """37 queries x 4 heads = 148 rows of one "kv head" (10 row blocks), ragged offsets, the
    interpret table's tiling."""
    rng = np.random.default_rng(9)
    kv_lengths, q_offsets = ragged_rows(37)
    q, latent, tables = latent_inputs(rng, 37, jnp.float32, kv_lengths)
    kw = dict(value_dim=32, sm_scale=0.15, q_offsets=q_offsets)
    expected = run(paged_latent_attention_reference, q, latent, tables, kv_lengths, **kw)
    assert_close(run(paged_latent_attention, q, latent, tables, kv_lengths, mode=INTERPRET, **kw), expected,
                 jnp.float32)


# --- sparse (DSA) attention ---


def sparse_inputs(rng, B, T, S, k, dtype, N=4, C=40):
    """Queries, latent rows and picks: distinct indices per query, some -1 (no token), one
    query with nothing picked, one pick past the rows (also "no token")."""
    q, kv = normal(rng, (B, T, N, C), dtype), normal(rng, (B, S, C), dtype)
    idx = np.stack([[rng.permutation(S)[:k] for _ in range(T)] for _ in range(B)]).astype(np.int32)
    idx[0, 0, :] = -1
    idx[0, 1, 7:] = -1
    idx[1, 2, 3] = S + 4
    return q, kv, idx


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sparse_attention(dtype):
    """20 picks per query (two blocks of 16, the second partial), 4 heads, C = 32 + 8."""
    rng = np.random.default_rng(8)
    q, kv, idx = sparse_inputs(rng, 2, 3, 30, 20, dtype)
    kw = dict(value_dim=32, sm_scale=0.2)
    expected = run(sparse_attention_reference, q, kv, idx, **kw)
    assert expected.shape == (2, 3, 4, 32)
    assert_close(run(sparse_attention, q, kv, idx, mode=INTERPRET, **kw), expected, dtype)
    assert not np.asarray(expected[0, 0], np.float32).any()


@pytest.mark.parametrize("mode", ["reference", INTERPRET])
def test_sparse_attention_shared_pool(mode):
    """kv [S,C] shared by every batch row equals the per-row form with kv broadcast; and
    per-row rows [B,S,C] equal one pool [B*S,C] with each row's picks moved to its part of
    the pool (as the serving engine translates picks to page-pool slots), -1 kept."""
    rng = np.random.default_rng(10)
    q, kv, idx = sparse_inputs(rng, 2, 3, 30, 20, jnp.float32)
    kw = dict(value_dim=32, sm_scale=0.2)
    shared = kv[1]
    expected = run(sparse_attention_reference, q, np.broadcast_to(shared, kv.shape), idx, **kw)
    assert_close(run(sparse_attention, q, shared, idx, mode=mode, **kw), expected, jnp.float32)
    valid = (idx >= 0) & (idx < kv.shape[1])
    pool_idx = np.where(valid, idx + kv.shape[1] * np.arange(2)[:, None, None], -1).astype(np.int32)
    assert_close(run(sparse_attention, q, kv.reshape(-1, kv.shape[2]), pool_idx, mode=mode, **kw),
                 run(sparse_attention_reference, q, kv, idx, **kw), jnp.float32)


def test_sparse_reference_matches_model_attend_gathered():
    """The reference computes what ``mla.attend_gathered`` does: its picks index the cached
    rows then the new ones, and a pick that is not visible becomes -1."""
    rng = np.random.default_rng(9)
    B, T, S, N, C, k, L = 2, 4, 12, 4, 40, 6, 32
    q, cache, new = (normal(rng, shape, jnp.float32) for shape in [(B, T, N, C), (B, S, C), (B, T, C)])
    indices = np.stack([[rng.permutation(S + T)[:k] for _ in range(T)] for _ in range(B)]).astype(np.int32)
    visible = rng.random((B, T, k)) < 0.8
    num_new = np.array([T, T - 1], np.int32)
    _, mask_new = run(transformer.attention_masks, np.full((B,), S, np.int32), num_new, T=T, max_len=S, window=None)
    mask_new = np.asarray(mask_new)
    model = run(mla.attend_gathered, q, cache, new, mask_new, indices, visible)[..., :L]
    new_ok = np.take_along_axis(mask_new, np.clip(indices - S, 0, T - 1), axis=2)
    ours_idx = np.where(visible & ((indices < S) | new_ok), indices, -1).astype(np.int32)
    ours = run(sparse_attention_reference, q, np.concatenate([cache, new], 1), ours_idx, value_dim=L, sm_scale=1.0)
    np.testing.assert_allclose(ours, model, rtol=1e-5, atol=1e-5)
