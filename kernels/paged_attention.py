"""Ragged paged attention (GQA/MQA): T queries per sequence over K/V pages, for decode (T=1)
and chunked prefill alike.

    paged_attention(q [B,T,N,H], k_pages [K,P,page,H], v_pages [K,P,page,H],
                    block_tables [B,W] int32, kv_lengths [B] int32, *, q_offsets=None,
                    sm_scale=None, window=None, sinks=None, k_scales=None, v_scales=None) -> [B,T,N,H]

Sequence b's token s lives in page ``block_tables[b, s // page]`` at slot ``s % page``; it has
``kv_lengths[b]`` valid keys (clamped to [0, W*page]). Query t of row b sits at key position
``q_offsets[b] + t`` (default ``kv_lengths - T``: the T queries are the sequence's last T keys,
so a decode step is T=1 at position kv_length-1). Masking is flash attention's with causal=True:
a query sees key s when s < kv_length and s <= its position, and with a sliding ``window`` when
position - s < window; a query that sees no key gives zeros. Query head n reads kv head
n // (N/K). Table entries past a sequence's pages may hold anything in [0, P) (they are clamped
there and masked); pages are never written. ``sinks`` (float32 [N]) are flash attention's
attention sinks: one more logit per query head in the softmax's denominator, with value zero.

The pages are either float (q's dtype) or quantized: int8 or float8_e4m3fn values with float32
``k_scales``/``v_scales`` [K,P,page,1], one per kv head, page and slot (real value = values *
scale; a ``QuantizedArray`` pool passes its ``.values`` and ``.scale``). Both paths gather the
stored values and their scales through the block table and dequantize to q's dtype where they
are used (the kernel per loaded tile), so the pool is never dequantized as a whole.

The kernel (shared with the MLA-latent variant in ``paged_latent_attention``) lays the queries of
each kv head out as T*G rows, token-major (row r is token r // G, G query heads per kv head), and
runs one program per (sequence, kv head, block of rows, split of the page list). Each program
gathers ``pages_per_tile`` pages per step through the block table and folds them into an online
softmax, visiting only the tiles its rows can see: up to its last row's position (causal) and
from its first row's window start. The splits (flash-decoding) keep a GPU busy when B*K*row
blocks alone are too few programs for a long context; their partial results are merged outside
the kernel, and that merge is where the sinks join the denominator, once per row whatever the
number of splits (the kernel itself does not see them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dayzero.kernels import tiles
from dayzero.kernels.flash_attention import flash_attention_reference, visible_keys
from dayzero.kernels.mode import KernelError, KernelMode, dispatch

OP = "paged_attention"


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
    """Tiling of the paged kernel.

    ``tokens_per_tile``: keys per step (whole pages, >= 16); ``block_rows``: query rows (T*G
    per kv head) per program (power of two >= 16, Triton's smallest matmul side; fewer rows are
    padded up to it); ``min_programs``: split the page list until B*K*row_blocks*splits
    reaches this.
    """

    tokens_per_tile: int
    block_rows: int
    min_programs: int
    num_warps: int = 4
    num_stages: int = 2


# GPU tiles by largest value width they serve (H for GQA, kv_lora_rank for MLA): starting
# points for Hopper-class GPUs (132 SMs: two programs each), not yet tuned on one. A decode
# step has G <= 16 rows per kv head and so uses 16 whatever ``block_rows`` says (rows are
# capped at the next power of two of R); a prefill chunk has T*G rows, and a larger block
# re-reads each kv head's pages for fewer programs (64 rows as flash's query blocks, unmeasured).
PAGED_BLOCKS_GPU: tuple[tuple[int, PagedBlocks], ...] = (
    (128, PagedBlocks(tokens_per_tile=64, block_rows=64, min_programs=264, num_warps=4, num_stages=2)),
    (256, PagedBlocks(tokens_per_tile=32, block_rows=32, min_programs=264, num_warps=4, num_stages=2)),
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


def check_tables(op: str, block_tables, kv_lengths, q_offsets, batch: int) -> None:
    """Raise unless block_tables is int32 [B, W >= 1], kv_lengths int32 [B] and q_offsets None
    or int32 [B]."""
    tiles.check_rank(op, "block_tables", block_tables, 2, "int32 [B, pages_per_seq]")
    if block_tables.shape[0] != batch or block_tables.shape[1] < 1 or block_tables.dtype != jnp.int32:
        raise KernelError(f"{op}: block_tables must be int32 [B={batch}, pages_per_seq>=1], "
                          f"got {block_tables.dtype}{list(block_tables.shape)}")
    tiles.check_int_vector(op, "kv_lengths", kv_lengths, batch)
    if q_offsets is not None:
        tiles.check_int_vector(op, "q_offsets", q_offsets, batch)


def validate_paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, q_offsets, sm_scale,
                             window, k_scales=None, v_scales=None, sinks=None) -> float:
    """Check shapes and dtypes (raising :class:`KernelError` naming the bad one): float pages
    in q's dtype without scales, or int8/float8_e4m3fn pages (both of one dtype) with float32
    scales [K,P,page,1]; return the softmax scale to use (1/sqrt(H) when ``sm_scale`` is None)."""
    tiles.check_rank(OP, "q", q, 4, "[B,T,N,H]")
    tiles.check_rank(OP, "k_pages", k_pages, 4, "[K,P,page_size,H]")
    B, T, N, H = q.shape
    K = k_pages.shape[0]
    if T < 1:
        raise KernelError(f"{OP}: q has shape {tuple(q.shape)}; it needs at least one query (T >= 1)")
    if k_pages.shape[3] != H or min(k_pages.shape) < 1:
        raise KernelError(f"{OP}: k_pages has shape {tuple(k_pages.shape)}, expected "
                          f"[K,P,page_size,H={H}] for q of shape {tuple(q.shape)}")
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise KernelError(f"{OP}: v_pages has shape {tuple(v_pages.shape)} but k_pages has "
                          f"{tuple(k_pages.shape)}; they must match")
    if N % K:
        raise KernelError(f"{OP}: {N} query heads are not a multiple of {K} kv heads")
    tiles.check_float(OP, "q", q)
    if jnp.dtype(v_pages.dtype) != jnp.dtype(k_pages.dtype):
        raise KernelError(f"{OP}: v_pages has dtype {v_pages.dtype} but k_pages has {k_pages.dtype}; "
                          "they must match")
    tiles.check_pool(OP, "k_pages", k_pages, "k_scales", k_scales, q.dtype)
    tiles.check_pool(OP, "v_pages", v_pages, "v_scales", v_scales, q.dtype)
    check_tables(OP, block_tables, kv_lengths, q_offsets, B)
    tiles.check_window(OP, window)
    tiles.check_sinks(OP, sinks, N)
    if sm_scale is None:
        return H**-0.5
    tiles.check_scale(OP, sm_scale)
    return float(sm_scale)


def ragged_defaults(kv_lengths: jax.Array, q_offsets: jax.Array | None, T: int,
                    max_len: int) -> tuple[jax.Array, jax.Array]:
    """kv_lengths clamped to [0, max_len] and the query offsets (default: the T queries are
    the last T keys, ``kv_lengths - T``), the contract both paged ops share."""
    kv_lengths = jnp.clip(kv_lengths, 0, max_len)
    return kv_lengths, (kv_lengths - T if q_offsets is None else q_offsets)


def page_rows(block_tables: jax.Array, num_kv_heads: int, num_pages: int) -> jax.Array:
    """The row of each (sequence, kv head, table entry) in a pool [K,P,page,H] seen as
    [K*P, page*H]: ``k * P + page`` as uint32 [B,K,W], table entries clamped to [0, P).

    Row units, not elements: 8 kv heads of 2^17 pages are 2^20 rows, while their elements
    (2^31 for pages of 16 x 128) would overflow int32. XLA's gather scales rows to addresses
    itself (in 64 bits where the operand needs it)."""
    tables = jnp.clip(block_tables, 0, num_pages - 1)
    heads = jnp.arange(num_kv_heads, dtype=jnp.uint32)[None, :, None]
    return tiles.flat_rows(heads, num_kv_heads, num_pages, tables[:, None, :])


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Each sequence's pages, in table order: [K,P,page,H] -> [B,K,W*page,H], or [P,page,C] ->
    [B,W*page,C] (only the pages in the tables are read; the pool is not relaid out). Scales
    [K,P,page,1] / [P,page,1] of a quantized pool gather the same way.

    One gather of whole pages (rows of page*H values), already in the output's order, so the
    result needs no transpose. Entries outside [0, P) read a clamped page (masks hide it).
    """
    B, W = block_tables.shape
    pages = jnp.asarray(pages)
    P = pages.shape[-3]
    # Clamping the small table makes every row index valid, so the gather can promise it and
    # unsigned indices skip the wrap-around of negative ones, which XLA:CPU would otherwise
    # compute for every gathered element.
    if pages.ndim == 3:
        _, page, C = pages.shape
        tables = jnp.clip(block_tables, 0, P - 1).astype(jnp.uint32)
        rows = pages.reshape(P, page * C).at[tables.reshape(-1)].get(mode="promise_in_bounds")
        return rows.reshape(B, W * page, C)
    K, _, page, H = pages.shape
    index = page_rows(block_tables, K, P)
    rows = pages.reshape(K * P, page * H).at[index.reshape(-1)].get(mode="promise_in_bounds")
    return rows.reshape(B, K, W * page, H)


