"""The gated delta rule (linear attention of Gated DeltaNet and Kimi Delta Attention) as Pallas kernels.

    chunked_delta_rule(q, k, v, g, beta, state, num_new, chunk=64)   -> (out, final_state)   prefill
    recurrent_delta_step(q, k, v, g, beta, state, num_new)           -> (out, final_state)   decode

The contract is ``dayzero.model.delta_rule``'s (whose ``delta_rule_chunked`` /
``delta_rule_recurrent`` are the references): q, k [B,T,Hk,dk]; v [B,T,Hv,dv] with Hv a multiple
of Hk (q/k head h serves value heads h*G .. h*G+G-1); g [B,T,Hv] (one log decay per head, GDN) or
[B,T,Hv,dk] (one per key channel, KDA), <= 0; beta [B,T,Hv]; state [B,Hv,dk,dv] float32 or None
(zeros); num_new [B] int32 or None (all T). Per value head and token, with q, k L2-normalised in
fp32 (x * rsqrt(sum x^2 + 1e-6)) and q scaled by dk**-0.5:

    S <- diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - k_t^T S)^T;   o_t = q_t^T S

Padding tokens (t >= num_new[b]) are loaded as zeros (q = k = v = g = beta = 0), as the
reference treats them: an identity step with output 0. Math in fp32; out in v's dtype, state fp32.

Both kernels run one program per (row b, value head h, tile of ``block_v`` value columns); the
state tile [dk, block_v] stays in fp32 registers for the whole call and is read and written once.
Value tiles split only v, the output and the state: every tile redoes its head's [C, C] work,
the price of more programs when B * Hv alone would leave SMs idle.

``chunked_delta_rule`` walks its row's chunks of C tokens in order. Per chunk, with gamma the log
decay accumulated from the chunk's start (cumsum of g inside the chunk, so every exponent below
is <= 0: decay factors are formed from differences of gamma under the causal mask and never as
exp(gamma_i) * exp(-gamma_j), whose second factor overflows):

    A[i,j]  = q_i . k_j * exp(gamma_i - gamma_j), j <= i          intra-chunk read-out
    L[i,j]  = beta_i k_i . k_j * exp(gamma_i - gamma_j), j < i    strictly lower
    Tm      = (I + L)^-1                                            unit-lower-triangular inverse
    u       = Tm (beta v);   w = Tm (beta k exp(gamma))             WY form of the C corrections
    v_new   = u - w S;       out = (q exp(gamma)) S + A v_new
    S       = exp(gamma_C) S + (k exp(gamma_C - gamma))^T v_new

Tm comes from block doubling (:func:`_invert_unit_lower`: log2(C) - 1 pairs of [C, C] products,
each intermediate an exact block of the inverse), not C sequential row updates. For per-head
decay (GDN) A and L are matrix products times one [C, C] decay matrix. Per-channel decay (KDA)
makes the decay [C, C, dk], no product; the same kernel then splits the strict lower triangle
into log2(C) levels of off-diagonal blocks and, per level, factors the decay through a token
between each pair (:func:`_per_channel_grams`): 2 log2(C) products [C, dk] x [dk, C] in place of 2.
``recurrent_delta_step`` (decode, T small) runs the recurrence token by token on the state tile:
normalise, decay, delta correction, state update and read-out fused.

Constraints of the Pallas path (Triton tiles are powers of two and matrix products need sides >=
16): dk and the value tile (block_v, at most dv) powers of two, dk >= 16 and the chunk a power of
two >= 16 for ``chunked_delta_rule``; dv a multiple of block_v. Other sizes raise
:class:`KernelError` pointing at ``--kernels reference`` (mode="reference"). Matrix products of
fp32 operands run as 3xTF32 on a GPU (about fp32 accuracy on tensor cores; the triangular solve and
the carried state do not tolerate TF32's 10-bit mantissa) and at HIGHEST precision in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dayzero.kernels import tiles
from dayzero.kernels.mode import KernelError, KernelMode, dispatch

OP_CHUNKED = "chunked_delta_rule"
OP_STEP = "recurrent_delta_step"
L2_EPS = 1e-6  # the reference's (FLA's) eps: added to the squared norm
F32 = jnp.float32
# Dot precision for fp32 operands on a GPU (see the module docstring) and in interpret mode (XLA:CPU
# does not implement the TF32 algorithms; HIGHEST is plain fp32 there).
GPU_DOT_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
INTERPRET_DOT_PRECISION = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class DeltaBlocks:
    """Value-column tile (a power of two; min(block_v, dv) is used) and Triton launch parameters."""

    block_v: int
    num_warps: int = 4
    num_stages: int = 1


# GPU tiling, untuned starting points for Hopper-class GPUs (bench/kernels.py is how to tune them).
# Prefill: a state tile [128, 64] plus the chunk's [64, 128] q/k/w tiles and [64, 64] matrices need
# 8 warps to stay mostly in registers; two value tiles per head double the programs (B * Hv * 2).
# Decode: one [dk, 32] state tile per program, four per 128-wide head, so a batch of 1 still
# spreads over 4 * Hv programs.
CHUNKED_BLOCKS_GPU = DeltaBlocks(block_v=64, num_warps=8, num_stages=1)
STEP_BLOCKS_GPU = DeltaBlocks(block_v=32, num_warps=4, num_stages=1)
# Interpret mode: 16-wide value tiles, so a test with dv = 32 spans two.
DELTA_BLOCKS_INTERPRET = DeltaBlocks(block_v=16)


def delta_blocks(op: str, interpret: bool) -> DeltaBlocks:
    """The table's tiling for ``op`` (interpret mode has its own)."""
    if interpret:
        return DELTA_BLOCKS_INTERPRET
    return CHUNKED_BLOCKS_GPU if op == OP_CHUNKED else STEP_BLOCKS_GPU


