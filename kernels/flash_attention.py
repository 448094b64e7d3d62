"""Flash attention for prefill: causal (or not), GQA/MQA, ragged key lengths, chunked prefill.

    flash_attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H]) -> [B,T,N,H]

Query t of row b sits at key position ``q_offsets[b] + t`` (0 by default; a chunked prefill
passes the number of keys that precede its chunk); row b has ``kv_lengths[b]`` valid keys (S by
default). A query sees key s when s < kv_length, and with ``causal`` when s <= its position, and
with a sliding ``window`` when position - s < window. Rows with no visible key give zeros.
Query head n reads kv head n // (N/K).

``sinks`` (float32 [N], gpt-oss's attention sinks; None for none) gives each query head one more
logit in its softmax's denominator, a key that is always visible and has value zero:
p_s = exp(l_s) / (exp(sinks[n]) + sum_k exp(l_k)), as HF's ``eager_attention_forward`` for
gpt_oss computes it (the sink is not scaled by ``sm_scale``). A row with no visible key still
gives zeros (the sink takes all the weight).

The kernel runs one program per (row, query head, block of queries) and walks the key blocks
that can be visible to that block (bounded by causality, the window and kv_length) with an
online softmax, so memory stays linear in the sequence length: no [T,S] score matrix exists.
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

OP = "flash_attention"


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes (powers of two, >= 16) and Triton launch parameters of the flash kernel."""

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


# GPU tiles by largest head dim they serve: common Triton flash-attention starting points for
# Hopper-class GPUs, not yet tuned on one (bench/kernels.py is how to tune them).
FLASH_BLOCKS_GPU: tuple[tuple[int, FlashBlocks], ...] = (
    (64, FlashBlocks(block_q=128, block_k=64, num_warps=4, num_stages=3)),
    (128, FlashBlocks(block_q=128, block_k=64, num_warps=8, num_stages=3)),
    (256, FlashBlocks(block_q=64, block_k=32, num_warps=8, num_stages=2)),
)
FLASH_BLOCKS_LARGE_HEAD = FlashBlocks(block_q=32, block_k=32, num_warps=8, num_stages=1)
# Interpret mode: the smallest legal tiles, so short test sequences still span several blocks.
FLASH_BLOCKS_INTERPRET = FlashBlocks(block_q=16, block_k=16)


def flash_blocks(head_dim: int, interpret: bool) -> FlashBlocks:
    """The table's tiles for ``head_dim`` (interpret mode has its own small tiles)."""
    if interpret:
        return FLASH_BLOCKS_INTERPRET
    for max_head_dim, blocks in FLASH_BLOCKS_GPU:
        if head_dim <= max_head_dim:
            return blocks
    return FLASH_BLOCKS_LARGE_HEAD


