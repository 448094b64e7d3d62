"""The multi-token-prediction (next-n) module of DeepSeek-V3, Kimi-K2 and GLM-4.5/4.6/4.7: its
weights and its forward pass.

The checkpoint stores ``num_nextn_predict_layers`` modules as layers ``num_hidden_layers`` and up
(``model.layers.61.*`` in the release). One module turns the main model's last hidden state at
position i and the token at i + 1 into a prediction of the token at i + 2:

    x   = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))      # [2D] -> [D], embedding first
    out = decoder_layer(x)                                         # attention + MoE, its own cache
    logits = head(shared_head.norm(out))

``h[i]`` is the main model's hidden state after its final norm (what HF's ``MtpModel`` takes as
``last_hidden_states``, and what vLLM's and sglang's MTP drafters are given); the embedding and
the head are the main model's (the release's ``embed_tokens`` / ``shared_head.head`` copies are
identical to them, and HF and sglang skip them too). The module's attention runs at the main
model's position i, in a one-layer cache of its own: entry i pairs t[i+1] with h[i]. (HF numbers
that entry i + 1 and vLLM i; RoPE sees only differences of positions, so both give the same.)
Chained drafting feeds ``out`` (before ``shared_head.norm``) back in as the next ``h``, as vLLM
does with a single module.

Weights: :class:`NextNWeights`, declared by :func:`nextn_specs` into ``Weights.mtp`` when the
converted checkpoint holds the modules (``ModelConfig.mtp_kept``; DeepSeek-V4's modules use the
same field with their own type, ``compressed_weights.MTPWeights``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model.config import Family, ModelConfig
from dayzero.model.norm import rms_norm
from dayzero.model.quant import dequantized
from dayzero.model.rope import rope_cos_sin
from dayzero.model.transformer import _additions, attention_masks, decoder_layer, output_logits, step_frame
from dayzero.model.weights import IN0, Init, LayerWeights, ParamSpec, Weights, _layer_specs

# The families whose MTP modules dayzero keeps and runs: those HF runs with its generic ``MtpModel``
# (the oracle). GLM-5 and MiniMax-M2 skip theirs (HF has no module for them); DeepSeek-V4's are its own.
MTP_FAMILIES = (Family.DEEPSEEK_V3, Family.KIMI_K2, Family.GLM4_MOE)


@struct.dataclass
class NextNWeights:
    """One MTP module: ``enorm`` / ``hnorm`` [D] (RMSNorm of the next token's embedding and of
    the main model's hidden state), ``eh_proj`` [2D, D] (input first: the embedding half, then
    the hidden half), one decoder ``layer`` (the main layers' attention, a MoE block) and
    ``norm`` [D] (``shared_head.norm``, before the main model's head)."""

    enorm: Any
    hnorm: Any
    eh_proj: Any
    layer: LayerWeights
    norm: Any


def nextn_block_config(config: ModelConfig) -> ModelConfig:
    """The one-layer config whose layer 0 is an MTP module's decoder layer: attention as the
    main layers', a MoE block (the module sits past ``first_k_dense_replace``, and
    HF's ``get_mtp_config`` sets it to 0 for the modules). Its specs, name map and cache come
    from this config, through the builders of the main layers."""
    if config.family not in MTP_FAMILIES:
        raise ValueError(f"MTP modules are run for {', '.join(f.value for f in MTP_FAMILIES)} only, "
                         f"not {config.family.value}")
    moe = None if config.moe is None else dataclasses.replace(config.moe, layers=(True,))
    return dataclasses.replace(config, num_layers=1, sliding_windows=(None,), moe=moe, mtp_layers=0,
                               mtp_kept=False)


def nextn_specs(c: ModelConfig) -> tuple[NextNWeights, ...] | None:
    """The specs of the kept MTP modules (None unless ``c.mtp_kept``)."""
    if not c.mtp_kept:
        return None
    D = c.hidden_size
    norm = ParamSpec((D,), ("embed",), Init.ONES)
    one = NextNWeights(enorm=norm, hnorm=norm, eh_proj=ParamSpec((2 * D, D), ("embed", None), in_axes=IN0),
                       layer=_layer_specs(nextn_block_config(c), 0), norm=norm)
    return (one,) * c.mtp_layers


def main_hidden(weights: Weights, config: ModelConfig, last_layer: jax.Array) -> jax.Array:
    """The main model's hidden state an MTP module reads: its last decoder layer's output
    (``forward(hidden_out=...)[-1]``) through the final norm."""
    return rms_norm(last_layer, weights.final_norm, config.rms_norm_eps, offset=config.norm_weight_offset)


def nextn_forward(w: NextNWeights, weights: Weights, config: ModelConfig, tokens: jax.Array, hidden: jax.Array,
                  cache=None, num_new: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """Run one MTP module over ``tokens`` [B,T] (t[i+1]) paired with ``hidden`` [B,T,D] (h[i],
    :func:`main_hidden`, or the module's own previous output when chaining), as the continuation
    of each row of its one-layer ``cache`` (a cache of :func:`nextn_block_config`; None: from
    scratch). ``num_new`` [B]: real entries per row (default all T).

    Returns the module's output [B,T,D] (before ``shared_head.norm``: :func:`nextn_logits`
    makes the logits) and what ``cache.append_to_cache`` writes."""
    block = nextn_block_config(config)
    B, T = tokens.shape
    num_new, starts, rope_len, max_len, positions = step_frame(B, T, cache, num_new)
    cos_sin = rope_cos_sin(config.rope, config.head_dim, config.max_position_embeddings, positions, rope_len)
    masks = attention_masks(starts, num_new, T, max_len, None)
    eps, offset = config.rms_norm_eps, config.norm_weight_offset
    embedded = rms_norm(jnp.take(weights.embed, tokens, axis=0), w.enorm, eps, offset=offset)
    normed = rms_norm(hidden.astype(embedded.dtype), w.hnorm, eps, offset=offset)
    both = jnp.concatenate([embedded, normed], axis=-1)
    x = jnp.einsum("btc,cd->btd", both, dequantized(w.eh_proj, both.dtype))
    layer_cache = None if cache is None else cache.layer(0, after=x)
    token_major = cache is not None and cache.keys_token_major  # a paged view's gathered keys
    x, added, _ = decoder_layer(w.layer, block, x, cos_sin, layer_cache, masks, keys_token_major=token_major,
                                tokens=tokens)
    return x, _additions(block, cache, [added], num_new, rope_len)


def nextn_logits(w: NextNWeights, weights: Weights, config: ModelConfig, out: jax.Array) -> jax.Array:
    """fp32 logits [B,T,V] of an MTP module's output ``out`` [B,T,D]: ``shared_head.norm`` then
    the main model's head."""
    return output_logits(weights, rms_norm(out, w.norm, config.rms_norm_eps, offset=config.norm_weight_offset))