# --- validation ---


def validate_delta_rule(op: str, q, k, v, g, beta, state, num_new) -> None:
    """Check shapes and dtypes, raising :class:`KernelError` naming the bad one. g [B,T,Hv] is per
    head decay (GDN), g [B,T,Hv,dk] per key channel (KDA)."""
    tiles.check_rank(op, "q", q, 4, "[B,T,Hk,dk]")
    tiles.check_rank(op, "v", v, 4, "[B,T,Hv,dv]")
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    if tuple(k.shape) != tuple(q.shape):
        raise KernelError(f"{op}: k has shape {tuple(k.shape)} but q has {tuple(q.shape)}; they must match")
    if tuple(v.shape[:2]) != (B, T) or min(q.shape) < 1 or min(v.shape) < 1:
        raise KernelError(f"{op}: v has shape {tuple(v.shape)}, expected [B={B}, T={T}, Hv, dv] (all >= 1) "
                          f"for q of shape {tuple(q.shape)}")
    if Hv % Hk:
        raise KernelError(f"{op}: {Hv} value heads are not a multiple of {Hk} query/key heads")
    tiles.check_float(op, "q", q)
    tiles.check_float(op, "k", k, q.dtype)
    tiles.check_float(op, "v", v, q.dtype)
    if tuple(g.shape) not in ((B, T, Hv), (B, T, Hv, dk)):
        raise KernelError(f"{op}: g has shape {tuple(g.shape)}, expected [B,T,Hv] = {(B, T, Hv)} (one log "
                          f"decay per head) or [B,T,Hv,dk] = {(B, T, Hv, dk)} (per key channel)")
    if tuple(beta.shape) != (B, T, Hv):
        raise KernelError(f"{op}: beta has shape {tuple(beta.shape)}, expected [B,T,Hv] = {(B, T, Hv)}")
    tiles.check_float(op, "g", g)
    tiles.check_float(op, "beta", beta)
    if state is not None and (tuple(state.shape) != (B, Hv, dk, dv) or jnp.dtype(state.dtype) != F32):
        raise KernelError(f"{op}: state must be float32 [B,Hv,dk,dv] = {[B, Hv, dk, dv]} or None, got "
                          f"{state.dtype}{list(state.shape)}")
    if num_new is not None:
        tiles.check_int_vector(op, "num_new", num_new, B)


