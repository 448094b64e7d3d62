"""Linear attention by the gated delta rule: the pure-jnp reference of Gated DeltaNet (Qwen3-Next,
Qwen3.5) and Kimi Delta Attention (Kimi-Linear), with the pieces around it.

Per value head the layer carries a state S [dk, dv] and, for each token t,

    S <- diag(exp(g_t)) S                        decay: one g per head (GDN) or per key channel (KDA)
    S <- S + beta_t k_t (v_t - k_t^T S)^T        delta rule: move k_t's read-out towards v_t
    o_t = q_t^T S

with q and k L2-normalised and q scaled by dk**-0.5. ``delta_rule_recurrent`` runs exactly that,
a token at a time (decode). ``delta_rule_chunked`` runs the same recurrence a chunk of C tokens at a
time (prefill): inside a chunk the C rank-one corrections collapse, through the WY / UT transform,
into one unit-lower-triangular solve and a few [C, C] / [C, d] matmuls, and only the chunk-to-chunk
carry is sequential. Both continue a row's state, and both treat padding tokens (t >= num_new[b]) as
identity steps (g = 0, beta = 0), so rows of different lengths share one call.

``causal_conv`` is the depthwise causal convolution (+ SiLU) both layers run on q, k and v first;
``gated_rms_norm`` is their output norm. HF's ``modeling_qwen3_next`` / ``modeling_kimi_linear`` are
the numerical ground truth (tests/test_delta_rule.py).

Matmuls use JAX's default precision (full fp32 on CPU); on a GPU wrap a reference call in
``jax.default_matmul_precision("float32")`` to keep TF32 out of it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32

# delta_rule's choice of form (T is static, so it is made at trace time). Measured on this 2-core
# CPU (shared: load ~5), B=1, dk=dv=128, jitted, best of 12, chunk 64, in ms:
#   GDN, Hk=16 Hv=32:   T=1  recurrent 0.37 chunked 0.44 | T=4  0.8-1.2 / 0.7-0.95 | T=8  1.3 / 1.6-2.6
#                       T=16 2.3-3.0 / 1.7-2.1 | T=32 6.0-6.6 / 3.6-4.8 | T=64 10-11 / 8-13
#                       T=256 42-53 / 36-53 (chunk 16: 44) | T=1024 272-296 / 339 (chunk 16: 217)
#   KDA, H=32:          T=1  0.52 / 0.31 | T=4  1.2 / 1.2 | T=16 2.3 / 3.9 | T=64 9.4 / 79
#                       T=256 52 / 208 (chunk 16) | T=1024 314 / 1101 (chunk 16)
# Per-head decay: the forms meet near T = 8 (beyond it they stay within noise of each other on
# CPU; chunk 16 is the faster chunk there). Per-channel decay: the chunked form's [C, C] decayed
# grams cost more than the whole token-by-token form on CPU at every length measured, so CPU runs
# the recurrence throughout. Elsewhere (unmeasured here: no accelerator) per-channel decay takes the
# per-head crossover: the chunked form is matmuls, the one an accelerator is built for, where the
# token-by-token form is T dependent steps. Accelerators normally run kernels/delta_rule.py instead.
RECURRENT_MAX_T = 8
RECURRENT_MAX_T_PER_CHANNEL_CPU = None  # None: recurrent at every T

_ACTIVATIONS = ("silu", "sigmoid")

# Tokens per diagonal block of the per-channel decay matrix (see _decayed_gram): the diagonal
# blocks cost C*_SUB*dk, the blocks off it C*(C/_SUB)*dk; 8 balances them for chunks of 64.
_SUB = 8


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis, in fp32 (the FLA / HF convention: eps is
    added to the squared norm, not clamped, so a zero vector stays zero)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


@jax.jit
def causal_conv(x, weight, state, num_new):
    """Depthwise causal convolution + SiLU of the new inputs after each row's carried inputs.

    x [B,T,C] (T new inputs per row, only the first num_new[b] real; the rest is padding),
    weight [W,C] (tap 0 oldest: out[t] = sum_j weight[j] * in[t - (W-1) + j]),
    state [B,W-1,C] the row's previous W-1 inputs oldest first (None = zeros: a fresh sequence),
    num_new [B] int32 (None: all T real).
    Returns (silu(conv) [B,T,C] in x.dtype, new_state [B,W-1,C] in x.dtype): new_state = the last
    W-1 *real* inputs of [state | x[:num_new]] (a row with num_new == 0 keeps its state unchanged).

    The sum and the SiLU run in fp32 whatever the input dtype (HF convolves in the weight's dtype;
    the two agree in fp32). Outputs at padding positions are finite but meaningless.
    """
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[1] != x.shape[2] or weight.shape[0] < 2:
        raise ValueError(f"causal_conv wants x [B,T,C] and weight [W>=2,C]; got x {x.shape}, weight {weight.shape}")
    b, t, c = x.shape
    w = weight.shape[0]
    if state is None:
        state = jnp.zeros((b, w - 1, c), x.dtype)
    elif state.shape != (b, w - 1, c):
        raise ValueError(f"causal_conv state has shape {state.shape}; it must be [B, W-1, C] = {(b, w - 1, c)}")
    num_new = _lengths(num_new, b, t, "causal_conv")

    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]: carried inputs, then new
    full32, w32 = full.astype(F32), weight.astype(F32)
    # Output t reads full[t .. t+W-1]: W shifted slices, since W (4 in both models) is tiny.
    acc = sum(w32[j] * full32[:, j : j + t] for j in range(w))
    out = jax.nn.silu(acc).astype(x.dtype)

    # The row's last W-1 real inputs are full[n .. n+W-2], n = num_new (n = 0: the old state).
    idx = num_new[:, None] + jnp.arange(w - 1)[None, :]
    new_state = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return out, new_state


def gated_rms_norm(x, weight, gate, eps, activation):
    """The output norm of both linear-attention blocks: RMS over the last axis in fp32, times
    ``weight``, times act(gate) with ``activation`` "silu" (GDN) or "sigmoid" (KDA); in x.dtype.

    The two HF modules differ only in where they round, which matters only below fp32, and each is
    matched: "silu" follows ``Qwen3NextRMSNormGated`` (the normalised x is cast back to x.dtype
    before the weight multiplies it, in the weight/x promoted dtype), "sigmoid" follows
    ``KimiLinearRMSNormGated`` (normalisation, weight and gate all in fp32, one final cast).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"gated_rms_norm activation {activation!r} is not one of {_ACTIVATIONS}")
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gated_rms_norm wants gate of x's shape {x.shape} and weight [{x.shape[-1]}]; "
                         f"got gate {gate.shape}, weight {weight.shape}")
    x32 = x.astype(F32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if activation == "silu":
        scaled = (weight * normed.astype(x.dtype)).astype(F32)
        return (scaled * jax.nn.silu(gate.astype(F32))).astype(x.dtype)
    return (weight.astype(F32) * normed * jax.nn.sigmoid(gate.astype(F32))).astype(x.dtype)


def delta_rule(q, k, v, g, beta, state, num_new, chunk=64):
    """The gated delta rule over T new tokens per row, continuing each row's state.

    q, k [B,T,Hk,dk]; v [B,T,Hv,dv] (Hv a multiple of Hk: query/key head h serves value heads
    h*G .. h*G+G-1, G = Hv/Hk, i.e. repeat_interleave as HF does);
    g [B,T,Hv] (GDN: one log-decay per head) or [B,T,Hv,dk] (KDA: one per key channel), <= 0;
    beta [B,T,Hv] in (0,1); state [B,Hv,dk,dv] float32 or None (zeros);
    num_new [B] int32 or None (all T real). Padding tokens (t >= num_new[b]) leave the state
    exactly as after the last real token (they are run as g = 0, beta = 0); their outputs are
    arbitrary but finite.
    As both HF references with use_qk_l2norm_in_kernel=True: q and k are L2-normalised over dk
    in float32 (eps 1e-6), q scaled by dk**-0.5, all math in float32.
    Returns (out [B,T,Hv,dv] in v.dtype, final state [B,Hv,dk,dv] float32).

    Runs ``delta_rule_recurrent`` for T <= RECURRENT_MAX_T (decode, short verify steps) and
    ``delta_rule_chunked`` otherwise; per-channel decay on CPU runs the recurrence at every T
    (RECURRENT_MAX_T_PER_CHANNEL_CPU; the measurements are beside the constants).
    """
    limit = RECURRENT_MAX_T
    if g.ndim == 4 and jax.default_backend() == "cpu":
        limit = RECURRENT_MAX_T_PER_CHANNEL_CPU
    if limit is None or q.shape[1] <= limit:
        return delta_rule_recurrent(q, k, v, g, beta, state, num_new)
    return delta_rule_chunked(q, k, v, g, beta, state, num_new, chunk)


@jax.jit
def delta_rule_recurrent(q, k, v, g, beta, state, num_new):
    """The gated delta rule a token at a time (a ``lax.scan`` over T): what decode (T = 1) runs.

    Arguments and result as :func:`delta_rule`.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, state, num_new)
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))  # time first for the scan
    final, out = jax.lax.scan(_token_step, state, xs)
    return jnp.moveaxis(out, 0, 1).astype(out_dtype), final


@functools.partial(jax.jit, static_argnames="chunk")
def delta_rule_chunked(q, k, v, g, beta, state, num_new, chunk=64):
    """The gated delta rule a chunk of ``chunk`` tokens at a time (WY / UT form): what prefill runs.

    Arguments and result as :func:`delta_rule`. A ``lax.scan`` over chunks; the largest intermediates
    are one chunk's [B,Hv,C,C] matrices (for per-channel decay also [B,Hv,C/8,8,8,dk] diagonal
    blocks and [B,Hv,C/8,C,dk] scaled keys), never [T,T]. T need not be a multiple of ``chunk``: the
    tail is padded with identity steps. A call with T < chunk runs one chunk of T tokens.
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"delta_rule_chunked chunk={chunk!r} must be a positive int")
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, state, num_new)
    b, t, h = beta.shape
    if t == 0:
        return jnp.zeros(v.shape, out_dtype), state
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t

    def chunks(a):  # [B,T,H,...] -> [N,B,H,C,...], zero-padded: g = beta = 0 is an identity step
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n, c, *a.shape[2:])
        return jnp.moveaxis(a, (1, 2), (0, 3))

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    g = jnp.cumsum(g, axis=3)  # log decay from the chunk's start through each token
    final, out = jax.lax.scan(_chunk_step, state, (q, k, v, g, beta))
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, n * c, h, -1)[:, :t]
    return out.astype(out_dtype), final