def gather_dequantized(pages: jax.Array, scales: jax.Array | None, block_tables: jax.Array, dtype) -> jax.Array:
    """:func:`gather_pages` of ``pages`` dequantized to ``dtype`` with their gathered ``scales``
    (a float pool, ``scales`` None, is only gathered)."""
    rows = gather_pages(pages, block_tables)
    return tiles.dequantize(rows, None if scales is None else gather_pages(scales, block_tables), dtype)


def paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lengths, *, q_offsets=None,
                              sm_scale=None, window=None, sinks=None, k_scales=None, v_scales=None):
    """Pure-jnp paged attention with the contract of :func:`paged_attention`: gathers each
    sequence's keys and values (and their scales, dequantizing, for a quantized pool) into a
    contiguous [B,S,K,H], then :func:`~dayzero.kernels.flash_attention.flash_attention_reference`
    (causal) over them."""
    sm_scale = validate_paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, q_offsets,
                                        sm_scale, window, k_scales, v_scales, sinks)
    k, v = (jnp.swapaxes(gather_dequantized(x, s, block_tables, q.dtype), 1, 2)
            for x, s in ((k_pages, k_scales), (v_pages, v_scales)))  # [B,S,K,H]
    kv_lengths, q_offsets = ragged_defaults(kv_lengths, q_offsets, q.shape[1], k.shape[1])
    return flash_attention_reference(q, k, v, causal=True, q_offsets=q_offsets, kv_lengths=kv_lengths,
                                     sm_scale=sm_scale, window=window, sinks=sinks)