def validate_flash_attention(q, k, v, q_offsets, kv_lengths, sm_scale, window, sinks=None) -> float:
    """Check shapes and dtypes (raising :class:`KernelError` naming the bad one); return the
    softmax scale to use (1/sqrt(H) when ``sm_scale`` is None)."""
    tiles.check_rank(OP, "q", q, 4, "[B,T,N,H]")
    tiles.check_rank(OP, "k", k, 4, "[B,S,K,H]")
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    if k.shape[0] != B or k.shape[3] != H or S < 1 or T < 1:
        raise KernelError(f"{OP}: k has shape {tuple(k.shape)}, expected [B={B}, S>=1, K, H={H}] "
                          f"for q of shape {tuple(q.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise KernelError(f"{OP}: v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match")
    if K < 1 or N % K:
        raise KernelError(f"{OP}: {N} query heads are not a multiple of {K} kv heads")
    tiles.check_float(OP, "q", q)
    tiles.check_float(OP, "k", k, q.dtype)
    tiles.check_float(OP, "v", v, q.dtype)
    for name, x in (("q_offsets", q_offsets), ("kv_lengths", kv_lengths)):
        if x is not None:
            tiles.check_int_vector(OP, name, x, B)
    tiles.check_window(OP, window)
    tiles.check_sinks(OP, sinks, N)
    if sm_scale is None:
        return H**-0.5
    tiles.check_scale(OP, sm_scale)
    return float(sm_scale)


def _defaults(q_offsets, kv_lengths, B: int, S: int) -> tuple[jax.Array, jax.Array]:
    """Query offsets (0) and key lengths (S) when not given; lengths clamped to [0, S]."""
    if q_offsets is None:
        q_offsets = jnp.zeros((B,), jnp.int32)
    kv_lengths = jnp.full((B,), S, jnp.int32) if kv_lengths is None else jnp.clip(kv_lengths, 0, S)
    return q_offsets, kv_lengths


def visible_keys(q_pos: jax.Array, k_pos: jax.Array, kv_lengths: jax.Array, causal: bool,
                 window: int | None) -> jax.Array:
    """Whether each query sees each key: q_pos [..., T] and k_pos [S] positions, kv_lengths
    broadcastable to q_pos[..., None] -> bool [..., T, S]."""
    q_pos, k_pos = q_pos[..., :, None], k_pos[None, :]
    visible = k_pos < kv_lengths
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    return visible


def flash_attention_reference(q, k, v, *, causal=True, q_offsets=None, kv_lengths=None,
                              sm_scale=None, window=None, sinks=None):
    """Pure-jnp attention with the same contract as :func:`flash_attention`: builds the full
    [T,S] scores, softmax in fp32, output in q's dtype."""
    sm_scale = validate_flash_attention(q, k, v, q_offsets, kv_lengths, sm_scale, window, sinks)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    q_offsets, kv_lengths = _defaults(q_offsets, kv_lengths, B, S)
    q_pos = q_offsets[:, None] + jnp.arange(T)[None, :]
    mask = visible_keys(q_pos, jnp.arange(S), kv_lengths[:, None, None], causal, window)  # [B,T,S]
    real = (jnp.arange(S)[None, :] < kv_lengths[:, None])[:, :, None, None]  # [B,S,1,1]
    # Padded slots may hold anything: zero them so that 0 * inf cannot leak into the output.
    # When the keys are the values (the latent form), that one masked copy serves both products.
    k, v = (jnp.where(real, v, 0),) * 2 if k is v else (k, jnp.where(real, v, 0))
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    head_sinks = None if sinks is None else sinks.reshape(K, N // K)[None, :, :, None]  # [1,K,G,1]
    probs = tiles.masked_softmax(scores, mask[:, None, None], head_sinks)
    # Output [B,K,G,T,H] then moved: asking the product for [B,T,K,G,H] directly makes XLA CPU
    # transpose all of v instead (measured 3-8x slower for decode and prefill shapes).
    out = jnp.einsum("bkgts,bskh->bkgth", probs, v.astype(jnp.float32)).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, T, N, H).astype(q.dtype)


def _key_block_range(q_offset, kv_len, i, block_q: int, block_k: int, causal: bool, window):
    """The key blocks [lo, hi) that may hold keys visible to query block ``i``."""
    first_q = q_offset + i * block_q
    hi_key = kv_len
    if causal:
        hi_key = jnp.minimum(hi_key, first_q + block_q)  # one past the last query's position
    lo = 0
    if window is not None:
        lo = jnp.maximum(first_q - window + 1, 0) // block_k
    hi = pl.cdiv(jnp.maximum(hi_key, 0), block_k)
    return lo, jnp.maximum(hi, lo)


def _flash_kernel(q_offsets_ref, kv_lengths_ref, q_ref, k_ref, v_ref, *refs, causal: bool,
                  window, sm_scale: float, block_q: int, block_k: int, parts: tiles.Parts, with_sinks: bool):
    """One (row b, query head n, query block i): q_ref [block_q,H], k_ref/v_ref [S_pad,H], then
    sinks_ref [N] when ``with_sinks``, then o_ref [block_q,H]."""
    sinks_ref, o_ref = refs if with_sinks else (None, *refs)
    b, i = pl.program_id(0), pl.program_id(2)
    q_offset, kv_len = q_offsets_ref[b], kv_lengths_ref[b]
    q_pos = q_offset + i * block_q + jnp.arange(block_q)
    q_parts = [q_ref[:, o:o + n] for o, n in parts]

    def visit(j, state):
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        scores = tiles.part_scores(q_parts, [k_ref[keys, o:o + n] for o, n in parts], sm_scale)
        k_pos = start + jnp.arange(block_k)
        scores = jnp.where(visible_keys(q_pos, k_pos, kv_len, causal, window), scores, -jnp.inf)
        # Slots past kv_length (padding, stale cache) may hold anything: zero them so that
        # 0 * inf cannot give NaN.
        real = (k_pos < kv_len)[:, None]
        return tiles.softmax_update(state, scores, [jnp.where(real, v_ref[keys, o:o + n], 0) for o, n in parts])

    lo, hi = _key_block_range(q_offset, kv_len, i, block_q, block_k, causal, window)
    state = jax.lax.fori_loop(lo, hi, visit, tiles.softmax_init(block_q, parts))
    if with_sinks:
        state = tiles.fold_sink(state, sinks_ref[pl.program_id(1)])
    tiles.store_parts(o_ref, tiles.softmax_finish(state), parts)


def flash_attention_pallas(q, k, v, *, causal=True, q_offsets=None, kv_lengths=None, sm_scale=None,
                           window=None, sinks=None, interpret=False, blocks: FlashBlocks | None = None):
    """The Pallas kernel behind :func:`flash_attention` (``interpret`` runs it as XLA ops on any
    platform). ``blocks`` overrides the tile table. T and S are padded to whole blocks (a copy
    only when they are not multiples already); padded keys are masked by kv_lengths."""
    sm_scale = validate_flash_attention(q, k, v, q_offsets, kv_lengths, sm_scale, window, sinks)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    blocks = blocks or flash_blocks(H, interpret)
    bq, bk = blocks.block_q, blocks.block_k
    q_offsets, kv_lengths = _defaults(q_offsets, kv_lengths, B, S)
    qp = tiles.pad_axis(q, 1, tiles.round_up(T, bq))
    kp, vp = (tiles.pad_axis(x, 1, tiles.round_up(S, bk)) for x in (k, v))
    kernel = functools.partial(_flash_kernel, causal=causal, window=window, sm_scale=sm_scale,
                               block_q=bq, block_k=bk, parts=tiles.pow2_parts(H), with_sinks=sinks is not None)
    row_spec = pl.BlockSpec((B,), lambda b, n, i: (0,))
    q_spec = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, kp.shape[1], None, H), lambda b, n, i: (b, 0, n // G, 0))
    in_specs, operands = [row_spec, row_spec, q_spec, kv_spec, kv_spec], [q_offsets, kv_lengths, qp, kp, vp]
    if sinks is not None:  # every program sees all N sinks and reads its head's
        in_specs.append(pl.BlockSpec((N,), lambda b, n, i: (0,)))
        operands.append(sinks)
    out = pl.pallas_call(
        kernel,
        grid=(B, N, qp.shape[1] // bq),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="dayzero_flash_attention",
    )(*operands)
    return out[:, :T]


def flash_attention(q, k, v, *, causal=True, q_offsets=None, kv_lengths=None, sm_scale=None,
                    window=None, sinks=None, mode: KernelMode | str = KernelMode.AUTO):
    """Attention of queries q [B,T,N,H] over keys/values [B,S,K,H] -> [B,T,N,H] (see the module
    docstring for the masking contract), run as ``mode`` resolves on this platform."""
    return dispatch(mode, flash_attention_reference, flash_attention_pallas, q, k, v, causal=causal,
                    q_offsets=q_offsets, kv_lengths=kv_lengths, sm_scale=sm_scale, window=window, sinks=sinks)
