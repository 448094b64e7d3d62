"""The weights of a hybrid model's linear-attention layers (``LinearAttnConfig``), declared as
``dayzero.model.weights`` declares the rest (``weights._layer_specs`` takes them from here for
the layers ``config.linear`` marks).

Letters: D hidden, Hk query/key heads of dk, Hv value heads of dv, W conv taps. Both kinds:
q/k [D,Hk,dk], v [D,Hv,dv]; the depthwise causal convolutions' taps conv_q/conv_k [W,Hk,dk] and
conv_v [W,Hv,dv] (oldest tap first, HF's ``conv1d.weight`` [C,1,W] split by channel group and
transposed); beta's projection b [D,Hv]; ``A_log`` [Hv] (float32); the output norm's weight
``norm`` [dv] (one per value dim, shared by the heads); the output o [Hv,dv,D].

Gated DeltaNet (Qwen3-Next, Qwen3.5): the output gate ``gate`` [D,Hv,dv] (HF's z) and the decay
input ``a`` [D,Hv] with ``dt_bias`` [Hv] (float32): g = -exp(A_log) * softplus(x.a + dt_bias).

Kimi Delta Attention (Hk = Hv = H, dk = dv = d): the decay through a low rank, ``decay_a``
[D,d] then ``decay_b`` [d,H,d] with ``dt_bias`` [H,d] (float32): g = -exp(A_log) *
softplus(x.decay_a.decay_b + dt_bias), one per channel; the output gate likewise through
``gate_a`` [D,d] and ``gate_b`` [d,H,d].

Logical axes: value heads split over ``tensor`` as query heads do (``q_heads``), query/key heads
as kv heads do (``kv_heads``, replicated when they do not divide the mesh axis).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import struct

from dayzero.model.config import LinearKind, ModelConfig
from dayzero.model.weights import IN0, Init, ParamSpec


@struct.dataclass
class LinearAttnWeights:
    """One linear-attention layer's weights (see the module docstring for shapes)."""

    q: Any
    k: Any
    v: Any
    conv_q: Any
    conv_k: Any
    conv_v: Any
    b: Any
    A_log: Any
    dt_bias: Any
    norm: Any
    o: Any
    gate: Any = None  # Gated DeltaNet
    a: Any = None  # Gated DeltaNet
    decay_a: Any = None  # Kimi Delta Attention
    decay_b: Any = None
    gate_a: Any = None
    gate_b: Any = None


def linear_attn_specs(c: ModelConfig) -> LinearAttnWeights:
    """The :class:`ParamSpec` tree of one linear-attention layer of ``c``."""
    lc, D = c.linear, c.hidden_size
    Hk, Hv, dk, dv, W = lc.num_k_heads, lc.num_v_heads, lc.k_head_dim, lc.v_head_dim, lc.conv_kernel
    f32 = jnp.dtype(jnp.float32)
    kv_heads, v_heads = ("embed", "kv_heads", "head_dim"), ("embed", "q_heads", "head_dim")
    common = dict(
        q=ParamSpec((D, Hk, dk), kv_heads, in_axes=IN0),
        k=ParamSpec((D, Hk, dk), kv_heads, in_axes=IN0),
        v=ParamSpec((D, Hv, dv), v_heads, in_axes=IN0),
        conv_q=ParamSpec((W, Hk, dk), (None, "kv_heads", "head_dim")),
        conv_k=ParamSpec((W, Hk, dk), (None, "kv_heads", "head_dim")),
        conv_v=ParamSpec((W, Hv, dv), (None, "q_heads", "head_dim")),
        b=ParamSpec((D, Hv), ("embed", "q_heads")),
        A_log=ParamSpec((Hv,), ("q_heads",), Init.ZEROS, f32),
        norm=ParamSpec((dv,), ("head_dim",), Init.ONES),
        o=ParamSpec((Hv, dv, D), ("q_heads", "head_dim", "embed"), in_axes=(0, 1)),
    )
    if lc.kind is LinearKind.GATED_DELTA:
        return LinearAttnWeights(**common, dt_bias=ParamSpec((Hv,), ("q_heads",), Init.ONES, f32),
                                 gate=ParamSpec((D, Hv, dv), v_heads, in_axes=IN0),
                                 a=ParamSpec((D, Hv), ("embed", "q_heads")))
    low = ParamSpec((D, dk), ("embed", None))
    up = ParamSpec((dk, Hv, dk), (None, "q_heads", "head_dim"))
    return LinearAttnWeights(**common, dt_bias=ParamSpec((Hv, dk), ("q_heads", "head_dim"), Init.ZEROS, f32),
                             decay_a=low, decay_b=up, gate_a=low, gate_b=up)
