"""The linear-attention layers of hybrid models: Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi
Delta Attention (Kimi-Linear), as one block over ``LinearAttnWeights`` (``dayzero.model.linear_weights``).

Both project the layer input to queries and keys (Hk heads of dk) and values (Hv heads of dv),
pass each through its depthwise causal convolution and SiLU, and run the gated delta rule
(``dayzero.model.delta_rule``): a per-head state S [dk,dv] decayed by exp(g), moved towards v by
beta along k, read by q. They differ in the decay g (GDN: one per head, -exp(A_log) *
softplus(x.a + dt_bias); KDA: one per head and key channel, through the low-rank decay_a.decay_b)
and in the output gate (GDN: silu of the projection ``gate``, after a per-head RMSNorm; KDA: the
sigmoid of the low-rank gate_a.gate_b). The block returns its output and the layer's new
:class:`LinearState` (the cache of a linear layer: fixed size whatever the context).

A row's padding tokens (t >= num_new) change neither state: the convolution keeps the last real
inputs, the delta rule treats them as identity steps. So one function serves a first prefill
(``state`` None: zeros), chunked prefill, decode and ragged batches.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.kernels import KernelMode, chunked_delta_rule, recurrent_delta_step
from dayzero.model.config import LinearKind, ModelConfig
from dayzero.model.delta_rule import causal_conv, delta_rule, gated_rms_norm
from dayzero.model.linear_weights import LinearAttnWeights
from dayzero.model.quant import dequantized
from dayzero.model.weights import Init, ParamSpec


@struct.dataclass
class LinearState:
    """One linear layer's per-sequence cache, rows first: each convolution's last W-1 inputs
    (oldest first) ``conv_q``/``conv_k`` [B,W-1,Hk,dk] and ``conv_v`` [B,W-1,Hv,dv] in the
    model's dtype, and the delta rule's state ``recurrent`` [B,Hv,dk,dv] in float32 (kept in fp32
    whatever the KV cache's quantization: it is rewritten every token, so a rounding would
    accumulate over the whole context)."""

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    recurrent: jax.Array


class LinearFrame(NamedTuple):
    """What ``transformer.decoder_layer`` passes a linear layer beyond its input and state: each
    row's number of real new tokens [B], and how the delta rule runs (a resolved kernel mode)."""

    num_new: jax.Array
    kernels: KernelMode = KernelMode.REFERENCE


# Below this many new tokens a kernel step runs the token-by-token decode kernel, from it up the
# chunked one (whose smallest chunk is 16 tokens: a shorter call would be mostly padding).
RECURRENT_KERNEL_BELOW = 16


def state_specs(config: ModelConfig, rows: int) -> LinearState:
    """One linear layer's state for ``rows`` sequences, declared (``ParamSpec`` leaves, zeros):
    value heads split over ``tensor`` as query heads, query/key heads as kv heads."""
    lc = config.linear
    W, Hk, Hv, dk, dv = lc.conv_kernel, lc.num_k_heads, lc.num_v_heads, lc.k_head_dim, lc.v_head_dim
    conv_k = ParamSpec((rows, W - 1, Hk, dk), ("batch", None, "kv_heads", None), Init.ZEROS)
    return LinearState(
        conv_q=conv_k, conv_k=conv_k,
        conv_v=ParamSpec((rows, W - 1, Hv, dv), ("batch", None, "q_heads", None), Init.ZEROS),
        recurrent=ParamSpec((rows, Hv, dk, dv), ("batch", "q_heads", None, None), Init.ZEROS,
                            jnp.dtype(jnp.float32)),
    )


def _project(x: jax.Array, w) -> jax.Array:
    """``x`` [B,T,D] through a projection [D, ...] (a quantized one dequantized first)."""
    w = dequantized(w, x.dtype)
    return jnp.tensordot(x, w, axes=1)


def _convolved(x: jax.Array, taps: jax.Array, state: jax.Array | None, num_new: jax.Array):
    """Per-head inputs [B,T,h,d] through their causal convolution (taps [W,h,d], state
    [B,W-1,h,d] or None) -> (outputs [B,T,h,d], new state)."""
    B, T, h, d = x.shape
    flat_state = None if state is None else state.reshape(B, -1, h * d)
    out, new = causal_conv(x.reshape(B, T, h * d), taps.reshape(-1, h * d).astype(x.dtype), flat_state, num_new)
    return out.reshape(B, T, h, d), new.reshape(B, -1, h, d)


def _decay(w: LinearAttnWeights, config: ModelConfig, x: jax.Array) -> jax.Array:
    """The log-decay g <= 0 of each token: [B,T,Hv] (GDN) or [B,T,H,d] (KDA), float32."""
    rate = -jnp.exp(w.A_log.astype(jnp.float32))
    if config.linear.kind is LinearKind.GATED_DELTA:
        return rate * jax.nn.softplus(_project(x, w.a).astype(jnp.float32) + w.dt_bias)
    low = _project(_project(x, w.decay_a), w.decay_b).astype(jnp.float32)
    return rate[:, None] * jax.nn.softplus(low + w.dt_bias)


def _delta(lc, kernels: KernelMode, q, k, v, g, beta, state, num_new):
    """The delta rule as ``kernels`` says: the reference (``delta_rule`` picks its form), or the
    decode kernel for a few tokens and the chunked kernel for more."""
    if kernels is KernelMode.REFERENCE:
        return delta_rule(q, k, v, g, beta, state, num_new, lc.chunk)
    if q.shape[1] < RECURRENT_KERNEL_BELOW:
        return recurrent_delta_step(q, k, v, g, beta, state, num_new, mode=kernels)
    return chunked_delta_rule(q, k, v, g, beta, state, num_new, lc.chunk, mode=kernels)


def linear_attn_block(w: LinearAttnWeights, config: ModelConfig, x: jax.Array, state: LinearState | None,
                      num_new: jax.Array, kernels: KernelMode = KernelMode.REFERENCE) -> tuple[jax.Array, LinearState]:
    """One linear-attention layer on ``x`` [B,T,D] (``num_new`` [B] real tokens per row) after
    each row's ``state`` (None: a fresh sequence) -> (output [B,T,D], the rows' new state).
    ``kernels``: a resolved mode, the delta rule on the Pallas kernels unless reference."""
    lc = config.linear
    q, k, v = _project(x, w.q), _project(x, w.k), _project(x, w.v)
    q, conv_q = _convolved(q, w.conv_q, None if state is None else state.conv_q, num_new)
    k, conv_k = _convolved(k, w.conv_k, None if state is None else state.conv_k, num_new)
    v, conv_v = _convolved(v, w.conv_v, None if state is None else state.conv_v, num_new)
    beta = jax.nn.sigmoid(_project(x, w.b))
    g = _decay(w, config, x)
    out, recurrent = _delta(lc, kernels, q, k, v, g, beta, None if state is None else state.recurrent,
                            num_new.astype(jnp.int32))
    if lc.kind is LinearKind.GATED_DELTA:
        out = gated_rms_norm(out, w.norm, _project(x, w.gate), config.rms_norm_eps, "silu")
    else:
        out = gated_rms_norm(out, w.norm, _project(_project(x, w.gate_a), w.gate_b), config.rms_norm_eps, "sigmoid")
    B, T = x.shape[:2]
    o = dequantized(w.o, x.dtype)
    out = jnp.einsum("bte,ed->btd", out.reshape(B, T, -1), o.reshape(-1, o.shape[-1]))
    return out, LinearState(conv_q=conv_q, conv_k=conv_k, conv_v=conv_v, recurrent=recurrent)