def _token_step(s, x):
    """One token of every row and head. ``s`` [B,H,dk,dv]; x: q, k [B,H,dk], v [B,H,dv], g [B,H]
    or [B,H,dk], beta [B,H].

    With a = exp(g): S' = diag(a) S + k delta^T, delta = beta (v - k^T diag(a) S), out = q^T S'
    = (q.a)^T S + (q.k) delta. Both reads of the old state are one matmul and the update one
    elementwise pass, so the state (the whole cost of a decode step) crosses memory twice, not
    four times as in the textbook order (2x faster measured).
    """
    q, k, v, g, beta = x
    a = jnp.exp(g)[..., None] if g.ndim == 2 else jnp.exp(g)  # [B,H,1] or [B,H,dk]
    reads = jnp.einsum("bhzk,bhkv->bhzv", jnp.stack([k * a, q * a], axis=2), s)  # [B,H,2,dv]
    delta = beta[..., None] * (v - reads[:, :, 0])
    out = reads[:, :, 1] + jnp.sum(q * k, axis=-1, keepdims=True) * delta
    return s * a[..., None] + k[..., :, None] * delta[..., None, :], out


def _chunk_step(s, x):
    """One chunk of every row and head. ``s`` [B,H,dk,dv]; x: q, k [B,H,C,dk], v [B,H,C,dv],
    gc [B,H,C] or [B,H,C,dk] (cumulative log decay from the chunk's start), beta [B,H,C].

    With D[i,j] = exp(gc_i - gc_j) (j <= i; per channel for KDA) the decay from token j to i, the
    chunk's corrections v_new satisfy (I + strict_lower(beta k k^T . D)) v_new = beta v - beta
    (k . exp(gc)) S: a unit-lower-triangular system, solved once for both right-hand sides.
    """
    q, k, v, gc, beta = x
    gk = gc if gc.ndim == 4 else gc[..., None]  # [B,H,C,dk or 1]
    kb = k * beta[..., None]
    system, attn = _decayed_gram(kb, k, gc), _decayed_gram(q, k, gc)  # system: strict lower part read
    solve = _unit_lower_inverse(system)
    u = solve @ (v * beta[..., None])  # the corrections against a zero state
    w = solve @ (kb * jnp.exp(gk))  # how much of the carried state each correction reads
    v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
    out = jnp.einsum("bhck,bhkv->bhcv", q * jnp.exp(gk), s) + jnp.einsum("bhij,bhjv->bhiv", attn, v_new)
    last = gk[:, :, -1]  # [B,H,dk or 1]: log decay over the whole chunk
    s = s * jnp.exp(last)[..., None] + jnp.einsum("bhck,bhcv->bhkv", k * jnp.exp(last[:, :, None] - gk), v_new)
    return s, out


