"""Native decode attention over a contiguous float32 KV cache for XLA:CPU, through the XLA FFI.

Why: on XLA:CPU, ``model.transformer.attend`` reads the cache in blocks (``cache.fold_blocks``),
and each block is a copy of keys and values (a ``dynamic-slice``, a zeroing ``select``) before
two small batched matmuls and half a dozen elementwise ops, each a separate thunk.
``cpu_attention.cc`` reads the visible positions of the cache where they lie and returns the
softmax statistics (m, l, o) of the queries over them, which ``attend`` merges with those of the
new keys (``kernels.tiles.merge_stats``), as it merges its blocks. A SmolLM2 fp32 decode step,
the two side by side (median of 100): 15.52 against 16.05 ms after a 128-token prompt, 18.85
against 21.32 after 2048.

It is built into the same library as the matrix-vector kernels (``kernels.cpu_matvec``: built on
first use, where a compiler is found; ``DAYZERO_NATIVE_CPU=0`` turns both off), and taken only
where :func:`applies`: single-device CPU, a plain float32 cache in the contiguous layout
(keys [B,K,H,S], values [B,K,S,H]) and a few query tokens per row (decode, speculative verify).
Everything else (quantized or paged caches, meshes, prefill chunks, other platforms) takes
``fold_blocks``, which is also the reference the tests compare the kernel with.

:func:`attend_in_place` goes one step further for ``Engine``'s decode (``model.cache.InPlaceKVCache``):
one call writes the step's new keys and values into the cache (its results alias the cache
operands, so a step that donates the cache writes in place) and returns the finished attention
over the cache, new keys included. That replaces, per layer, the new keys' own statistics, the
merge, the finish and the transposes around them (a dozen XLA ops), and the separate program
that wrote the cache after each step. Its reference is ``attend`` over ``attention_masks``
followed by ``cache.append_to_cache``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.kernels import cpu_matvec
from dayzero.kernels.tiles import Stats

# Most query tokens per row for which the kernel is taken: it scores each query row against the
# keys separately, where XLA's batched matmul shares the key reads across rows.
MAX_QUERY_TOKENS = 8


def applies(q: jax.Array, keys, values, keys_token_major: bool) -> bool:
    """Whether :func:`cached_stats` serves queries ``q`` [B,T,N,H] over this cache: single-device
    CPU with the native kernels built, float32 arrays (not quantized) in the contiguous layout,
    at most ``MAX_QUERY_TOKENS`` tokens per row (the cache as :func:`in_place_applies` takes it)."""
    return not keys_token_major and q.dtype == jnp.float32 and in_place_applies(keys, values, q.shape[1])


def cached_stats(qg: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array) -> Stats:
    """Softmax statistics of queries ``qg`` [B,K,G*T,H] (already scaled; row r is query token
    r % T) over the cached ``keys`` [B,K,H,S] and ``values`` [B,K,S,H] that ``mask`` [B,T,S]
    shows: (m [B,K,G*T], l [B,K,G*T], o [B,K,G*T,H]), float32, as
    :func:`dayzero.kernels.tiles.masked_stats` gives them (a row that sees nothing: -inf, 0, 0).
    Call only where :func:`applies`."""
    B, K, M, H = qg.shape
    S = keys.shape[-1]
    if keys.shape != (B, K, H, S) or values.shape != (B, K, S, H) or mask.shape[::2] != (B, S) or M % mask.shape[1]:
        raise ValueError(f"cached_stats takes q [B,K,G*T,H], keys [B,K,H,S], values [B,K,S,H] and mask [B,T,S]; "
                         f"got {qg.shape}, {keys.shape}, {values.shape}, {mask.shape}")
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((B, K, M), f32), jax.ShapeDtypeStruct((B, K, M), f32),
           jax.ShapeDtypeStruct((B, K, M, H), f32))
    call = jax.ffi.ffi_call(cpu_matvec.TARGET_ATTENTION, out, vmap_method="sequential")
    return tuple(call(qg.astype(f32), keys, values, mask.astype(jnp.bool_)))


def in_place_applies(k_cache, v_cache, T: int) -> bool:
    """Whether :func:`attend_in_place` serves a step of ``T`` new tokens per row over this layer's
    cache: plain float32 arrays, single-device CPU with the native kernels built, at most
    ``MAX_QUERY_TOKENS`` tokens per row. (Worth it only where the step donates the cache: else XLA
    copies each written buffer, see ``model.cache.InPlaceKVCache``.)"""
    return (isinstance(k_cache, jax.Array) and isinstance(v_cache, jax.Array)
            and k_cache.dtype == v_cache.dtype == jnp.float32 and T <= MAX_QUERY_TOKENS
            and cpu_matvec.single_device_cpu() and cpu_matvec.available())


def attend_in_place(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    starts: jax.Array, num_new: jax.Array, window: int | None = None,
                    sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's attention in one native call, its new keys written into the cache first:
    queries ``q`` [B,T,N,H] and the new ``k_new``/``v_new`` [B,T,K,H] of rows that hold
    ``starts`` [B] positions, ``num_new`` [B] of the T real. Returns (output [B,T,N,H], the
    cache written: ``k_cache`` [B,K,H,S] and ``v_cache`` [B,K,S,H] with each row's T new tokens at
    ``starts``), as ``transformer.attend`` over ``attention_masks(starts, num_new, T, S, window)``
    then ``cache.append_to_cache`` give them (scale 1/sqrt(H); ``sinks`` [N] as ``attend``'s).
    The cache results alias the cache operands: XLA writes in place when the step donates the
    cache, and copies it first otherwise. Call only where :func:`in_place_applies`."""
    B, T, N, H = q.shape
    K, S = k_new.shape[2], k_cache.shape[-1]
    if (k_new.shape != (B, T, K, H) or v_new.shape != k_new.shape or k_cache.shape != (B, K, H, S)
            or v_cache.shape != (B, K, S, H) or N % K):
        raise ValueError(f"attend_in_place takes q [B,T,N,H], k_new and v_new [B,T,K,H], k_cache [B,K,H,S] and "
                         f"v_cache [B,K,S,H]; got {q.shape}, {k_new.shape}, {v_new.shape}, {k_cache.shape}, "
                         f"{v_cache.shape}")
    f32 = jnp.float32
    sinks = jnp.full((N,), -jnp.inf, f32) if sinks is None else sinks.astype(f32)
    out = (jax.ShapeDtypeStruct(q.shape, f32), jax.ShapeDtypeStruct(k_cache.shape, f32),
           jax.ShapeDtypeStruct(v_cache.shape, f32))
    call = jax.ffi.ffi_call(cpu_matvec.TARGET_ATTENTION_IN_PLACE, out, vmap_method="sequential",
                            input_output_aliases={3: 1, 4: 2})
    return tuple(call(q.astype(f32), k_new.astype(f32), v_new.astype(f32), k_cache, v_cache,
                      starts.astype(jnp.int32), num_new.astype(jnp.int32), sinks,
                      scale=np.float32(H**-0.5), window=np.int64(window or 0)))
