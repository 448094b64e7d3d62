"""Value transforms from source tensor layouts to dayzero's weight layouts.

Kept apart from the name maps: a map says *which* source tensor feeds *which* leaf, these
functions say *how* its values are rearranged. Each is a pure numpy function that returns views
where it can; the streaming loop makes the one contiguous copy when it casts to the storage dtype.

Source layouts: a PyTorch ``Linear`` weight is [out, in]; dayzero keeps the input dimension first
(q [D,N,H], k/v [D,K,H], o [N,H,D], gate/up [D,F], down [F,D], lm_head [D,V]). Expert weights
are stacked expert-major (gate/up [E,D,F], down [E,F,D]): per-expert tensors are transformed one
at a time and stacked by the streaming loop; already stacked ones are transformed here.
"""

from __future__ import annotations

import numpy as np


def identity(x: np.ndarray) -> np.ndarray:
    """The tensor as stored (embeddings, norms, o bias)."""
    return x


def transpose(x: np.ndarray) -> np.ndarray:
    """[out, in] -> [in, out] for plain linear layers (MLP projections, lm_head)."""
    return x.T


def split_heads_in(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """q/k/v projection [heads*head_dim, D] -> [D, heads, head_dim]."""
    return x.T.reshape(x.shape[1], heads, head_dim)


def split_heads_out(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """o projection [D, heads*head_dim] -> [heads, head_dim, D]."""
    return x.T.reshape(heads, head_dim, x.shape[0])


def split_bias(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """q/k/v bias [heads*head_dim] -> [heads, head_dim]."""
    return x.reshape(heads, head_dim)


def llama_cpp_unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp applies to q and k weights of the llama architecture.

    Within each head of ``head_dim`` rows, HF keeps the two rotary halves apart (rows
    ``[0, H/2)`` pair with ``[H/2, H)``), while llama.cpp's rotary kernel wants each pair adjacent.
    Its converter therefore views the rows as [heads, 2, H/2] and swaps the last two axes, so that
    stored row ``2*j + s`` holds HF row ``s*H/2 + j``. The inverse views the stored rows as
    [heads, H/2, 2] and swaps back. ``heads`` is the number of query heads for q and of key/value
    heads for k.
    """
    rows = x.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows cannot be split into {heads} heads of even size")
    half = rows // heads // 2
    return x.reshape(heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def transpose_experts(x: np.ndarray) -> np.ndarray:
    """Stacked expert linear weights [E, out, in] -> [E, in, out]."""
    return x.transpose(0, 2, 1)


def split_gate_up(x: np.ndarray, half: int) -> np.ndarray:
    """One half of HF's fused expert projection [E, 2F, D] (gate rows, then up rows) -> [E, D, F]."""
    width = x.shape[1] // 2
    return transpose_experts(x[:, half * width : (half + 1) * width])


def deinterleave(x: np.ndarray, axis: int, part: int) -> np.ndarray:
    """Entries ``part``, ``part + 2``, ``part + 4``, ... of ``axis``: one of two projections
    stored interleaved along it (gpt-oss's ``gate_up_proj`` [E, D, 2F] keeps gate in the even
    columns and up in the odd ones, and its bias [E, 2F] alike). A strided view, whatever the
    dtype (quantized values and their per-column scales split the same way along that axis)."""
    if part not in (0, 1) or x.shape[axis] % 2:
        raise ValueError(f"deinterleave takes part 0 or 1 of an even axis; got part {part} of {x.shape[axis]}")
    index = [slice(None)] * x.ndim
    index[axis] = slice(part, None, 2)
    return x[tuple(index)]


def split_kv_up(x: np.ndarray, heads: int, nope_dim: int, part: int) -> np.ndarray:
    """One half of MLA's ``kv_b_proj`` [heads*(P+V), L] (per head: P key rows, then V value rows)
    -> the key up-projection [L, heads, P] (``part`` 0) or the value one [L, heads, V] (1)."""
    per_head = x.reshape(heads, -1, x.shape[1])
    rows = per_head[:, :nope_dim] if part == 0 else per_head[:, nope_dim:]
    return rows.transpose(2, 0, 1)


def mla_k_b(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``attn_k_b`` [heads, L, P] (each head's key rows of ``kv_b_proj``, transposed by
    its converter) -> the key up-projection [L, heads, P]."""
    return x.transpose(1, 0, 2)


def mla_v_b(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``attn_v_b`` [heads, V, L] (each head's value rows of ``kv_b_proj``) -> the
    value up-projection [L, heads, V]."""
    return x.transpose(2, 0, 1)