def _decayed_gram(a, b, g):
    """G[..., i, j] = sum_d a_id b_jd exp(g_i - g_j) for j <= i, 0 above. a, b [B,H,C,dk]; g [B,H,C]
    (per head) or [B,H,C,dk] (per channel), the cumulative log decay: exp(g_i - g_j) is the decay
    from token j to token i.

    The decay is never factored as exp(g_i) * exp(-g_j): the cumulative decay underflows inside a
    chunk and its inverse overflows. Per head, D [C, C] comes from differences under the causal
    mask. Per channel that would be a [C, C, dk] tensor (16M exps per chunk of 64 for 32 heads of
    128: over 10x the whole token-by-token form on CPU), so only the diagonal [_SUB, _SUB, dk]
    blocks are formed that way; for a block J before block I the decay splits into three forward
    stretches, j -> end of J -> start of I -> i, each <= 1, and a matmul carries it. Nothing can
    overflow, and a factor that underflows means a product below fp32's range anyway.
    """
    c = b.shape[-2]
    causal = jnp.tril(jnp.ones((c, c), bool))
    if g.ndim == b.ndim - 1:
        decay = jnp.exp(jnp.where(causal, g[..., :, None] - g[..., None, :], -jnp.inf))
        return jnp.einsum("...id,...jd->...ij", a, b) * decay
    sub = _SUB if c % _SUB == 0 else c  # one diagonal block for a chunk of odd length
    n = c // sub

    def blocks(x):  # [..., C, dk] -> [..., n, sub, dk]
        return x.reshape(*x.shape[:-2], n, sub, x.shape[-1])

    a, b, g = blocks(a), blocks(b), blocks(g)
    tri = jnp.tril(jnp.ones((sub, sub), bool))[:, :, None]
    inner = jnp.exp(jnp.where(tri, g[..., :, None, :] - g[..., None, :, :], -jnp.inf))  # [B,H,n,sub,sub,dk]
    diag = jnp.einsum("bhnijd,bhnjd->bhnij", a[..., :, None, :] * inner, b)  # [B,H,n,sub,sub]
    first, last = g[..., :1, :], g[..., -1:, :]  # [B,H,n,1,dk]
    earlier = jnp.triu(jnp.ones((n, n), bool), 1)[:, :, None]  # [J, I]: block J before block I
    between = jnp.exp(jnp.where(earlier, jnp.swapaxes(first, -3, -2) - last, -jnp.inf))  # [B,H,nJ,nI,dk]
    # Rows (I, i) of every block I against the columns of one block J: a [C, dk] x [dk, sub] matmul
    # per J (J-major, so XLA needs no transpose around the dot).
    a_in = (a * jnp.exp(g - first))[:, :, None] * between[..., None, :]  # [B,H,nJ,nI,sub,dk]
    a_in = a_in.reshape(*a_in.shape[:3], c, a_in.shape[-1])
    off = jnp.einsum("bhJxd,bhJjd->bhxJj", a_in, b * jnp.exp(last - g))  # [B,H,C,nJ,sub]; 0 for J >= I
    eye = jnp.eye(n, dtype=a.dtype)[:, None, :, None]
    full = off.reshape(*off.shape[:2], n, sub, n, sub) + diag[..., :, :, None, :] * eye  # diagonal blocks
    return full.reshape(*full.shape[:2], c, c)


