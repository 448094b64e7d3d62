"""Ragged paged decode attention (GQA/MQA): one query per sequence over K/V pages.

    paged_attention(q [B,N,H], k_pages [K,P,page,H], v_pages [K,P,page,H],
                    block_tables [B,pages_per_seq] int32, lengths [B] int32) -> [B,N,H]

Sequence b's token t lives in page ``block_tables[b, t // page]`` at slot ``t % page``; its first
``lengths[b]`` tokens are attended to (0 gives zeros). The query is the sequence's last token, so
a sliding ``window`` keeps keys t >= length - window. Query head n reads kv head n // (N/K).
Table entries past a sequence's pages may hold anything in [0, P) (they are clamped there and
masked); pages are never written.

The kernel (shared with the MLA-latent variant in ``paged_latent_attention``) runs one program
per (sequence, kv head, block of query rows, split of the page list). Each program gathers
``pages_per_tile`` pages per step through the block table and folds them into an online softmax;
the splits (flash-decoding) keep a GPU busy when B*K alone is too few programs for a long
context, and their partial results are merged outside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dayzero.kernels import tiles
from dayzero.kernels.mode import KernelError, KernelMode, dispatch

OP = "paged_attention"


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
    """Tiling of the paged decode kernel.

    ``tokens_per_tile``: keys per step (whole pages, >= 16); ``block_rows``: query rows per
    program (power of two >= 16, Triton's smallest matmul side; GQA groups are padded up to
    it); ``min_programs``: split the page list until B*K*row_blocks*splits reaches this.
    """

    tokens_per_tile: int
    block_rows: int
    min_programs: int
    num_warps: int = 4
    num_stages: int = 2


# GPU tiles by largest value width they serve (H for GQA, kv_lora_rank for MLA): starting
# points for Hopper-class GPUs (132 SMs: two programs each), not yet tuned on one.
PAGED_BLOCKS_GPU: tuple[tuple[int, PagedBlocks], ...] = (
    (128, PagedBlocks(tokens_per_tile=64, block_rows=16, min_programs=264, num_warps=4, num_stages=2)),
    (256, PagedBlocks(tokens_per_tile=32, block_rows=16, min_programs=264, num_warps=4, num_stages=2)),
)
PAGED_BLOCKS_WIDE = PagedBlocks(tokens_per_tile=16, block_rows=16, min_programs=264, num_warps=8, num_stages=2)
# Interpret mode: one page of 16 tokens per step, no splits (tests force splits explicitly).
PAGED_BLOCKS_INTERPRET = PagedBlocks(tokens_per_tile=16, block_rows=16, min_programs=1)


def paged_blocks(value_dim: int, interpret: bool) -> PagedBlocks:
    """The table's tiling for values ``value_dim`` wide (interpret mode has its own)."""
    if interpret:
        return PAGED_BLOCKS_INTERPRET
    for max_dim, blocks in PAGED_BLOCKS_GPU:
        if value_dim <= max_dim:
            return blocks
    return PAGED_BLOCKS_WIDE


def check_tables(op: str, block_tables, lengths, batch: int) -> None:
    """Raise unless block_tables is int32 [B, pages_per_seq >= 1] and lengths int32 [B]."""
    tiles.check_rank(op, "block_tables", block_tables, 2, "int32 [B, pages_per_seq]")
    if block_tables.shape[0] != batch or block_tables.shape[1] < 1 or block_tables.dtype != jnp.int32:
        raise KernelError(f"{op}: block_tables must be int32 [B={batch}, pages_per_seq>=1], "
                          f"got {block_tables.dtype}{list(block_tables.shape)}")
    tiles.check_int_vector(op, "lengths", lengths, batch)


def validate_paged_attention(q, k_pages, v_pages, block_tables, lengths, sm_scale, window) -> float:
    """Check shapes and dtypes (raising :class:`KernelError` naming the bad one); return the
    softmax scale to use (1/sqrt(H) when ``sm_scale`` is None)."""
    tiles.check_rank(OP, "q", q, 3, "[B,N,H]")
    tiles.check_rank(OP, "k_pages", k_pages, 4, "[K,P,page_size,H]")
    B, N, H = q.shape
    K = k_pages.shape[0]
    if k_pages.shape[3] != H or min(k_pages.shape) < 1:
        raise KernelError(f"{OP}: k_pages has shape {tuple(k_pages.shape)}, expected "
                          f"[K,P,page_size,H={H}] for q of shape {tuple(q.shape)}")
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise KernelError(f"{OP}: v_pages has shape {tuple(v_pages.shape)} but k_pages has "
                          f"{tuple(k_pages.shape)}; they must match")
    if N % K:
        raise KernelError(f"{OP}: {N} query heads are not a multiple of {K} kv heads")
    tiles.check_float(OP, "q", q)
    tiles.check_float(OP, "k_pages", k_pages, q.dtype)
    tiles.check_float(OP, "v_pages", v_pages, q.dtype)
    check_tables(OP, block_tables, lengths, B)
    tiles.check_window(OP, window)
    if sm_scale is None:
        return H**-0.5
    tiles.check_scale(OP, sm_scale)
    return float(sm_scale)


