"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer and its top-k selection.

Per layer, a small indexer scores every visible token s for each query t,

    score[t, s] = sum_i w[t, i] * I^-1/2 * relu(J^-1/2 * q[t, i] . k[s])

with I index heads of width J: queries ``q_b`` applied to the q LoRA latent (the normed
``q_a`` output the main attention also uses), one key per token (``k`` then a LayerNorm with
bias, cached beside the latent row), and per-head weights ``w`` = hidden @ ``head_weights``.
The first R (= rope dim) dims of queries and keys are rotated with the half-split pairs of
``apply_rope``, not the interleaved pairs of the main attention (as HF's ``DeepseekV32Indexer``;
DeepSeek's reference adds a Hadamard rotation and FP8 scoring, an orthogonal map and a precision
choice that HF, and so dayzero, leave out). GLM-5's indexer (``DSAConfig.rope_interleave``)
rotates interleaved pairs instead, as HF's ``GlmMoeDsaIndexer``: its rope dims are deinterleaved
first (queries and keys alike, so the scores are those of the interleaved rotation). The ``topk``
best visible tokens per query are what latent attention then reads (``dayzero.model.mla``).

This module only chooses tokens; it knows nothing of the latent rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dayzero.model.config import ModelConfig
from dayzero.model.norm import layer_norm
from dayzero.model.quant import dequantized
from dayzero.model.rope import apply_rope, deinterleave
from dayzero.model.weights import IndexerWeights

# HF builds the indexer's k_norm as nn.LayerNorm(index_head_dim, eps=1e-6), whatever rms_norm_eps is.
K_NORM_EPS = 1e-6


def _rope(x: jax.Array, config: ModelConfig, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate the first R dims of ``x`` [B,T,heads,J] (tables of rope_dim), from interleaved
    pairs when the indexer uses them (GLM-5)."""
    if config.dsa.rope_interleave:
        R = config.mla.rope_dim
        x = jnp.concatenate([deinterleave(x[..., :R]), x[..., R:]], axis=-1)
    return apply_rope(x, *cos_sin)


def index_keys(w: IndexerWeights, config: ModelConfig, x: jax.Array,
               cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """The indexer key of each token of ``x`` [B,T,D] -> [B,T,J], as the cache stores it."""
    k = layer_norm(x @ w.k, w.k_norm, w.k_norm_bias, K_NORM_EPS)
    return _rope(k[:, :, None], config, cos_sin)[:, :, 0]


def index_scores(w: IndexerWeights, config: ModelConfig, x: jax.Array, q_latent: jax.Array,
                 cos_sin: tuple[jax.Array, jax.Array], keys: jax.Array) -> jax.Array:
    """fp32 scores [B,T,S] of the queries of ``x`` [B,T,D] (q LoRA latent ``q_latent`` [B,T,Q])
    against ``keys`` [B,S,J]; no mask applied."""
    I, J = config.dsa.heads, config.dsa.head_dim
    q = _rope(jnp.einsum("btq,qij->btij", q_latent, w.q_b), config, cos_sin)
    B, T = q.shape[:2]
    # Queries flattened to [B, T*I, J] (a free reshape) make the key product one plain batched
    # matmul: the 4-D einsum ran ~3x slower on XLA:CPU over a 64k-token key cache.
    per_head = jnp.einsum("bmj,bsj->bms", q.reshape(B, T * I, J), dequantized(keys, q.dtype),
                          preferred_element_type=jnp.float32)
    per_head = jax.nn.relu(per_head * J**-0.5).reshape(B, T, I, -1)
    weights = jnp.einsum("btd,di->bti", x, w.head_weights, preferred_element_type=jnp.float32) * I**-0.5
    return jnp.einsum("bti,btis->bts", weights, per_head)


def select(w: IndexerWeights, config: ModelConfig, x: jax.Array, q_latent: jax.Array,
           cos_sin: tuple[jax.Array, jax.Array], key_cache: jax.Array | None, new_keys: jax.Array,
           masks: tuple[jax.Array | None, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Each query's top-k tokens among the cached ones then the new ones.

    ``key_cache`` [B,S,J] (None: nothing cached), ``new_keys`` [B,T,J] and ``masks`` as
    ``transformer.attention_masks`` makes them. Returns indices [B,T,k] into the S cached then T
    new positions, k = min(topk, S+T), and whether each is visible [B,T,k]: with fewer than k
    visible tokens, every visible one is chosen and the remaining picks are masked ones (HF's
    ``topk`` over masked scores does the same, and its attention mask then drops them).
    """
    mask_cached, mask_new = masks
    scores = index_scores(w, config, x, q_latent, cos_sin, new_keys)
    mask = mask_new
    if key_cache is not None:
        cached = index_scores(w, config, x, q_latent, cos_sin, key_cache)
        scores = jnp.concatenate([cached, scores], axis=-1)
        mask = jnp.concatenate([mask_cached, mask_new], axis=-1)
    scores = jnp.where(mask, scores, -jnp.inf)
    k = min(config.dsa.topk, scores.shape[-1])
    _, indices = jax.lax.top_k(scores, k)
    return indices, jnp.take_along_axis(mask, indices, axis=-1)


def selection_masks(indices: jax.Array, visible: jax.Array, masks: tuple[jax.Array | None, jax.Array]
                    ) -> tuple[jax.Array | None, jax.Array]:
    """``masks`` narrowed to the selected tokens: the dense form of the selection, for calls
    where scanning every key costs less than gathering k rows per query (see ``mla.mla_block``)."""
    mask_cached, mask_new = masks
    B, T, _ = indices.shape
    S = 0 if mask_cached is None else mask_cached.shape[-1]
    chosen = jnp.zeros((B, T, S + T), bool)
    chosen = chosen.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], indices].set(visible)
    if mask_cached is None:
        return None, mask_new & chosen
    return mask_cached & chosen[..., :S], mask_new & chosen[..., S:]