def check_chunk(chunk) -> None:
    """Raise unless ``chunk`` is a positive int (both paths)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise KernelError(f"{OP_CHUNKED}: chunk must be a positive int, got {chunk!r}")


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_pallas_sizes(op: str, dk: int, dv: int, block_v: int, chunk: int | None = None) -> None:
    """Raise :class:`KernelError` unless the Pallas path can tile these sizes (module docstring);
    ``chunk`` is None for the decode kernel, which has no matrix products (no minimum of 16)."""
    least = tiles.MIN_DOT if chunk is not None else 1
    fix = f"use --kernels reference (mode='reference') for {op}"
    if not _pow2(dk) or dk < least:
        raise KernelError(f"{op}: key head dim dk={dk} must be a power of two >= {least} for the Pallas kernel; "
                          f"{fix}")
    if not _pow2(block_v) or block_v < least or dv % block_v:
        raise KernelError(f"{op}: value head dim dv={dv} gives value tiles of {block_v}; the Pallas kernel "
                          f"needs power-of-two tiles >= {least} that divide dv (a power-of-two dv always "
                          f"works); {fix}")
    if chunk is not None and (not _pow2(chunk) or chunk < tiles.MIN_DOT):
        raise KernelError(f"{op}: chunk={chunk} must be a power of two >= 16 for the Pallas kernel (Triton "
                          f"tiles); pass chunk=64 (or 16, 32, 128) or {fix}")


def pallas_size_refusal(dk: int, dv: int, chunk: int, interpret: bool) -> str | None:
    """Why the Pallas path cannot run a model's linear layers (key/value head dims ``dk``/``dv``,
    prefill ``chunk``) in both ops, or None when it can: the decision ``engine.runtime`` takes
    before any step, from the same checks the kernels raise."""
    try:
        for op, chunk_of in ((OP_CHUNKED, chunk), (OP_STEP, None)):
            check_pallas_sizes(op, dk, dv, min(delta_blocks(op, interpret).block_v, dv), chunk_of)
    except KernelError as e:
        return str(e)
    return None


# --- references: the model's pure-jnp code behind the same validation ---


def chunked_delta_rule_reference(q, k, v, g, beta, state, num_new, chunk=64):
    """``dayzero.model.delta_rule.delta_rule_chunked`` after this op's validation."""
    from dayzero.model import delta_rule  # lazily: the model may import the kernels

    validate_delta_rule(OP_CHUNKED, q, k, v, g, beta, state, num_new)
    check_chunk(chunk)
    return delta_rule.delta_rule_chunked(q, k, v, g, beta, state, num_new, chunk)


def recurrent_delta_step_reference(q, k, v, g, beta, state, num_new):
    """``dayzero.model.delta_rule.delta_rule_recurrent`` after this op's validation."""
    from dayzero.model import delta_rule  # lazily: the model may import the kernels

    validate_delta_rule(OP_STEP, q, k, v, g, beta, state, num_new)
    return delta_rule.delta_rule_recurrent(q, k, v, g, beta, state, num_new)


# --- kernel pieces ---


def _normalize(x: jax.Array, scale: float = 1.0) -> jax.Array:
    """fp32 ``x * rsqrt(sum(x^2) + eps) * scale`` over the last axis (the reference's l2_normalize)."""
    x = x.astype(F32)
    return x * (lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS) * scale)


def _dot(a, b, contract: tuple[int, int], precision) -> jax.Array:
    """fp32 product of 2-D a and b contracting a's axis contract[0] with b's contract[1]."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def _load_rows(ref, start, size: int, valid: jax.Array) -> jax.Array:
    """Rows [start, start+size) of ``ref`` ([T] or [T, d]) as fp32, zeros where not ``valid`` (a
    padding token or past T: masked, so the load never leaves the array)."""
    block = ref.at[pl.ds(start, size)]
    mask = valid if len(block.shape) == 1 else jnp.broadcast_to(valid[:, None], block.shape)
    return plgpu.load(block, mask=mask, other=0).astype(F32)


def _row(x: jax.Array, i: int) -> jax.Array:
    """Row ``i`` of a register tile [C, d]: a masked sum, as Triton cannot index tiles."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0)