def gather_pages(pages: jax.Array, block_tables: jax.Array, axis: int = 0) -> jax.Array:
    """Each sequence's pages in order: the [P, page] axes of ``pages`` starting at ``axis``
    become [B, pages_per_seq*page] (only the pages in the tables are read, the pool is not
    relaid out)."""
    rows = jnp.take(pages, jnp.clip(block_tables, 0, pages.shape[axis] - 1), axis=axis)
    shape = rows.shape
    return rows.reshape(*shape[:axis], shape[axis], shape[axis + 1] * shape[axis + 2], *shape[axis + 3:])


def decode_mask(lengths: jax.Array, S: int, window: int | None) -> jax.Array:
    """Which of S key positions the last token of each sequence sees -> bool [B,S]."""
    pos = jnp.arange(S)[None, :]
    visible = pos < lengths[:, None]
    if window is not None:
        visible &= pos >= lengths[:, None] - window
    return visible


def paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, window=None):
    """Pure-jnp paged decode attention with the contract of :func:`paged_attention`: gathers
    each sequence's keys and values into a contiguous [K,B,S,H], then plain softmax attention."""
    sm_scale = validate_paged_attention(q, k_pages, v_pages, block_tables, lengths, sm_scale, window)
    B, N, H = q.shape
    K = k_pages.shape[0]
    k = gather_pages(k_pages, block_tables, axis=1)  # [K,B,S,H]
    v = gather_pages(v_pages, block_tables, axis=1)
    visible = decode_mask(lengths, k.shape[2], window)  # [B,S]
    scores = jnp.einsum("bkgh,kbsh->bkgs", q.reshape(B, K, N // K, H), k,
                        preferred_element_type=jnp.float32) * sm_scale
    probs = tiles.masked_softmax(scores, visible[:, None, None, :])
    v = jnp.where(visible[None, :, :, None], v.astype(jnp.float32), 0.0)  # stale slots can't leak (0*inf)
    return jnp.einsum("bkgs,kbsh->bkgh", probs, v).reshape(B, N, H).astype(q.dtype)


def _paged_kernel(lengths_ref, tables_ref, q_ref, k_ref, *refs, sm_scale: float, window,
                  page_size: int, pages_per_tile: int, tiles_per_split: int, key_parts: tiles.Parts,
                  value_parts: tiles.Parts, values_in_keys: bool):
    """One (sequence b, kv head, row block, split s): q_ref [rows,Dq], k_ref [P,page,Dq] (and
    v_ref [P,page,Dv] unless the values are the keys' first columns); writes the unnormalised
    acc [rows,Dv] and the softmax state m, l [rows]."""
    v_ref, (acc_ref, m_ref, l_ref) = (None, refs) if values_in_keys else (refs[0], refs[1:])
    b, s = pl.program_id(0), pl.program_id(3)
    length = lengths_ref[b]
    tile = pages_per_tile * page_size
    first_key = 0 if window is None else jnp.maximum(length - window, 0)
    lo = jnp.maximum(s * tiles_per_split, first_key // tile)
    hi = jnp.maximum(jnp.minimum((s + 1) * tiles_per_split, pl.cdiv(length, tile)), lo)
    q_parts = [q_ref[:, o:o + n] for o, n in key_parts]

    def visit(j, state):
        pages = tables_ref[pl.ds(j * pages_per_tile, pages_per_tile)]
        pos = j * tile + jnp.arange(tile)
        valid = (pos < length) & (pos >= first_key)

        def load(ref, o, n):  # [pages_per_tile, page, n] gathered through the table -> [tile, n]
            return ref[pages, :, o:o + n].reshape(tile, n)

        k_parts = [load(k_ref, o, n) for o, n in key_parts]
        scores = jnp.where(valid[None, :], tiles.part_scores(q_parts, k_parts, sm_scale), -jnp.inf)
        v_parts = k_parts[:len(value_parts)] if values_in_keys else [load(v_ref, o, n) for o, n in value_parts]
        # Slots past the length may hold stale values; zero them so 0 * inf cannot give NaN.
        v_parts = [jnp.where(valid[:, None], v, 0) for v in v_parts]
        return tiles.softmax_update(state, scores, v_parts)

    m, l, acc = jax.lax.fori_loop(lo, hi, visit, tiles.softmax_init(q_ref.shape[0], value_parts))
    tiles.store_parts(acc_ref, acc, value_parts)
    m_ref[...] = m
    l_ref[...] = l


def paged_decode_pallas(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float, window,
                        key_parts: tiles.Parts, value_parts: tiles.Parts, interpret: bool,
                        blocks: PagedBlocks | None) -> jax.Array:
    """The kernel launch both paged ops share: q [B,K,R,Dq] (R query rows per kv head),
    k_pages [K,P,page,Dq], v_pages [K,P,page,Dv] or None (values = the keys' ``value_parts``
    columns) -> normalised fp32 [B,K,R,Dv]. Inputs are assumed validated."""
    B, K, R, Dq = q.shape
    P, page_size = k_pages.shape[1], k_pages.shape[2]
    Dv = sum(n for _, n in value_parts)
    if page_size & (page_size - 1):
        raise KernelError(f"page_size {page_size} is not a power of two, which the Pallas kernels "
                          "need (Triton loads power-of-two tiles); use --kernels reference")
    blocks = blocks or paged_blocks(Dv, interpret)
    rows = min(blocks.block_rows, max(tiles.MIN_DOT, tiles.next_pow2(R)))
    q = tiles.pad_axis(q, 2, tiles.round_up(R, rows))
    row_blocks = q.shape[2] // rows
    pages_per_tile = max(1, blocks.tokens_per_tile // page_size)
    num_tiles = tiles.round_up(block_tables.shape[1], pages_per_tile) // pages_per_tile
    splits = max(1, min(num_tiles, -(-blocks.min_programs // (B * K * row_blocks))))
    tiles_per_split = -(-num_tiles // splits)
    tables = tiles.pad_axis(jnp.clip(block_tables, 0, P - 1), 1, splits * tiles_per_split * pages_per_tile)
    lengths = jnp.clip(lengths, 0, block_tables.shape[1] * page_size)

    kernel = functools.partial(
        _paged_kernel, sm_scale=sm_scale, window=window, page_size=page_size,
        pages_per_tile=pages_per_tile, tiles_per_split=tiles_per_split, key_parts=key_parts,
        value_parts=value_parts, values_in_keys=v_pages is None)
    page_spec = lambda d: pl.BlockSpec((None, P, page_size, d), lambda b, k, r, s: (k, 0, 0, 0))
    in_specs = [pl.BlockSpec((B,), lambda b, k, r, s: (0,)),
                pl.BlockSpec((None, tables.shape[1]), lambda b, k, r, s: (b, 0)),
                pl.BlockSpec((None, None, rows, Dq), lambda b, k, r, s: (b, k, r, 0)),
                page_spec(Dq)]
    operands = [lengths, tables, q, k_pages]
    if v_pages is not None:
        in_specs.append(page_spec(v_pages.shape[3]))
        operands.append(v_pages)
    state_spec = pl.BlockSpec((None, None, None, rows), lambda b, k, r, s: (b, k, s, r))
    state_shape = jax.ShapeDtypeStruct((B, K, splits, q.shape[2]), jnp.float32)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, row_blocks, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, rows, Dv), lambda b, k, r, s: (b, k, s, r, 0)),
                   state_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, q.shape[2], Dv), jnp.float32), state_shape, state_shape],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="dayzero_paged_attention",
    )(*operands)
    return tiles.combine_splits(acc, m, l, axis=2)[:, :, :R]


def paged_attention_pallas(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, window=None,
                           interpret=False, blocks: PagedBlocks | None = None):
    """The Pallas kernel behind :func:`paged_attention` (``interpret`` runs it as XLA ops on any
    platform); ``blocks`` overrides the tiling table."""
    sm_scale = validate_paged_attention(q, k_pages, v_pages, block_tables, lengths, sm_scale, window)
    B, N, H = q.shape
    K = k_pages.shape[0]
    parts = tiles.pow2_parts(H)
    out = paged_decode_pallas(q.reshape(B, K, N // K, H), k_pages, v_pages, block_tables, lengths,
                              sm_scale=sm_scale, window=window, key_parts=parts, value_parts=parts,
                              interpret=interpret, blocks=blocks)
    return out.reshape(B, N, H).astype(q.dtype)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, window=None,
                    mode: KernelMode | str = KernelMode.AUTO):
    """Decode attention of one query per sequence q [B,N,H] over its K/V pages -> [B,N,H] (see
    the module docstring for the layout), run as ``mode`` resolves on this platform."""
    return dispatch(mode, paged_attention_reference, paged_attention_pallas, q, k_pages, v_pages,
                    block_tables, lengths, sm_scale=sm_scale, window=window)
