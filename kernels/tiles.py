"""Pieces shared by the Pallas kernels: head-dim parts, tile products, online softmax, checks.

Pallas Triton only loads and stores arrays whose size is a power of two, and Triton's matrix
product wants every side >= 16. Rather than pad the caches (a copy of the whole KV pool), each
kernel splits the head dim into power-of-two parts (``pow2_parts``: 576 = 512 + 64, 96 = 64 + 32)
and works on those parts: a score is the sum of the parts' dot products, an output is stored
part by part. Parts narrower than 16 use a broadcast multiply-and-sum instead of a matmul.

The online softmax keeps, per query row, the running max ``m``, the running sum ``l`` of
exp(score - m) and the unnormalised output ``acc`` (one array per value part), all in fp32.
``m`` starts at a large finite negative number, not -inf: masked scores are -inf, so a tile (or
a whole row) with nothing visible adds exp(-inf) = 0 and never computes inf - inf = NaN. A row
that saw no key ends with l == 0 and its output is defined as zeros.

Attention sinks (gpt-oss): a learned logit per query head that joins the softmax's denominator
as one more key whose value is zero, p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)). It is folded
in once, after the keys (:func:`fold_sink` in a kernel, or ``sinks`` of :func:`combine_splits`
when the keys were split among programs), as a merge of two partial softmaxes: both sides are
rescaled to their common max, so every exponent is <= 0 whatever the sink's size. Starting the
running max at the sink instead (l = 1) would count it once in every split started that way,
and a sink of -inf (no sink for that head) would meet a fully masked tile as exp(-inf - -inf) =
NaN. A row that sees no key but has a sink ends with acc == 0 and l > 0: zeros, as HF gives
(the sink takes all the weight).

Quantized pools (int8 or float8_e4m3fn values with one float32 scale per row, the layout of
``dayzero.model.quant.QuantizedArray`` in channel layout over the last axis) are read as stored
and dequantized where they are used: :func:`dequantize` turns gathered values and their gathered
scales into q's dtype, the same maths in the references (on the gathered rows) and in the
kernels (on each loaded tile), so both see the same keys and values.

Offsets: Pallas Triton addresses each operand from its base with 32-bit element offsets unless the
operand is larger than 2^32 bytes (jax 0.10: ``_compute_offsets_from_indices``). For 2- and 4-byte
elements that is safe (at most 2^31 elements, so every offset fits int32); a 1-byte (int8/fp8)
array of more than 2^31 and at most 2^32 elements gets int32 offsets that overflow (Triton's
addptr sign-extends them). The kernels cannot choose the offset type; the one way around it from
here, handing Pallas the pool as 2-byte words, needs an XLA bitcast-convert across widths, which
XLA may materialise as a copy of the whole pool on every call. :func:`check_pallas_offsets`
refuses such an operand instead (tests/test_kernel_offsets.py reads the emitted IR); the
wrappers' own index arithmetic works in rows, never in elements (see :func:`flat_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dayzero.kernels.mode import KernelError

# Running-max start value: below any real score, finite so that exp(m_old - m_new) stays defined.
M_INIT = -1e30
# Triton's tl.dot needs each side of a product to be at least this long.
MIN_DOT = 16
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Stored element types of a quantized pool (read with a float32 scale per row).
QUANT_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
# Pallas Triton (jax 0.10) switches an operand's offsets to int64 only above this many bytes.
PALLAS_INT32_OFFSET_BYTES = 2**32
INT32_MAX = 2**31 - 1

Parts = tuple[tuple[int, int], ...]  # (offset, size) of each power-of-two part of a dim


def pow2_parts(n: int, offset: int = 0) -> Parts:
    """Split ``n`` columns starting at ``offset`` into power-of-two parts, largest first."""
    parts, start = [], offset
    for bit in reversed(range(n.bit_length())):
        size = 1 << bit
        if n & size:
            parts.append((start, size))
            start += size
    return tuple(parts)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """``x`` padded with ``value`` at the end of ``axis`` to ``size`` (no copy if already there)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, d] . b [n, d]^T -> fp32 [m, n]."""
    if a.shape[1] >= MIN_DOT:
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.sum(a[:, None, :].astype(jnp.float32) * b[None, :, :].astype(jnp.float32), axis=2)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, n] . b [n, d] -> fp32 [m, d]."""
    if b.shape[1] >= MIN_DOT:
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.sum(a[:, :, None].astype(jnp.float32) * b[None, :, :].astype(jnp.float32), axis=1)