def _level_mask(C: int, b: int) -> jax.Array:
    """bool [C, C]: (i, j) with i in the second and j in the first half of the same 2b-row block.
    Over b = 1, 2, 4, ..., C/2 these regions tile the strict lower triangle exactly once."""
    i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    return (i // (2 * b) == j // (2 * b)) & ((i // b) % 2 == 1) & ((j // b) % 2 == 0)


def _invert_unit_lower(strict: jax.Array, precision) -> jax.Array:
    """(I + L)^-1 for L = ``strict`` [C, C] strictly lower, by block doubling.

    With Tb the block-diagonal inverse for diagonal blocks of size b, the blocks of size 2b are
    [[T11, 0], [-T22 L21 T11, T22]], i.e. T2b = Tb - Tb (L on the level-b region) Tb: log2(C) - 1
    pairs of [C, C] products instead of C sequential row updates. Every intermediate is an exact
    block of the inverse (no powers of L, which grow like binomials when keys are alike and decay
    is slow), so this is as stable as forward substitution.
    """
    C = strict.shape[0]
    eye = (lax.broadcasted_iota(jnp.int32, (C, C), 0) == lax.broadcasted_iota(jnp.int32, (C, C), 1)).astype(F32)
    tm = eye - jnp.where(_level_mask(C, 1), strict, 0.0)  # T2 = T1 - T1 L1 T1 with T1 = I
    b = 2
    while b < C:
        level = jnp.where(_level_mask(C, b), strict, 0.0)
        tm = tm - _dot(_dot(tm, level, (1, 0), precision), tm, (1, 0), precision)
        b *= 2
    return tm


def _block_reference(gamma: jax.Array, b: int) -> jax.Array:
    """[C, dk]: for each row, gamma at the last row of the first half of its 2b-row block."""
    C, dk = gamma.shape
    blocks = gamma.reshape(C // (2 * b), 2 * b, dk)
    pick = lax.broadcasted_iota(jnp.int32, blocks.shape, 1) == b - 1
    ref = jnp.sum(jnp.where(pick, blocks, 0.0), axis=1, keepdims=True)
    return jnp.broadcast_to(ref, blocks.shape).reshape(C, dk)


def _per_channel_grams(q, k, gamma, precision):
    """(sum_d q_id k_jd D_ijd, sum_d k_id k_jd D_ijd) [C, C] for j <= i (the second without its
    diagonal), D_ijd = exp(gamma_id - gamma_jd): per-channel decay as matrix products.

    D does not factor safely as exp(gamma_i) exp(-gamma_j) (the second factor overflows), but it
    does through a reference row r between j and i: exp(gamma_i - gamma_r) exp(gamma_r - gamma_j),
    both factors <= 1 since gamma falls along the chunk. Each level-b region (:func:`_level_mask`)
    has such a row for all its pairs, the last row of the first half of its block; the exponents
    are clamped at 0 for the rows and columns outside the region (their products are masked).
    """
    C = q.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    qk = jnp.where(i == j, jnp.sum(q * k, axis=1)[:, None], 0.0)  # D = 1 on the diagonal
    kk = jnp.zeros((C, C), F32)
    b = 1
    while b < C:
        ref = _block_reference(gamma, b)
        to_row = jnp.exp(jnp.minimum(gamma - ref, 0.0))  # rows i after r
        cols = k * jnp.exp(jnp.minimum(ref - gamma, 0.0))  # columns j up to r
        mask = _level_mask(C, b)
        qk = qk + jnp.where(mask, _dot(q * to_row, cols, (1, 1), precision), 0.0)
        kk = kk + jnp.where(mask, _dot(k * to_row, cols, (1, 1), precision), 0.0)
        b *= 2
    return qk, kk


def _intra_chunk(q, k, gamma, beta, precision):
    """The chunk's read-out matrix A [C,C] (lower, with diagonal) and Tm = (I + L)^-1 [C,C] (see the
    module docstring). gamma is [C] (per head) or [C, dk] (per channel)."""
    C = q.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    if gamma.ndim == 1:
        decay = jnp.exp(jnp.where(j <= i, gamma[:, None] - gamma[None, :], -jnp.inf))
        a, kk = _dot(q, k, (1, 1), precision) * decay, _dot(k, k, (1, 1), precision) * decay
    else:
        a, kk = _per_channel_grams(q, k, gamma, precision)
    strict = jnp.where(j < i, beta[:, None] * kk, 0.0)
    return a, _invert_unit_lower(strict, precision)


def _chunk_update(state, q, k, v, gamma, beta, precision):
    """One chunk: its output [C, bv] and the state [dk, bv] after it (module docstring)."""
    a, tm = _intra_chunk(q, k, gamma, beta, precision)
    per_channel = gamma.ndim == 2
    gk = gamma if per_channel else gamma[:, None]  # [C, dk or 1]
    last = _row(gk, gk.shape[0] - 1)  # [dk or 1]: log decay over the whole chunk
    u = _dot(tm, v * beta[:, None], (1, 0), precision)
    w = _dot(tm, k * (beta[:, None] * jnp.exp(gk)), (1, 0), precision)
    v_new = u - _dot(w, state, (1, 0), precision)
    out = _dot(q * jnp.exp(gk), state, (1, 0), precision) + _dot(a, v_new, (1, 0), precision)
    k_decayed = k * jnp.exp(last[None, :] - gk)
    state = state * jnp.exp(last)[:, None] + _dot(k_decayed, v_new, (0, 0), precision)
    return out, state


def _chunked_kernel(num_new_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, chunk: int, with_state: bool,
                    precision):
    """One (row b, value head h, value tile): q_ref/k_ref [T,dk], v_ref [T,bv], g_ref [T] or [T,dk],
    beta_ref [T], then state_ref [dk,bv] when ``with_state``, then o_ref [T,bv], s_ref [dk,bv]."""
    state_ref, o_ref, s_ref = refs if with_state else (None, *refs)
    T, dk = q_ref.shape
    n = num_new_ref[pl.program_id(0)]
    scale = dk**-0.5
    state = state_ref[...].astype(F32) if with_state else jnp.zeros(s_ref.shape, F32)

    def visit(c, state):
        start = pl.multiple_of(c * chunk, chunk)
        real = start + jnp.arange(chunk) < n
        q = _normalize(_load_rows(q_ref, start, chunk, real), scale)
        k = _normalize(_load_rows(k_ref, start, chunk, real))
        v = _load_rows(v_ref, start, chunk, real)
        gamma = jnp.cumsum(_load_rows(g_ref, start, chunk, real), axis=0)
        beta = _load_rows(beta_ref, start, chunk, real)
        out, state = _chunk_update(state, q, k, v, gamma, beta, precision)
        _store_rows(o_ref, start, out, T)
        return state

    def clear(c, carry):  # chunks past the row's last real token: outputs 0, the state untouched
        start = pl.multiple_of(c * chunk, chunk)
        _store_rows(o_ref, start, jnp.zeros((chunk, o_ref.shape[1]), F32), T)
        return carry

    real_chunks = pl.cdiv(n, chunk)
    state = lax.fori_loop(0, real_chunks, visit, state)
    lax.fori_loop(real_chunks, pl.cdiv(T, chunk), clear, 0)
    s_ref[...] = state


def _store_rows(ref, start, x: jax.Array, T: int) -> None:
    """Write x [C, d] to rows [start, start+C) of ``ref`` [T, d], masking rows past T."""
    rows = start + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    plgpu.store(ref.at[pl.ds(start, x.shape[0])], x.astype(ref.dtype), mask=rows < T)


def _step_kernel(num_new_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, with_state: bool):
    """One (row b, value head h, value tile), token by token; refs as :func:`_chunked_kernel`'s."""
    state_ref, o_ref, s_ref = refs if with_state else (None, *refs)
    T, dk = q_ref.shape
    n = num_new_ref[pl.program_id(0)]
    scale = dk**-0.5

    def token(t, state):
        real = t < n  # a padding token loads as zeros: decay 1, no correction, output 0
        q = jnp.where(real, _normalize(q_ref[t, :], scale), 0.0)
        k = jnp.where(real, _normalize(k_ref[t, :]), 0.0)
        v = jnp.where(real, v_ref[t, :].astype(F32), 0.0)
        g = jnp.where(real, g_ref[t, :] if len(g_ref.shape) == 2 else g_ref[t], 0.0).astype(F32)
        beta = jnp.where(real, beta_ref[t], 0.0).astype(F32)
        state = state * (jnp.exp(g)[:, None] if g.ndim else jnp.exp(g))
        delta = beta * (v - jnp.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * delta[None, :]
        o_ref[t, :] = jnp.sum(state * q[:, None], axis=0).astype(o_ref.dtype)
        return state

    state = state_ref[...].astype(F32) if with_state else jnp.zeros(s_ref.shape, F32)
    s_ref[...] = lax.fori_loop(0, T, token, state)


def _delta_call(kernel, name: str, q, k, v, g, beta, state, num_new, blocks: DeltaBlocks, interpret: bool):
    """The pallas_call both ops share: grid (B, Hv, dv / block_v), returns (out, final state)."""
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    G, bv = Hv // Hk, min(blocks.block_v, dv)
    num_new = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.clip(num_new, 0, T)
    qk_spec = pl.BlockSpec((None, T, None, dk), lambda b, h, j: (b, 0, h // G, 0))
    v_spec = pl.BlockSpec((None, T, None, bv), lambda b, h, j: (b, 0, h, j))
    g_spec = (pl.BlockSpec((None, T, None, dk), lambda b, h, j: (b, 0, h, 0)) if g.ndim == 4
              else pl.BlockSpec((None, T, None), lambda b, h, j: (b, 0, h)))
    state_spec = pl.BlockSpec((None, None, dk, bv), lambda b, h, j: (b, h, 0, j))
    in_specs = [pl.BlockSpec((B,), lambda b, h, j: (0,)), qk_spec, qk_spec, v_spec, g_spec,
                pl.BlockSpec((None, T, None), lambda b, h, j: (b, 0, h))]
    operands = [num_new, q, k, v, g, beta]
    if state is not None:  # the new state overwrites the old in place when the caller donates it
        in_specs.append(state_spec)
        operands.append(state)
    out, final = pl.pallas_call(
        functools.partial(kernel, with_state=state is not None),
        grid=(B, Hv, dv // bv),
        in_specs=in_specs,
        out_specs=[v_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, Hv, dk, dv), F32)],
        input_output_aliases={len(operands) - 1: 1} if state is not None else {},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)
    return out, final


# --- the ops ---


def chunked_delta_rule_pallas(q, k, v, g, beta, state, num_new, chunk=64, *, interpret=False,
                              blocks: DeltaBlocks | None = None):
    """The Pallas kernel behind :func:`chunked_delta_rule` (``interpret`` runs it as XLA ops on any
    platform); ``blocks`` overrides the tiling table. A call with T < chunk uses the smallest
    power-of-two chunk >= max(T, 16) (the same recurrence, less padding work)."""
    validate_delta_rule(OP_CHUNKED, q, k, v, g, beta, state, num_new)
    check_chunk(chunk)
    blocks = blocks or delta_blocks(OP_CHUNKED, interpret)
    dk, dv, T = q.shape[3], v.shape[3], q.shape[1]
    check_pallas_sizes(OP_CHUNKED, dk, dv, min(blocks.block_v, dv), chunk)
    chunk = min(chunk, max(tiles.MIN_DOT, tiles.next_pow2(T)))
    precision = INTERPRET_DOT_PRECISION if interpret else GPU_DOT_PRECISION
    kernel = functools.partial(_chunked_kernel, chunk=chunk, precision=precision)
    return _delta_call(kernel, "dayzero_chunked_delta_rule", q, k, v, g, beta, state, num_new, blocks,
                       interpret)


def recurrent_delta_step_pallas(q, k, v, g, beta, state, num_new, *, interpret=False,
                                blocks: DeltaBlocks | None = None):
    """The Pallas kernel behind :func:`recurrent_delta_step` (``interpret`` runs it as XLA ops on
    any platform); ``blocks`` overrides the tiling table."""
    validate_delta_rule(OP_STEP, q, k, v, g, beta, state, num_new)
    blocks = blocks or delta_blocks(OP_STEP, interpret)
    check_pallas_sizes(OP_STEP, q.shape[3], v.shape[3], min(blocks.block_v, v.shape[3]))
    return _delta_call(_step_kernel, "dayzero_recurrent_delta_step", q, k, v, g, beta, state, num_new, blocks,
                       interpret)


def chunked_delta_rule(q, k, v, g, beta, state, num_new, chunk=64, *, mode: KernelMode | str = KernelMode.AUTO):
    """The gated delta rule over T new tokens per row in chunks of ``chunk`` (prefill): returns
    (out [B,T,Hv,dv] in v's dtype, final state [B,Hv,dk,dv] fp32); see the module docstring for
    the contract. Runs as ``mode`` resolves on this platform."""
    return dispatch(mode, chunked_delta_rule_reference, chunked_delta_rule_pallas, q, k, v, g, beta, state,
                    num_new, chunk)


def recurrent_delta_step(q, k, v, g, beta, state, num_new, *, mode: KernelMode | str = KernelMode.AUTO):
    """The gated delta rule token by token (decode: T small, typically 1): returns (out [B,T,Hv,dv]
    in v's dtype, final state [B,Hv,dk,dv] fp32). Runs as ``mode`` resolves on this platform."""
    return dispatch(mode, recurrent_delta_step_reference, recurrent_delta_step_pallas, q, k, v, g, beta, state,
                    num_new)
