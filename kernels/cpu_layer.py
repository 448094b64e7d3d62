"""A Llama-family decoder layer's decode step in one native call for XLA:CPU, through the XLA FFI.

Why: a decode step on one CPU device reads each weight once, at the memory bus's rate (the
quantized products also convert in registers), so everything else is overhead, and it added up:
per layer, seven product calls, each handing half its rows to XLA's pool and back, the in-place
attention call, and a dozen small XLA ops between them (two norms, RoPE, the gating, three
residual adds), about twenty thunks in all. SmolLM2-135M's step on a 2-core AMD EPYC, in one
process (NOTES "Measured"): the bare chain of its products 26.6 ms median against the whole
step's 30.2, and llama.cpp's whole step 25.3. ``cpu_layer.cc`` runs the layer as one call: the
same eight-row product passes and the same in-place attention (``kernels.cpu_attention``), cut
into phases that the calling thread and the pool's threads work through together, handed off
once per layer.

Taken only where :func:`applies`: a ``model.cache.InPlaceLayer`` (a step that writes the float32
cache in place, ``Engine`` decode and speculative verify on single-device CPU, native kernels
built), a grouped-query attention layer with no biases, q/k norms, sinks or output gate, a dense
SwiGLU MLP, each projection float32, int8 with a scale per column or int4 with one per group of
inputs (as ``kernels.cpu_matvec``'s products take them; fp8 and other layouts are not), no
hyper-connections. Everything else runs ``transformer.decoder_layer``'s ops, which are also the
reference the tests compare it with.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import cpu_matvec
from dayzero.model.weights import AttentionWeights, LayerWeights, MLPWeights


# The int4 products' outputs: whole blocks of 32 columns (cpu_layer.cc keeps a block in one slice).
INT4_COLUMNS = 32


def _matrix(w, n_in: int) -> tuple[jax.Array, jax.Array, int] | None:
    """(matrix [In, Out], scale, group) as the native layer takes weight ``w`` (its first ``n_in``
    axes the input): float32 (a placeholder scale, group 0), or int8 / int4 as the native products
    take them (``model.quant_matmul.native_matrix``; int4 with a multiple of 32 columns and whole
    groups of rows); None for anything else."""
    from dayzero.model import quant_matmul
    from dayzero.model.quant import QuantizedArray

    if isinstance(w, QuantizedArray):
        native = quant_matmul.native_matrix(w, n_in) if tuple(w.in_axes) == tuple(range(n_in)) else None
        if native is None or (native[2] and (native[0].shape[1] % INT4_COLUMNS or native[0].shape[0] % native[2])):
            return None
        return native
    if isinstance(w, jax.Array) and w.dtype == jnp.float32:
        return w.reshape(math.prod(w.shape[:n_in]), -1), jnp.zeros((1,), jnp.float32), 0
    return None


def _matrices(w: LayerWeights) -> list | None:
    """The seven products' (matrix, scale, group), q k v o gate up down; None if one is not taken."""
    a, m = w.attn, w.mlp
    found = [_matrix(a.q, 1), _matrix(a.k, 1), _matrix(a.v, 1), _matrix(a.o, 2), _matrix(m.gate, 1),
             _matrix(m.up, 1), _matrix(m.down, 1)]
    return None if any(f is None for f in found) else found


def _plain_float32(*arrays) -> bool:
    return all(isinstance(a, jax.Array) and a.dtype == jnp.float32 for a in arrays)


def applies(w: LayerWeights, x: jax.Array, layer_cache, cos: jax.Array) -> bool:
    """Whether :func:`decoder_layer` serves this layer's step: ``layer_cache`` an
    :class:`~dayzero.model.cache.InPlaceLayer`, ``w`` a plain grouped-query attention block (no
    biases, q/k norms, sinks or output gate) and a dense SwiGLU MLP, each projection float32 or
    quantized as the native products take it (int8 with a scale per column, int4 with one per
    group of inputs and a multiple of 32 outputs), ``x`` and the norms float32, no
    hyper-connections, the products' input sizes multiples of 8 and the RoPE tables ``cos``
    [B,T,R] an even width no wider than a head. (The caller, ``transformer.decoder_layer``, also
    checks that the layer is grouped-query attention with no frame.)"""
    from dayzero.model.cache import InPlaceLayer

    a, m = w.attn, w.mlp
    if not (isinstance(layer_cache, InPlaceLayer) and isinstance(a, AttentionWeights) and isinstance(m, MLPWeights)):
        return False
    if w.attn_hc is not None or w.mlp_hc is not None:
        return False
    if any(extra is not None for extra in (a.q_bias, a.k_bias, a.v_bias, a.o_bias, a.q_norm, a.k_norm, a.sinks,
                                           a.gate)):
        return False
    if not _plain_float32(x, w.attn_norm, w.mlp_norm) or _matrices(w) is None:
        return False
    D, N, H = a.q.shape
    R = cos.shape[-1]
    return D % 8 == 0 and (N * H) % 8 == 0 and m.gate.shape[1] % 8 == 0 and R % 2 == 0 and R <= H


def decoder_layer(w: LayerWeights, x: jax.Array, cos_sin: tuple[jax.Array, jax.Array], layer_cache,
                  eps: float, norm_offset: float = 0.0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The layer's step on ``x`` [B,T,D] in one native call: (output [B,T,D], the layer's cache
    written: keys [B,K,H,S], values [B,K,S,H]), as ``transformer.decoder_layer`` over the same
    :class:`~dayzero.model.cache.InPlaceLayer` gives them (RMS norms with ``eps`` and scale
    ``norm_offset`` + weight, RoPE from ``cos_sin`` [B,T,R] each, the layer's window). The cache
    results alias the cache operands (see ``kernels.cpu_attention.attend_in_place``). Call only
    where :func:`applies`."""
    B, T, D = x.shape
    cos, sin = cos_sin
    M, R = B * T, cos.shape[-1]
    f32 = jnp.float32
    (q, k, v, o, gate, up, down) = _matrices(w)
    operands = [x.reshape(M, D), w.attn_norm, *q[:2], *k[:2], *v[:2], *o[:2], w.mlp_norm, *gate[:2], *up[:2],
                *down[:2], jnp.broadcast_to(cos, (B, T, R)).reshape(M, R).astype(f32),
                jnp.broadcast_to(sin, (B, T, R)).reshape(M, R).astype(f32), layer_cache.k, layer_cache.v,
                layer_cache.starts.astype(jnp.int32), layer_cache.num_new.astype(jnp.int32)]
    out = (jax.ShapeDtypeStruct((M, D), f32), jax.ShapeDtypeStruct(layer_cache.k.shape, f32),
           jax.ShapeDtypeStruct(layer_cache.v.shape, f32))
    keys_at = len(operands) - 4  # the cache operands, which the cache results alias
    call = jax.ffi.ffi_call(cpu_matvec.TARGET_DECODER_LAYER, out, vmap_method="sequential",
                            input_output_aliases={keys_at: 1, keys_at + 1: 2})
    groups = np.array([g for _, _, g in (q, k, v, o, gate, up, down)], np.int64)
    y, keys, values = call(*operands, eps=np.float32(eps), norm_offset=np.float32(norm_offset),
                           window=np.int64(layer_cache.window or 0), groups=groups)
    return y.reshape(B, T, D), (keys, values)
