"""DeepSeek-V4's weights beyond the common decoder's: the compressed attention (its compressors
and CSA indexer), the hyper-connection mixes and the multi-token-prediction modules, declared as
``dayzero.model.weights`` declares the rest (its ``_layer_specs`` and ``abstract_weights`` take
them from here when ``config.compressed`` / ``config.hyper`` / ``config.mtp_layers`` ask)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import struct

from dayzero.model.config import CompressKind, Family, ModelConfig
from dayzero.model.weights import IN0, Init, LayerWeights, ParamSpec, _layer_specs


@struct.dataclass
class CompressorWeights:
    """One DeepSeek-V4 compressor at width C (H for the attention's, J for the indexer's), m = 2 for
    CSA's overlapping windows (two series of C features per token) and 1 for HCA's.

    ``kv``/``gate`` [D, m*C] project each token; ``position_bias`` [r, m*C] (fp32) is added to the
    gate by slot in the window; an entry is the per-channel softmax(gate)-weighted sum of the
    window's kv rows, then RMSNorm'd with ``norm`` [C]."""

    kv: Any
    gate: Any
    position_bias: Any
    norm: Any


@struct.dataclass
class CompressedIndexerWeights:
    """DeepSeek-V4's CSA indexer: queries ``q_b`` [Q,I,J] from the q LoRA latent, per-head weights
    ``head_weights`` [D,I], and keys from its own compressor at width J."""

    q_b: Any
    head_weights: Any
    compressor: CompressorWeights


@struct.dataclass
class CompressedAttnWeights:
    """DeepSeek-V4 attention (see ``CompressedConfig``): ``q_a`` [D,Q] -> ``q_a_norm`` [Q] -> ``q_b``
    [Q,N,H]; one key=value row ``kv`` [D,H] -> ``kv_norm`` [H]; the grouped output ``o_a``
    [g, N*H/g, d_g] then ``o_b`` [g*d_g, D]; ``sinks`` [N] fp32. ``compressor`` on CSA/HCA layers,
    ``indexer`` on CSA layers only."""

    q_a: Any
    q_a_norm: Any
    q_b: Any
    kv: Any
    kv_norm: Any
    o_a: Any
    o_b: Any
    sinks: Any
    compressor: CompressorWeights | None = None
    indexer: CompressedIndexerWeights | None = None


@struct.dataclass
class HyperWeights:
    """One hyper-connection mix (``dayzero.model.hyper``), fp32, n = hc_mult streams of D: ``fn``
    [(2+n)n, nD] (a block's pre/post/comb) or [n, nD] (the final head's collapse), ``base`` of
    fn's first size, ``scale`` [3] (pre, post, comb) or [1]."""

    fn: Any
    base: Any
    scale: Any


@struct.dataclass
class MTPWeights:
    """One DeepSeek-V4 multi-token-prediction (next-n) module, kept for speculative decoding (the
    forward pass does not run it). As DeepSeek's ``MTPBlock``: the next token's embedding,
    RMSNorm'd by ``enorm`` [D] and projected by ``e_proj`` [D,D], is added to each residual stream
    of the main model's last hidden state, RMSNorm'd by ``hnorm`` [D] and projected by ``h_proj``
    [D,D] (both input-first); ``layer`` is one decoder block of the sliding kind with a top-k
    routed MoE (:func:`mtp_block_config`); its own ``hc_head`` collapses the streams and ``norm``
    [D] precedes the shared output head. Embedding and head are the main model's."""

    enorm: Any
    hnorm: Any
    e_proj: Any
    h_proj: Any
    layer: LayerWeights
    norm: Any
    hc_head: HyperWeights | None = None


def compressor_specs(c: ModelConfig, width: int, overlap: bool, ratio: int) -> CompressorWeights:
    D, m = c.hidden_size, 2 if overlap else 1
    return CompressorWeights(
        # Not quantized (in_axes None): the published checkpoints keep these in bf16 too.
        kv=ParamSpec((D, m * width), ("embed", None)),
        gate=ParamSpec((D, m * width), ("embed", None)),
        position_bias=ParamSpec((ratio, m * width), (None, None), dtype=jnp.dtype(jnp.float32)),
        norm=ParamSpec((width,), (None,), Init.ONES),
    )


