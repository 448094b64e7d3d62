"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) in the absorbed form.

Each token is cached as one latent row of C = L + R values (``kv_lora_rank`` after its RMSNorm,
then the rotated rope key shared by all heads), not as N per-head keys and values. Per head n,
HF expands the latent c into a key ``[k_up[n] c, k_rope]`` and a value ``v_up[n] c``. Attention
is linear in both, so the up-projections move to the query and output sides:

    q_n . k_n = (k_up[n]^T q_nope_n) . c + q_rope_n . k_rope = [q_latent_n, q_rope_n] . latent
    sum_s p_s v_n(s) = v_up[n] (sum_s p_s c_s)

so every head attends over the cached latent rows themselves (one [C]-wide dot product per key)
and nothing per head is ever materialised for the cache. Prefill uses the same absorbed form as
decode: one implementation, and a prefill never builds per-head keys for S positions. (The
expanded form does fewer FLOPs per score, P + R against L + R, which a long-prompt prefill on an
accelerator may want back one day; it would be a second implementation of the same block.)

The block returns the new latent rows; ``transformer.append_to_cache`` writes them, keeping
``forward``'s read and the cache's in-place write in separate jits (see transformer.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dayzero.model.config import ModelConfig, RopeType
from dayzero.model.norm import rms_norm
from dayzero.model.rope import yarn_mscale, apply_rope, deinterleave
from dayzero.model.weights import MLAWeights

# HF builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(P+R), times mscale^2 when the RoPE scaling sets ``mscale_all_dim`` (as HF and
    DeepSeek do: the YaRN entropy correction goes into the logits, not only into cos/sin)."""
    m, rope = config.mla, config.rope
    scale = (m.nope_dim + m.rope_dim) ** -0.5
    if rope.type is not RopeType.DEFAULT and rope.mscale_all_dim:
        mscale = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= mscale * mscale
    return scale


def _queries(w: MLAWeights, x: jax.Array) -> jax.Array:
    """Per-head queries [B,T,N,P+R], through the q LoRA when the model has one."""
    if w.q is not None:
        return jnp.einsum("btd,dnh->btnh", x, w.q)
    q_latent = rms_norm(x @ w.q_a, w.q_a_norm, LORA_NORM_EPS)
    return jnp.einsum("btq,qnh->btnh", q_latent, w.q_b)


def _rope(x: jax.Array, config: ModelConfig, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate the rope part [B,T,heads,R], from DeepSeek's interleaved pairs if the model uses them."""
    if config.mla.rope_interleave:
        x = deinterleave(x)
    return apply_rope(x, *cos_sin)


def latent_rows(w: MLAWeights, config: ModelConfig, x: jax.Array,
                cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """What the cache stores for tokens ``x`` [B,T,D]: [normed latent, rotated rope key] [B,T,L+R]."""
    L = config.mla.kv_lora_rank
    kv = x @ w.kv_a
    latent = rms_norm(kv[..., :L], w.kv_a_norm, LORA_NORM_EPS)
    k_rope = _rope(kv[..., None, L:], config, cos_sin)[:, :, 0]
    return jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    # A query with no visible key (padding of an empty row) would be NaN; make it zero.
    return jnp.where(mask, probs, 0.0)


def attend_latent(q: jax.Array, cache: jax.Array | None, new: jax.Array,
                  masks: tuple[jax.Array | None, jax.Array]) -> jax.Array:
    """Softmax attention of absorbed queries ``q`` [B,T,N,C] over latent rows -> [B,T,N,C].

    ``cache`` [B,S,C] (the rows written before this call, or None) and ``new`` [B,T,C]; masks as
    ``transformer.attention_masks`` makes them ([B,T,S], [B,T,T]). Queries are flattened to
    [B, T*N, C] (a free reshape), so both products are plain batched matmuls over the cache.
    The value product runs over all C columns and drops the rope ones afterwards: slicing the
    cache first would copy it, and the R extra columns cost only R/L more work.
    """
    B, T, N, C = q.shape
    qf = q.reshape(B, T * N, C)
    mask_cached, mask_new = masks
    scores = jnp.einsum("bmc,bjc->bmj", qf, new, preferred_element_type=jnp.float32)
    mask = mask_new
    if cache is not None:
        cache = cache.astype(q.dtype)
        s_cached = jnp.einsum("bmc,bsc->bms", qf, cache, preferred_element_type=jnp.float32)
        scores = jnp.concatenate([s_cached, scores], axis=-1)
        mask = jnp.concatenate([mask_cached, mask_new], axis=-1)
    # The [B,T,keys] mask repeated for each head, in the (t, n) row order of the queries.
    mask = jnp.broadcast_to(mask[:, :, None], (B, T, N, mask.shape[-1])).reshape(B, T * N, -1)
    probs = _masked_softmax(scores, mask).astype(q.dtype)
    S = 0 if cache is None else cache.shape[1]
    out = jnp.einsum("bmj,bjc->bmc", probs[..., S:], new)
    if cache is not None:
        out += jnp.einsum("bms,bsc->bmc", probs[..., :S], cache)
    return out.reshape(B, T, N, C)


def mla_block(
    w: MLAWeights,
    config: ModelConfig,
    x: jax.Array,
    cos_sin: tuple[jax.Array, jax.Array],
    cache: jax.Array | None,
    masks: tuple[jax.Array | None, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """Latent self-attention of ``x`` [B,T,D] over the cached rows [B,S,L+R] (None: none).

    Returns the output [B,T,D] and the new latent rows [B,T,L+R] for ``append_to_cache``.
    """
    m = config.mla
    q = _queries(w, x)
    q_nope, q_rope = q[..., : m.nope_dim], _rope(q[..., m.nope_dim :], config, cos_sin)
    q_latent = jnp.einsum("btnp,lnp->btnl", q_nope, w.k_up)  # k_up folded into the query
    q_cat = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1) * softmax_scale(config)
    new = latent_rows(w, config, x, cos_sin)
    out_latent = attend_latent(q_cat, cache, new, masks)[..., : m.kv_lora_rank]
    out = jnp.einsum("btnl,lnv->btnv", out_latent, w.v_up)  # v_up applied after attention
    B, T, N, V = out.shape
    # A flattened N*V contraction, as in transformer.attention_block (an einsum over (n, v)
    # made XLA:CPU transpose the o weight on every call).
    return jnp.einsum("bte,ed->btd", out.reshape(B, T, N * V), w.o.reshape(N * V, -1)), new
