"""Ragged paged decode attention over MLA latent pages (DeepSeek-V2/V3, Kimi-K2).

    paged_latent_attention(q [B,N,C], latent_pages [P,page,C], block_tables [B,pages_per_seq],
                           lengths [B], *, value_dim, sm_scale) -> [B,N,value_dim]

The absorbed form of ``dayzero.model.mla``: each cached token is one latent row of C =
kv_lora_rank + rope_dim values, shared by every head as both key (all C columns, against the
absorbed query [q_latent, q_rope]) and value (its first ``value_dim`` = kv_lora_rank columns;
the caller applies v_up afterwards). There is no natural default scale in this form (the model
uses 1/sqrt(nope + rope dims), possibly YaRN-corrected), so ``sm_scale`` is required.

Paging and ragged lengths work as in :mod:`dayzero.kernels.paged_attention`, whose kernel this
op reuses with one "kv head" whose values are the first columns of its keys: every latent row
is loaded once per step and serves both products.
"""

from __future__ import annotations

import jax.numpy as jnp

from dayzero.kernels import tiles
from dayzero.kernels.mode import KernelError, KernelMode, dispatch
from dayzero.kernels.paged_attention import (PagedBlocks, check_tables, decode_mask, gather_pages,
                                             paged_decode_pallas)

OP = "paged_latent_attention"


def validate_paged_latent_attention(q, latent_pages, block_tables, lengths, value_dim, sm_scale) -> None:
    """Check shapes, dtypes and arguments, raising :class:`KernelError` naming the bad one."""
    tiles.check_rank(OP, "q", q, 3, "[B,N,C]")
    tiles.check_rank(OP, "latent_pages", latent_pages, 3, "[P,page_size,C]")
    B, N, C = q.shape
    if latent_pages.shape[2] != C or min(latent_pages.shape) < 1:
        raise KernelError(f"{OP}: latent_pages has shape {tuple(latent_pages.shape)}, expected "
                          f"[P,page_size,C={C}] for q of shape {tuple(q.shape)}")
    tiles.check_value_dim(OP, value_dim, C)
    tiles.check_float(OP, "q", q)
    tiles.check_float(OP, "latent_pages", latent_pages, q.dtype)
    check_tables(OP, block_tables, lengths, B)
    tiles.check_scale(OP, sm_scale)


def paged_latent_attention_reference(q, latent_pages, block_tables, lengths, *, value_dim: int,
                                     sm_scale: float):
    """Pure-jnp latent decode attention with the contract of :func:`paged_latent_attention`:
    gathers each sequence's latent rows [B,S,C], then softmax attention over them."""
    validate_paged_latent_attention(q, latent_pages, block_tables, lengths, value_dim, sm_scale)
    visible = decode_mask(lengths, block_tables.shape[1] * latent_pages.shape[1], None)  # [B,S]
    # Slots past a length may hold stale values: zero them so 0 * inf cannot give NaN.
    rows = jnp.where(visible[..., None], gather_pages(latent_pages, block_tables), 0)  # [B,S,C]
    scores = jnp.einsum("bnc,bsc->bns", q, rows, preferred_element_type=jnp.float32) * sm_scale
    probs = tiles.masked_softmax(scores, visible[:, None, :])
    # The value product runs over all C columns and drops the rope ones after: slicing the
    # rows first costs a copy (measured 3x slower on CPU).
    out = jnp.einsum("bns,bsc->bnc", probs, rows.astype(jnp.float32))
    return out[..., :value_dim].astype(q.dtype)


def paged_latent_attention_pallas(q, latent_pages, block_tables, lengths, *, value_dim: int,
                                  sm_scale: float, interpret=False, blocks: PagedBlocks | None = None):
    """The Pallas kernel behind :func:`paged_latent_attention` (``interpret`` runs it as XLA
    ops on any platform); ``blocks`` overrides the tiling table."""
    validate_paged_latent_attention(q, latent_pages, block_tables, lengths, value_dim, sm_scale)
    C = q.shape[2]
    # Keys: the value columns' parts then the rope columns' parts, so the first parts of every
    # loaded key tile are exactly the value tile.
    value_parts = tiles.pow2_parts(value_dim)
    key_parts = value_parts + tiles.pow2_parts(C - value_dim, value_dim)
    out = paged_decode_pallas(q[:, None], latent_pages[None], None, block_tables, lengths,
                              sm_scale=float(sm_scale), window=None, key_parts=key_parts,
                              value_parts=value_parts, interpret=interpret, blocks=blocks)
    return out[:, 0].astype(q.dtype)


def paged_latent_attention(q, latent_pages, block_tables, lengths, *, value_dim: int, sm_scale: float,
                           mode: KernelMode | str = KernelMode.AUTO):
    """Decode attention of absorbed MLA queries q [B,N,C] over paged latent rows ->
    [B,N,value_dim], run as ``mode`` resolves on this platform."""
    return dispatch(mode, paged_latent_attention_reference, paged_latent_attention_pallas, q,
                    latent_pages, block_tables, lengths, value_dim=value_dim, sm_scale=sm_scale)