def compressed_specs(c: ModelConfig, i: int) -> CompressedAttnWeights:
    cc, D, N, H = c.compressed, c.hidden_size, c.num_heads, c.head_dim
    Q, g, dg = cc.q_lora_rank, cc.o_groups, cc.o_lora_rank
    kind, ratio = cc.kinds[i], cc.ratio(i)
    csa = kind is CompressKind.CSA
    indexer = None
    if csa:  # index heads replicated, as DeepSeek-V3.2's: a query's top-k needs all of them
        I, J = cc.index_heads, cc.index_head_dim
        indexer = CompressedIndexerWeights(
            q_b=ParamSpec((Q, I, J), (None, None, None)),
            head_weights=ParamSpec((D, I), ("embed", None)),
            compressor=compressor_specs(c, J, True, ratio),
        )
    return CompressedAttnWeights(
        q_a=ParamSpec((D, Q), ("embed", None), in_axes=IN0),
        q_a_norm=ParamSpec((Q,), (None,), Init.ONES),
        q_b=ParamSpec((Q, N, H), (None, "q_heads", "head_dim"), in_axes=IN0),
        # The one key=value head is replicated (as MQA's single kv head).
        kv=ParamSpec((D, H), ("embed", None), in_axes=IN0),
        kv_norm=ParamSpec((H,), (None,), Init.ONES),
        # Groups are whole sets of heads, so they split with the heads.
        o_a=ParamSpec((g, N * H // g, dg), ("q_heads", None, None), in_axes=(1,)),
        o_b=ParamSpec((g * dg, D), ("q_heads", "embed"), in_axes=IN0),
        sinks=ParamSpec((N,), ("q_heads",), dtype=jnp.dtype(jnp.float32)),
        compressor=None if ratio is None else compressor_specs(c, H, csa, ratio),
        indexer=indexer,
    )


def hyper_specs(c: ModelConfig, outputs: int, scales: int) -> HyperWeights:
    n, f32 = c.hyper.mult, jnp.dtype(jnp.float32)
    # fp32 whatever the model's dtype, as HF keeps them: the Sinkhorn iterations need it.
    return HyperWeights(
        fn=ParamSpec((outputs, n * c.hidden_size), (None, None), dtype=f32),
        base=ParamSpec((outputs,), (None,), Init.ZEROS, dtype=f32),
        scale=ParamSpec((scales,), (None,), Init.ONES, dtype=f32),
    )


def block_hyper_specs(c: ModelConfig) -> HyperWeights | None:
    return None if c.hyper is None else hyper_specs(c, (2 + c.hyper.mult) * c.hyper.mult, 3)


def mtp_block_config(config: ModelConfig) -> ModelConfig:
    """The one-layer config whose layer 0 is a DeepSeek-V4 MTP module's decoder block: attention
    of the sliding kind (DeepSeek's ``compress_ratios`` entry 0 for it) and a MoE block routed by
    top-k with a score bias, never by the token table (DeepSeek's ``Gate`` hashes only layers
    below ``num_hash_layers``, and an MTP block's index is past every layer). The block's specs
    and name map come from this config, through the same builders as the main layers'."""
    if config.family is not Family.DEEPSEEK_V4:
        raise ValueError(f"MTP modules are kept for DeepSeek-V4 only, not {config.family.value}")
    moe = dataclasses.replace(config.moe, layers=(True,), hash_layers=(False,) if config.moe.hash_layers else ())
    compressed = dataclasses.replace(config.compressed, kinds=(CompressKind.SLIDING,))
    return dataclasses.replace(config, num_layers=1, sliding_windows=(config.compressed.window,), moe=moe,
                               compressed=compressed, mtp_layers=0)


def mtp_specs(c: ModelConfig) -> tuple[MTPWeights, ...] | None:
    if c.family is not Family.DEEPSEEK_V4 or not c.mtp_layers:
        return None
    D, block = c.hidden_size, mtp_block_config(c)
    norm = ParamSpec((D,), ("embed",), Init.ONES)
    # e_proj / h_proj are projections like q_a (published in FP8): input-first, quantizable.
    proj = ParamSpec((D, D), ("embed", None), in_axes=IN0)
    one = MTPWeights(enorm=norm, hnorm=norm, e_proj=proj, h_proj=proj, layer=_layer_specs(block, 0), norm=norm,
                     hc_head=hyper_specs(c, c.hyper.mult, 1))
    return (one,) * c.mtp_layers
