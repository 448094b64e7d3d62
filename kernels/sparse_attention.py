"""Sparse latent attention over per-query selected tokens (DeepSeek Sparse Attention, V3.2).

    sparse_attention(q [B,T,N,C], kv [B,S,C] or [S,C], indices [B,T,k] int32, *, value_dim,
                     sm_scale, kv_scales=None) -> [B,T,N,value_dim]

Query t of row b attends, with every head, only to the latent rows ``kv[b, indices[b,t,:]]``
that its indexer picked (``dayzero.model.dsa.select``); an index outside [0, S) (canonically
-1) means "no token" and is skipped, and a query with no token gives zeros. A ``kv`` of shape
[S,C] is one pool of rows shared by every batch row (``kv[indices[b,t,:]]``): the serving
engine passes its latent page pool flattened to [P*page, C] with the picks already translated
to pool slots, so nothing is gathered per sequence before the kernel. Each row is both the
key (all C columns) and the value (its first ``value_dim`` columns), as in the absorbed MLA form
of ``dayzero.model.mla.attend_gathered``: there, ``kv`` is the cached rows followed by the new
ones, and picks that are not visible become -1 here. The model scales its queries before the
call, so it passes ``sm_scale=1.0``; the scale is required because the latent form has no
natural default.

``kv`` is float (q's dtype) or quantized: int8 or float8_e4m3fn values with float32 ``kv_scales``
of kv's shape with last dim 1 (one per row, real value = values * scale; a ``QuantizedArray``
pool passes ``.values`` and ``.scale``, flattened alike). Each picked row is gathered with its
scale and dequantized where it is read.

The kernel runs one program per (row, query, block of heads) and walks the picks in blocks,
gathering those rows from ``kv`` and folding them into an online softmax: work is proportional
to k, never to S.
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

OP = "sparse_attention"


@dataclasses.dataclass(frozen=True)
class SparseBlocks:
    """Tiling of the sparse kernel: picks per step and query heads per program (powers of
    two >= 16, Triton's smallest matmul side; heads are padded up to ``block_rows``)."""

    block_k: int
    block_rows: int
    num_warps: int = 4
    num_stages: int = 2


# GPU tiles by largest value width they serve; starting points, not yet tuned on a GPU.
SPARSE_BLOCKS_GPU: tuple[tuple[int, SparseBlocks], ...] = (
    (128, SparseBlocks(block_k=64, block_rows=16, num_warps=4, num_stages=2)),
)
SPARSE_BLOCKS_WIDE = SparseBlocks(block_k=32, block_rows=16, num_warps=4, num_stages=2)
SPARSE_BLOCKS_INTERPRET = SparseBlocks(block_k=16, block_rows=16)


def sparse_blocks(value_dim: int, interpret: bool) -> SparseBlocks:
    """The table's tiling for values ``value_dim`` wide (interpret mode has its own)."""
    if interpret:
        return SPARSE_BLOCKS_INTERPRET
    for max_dim, blocks in SPARSE_BLOCKS_GPU:
        if value_dim <= max_dim:
            return blocks
    return SPARSE_BLOCKS_WIDE


def validate_sparse_attention(q, kv, indices, value_dim, sm_scale, kv_scales=None) -> None:
    """Check shapes, dtypes and arguments, raising :class:`KernelError` naming the bad one: a
    float kv in q's dtype, or int8/float8_e4m3fn kv with float32 ``kv_scales`` [B,S,1] / [S,1]."""
    tiles.check_rank(OP, "q", q, 4, "[B,T,N,C]")
    tiles.check_rank(OP, "indices", indices, 3, "int32 [B,T,k]")
    B, T, N, C = q.shape
    if len(kv.shape) not in (2, 3) or kv.shape[-1] != C or kv.shape[-2] < 1 or kv.shape[:-2] not in ((), (B,)):
        raise KernelError(f"{OP}: kv has shape {tuple(kv.shape)}, expected [B={B}, S>=1, C={C}] "
                          f"(per row) or [S>=1, C={C}] (shared) for q of shape {tuple(q.shape)}")
    if tuple(indices.shape[:2]) != (B, T) or indices.shape[2] < 1 or indices.dtype != jnp.int32:
        raise KernelError(f"{OP}: indices must be int32 [B={B}, T={T}, k>=1], "
                          f"got {indices.dtype}{list(indices.shape)}")
    tiles.check_value_dim(OP, value_dim, C)
    tiles.check_float(OP, "q", q)
    tiles.check_pool(OP, "kv", kv, "kv_scales", kv_scales, q.dtype)
    tiles.check_scale(OP, sm_scale)


def picked_rows(indices: jax.Array, num_rows: int, batch_rows: bool) -> tuple[jax.Array, jax.Array]:
    """Where each pick of ``indices`` [B,T,k] reads: (valid [B,T,k], row [B,T,k] uint32) in a
    pool of ``num_rows`` rows, or with ``batch_rows`` in per-row rows [B,S] seen as one
    [B*S] pool (row b's rows from b*S). Invalid picks read row 0 (of their batch row).
    Row units, uint32: never the elements row * C, which overflow int32 for large pools."""
    valid = (indices >= 0) & (indices < num_rows)
    picked = jnp.where(valid, indices, 0)
    if not batch_rows:
        return valid, picked.astype(jnp.uint32)
    B = indices.shape[0]
    batch = jnp.arange(B, dtype=jnp.uint32)[:, None, None]
    return valid, tiles.flat_rows(batch, B, num_rows, picked)


def sparse_attention_reference(q, kv, indices, *, value_dim: int, sm_scale: float, kv_scales=None):
    """Pure-jnp sparse attention with the contract of :func:`sparse_attention`: gathers each
    query's k picked rows [B,T,k,C] (and their scales, dequantizing, for a quantized kv), then
    softmax attention over them."""
    validate_sparse_attention(q, kv, indices, value_dim, sm_scale, kv_scales)
    S = kv.shape[-2]
    valid, picked = picked_rows(indices, S, kv.ndim == 3)  # [B,T,k]

    def take(x):  # per-row [B,S,c] or shared [S,c] -> the picked rows [B,T,k,c]
        return jnp.asarray(x).reshape(-1, x.shape[-1]).at[picked].get(mode="promise_in_bounds")

    rows = tiles.dequantize(take(kv), None if kv_scales is None else take(kv_scales), q.dtype)
    rows = jnp.where(valid[..., None], rows, 0)  # empty picks read row 0: zero it (no 0 * inf)
    scores = jnp.einsum("btnc,btkc->btnk", q, rows, preferred_element_type=jnp.float32) * sm_scale
    probs = tiles.masked_softmax(scores, valid[:, :, None, :])
    out = jnp.einsum("btnk,btkc->btnc", probs, rows.astype(jnp.float32))  # all C columns, sliced after
    return out[..., :value_dim].astype(q.dtype)


def _sparse_kernel(indices_ref, q_ref, kv_ref, *refs, sm_scale: float, block_k: int,
                   num_tiles: int, key_parts: tiles.Parts, value_parts: tiles.Parts, scaled: bool):
    """One (row, query, head block): indices_ref [k_pad], q_ref [rows,C], kv_ref [S,C] (the
    row's own rows or the shared pool), with ``scaled`` then s_ref [S] (their scales);
    o_ref [rows,value_dim]."""
    s_ref, o_ref = refs if scaled else (None, refs[0])
    num_rows = kv_ref.shape[0]
    q_parts = [q_ref[:, o:o + n] for o, n in key_parts]

    def visit(j, state):
        picks = indices_ref[pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]
        valid = (picks >= 0) & (picks < num_rows)
        rows = jnp.where(valid, picks, 0)
        scale = None if s_ref is None else s_ref[rows][:, None]  # gathered [block_k, 1]
        k_parts = [tiles.dequantize(kv_ref[rows, o:o + n], scale, q_ref.dtype)  # gathered [block_k, n]
                   for o, n in key_parts]
        scores = jnp.where(valid[None, :], tiles.part_scores(q_parts, k_parts, sm_scale), -jnp.inf)
        # Zero the rows of empty picks (they read row 0) so that 0 * inf cannot give NaN.
        v_parts = [jnp.where(valid[:, None], k, 0) for k in k_parts[:len(value_parts)]]
        return tiles.softmax_update(state, scores, v_parts)

    state = jax.lax.fori_loop(0, num_tiles, visit, tiles.softmax_init(q_ref.shape[0], value_parts))
    tiles.store_parts(o_ref, tiles.softmax_finish(state), value_parts)


def _kv_spec(x, per_row: bool) -> pl.BlockSpec:
    """Row b's own rows [S,C] (or scales [S]) of a per-row kv [B,S,C] ([B,S]); the whole of a
    shared pool for every program (the kernel gathers only the picked rows, so the pool is
    never copied)."""
    if per_row:
        return pl.BlockSpec((None,) + x.shape[1:], lambda b, t, r: (b,) + (0,) * (x.ndim - 1))
    return pl.BlockSpec(x.shape, lambda b, t, r: (0,) * x.ndim)


def sparse_attention_pallas(q, kv, indices, *, value_dim: int, sm_scale: float, kv_scales=None,
                            interpret=False, blocks: SparseBlocks | None = None):
    """The Pallas kernel behind :func:`sparse_attention` (``interpret`` runs it as XLA ops on
    any platform); ``blocks`` overrides the tiling table."""
    validate_sparse_attention(q, kv, indices, value_dim, sm_scale, kv_scales)
    tiles.check_pallas_offsets(OP, "kv", kv)
    B, T, N, C = q.shape
    blocks = blocks or sparse_blocks(value_dim, interpret)
    rows = min(blocks.block_rows, max(tiles.MIN_DOT, tiles.next_pow2(N)))
    qp = tiles.pad_axis(q, 2, tiles.round_up(N, rows))
    picks = tiles.pad_axis(indices, 2, tiles.round_up(indices.shape[2], blocks.block_k), value=-1)
    value_parts = tiles.pow2_parts(value_dim)
    kernel = functools.partial(
        _sparse_kernel, sm_scale=float(sm_scale), block_k=blocks.block_k,
        num_tiles=picks.shape[2] // blocks.block_k, value_parts=value_parts,
        key_parts=value_parts + tiles.pow2_parts(C - value_dim, value_dim), scaled=kv_scales is not None)
    per_row = kv.ndim == 3
    in_specs = [pl.BlockSpec((None, None, picks.shape[2]), lambda b, t, r: (b, t, 0)),
                pl.BlockSpec((None, None, rows, C), lambda b, t, r: (b, t, r, 0)),
                _kv_spec(kv, per_row)]
    operands = [picks, qp, kv]
    if kv_scales is not None:
        scales = kv_scales.reshape(kv_scales.shape[:-1])  # [B,S] / [S]: one per row
        in_specs.append(_kv_spec(scales, per_row))
        operands.append(scales)
    out = pl.pallas_call(
        kernel,
        grid=(B, T, qp.shape[2] // rows),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, rows, value_dim), lambda b, t, r: (b, t, r, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, qp.shape[2], value_dim), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="dayzero_sparse_attention",
    )(*operands)
    return out[:, :, :N]


def sparse_attention(q, kv, indices, *, value_dim: int, sm_scale: float, kv_scales=None,
                     mode: KernelMode | str = KernelMode.AUTO):
    """Latent attention of q [B,T,N,C] over the rows of kv [B,S,C] (or a shared pool [S,C];
    float, or quantized with ``kv_scales``) that ``indices`` [B,T,k] picks per query ->
    [B,T,N,value_dim], run as ``mode`` resolves on this platform."""
    return dispatch(mode, sparse_attention_reference, sparse_attention_pallas, q, kv, indices,
                    value_dim=value_dim, sm_scale=sm_scale, kv_scales=kv_scales)