def _unit_lower_inverse(a):
    """(I + strict_lower(a))^-1 for a [..., C, C], by forward substitution over its rows.

    Row i of the inverse is e_i - a[i, :i] @ inv[:i]: the rows below i are still identity rows
    when row i is formed, and a's strictly lower mask zeroes their share. Not ``solve_triangular``:
    on CPU it calls LAPACK strsm, which runs without XLA's flush-to-zero, and strong decays fill the
    system with values near the fp32 denormal range (a [2,4,64,64] solve took 0.12 s against 0.4 ms
    for this loop, whose compile is also the cheapest of the forms tried).
    """
    c = a.shape[-1]
    a = jnp.tril(a, -1)
    eye = jnp.broadcast_to(jnp.eye(c, dtype=a.dtype), a.shape)

    def row(i, inv):
        new = (jax.lax.dynamic_index_in_dim(eye, i, axis=-2)
               - jax.lax.dynamic_index_in_dim(a, i, axis=-2) @ inv)  # [..., 1, C]
        return jax.lax.dynamic_update_index_in_dim(inv, new, i, axis=-2)

    return jax.lax.fori_loop(1, c, row, eye)


def _lengths(num_new, b, t, who):
    """``num_new`` as int32 [B] clipped to [0, T] (None: all T real). Its values are traced, so one
    out of range cannot raise; clipping keeps the gathers in bounds."""
    if num_new is None:
        return jnp.full((b,), t, jnp.int32)
    num_new = jnp.asarray(num_new)
    if num_new.shape != (b,) or not jnp.issubdtype(num_new.dtype, jnp.integer):
        raise ValueError(f"{who} num_new must be integers of shape [B] = ({b},); got {num_new.dtype}{num_new.shape}")
    return jnp.clip(num_new.astype(jnp.int32), 0, t)


