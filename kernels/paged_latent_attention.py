"""Ragged paged attention over MLA latent pages (DeepSeek-V2/V3, Kimi-K2): decode and chunked
prefill.

    paged_latent_attention(q [B,T,N,C], latent_pages [P,page,C], block_tables [B,W],
                           kv_lengths [B], *, q_offsets=None, value_dim, sm_scale,
                           latent_scales=None) -> [B,T,N,value_dim]

The absorbed form of ``dayzero.model.mla``: each cached token is one latent row of C =
kv_lora_rank + rope_dim values, shared by every head as both key (all C columns, against the
absorbed query [q_latent, q_rope]) and value (its first ``value_dim`` = kv_lora_rank columns;
the caller applies v_up afterwards). There is no natural default scale in this form (the model
uses 1/sqrt(nope + rope dims), possibly YaRN-corrected), so ``sm_scale`` is required.

Paging, ragged lengths, query positions and masking work as in
:mod:`dayzero.kernels.paged_attention` (causal, ``q_offsets`` defaulting to ``kv_lengths - T``),
whose kernel this op reuses with one "kv head" of T*N query rows whose values are the first
columns of its keys: every latent row is loaded once per step and serves both products.

The pages are float (q's dtype) or quantized: int8 or float8_e4m3fn values with float32
``latent_scales`` [P,page,1], one per cached row (real value = values * scale), gathered with
the rows and dequantized where they are read (the kernel per loaded tile, once for both products).
"""

from __future__ import annotations

from dayzero.kernels import tiles
from dayzero.kernels.flash_attention import flash_attention_reference
from dayzero.kernels.mode import KernelError, KernelMode, dispatch
from dayzero.kernels.paged_attention import (PagedBlocks, check_tables, gather_dequantized, paged_pallas,
                                             ragged_defaults)

OP = "paged_latent_attention"


def validate_paged_latent_attention(q, latent_pages, block_tables, kv_lengths, q_offsets, value_dim,
                                    sm_scale, latent_scales=None) -> None:
    """Check shapes, dtypes and arguments, raising :class:`KernelError` naming the bad one: float
    pages in q's dtype, or int8/float8_e4m3fn pages with float32 ``latent_scales`` [P,page,1]."""
    tiles.check_rank(OP, "q", q, 4, "[B,T,N,C]")
    tiles.check_rank(OP, "latent_pages", latent_pages, 3, "[P,page_size,C]")
    B, T, N, C = q.shape
    if T < 1:
        raise KernelError(f"{OP}: q has shape {tuple(q.shape)}; it needs at least one query (T >= 1)")
    if latent_pages.shape[2] != C or min(latent_pages.shape) < 1:
        raise KernelError(f"{OP}: latent_pages has shape {tuple(latent_pages.shape)}, expected "
                          f"[P,page_size,C={C}] for q of shape {tuple(q.shape)}")
    tiles.check_value_dim(OP, value_dim, C)
    tiles.check_float(OP, "q", q)
    tiles.check_pool(OP, "latent_pages", latent_pages, "latent_scales", latent_scales, q.dtype)
    check_tables(OP, block_tables, kv_lengths, q_offsets, B)
    tiles.check_scale(OP, sm_scale)


def paged_latent_attention_reference(q, latent_pages, block_tables, kv_lengths, *, q_offsets=None,
                                     value_dim: int, sm_scale: float, latent_scales=None):
    """Pure-jnp latent attention with the contract of :func:`paged_latent_attention`: gathers
    each sequence's latent rows [B,S,C] (and their scales, dequantizing, for a quantized pool)
    and runs :func:`~dayzero.kernels.flash_attention.flash_attention_reference` (causal) over
    them as one kv head whose keys and values are those rows."""
    validate_paged_latent_attention(q, latent_pages, block_tables, kv_lengths, q_offsets, value_dim, sm_scale,
                                    latent_scales)
    rows = gather_dequantized(latent_pages, latent_scales, block_tables, q.dtype)[:, :, None, :]  # [B,S,1,C]
    kv_lengths, q_offsets = ragged_defaults(kv_lengths, q_offsets, q.shape[1], rows.shape[1])
    # The value product runs over all C columns and drops the rope ones after: slicing the
    # rows first costs a copy (measured 3x slower on CPU).
    out = flash_attention_reference(q, rows, rows, causal=True, q_offsets=q_offsets, kv_lengths=kv_lengths,
                                    sm_scale=float(sm_scale))
    return out[..., :value_dim]


def paged_latent_attention_pallas(q, latent_pages, block_tables, kv_lengths, *, q_offsets=None,
                                  value_dim: int, sm_scale: float, latent_scales=None, interpret=False,
                                  blocks: PagedBlocks | None = None):
    """The Pallas kernel behind :func:`paged_latent_attention` (``interpret`` runs it as XLA
    ops on any platform); ``blocks`` overrides the tiling table."""
    validate_paged_latent_attention(q, latent_pages, block_tables, kv_lengths, q_offsets, value_dim, sm_scale,
                                    latent_scales)
    B, T, N, C = q.shape
    # Keys: the value columns' parts then the rope columns' parts, so the first parts of every
    # loaded key tile are exactly the value tile.
    value_parts = tiles.pow2_parts(value_dim)
    key_parts = value_parts + tiles.pow2_parts(C - value_dim, value_dim)
    # One "kv head" whose rows are the N heads of token 0, then of token 1, ...
    out = paged_pallas(q.reshape(B, 1, T * N, C), latent_pages[None], None, block_tables, kv_lengths,
                       q_offsets, rows_per_token=N, sm_scale=float(sm_scale), window=None,
                       key_parts=key_parts, value_parts=value_parts, interpret=interpret, blocks=blocks,
                       k_scales=None if latent_scales is None else latent_scales[None], op=OP,
                       names=("latent_pages", ""))
    return out.reshape(B, T, N, value_dim).astype(q.dtype)


def paged_latent_attention(q, latent_pages, block_tables, kv_lengths, *, q_offsets=None, value_dim: int,
                           sm_scale: float, latent_scales=None, mode: KernelMode | str = KernelMode.AUTO):
    """Attention of absorbed MLA queries q [B,T,N,C] over paged latent rows (float, or quantized
    with ``latent_scales``) -> [B,T,N,value_dim] (see the module docstring), run as ``mode``
    resolves on this platform."""
    return dispatch(mode, paged_latent_attention_reference, paged_latent_attention_pallas, q,
                    latent_pages, block_tables, kv_lengths, q_offsets=q_offsets, value_dim=value_dim,
                    sm_scale=sm_scale, latent_scales=latent_scales)
