"""Value transforms for the linear-attention hybrids' tensors (``dayzero.convert.name_map_linear``).

Kept apart from the name map as ``dayzero.convert.transforms`` is: pure numpy rearrangements
(reshapes, slices, transposes) that return views, so they serve the stored FP8 values and their
per-element scales alike (``dayzero.convert.quantize.native_leaf``). Layouts of the results are
those of ``dayzero.model.linear_weights`` (input first).
"""

from __future__ import annotations

import numpy as np


def gated_query(x: np.ndarray, heads: int, head_dim: int, part: int) -> np.ndarray:
    """Qwen3-Next's full-attention ``q_proj`` [N*2H, D], per head [query(H) | gate(H)] rows (HF
    views its output as [.., N, 2H] and chunks the last axis) -> the query (``part`` 0) or the
    output gate (1) as [D, N, H]."""
    per_head = x.reshape(heads, 2, head_dim, x.shape[1])[:, part]
    return per_head.transpose(2, 0, 1)


def rows(x: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a [out, ...] tensor: one projection of several stacked along ``out``."""
    if not 0 <= start < stop <= x.shape[0]:
        raise ValueError(f"rows {start}:{stop} of a tensor with {x.shape[0]}")
    return x[start:stop]


def conv_taps(x: np.ndarray, start: int, heads: int, head_dim: int) -> np.ndarray:
    """Channels [start, start + heads*head_dim) of a depthwise ``conv1d.weight`` [C, 1, W] ->
    [W, heads, head_dim], tap 0 (the oldest input, as PyTorch's causal padding applies it) first."""
    taps = rows(x, start, start + heads * head_dim)[:, 0, :]
    return taps.T.reshape(x.shape[2], heads, head_dim)


def qkvz_part(x: np.ndarray, k_heads: int, k_dim: int, v_heads: int, v_dim: int, part: str) -> np.ndarray:
    """One of q, k, v, z from Qwen3-Next's fused ``in_proj_qkvz`` [2*Hk*dk + 2*Hv*dv, D], laid out
    per key-head group (HF ``fix_query_key_value_ordering``): for each of the Hk groups, rows
    [q(dk) | k(dk) | v(G*dv) | z(G*dv)] with G = Hv / Hk value heads per group. q and k ->
    [D, Hk, dk]; v and z -> [D, Hv, dv] (group g's value heads are heads g*G ... g*G + G - 1)."""
    group = v_heads // k_heads
    width = 2 * k_dim + 2 * group * v_dim
    per_group = x.reshape(k_heads, width, x.shape[1])
    start, size = {"q": (0, k_dim), "k": (k_dim, k_dim), "v": (2 * k_dim, group * v_dim),
                   "z": (2 * k_dim + group * v_dim, group * v_dim)}[part]
    block = per_group[:, start:start + size]
    heads, dim = (k_heads, k_dim) if part in ("q", "k") else (v_heads, v_dim)
    return block.reshape(heads, dim, x.shape[1]).transpose(2, 0, 1)


def ba_part(x: np.ndarray, k_heads: int, v_heads: int, part: str) -> np.ndarray:
    """b or a from Qwen3-Next's fused ``in_proj_ba`` [2*Hv, D], per key-head group [b(G) | a(G)]
    -> [D, Hv]."""
    group = v_heads // k_heads
    per_group = x.reshape(k_heads, 2, group, x.shape[1])[:, 0 if part == "b" else 1]
    return per_group.reshape(v_heads, x.shape[1]).T


def first_row(x: np.ndarray) -> np.ndarray:
    """A [1, D] projection (Qwen3-Next's ``shared_expert_gate``) -> its one row [D]."""
    if x.shape[0] != 1:
        raise ValueError(f"expected one row, got {x.shape[0]}")
    return x[0]


def per_head(x: np.ndarray) -> np.ndarray:
    """Kimi's ``A_log`` [1, 1, H, 1] -> [H]."""
    return x.reshape(x.shape[2])