def _prepare(q, k, v, g, beta, state, num_new):
    """Check shapes; return fp32 q, k (L2-normalised, q scaled, repeated to Hv heads), v, g, beta
    with padding tokens zeroed (g = beta = 0: an identity step; q = k = v = 0 keeps any garbage
    there out of the sums), and the fp32 state."""
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"delta rule wants q, k [B,T,Hk,dk] and v [B,T,Hv,dv]; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if hv % hk:
        raise ValueError(f"delta rule: value heads Hv={hv} must be a multiple of query/key heads Hk={hk}")
    if g.shape not in ((b, t, hv), (b, t, hv, dk)):
        raise ValueError(f"delta rule g has shape {g.shape}; it must be [B,T,Hv] = {(b, t, hv)} (one decay per "
                         f"head) or [B,T,Hv,dk] = {(b, t, hv, dk)} (per key channel)")
    if beta.shape != (b, t, hv):
        raise ValueError(f"delta rule beta has shape {beta.shape}; it must be [B,T,Hv] = {(b, t, hv)}")
    if state is None:
        state = jnp.zeros((b, hv, dk, dv), F32)
    elif state.shape != (b, hv, dk, dv):
        raise ValueError(f"delta rule state has shape {state.shape}; it must be [B,Hv,dk,dv] = {(b, hv, dk, dv)}")
    real = jnp.arange(t)[None, :] < _lengths(num_new, b, t, "delta rule")[:, None]  # [B,T]

    def keep(a):
        return jnp.where(real.reshape(b, t, *([1] * (a.ndim - 2))), a.astype(F32), 0.0)

    q = l2_normalize(keep(q)) * dk**-0.5
    k = l2_normalize(keep(k))
    if hv != hk:  # query/key head h serves value heads h*G .. h*G+G-1
        q, k = (jnp.repeat(a, hv // hk, axis=2) for a in (q, k))
    return q, k, keep(v), keep(g), keep(beta), state.astype(F32)