def _tile_range(q_offset, kv_len, first_row, *, block: int, num_rows: int, rows_per_token: int,
                tile: int, split, tiles_per_split: int, window):
    """The key tiles [lo, hi) of ``split`` that may hold keys visible to the rows
    [first_row, first_row + block): up to the last real row's position (causal, and kv_len),
    from the first row's window start."""
    first_pos = q_offset + first_row // rows_per_token
    last_pos = q_offset + (jnp.minimum(first_row + block, num_rows) - 1) // rows_per_token
    end_key = jnp.maximum(jnp.minimum(kv_len, last_pos + 1), 0)
    first_key = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)
    lo = jnp.maximum(split * tiles_per_split, first_key // tile)
    hi = jnp.minimum((split + 1) * tiles_per_split, pl.cdiv(end_key, tile))
    return lo, jnp.maximum(hi, lo)


def _paged_kernel(q_offsets_ref, kv_lengths_ref, tables_ref, q_ref, k_ref, *refs, sm_scale: float,
                  window, page_size: int, pages_per_tile: int, tiles_per_split: int, rows_per_token: int,
                  num_rows: int, key_parts: tiles.Parts, value_parts: tiles.Parts, values_in_keys: bool,
                  k_scaled: bool, v_scaled: bool):
    """One (sequence b, kv head, row block r, split s): q_ref [block,Dq] (rows token-major,
    ``rows_per_token`` per token, ``num_rows`` real ones in all), k_ref [P,page,Dq] (then
    ks_ref [P,page] when ``k_scaled``; then v_ref [P,page,Dv] and vs_ref [P,page] when
    ``v_scaled``, unless the values are the keys' first columns); writes the unnormalised acc
    [block,Dv] and the softmax state m, l [block]."""
    refs = list(refs)
    ks_ref = refs.pop(0) if k_scaled else None
    v_ref = None if values_in_keys else refs.pop(0)
    vs_ref = refs.pop(0) if v_scaled else None
    acc_ref, m_ref, l_ref = refs
    b, r, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_offset, kv_len = q_offsets_ref[b], kv_lengths_ref[b]
    block = q_ref.shape[0]
    tile = pages_per_tile * page_size
    q_pos = q_offset + (r * block + jnp.arange(block)) // rows_per_token  # each row's key position
    lo, hi = _tile_range(q_offset, kv_len, r * block, block=block, num_rows=num_rows,
                         rows_per_token=rows_per_token, tile=tile, split=s,
                         tiles_per_split=tiles_per_split, window=window)
    q_parts = [q_ref[:, o:o + n] for o, n in key_parts]

    def visit(j, state):
        pages = tables_ref[pl.ds(j * pages_per_tile, pages_per_tile)]
        k_pos = j * tile + jnp.arange(tile)

        def scales(ref):  # one per slot [pages_per_tile, page] through the same table -> [tile, 1]
            return None if ref is None else ref[pages, :].reshape(tile, 1)

        def load(ref, scale, o, n):  # [pages_per_tile, page, n] through the table -> [tile, n]
            return tiles.dequantize(ref[pages, :, o:o + n].reshape(tile, n), scale, q_ref.dtype)

        k_scale = scales(ks_ref)
        k_parts = [load(k_ref, k_scale, o, n) for o, n in key_parts]
        scores = tiles.part_scores(q_parts, k_parts, sm_scale)
        scores = jnp.where(visible_keys(q_pos, k_pos, kv_len, True, window), scores, -jnp.inf)
        if values_in_keys:
            v_parts = k_parts[:len(value_parts)]
        else:
            v_scale = scales(vs_ref)
            v_parts = [load(v_ref, v_scale, o, n) for o, n in value_parts]
        # Slots past kv_len may hold stale values; zero them so 0 * inf cannot give NaN.
        real = (k_pos < kv_len)[:, None]
        return tiles.softmax_update(state, scores, [jnp.where(real, v, 0) for v in v_parts])

    m, l, acc = jax.lax.fori_loop(lo, hi, visit, tiles.softmax_init(block, value_parts))
    tiles.store_parts(acc_ref, acc, value_parts)
    m_ref[...] = m
    l_ref[...] = l


def paged_pallas(q, k_pages, v_pages, block_tables, kv_lengths, q_offsets, *, rows_per_token: int,
                 sm_scale: float, window, key_parts: tiles.Parts, value_parts: tiles.Parts, interpret: bool,
                 blocks: PagedBlocks | None, k_scales=None, v_scales=None, row_sinks=None, op: str = OP,
                 names: tuple[str, str] = ("k_pages", "v_pages")) -> jax.Array:
    """The kernel launch both paged ops share: q [B,K,R,Dq] (per kv head, R = T*rows_per_token
    query rows, token-major), k_pages [K,P,page,Dq], v_pages [K,P,page,Dv] or None (values =
    the keys' ``value_parts`` columns), kv_lengths [B], q_offsets [B] or None, and for a
    quantized pool k_scales (v_scales) [K,P,page,1] -> normalised fp32 [B,K,R,Dv]. ``row_sinks``
    (fp32 [K,R], each row's query head's sink, or None) join the merge of the splits. Inputs are
    assumed validated; ``op`` and ``names`` name the caller's op and pools in errors."""
    B, K, R, Dq = q.shape
    P, page_size = k_pages.shape[1], k_pages.shape[2]
    Dv = sum(n for _, n in value_parts)
    if page_size & (page_size - 1):
        raise KernelError(f"{op}: page_size {page_size} is not a power of two, which the Pallas kernels "
                          "need (Triton loads power-of-two tiles); use --kernels reference")
    for name, pages in zip(names, (k_pages, v_pages)):
        if pages is not None:
            tiles.check_pallas_offsets(op, name, pages)
    blocks = blocks or paged_blocks(Dv, interpret)
    rows = min(blocks.block_rows, max(tiles.MIN_DOT, tiles.next_pow2(R)))
    q = tiles.pad_axis(q, 2, tiles.round_up(R, rows))
    row_blocks = q.shape[2] // rows
    pages_per_tile = max(1, blocks.tokens_per_tile // page_size)
    num_tiles = tiles.round_up(block_tables.shape[1], pages_per_tile) // pages_per_tile
    splits = max(1, min(num_tiles, -(-blocks.min_programs // (B * K * row_blocks))))
    tiles_per_split = -(-num_tiles // splits)
    tables = tiles.pad_axis(jnp.clip(block_tables, 0, P - 1), 1, splits * tiles_per_split * pages_per_tile)
    kv_lengths, q_offsets = ragged_defaults(kv_lengths, q_offsets, R // rows_per_token,
                                            block_tables.shape[1] * page_size)

    kernel = functools.partial(
        _paged_kernel, sm_scale=sm_scale, window=window, page_size=page_size,
        pages_per_tile=pages_per_tile, tiles_per_split=tiles_per_split, rows_per_token=rows_per_token,
        num_rows=R, key_parts=key_parts, value_parts=value_parts, values_in_keys=v_pages is None,
        k_scaled=k_scales is not None, v_scaled=v_scales is not None)
    row_spec = pl.BlockSpec((B,), lambda b, k, r, s: (0,))
    # Each program sees its kv head's pages (and their scales, [K,P,page] without the unit dim).
    page_spec = lambda d: pl.BlockSpec((None, P, page_size, d), lambda b, k, r, s: (k, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, P, page_size), lambda b, k, r, s: (k, 0, 0))
    in_specs = [row_spec, row_spec,
                pl.BlockSpec((None, tables.shape[1]), lambda b, k, r, s: (b, 0)),
                pl.BlockSpec((None, None, rows, Dq), lambda b, k, r, s: (b, k, r, 0)),
                page_spec(Dq)]
    operands = [q_offsets, kv_lengths, tables, q, k_pages]
    for pages, scales in ((None, k_scales), (v_pages, v_scales)):
        if pages is not None:
            in_specs.append(page_spec(pages.shape[3]))
            operands.append(pages)
        if scales is not None:
            in_specs.append(scale_spec)
            operands.append(scales.reshape(scales.shape[:3]))
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
    if row_sinks is not None:  # the padding rows' sinks are never read back
        row_sinks = tiles.pad_axis(row_sinks, 1, q.shape[2])[None]  # [1,K,R_pad]
    return tiles.combine_splits(acc, m, l, axis=2, sinks=row_sinks)[:, :, :R]


def paged_attention_pallas(q, k_pages, v_pages, block_tables, kv_lengths, *, q_offsets=None, sm_scale=None,
                           window=None, sinks=None, k_scales=None, v_scales=None, interpret=False,
                           blocks: PagedBlocks | None = None):
    """The Pallas kernel behind :func:`paged_attention` (``interpret`` runs it as XLA ops on any
    platform); ``blocks`` overrides the tiling table."""
    sm_scale = validate_paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, q_offsets,
                                        sm_scale, window, k_scales, v_scales, sinks)
    B, T, N, H = q.shape
    K = k_pages.shape[0]
    G = N // K
    parts = tiles.pow2_parts(H)
    # Rows of kv head k: its G query heads of token 0, then of token 1, ...
    rows = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
    # Row t*G + g of kv head k is query head k*G + g.
    row_sinks = None if sinks is None else jnp.tile(sinks.reshape(K, G), (1, T))
    out = paged_pallas(rows, k_pages, v_pages, block_tables, kv_lengths, q_offsets, rows_per_token=G,
                       sm_scale=sm_scale, window=window, key_parts=parts, value_parts=parts,
                       interpret=interpret, blocks=blocks, k_scales=k_scales, v_scales=v_scales,
                       row_sinks=row_sinks)
    return out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H).astype(q.dtype)


def paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, *, q_offsets=None, sm_scale=None,
                    window=None, sinks=None, k_scales=None, v_scales=None,
                    mode: KernelMode | str = KernelMode.AUTO):
    """Attention of T queries per sequence q [B,T,N,H] over its K/V pages (float, or quantized
    with ``k_scales``/``v_scales``) -> [B,T,N,H] (see the module docstring for the layout and
    masking), run as ``mode`` resolves on this platform."""
    return dispatch(mode, paged_attention_reference, paged_attention_pallas, q, k_pages, v_pages,
                    block_tables, kv_lengths, q_offsets=q_offsets, sm_scale=sm_scale, window=window,
                    sinks=sinks, k_scales=k_scales, v_scales=v_scales)
