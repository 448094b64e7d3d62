"""A Llama-family decoder layer's decode step in one native call for XLA:CPU, through the XLA FFI.

Why: a float32 decode step on one CPU device reads each weight once, at the memory bus's rate, so
everything else is overhead, and it added up: per layer, seven product calls, each handing half
its rows to XLA's pool and back, the in-place attention call, and a dozen small XLA ops between
them (two norms, RoPE, the gating, three residual adds), about twenty thunks in all. SmolLM2-135M's
step on a 2-core AMD EPYC, in one process (NOTES "Measured"): the bare chain of its products 26.6
ms median against the whole step's 30.2, and llama.cpp's whole step 25.3. ``cpu_layer.cc`` runs
the layer as one call: the same eight-row product passes and the same in-place attention
(``kernels.cpu_attention``), cut into phases that the calling thread and the pool's threads work
through together, handed off once per layer.

Taken only where :func:`applies`: a ``model.cache.InPlaceLayer`` (a step that writes the float32
cache in place, ``Engine`` decode and speculative verify on single-device CPU, native kernels
built), a grouped-query attention layer with no biases, q/k norms, sinks or output gate, a dense
SwiGLU MLP, all weights float32 (not quantized), no hyper-connections. Everything else runs
``transformer.decoder_layer``'s ops, which are also the reference the tests compare it with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import cpu_matvec
from dayzero.model.weights import AttentionWeights, LayerWeights, MLPWeights


def _plain_float32(*arrays) -> bool:
    return all(isinstance(a, jax.Array) and a.dtype == jnp.float32 for a in arrays)


def applies(w: LayerWeights, x: jax.Array, layer_cache, cos: jax.Array) -> bool:
    """Whether :func:`decoder_layer` serves this layer's step: ``layer_cache`` an
    :class:`~dayzero.model.cache.InPlaceLayer`, ``w`` a plain grouped-query attention block (no
    biases, q/k norms, sinks or output gate) and a dense SwiGLU MLP, every weight and ``x`` float32,
    no hyper-connections, the products' input sizes multiples of 8 and the RoPE tables ``cos``
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
    if not _plain_float32(x, w.attn_norm, w.mlp_norm, a.q, a.k, a.v, a.o, m.gate, m.up, m.down):
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
    a, m = w.attn, w.mlp
    cos, sin = cos_sin
    M, R = B * T, cos.shape[-1]
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((M, D), f32), jax.ShapeDtypeStruct(layer_cache.k.shape, f32),
           jax.ShapeDtypeStruct(layer_cache.v.shape, f32))
    call = jax.ffi.ffi_call(cpu_matvec.TARGET_DECODER_LAYER, out, vmap_method="sequential",
                            input_output_aliases={12: 1, 13: 2})
    y, keys, values = call(
        x.reshape(M, D), w.attn_norm, a.q.reshape(D, -1), a.k.reshape(D, -1), a.v.reshape(D, -1),
        a.o.reshape(-1, D), w.mlp_norm, m.gate, m.up, m.down,
        jnp.broadcast_to(cos, (B, T, R)).reshape(M, R).astype(f32),
        jnp.broadcast_to(sin, (B, T, R)).reshape(M, R).astype(f32),
        layer_cache.k, layer_cache.v, layer_cache.starts.astype(jnp.int32), layer_cache.num_new.astype(jnp.int32),
        eps=np.float32(eps), norm_offset=np.float32(norm_offset), window=np.int64(layer_cache.window or 0))
    return y.reshape(B, T, D), (keys, values)