def part_scores(q_parts: list[jax.Array], k_parts: list[jax.Array], sm_scale: float) -> jax.Array:
    """Scaled fp32 scores [rows, keys] of queries against keys given part by part."""
    scores = dot_nt(q_parts[0], k_parts[0])
    for q, k in zip(q_parts[1:], k_parts[1:]):
        scores = scores + dot_nt(q, k)
    return scores * sm_scale


def softmax_init(rows: int, value_parts: Parts):
    """Empty online-softmax state for ``rows`` query rows: (m, l, acc per value part)."""
    m = jnp.full((rows,), M_INIT, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc = tuple(jnp.zeros((rows, size), jnp.float32) for _, size in value_parts)
    return m, l, acc


def softmax_update(state, scores: jax.Array, v_parts: list[jax.Array]):
    """Fold one tile of masked scores [rows, keys] (-inf where hidden) and its values
    (one [keys, part] array per value part) into the state."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    rescale = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[:, None])
    l = l * rescale + jnp.sum(p, axis=1)
    # The value product runs in the values' dtype (bf16 tensor cores on GPU), accumulating in fp32.
    acc = tuple(a * rescale[:, None] + dot_nn(p.astype(v.dtype), v) for a, v in zip(acc, v_parts))
    return m_new, l, acc


def fold_sink(state, sink: jax.Array):
    """The state with the sink logit ``sink`` (a scalar or [rows], fp32; -inf means none) folded
    into its denominator once, as a key whose value is zero (see the module docstring)."""
    m, l, acc = state
    m_new = jnp.maximum(m, sink)  # m starts at M_INIT (finite), so m_new is finite
    rescale = jnp.exp(m - m_new)
    l = l * rescale + jnp.exp(sink - m_new)
    return m_new, l, tuple(a * rescale[:, None] for a in acc)


def softmax_finish(state) -> tuple[jax.Array, ...]:
    """Normalised fp32 outputs per value part; zeros for rows that saw no key."""
    _, l, acc = state
    seen = l > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    return tuple(a * inv[:, None] for a in acc)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, axis: int, sinks: jax.Array | None = None) -> jax.Array:
    """Merge partial softmax results computed over disjoint key ranges along ``axis``.

    ``acc`` [..., split, ..., rows, D] unnormalised, ``m``/``l`` the same without D. Returns the
    normalised fp32 output with ``axis`` removed (zeros where no split saw a key). ``sinks``
    (fp32, broadcastable to ``m`` without ``axis``; -inf means none) joins the denominator here,
    once for all splits, as a zero-valued key.
    """
    m_all = jnp.max(m, axis=axis, keepdims=True)
    if sinks is not None:
        m_all = jnp.maximum(m_all, jnp.expand_dims(sinks, axis))  # finite: m >= M_INIT
    weight = jnp.exp(m - m_all)
    total = jnp.sum(l * weight, axis=axis)
    if sinks is not None:
        total = total + jnp.exp(sinks - jnp.squeeze(m_all, axis))
    out = jnp.sum(acc * weight[..., None], axis=axis)
    seen = total > 0
    return jnp.where(seen[..., None], out / jnp.where(seen, total, 1.0)[..., None], 0.0)


def store_parts(ref, outs: tuple[jax.Array, ...], parts: Parts) -> None:
    """Write each part's [rows, size] output into its columns of ``ref`` [rows, D]."""
    for (offset, size), out in zip(parts, outs):
        ref[:, offset:offset + size] = out.astype(ref.dtype)


def dequantize(values: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """``values`` as ``dtype``: unchanged when ``scale`` is None (a float pool, already
    ``dtype``), else ``values * scale`` computed in float32 (``scale`` broadcastable to
    ``values``: [..., 1] for gathered rows, [rows, 1] for a kernel tile), then rounded."""
    if scale is None:
        return values
    return (values.astype(jnp.float32) * scale).astype(dtype)


def flat_rows(major: jax.Array, num_major: int, rows_per_major: int, minor: jax.Array) -> jax.Array:
    """Row index ``major * rows_per_major + minor`` into a [num_major * rows_per_major, ...]
    view, as uint32 (non-negative, so a gather skips the wrap-around of negative indices).

    The wrappers gather whole rows, so indices count rows, never elements: a pool of 2^31
    elements is 2^20 rows of 2048. Both inputs must already be in range (non-negative,
    clamped). JAX hands gathers int32 indices (it converts uint32 ones), so the rows must be at
    most 2^31 (2^31 pages: beyond any memory); raises otherwise."""
    if num_major * rows_per_major > INT32_MAX + 1:
        raise KernelError(f"{num_major} x {rows_per_major} rows exceed the 2^31 rows a gather index can address")
    return major.astype(jnp.uint32) * jnp.uint32(rows_per_major) + minor.astype(jnp.uint32)


def pallas_offsets_fit(shape: tuple[int, ...], dtype) -> bool:
    """Whether Pallas Triton's element offsets into an operand of ``shape`` and ``dtype``
    cannot overflow: it uses int64 above 2^32 bytes, else int32, which holds offsets up to
    2^31 - 1 (so at most 2^31 elements)."""
    elements = 1
    for n in shape:
        elements *= int(n)
    nbytes = elements * jnp.dtype(dtype).itemsize
    return nbytes > PALLAS_INT32_OFFSET_BYTES or elements - 1 <= INT32_MAX


def check_pallas_offsets(op: str, name: str, x) -> None:
    """Raise unless :func:`pallas_offsets_fit` (only a 1-byte array of 2^31 to 2^32 elements
    fails: Pallas Triton would address it with int32 offsets that overflow)."""
    if not pallas_offsets_fit(tuple(x.shape), x.dtype):
        raise KernelError(
            f"{op}: {name} {x.dtype}{list(x.shape)} has more than 2^31 one-byte elements but at most "
            f"2^32 bytes, which Pallas Triton addresses with int32 offsets that overflow; keep each "
            f"1-byte pool to at most 2^31 elements (fewer pages) or use --kernels reference")


def masked_softmax(scores: jax.Array, mask: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """For the references: fp32 softmax of ``scores`` over its last axis where ``mask``; rows
    with nothing visible give zeros (not NaN). ``sinks`` (fp32, broadcastable to scores[..., 0];
    -inf means none) adds exp(sink) to each row's denominator: a key with zero value."""
    logits = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    if sinks is None:
        return jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)
    m = jnp.maximum(jnp.max(logits, axis=-1), sinks)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no key and no sink: everything below is 0
    e = jnp.exp(logits - m[..., None])
    total = jnp.sum(e, axis=-1) + jnp.exp(sinks - m)
    return jnp.where(mask, e / jnp.where(total > 0, total, 1.0)[..., None], 0.0)



# Softmax statistics of one block of keys, for the references that read keys block by block
# (``dayzero.model.transformer.attend``, ``dayzero.model.mla``): per query row the visible
# score maximum m (-inf where no key is visible), l = sum_s exp(s - m) and the unnormalised
# output o = sum_s exp(s - m) v_s, all fp32. Blocks merge exactly (:func:`merge_stats`), so
# attention over many blocks never concatenates their scores.
Stats = tuple[jax.Array, jax.Array, jax.Array]


def finite_or_zero(m: jax.Array) -> jax.Array:
    """``m`` with -inf (no visible key) replaced by 0, so that exp(-inf - 0) = 0 and not NaN."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def masked_stats(scores: jax.Array, mask: jax.Array, value_product, reduce_max=lambda m: m) -> Stats:
    """:data:`Stats` of fp32 ``scores`` [..., keys] where ``mask`` (broadcastable); the output
    is ``value_product(p)`` of the weights p [..., keys] (0 where hidden). ``reduce_max`` makes
    the maximum a shared one (e.g. across devices) before the exponentials are taken."""
    scores = jnp.where(mask, scores, -jnp.inf)
    m = reduce_max(jnp.max(scores, axis=-1))
    p = jnp.exp(scores - finite_or_zero(m)[..., None])  # hidden keys: exp(-inf) = 0
    return m, jnp.sum(p, axis=-1), value_product(p)


def merge_stats(a: Stats, b: Stats) -> Stats:
    """The :data:`Stats` of two blocks of keys together, each rescaled to the shared maximum."""
    top = jnp.maximum(a[0], b[0])
    merged_l, merged_o = 0.0, 0.0
    for m, l, o in (a, b):
        scale = jnp.exp(m - finite_or_zero(top))  # 0 for a block with no visible key
        merged_l, merged_o = merged_l + l * scale, merged_o + o * scale[..., None]
    return top, merged_l, merged_o


def finish_stats(stats: Stats, sinks: jax.Array | None = None) -> jax.Array:
    """The fp32 attention output o / l; zeros for a row that saw no key. ``sinks`` (fp32,
    broadcastable to m; -inf means none) joins the denominator once, as a zero-valued key."""
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks, stats[0].shape)
        stats = merge_stats(stats, (sinks, jnp.ones_like(sinks), jnp.zeros_like(stats[2])))
    _, l, o = stats
    return o / jnp.where(l > 0, l, 1.0)[..., None]


# --- validation helpers (the per-op validators are built from these) ---


def check_rank(op: str, name: str, x, rank: int, layout: str) -> None:
    """Raise unless ``x`` has ``rank`` axes (``layout`` names them, e.g. "[B,T,N,H]")."""
    if len(x.shape) != rank:
        raise KernelError(f"{op}: {name} must be {layout}, got shape {tuple(x.shape)}")


def check_float(op: str, name: str, x, dtype=None) -> None:
    """Raise unless ``x`` is fp32/bf16/fp16 (and equals ``dtype`` when given)."""
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise KernelError(f"{op}: {name} must be float32, bfloat16 or float16, got {x.dtype}")
    if dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise KernelError(f"{op}: {name} has dtype {x.dtype} but q has {dtype}; cast it to q's dtype")


def check_pool(op: str, name: str, pool, scale_name: str, scale, dtype) -> bool:
    """Check a pool of rows and its optional scale; return whether it is quantized.

    A float pool has ``dtype`` (q's) and no scale; an int8/float8_e4m3fn pool needs
    ``scale``: float32, the pool's shape with last dim 1 (one scale per row: per kv head, page
    and slot for K/V pages). Raises :class:`KernelError` naming the argument and what to pass.
    """
    kind = jnp.dtype(pool.dtype)
    expected = tuple(pool.shape[:-1]) + (1,)
    if kind in [jnp.dtype(d) for d in QUANT_DTYPES]:
        if scale is None:
            raise KernelError(
                f"{op}: {name} is {kind}, a quantized pool, so {scale_name} is required: float32 "
                f"{list(expected)} (one scale per row, real value = values * scale), e.g. the "
                f"pool's QuantizedArray .scale")
        if tuple(scale.shape) != expected:
            raise KernelError(f"{op}: {scale_name} has shape {tuple(scale.shape)}, expected {expected} "
                              f"({name}'s shape {tuple(pool.shape)} with last dim 1)")
        if jnp.dtype(scale.dtype) != jnp.float32:
            raise KernelError(f"{op}: {scale_name} must be float32, got {scale.dtype}")
        return True
    if scale is not None:
        raise KernelError(
            f"{op}: {scale_name} was given but {name} is {kind}, not a quantized pool (int8 or "
            f"float8_e4m3fn); pass {scale_name} only with quantized values (QuantizedArray .values)")
    if kind not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise KernelError(f"{op}: {name} must be float32, bfloat16 or float16 (q's dtype), or int8 or "
                          f"float8_e4m3fn with {scale_name}; got {kind}")
    check_float(op, name, pool, dtype)
    return False


def check_int_vector(op: str, name: str, x, length: int) -> None:
    """Raise unless ``x`` is an int32 vector [length] (None is allowed by the caller first)."""
    if tuple(x.shape) != (length,) or jnp.dtype(x.dtype) != jnp.int32:
        raise KernelError(f"{op}: {name} must be int32 [B={length}], got {x.dtype}{list(x.shape)}")


def check_scale(op: str, sm_scale) -> None:
    """Raise unless ``sm_scale`` is a positive Python number (it is baked into the kernel)."""
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise KernelError(f"{op}: sm_scale must be a positive number, got {sm_scale!r}")


def check_value_dim(op: str, value_dim, width: int) -> None:
    """``value_dim`` (the leading columns of a latent row that are its value) is an int in [1, width]."""
    if isinstance(value_dim, bool) or not isinstance(value_dim, int) or not 0 < value_dim <= width:
        raise KernelError(f"{op}: value_dim must be an int in [1, C={width}], got {value_dim!r}")


def check_sinks(op: str, sinks, num_heads: int) -> None:
    """Raise unless ``sinks`` is None or float32 [N=num_heads] (one sink logit per query head)."""
    if sinks is not None and (tuple(sinks.shape) != (num_heads,) or jnp.dtype(sinks.dtype) != jnp.float32):
        raise KernelError(f"{op}: sinks must be float32 [N={num_heads}] (one logit per query head), got "
                          f"{sinks.dtype}{list(sinks.shape)}; cast the model's sinks with .astype(float32)")


def check_window(op: str, window) -> None:
    """Raise unless ``window`` is None or a positive int."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise KernelError(f"{op}: window must be None or a positive int, got {window!r}")

