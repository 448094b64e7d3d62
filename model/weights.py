"""The weight pytree, declared once abstractly.

``abstract_weights(config)`` returns the tree with a :class:`ParamSpec` at every leaf (shape,
logical axes, initializer). Everything else is derived from it: random init, the
``jax.ShapeDtypeStruct`` restore target, the shardings and the converter's shape checks.

``abstract_weights(config, quant)`` puts a :class:`~dayzero.model.quant.QuantizedArray` of two
specs (stored values, float32 scale) in place of each projection the scheme quantizes, so the
same derivations cover quantized checkpoints. On a mesh, ``mesh_aligned_specs`` and
``aligned_weights`` give block-scaled leaves scales that split with their values.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dayzero.model.config import ModelConfig
from dayzero.model.quant import (
    INT4_ALL_GROUP, INT4_GROUP, MXFP4_BLOCK, QuantConfig, QuantError, QuantizedArray, ValueFormat, WeightQuant,
    quantize, reblocked, scale_shape,
)


class Init(enum.Enum):
    """How a parameter is initialised for random (test) models."""

    NORMAL = "normal"
    ONES = "ones"
    ZEROS = "zeros"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Abstract parameter: shape, logical axis names (one per dim) and initializer.

    ``dtype``: the stored dtype when fixed (quantized values, scales); None means the model's
    dtype, chosen at load. ``in_axes``: for a projection weight that weight quantization applies
    to, the axes contracted with the activation (one scale per output channel); None for every
    other tensor (norms, biases, router, indexer, embedding, output head).

    Deliberately not a pytree node, so ``jax.tree.map`` treats it as a leaf.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Init = Init.NORMAL
    dtype: Any = None
    in_axes: tuple[int, ...] | None = None

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


@struct.dataclass
class AttentionWeights:
    """Projections in head-split form: q [D,N,H], k/v [D,K,H], o [N,H,D]."""

    q: Any
    k: Any
    v: Any
    o: Any
    q_bias: Any = None  # [N,H]
    k_bias: Any = None  # [K,H]
    v_bias: Any = None  # [K,H]
    o_bias: Any = None  # [D]
    q_norm: Any = None  # [H] (Qwen3), or [N,H] with qk_norm_all_heads (MiniMax-M2)
    k_norm: Any = None  # [H] (Qwen3), or [K,H] with qk_norm_all_heads (MiniMax-M2)
    sinks: Any = None  # [N] float32, one logit per query head in the softmax's denominator (gpt-oss)
    gate: Any = None  # [D,N,H] the output gate's projection (attn_output_gate, Qwen3-Next)


@struct.dataclass
class IndexerWeights:
    """DeepSeek-V3.2's lightning indexer (see ``DSAConfig``), I = index heads, J = index head dim.

    ``q_b`` [Q,I,J] reads the q LoRA latent; ``k`` [D,J] then LayerNorm (``k_norm``, ``k_norm_bias``
    [J]) makes the one cached key per token; ``head_weights`` [D,I] weighs each head's score.
    """

    q_b: Any
    k: Any
    k_norm: Any
    k_norm_bias: Any
    head_weights: Any


@struct.dataclass
class MLAWeights:
    """Multi-head latent attention (see ``MLAConfig``), Q = q_lora_rank, L = kv_lora_rank, P = nope dim.

    q: ``q_a`` [D,Q] -> ``q_a_norm`` [Q] -> ``q_b`` [Q,N,P+R], or ``q`` [D,N,P+R] without a q LoRA.
    kv: ``kv_a`` [D,L+R] (latent, then the shared rope key) -> ``kv_a_norm`` [L] on the latent;
    ``k_up`` [L,N,P] and ``v_up`` [L,N,V] are HF's ``kv_b_proj`` split per head, kept apart because
    the absorbed form folds ``k_up`` into the query and applies ``v_up`` after attention.
    """

    kv_a: Any
    kv_a_norm: Any
    k_up: Any
    v_up: Any
    o: Any  # [N,V,D]
    q: Any = None
    q_a: Any = None
    q_a_norm: Any = None
    q_b: Any = None
    indexer: IndexerWeights | None = None  # sparse attention only, and not on GLM-5's shared layers


@struct.dataclass
class MLPWeights:
    """SwiGLU MLP: gate/up [D,F], down [F,D]."""

    gate: Any
    up: Any
    down: Any


@struct.dataclass
class MoEWeights:
    """Mixture-of-Experts block: router [D,E]; experts stacked expert-major, gate/up [E,D,F], down [E,F,D]."""

    router: Any
    gate: Any
    up: Any
    down: Any
    score_bias: Any = None  # [E], added to the scores for the choice only (DeepSeek-V3)
    shared: MLPWeights | None = None  # always-on experts as one SwiGLU [D, S*F] (DeepSeek-V3)
    router_bias: Any = None  # [E], added to the router logits: choice and weights (gpt-oss)
    gate_bias: Any = None  # [E,F] (gpt-oss's expert biases, with up_bias and down_bias)
    up_bias: Any = None  # [E,F]
    down_bias: Any = None  # [E,D]
    tid2eid: Any = None  # [V,C] int32: each token id's experts on a hash-routed layer (DeepSeek-V4)
    shared_gate: Any = None  # [D]: the shared expert's output times sigmoid(x . shared_gate) (Qwen3-Next)


@struct.dataclass
class LayerWeights:
    """One decoder layer: pre-norm attention then a pre-norm dense MLP or MoE block; with
    hyper-connections, the mixes around each (``attn_hc``, ``mlp_hc``)."""

    attn_norm: Any
    # AttentionWeights | MLAWeights | compressed_weights.CompressedAttnWeights | linear_weights.LinearAttnWeights
    attn: Any
    mlp_norm: Any
    mlp: MLPWeights | MoEWeights
    attn_hc: Any = None  # compressed_weights.HyperWeights (hyper-connections)
    mlp_hc: Any = None


@struct.dataclass
class Weights:
    """The whole model. ``lm_head`` is None when the output projection is tied to ``embed``."""

    embed: Any  # [V,D]
    layers: tuple[LayerWeights, ...]
    final_norm: Any  # [D]
    lm_head: Any = None  # [D,V]
    hc_head: Any = None  # compressed_weights.HyperWeights: the streams' collapse before final_norm
    # The MTP modules (config.mtp_layers of them): DeepSeek-V4's (compressed_weights.MTPWeights),
    # loaded and kept, not run; DeepSeek-V3's (mtp.NextNWeights) where the checkpoint has them
    # (config.mtp_kept), run by the MTP drafter. None otherwise: the converter skips the tensors.
    mtp: Any = None
    vision: Any = None  # vision_weights.VisionWeights: the vision tower (config.vision), else None


IN0 = (0,)  # a projection whose first axis is its input: one scale per the other axes


def _attention_specs(c: ModelConfig) -> AttentionWeights:
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    bias = lambda *shape_axes: ParamSpec(*shape_axes, init=Init.ZEROS)  # noqa: E731
    return AttentionWeights(
        q=ParamSpec((D, N, H), ("embed", "q_heads", "head_dim"), in_axes=IN0),
        k=ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), in_axes=IN0),
        v=ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), in_axes=IN0),
        o=ParamSpec((N, H, D), ("q_heads", "head_dim", "embed"), in_axes=(0, 1)),
        q_bias=bias((N, H), ("q_heads", "head_dim")) if c.qkv_bias else None,
        k_bias=bias((K, H), ("kv_heads", "head_dim")) if c.qkv_bias else None,
        v_bias=bias((K, H), ("kv_heads", "head_dim")) if c.qkv_bias else None,
        o_bias=bias((D,), ("embed",)) if c.o_bias else None,
        q_norm=_qk_norm_spec(c, N, "q_heads"),
        k_norm=_qk_norm_spec(c, K, "kv_heads"),
        # float32 whatever the model's dtype (the kernels take them so), split with the heads.
        sinks=ParamSpec((N,), ("q_heads",), dtype=jnp.dtype(jnp.float32)) if c.attention_sinks else None,
        gate=ParamSpec((D, N, H), ("embed", "q_heads", "head_dim"), in_axes=IN0) if c.attn_output_gate else None,
    )


def _qk_norm_spec(c: ModelConfig, heads: int, axis: str) -> ParamSpec | None:
    """A q or k norm weight: [H] shared by the heads (Qwen3), or [heads,H] over all heads together
    (MiniMax-M2), split across devices like the heads it scales."""
    if not c.qk_norm:
        return None
    init = norm_init(c)
    if c.qk_norm_all_heads:
        return ParamSpec((heads, c.head_dim), (axis, "head_dim"), init)
    return ParamSpec((c.head_dim,), ("head_dim",), init)


def norm_init(c: ModelConfig) -> Init:
    """How the decoder's RMSNorm weights start: zeros where they are stored zero-centred
    (``norm_weight_offset`` 1: the scale is 1 + w), ones otherwise."""
    return Init.ZEROS if c.norm_weight_offset == 1.0 else Init.ONES


def _mla_specs(c: ModelConfig, i: int) -> MLAWeights:
    m, D, N = c.mla, c.hidden_size, c.num_heads
    Q, L, P, R, V = m.q_lora_rank, m.kv_lora_rank, m.nope_dim, m.rope_dim, m.v_head_dim
    lora = Q is not None
    return MLAWeights(
        kv_a=ParamSpec((D, L + R), ("embed", None), in_axes=IN0),
        kv_a_norm=ParamSpec((L,), ("latent",), Init.ONES),
        # k_up/v_up come from HF's kv_b_proj [N*(P+V), L]: L is its input, whatever the einsum.
        k_up=ParamSpec((L, N, P), ("latent", "q_heads", "head_dim"), in_axes=IN0),
        v_up=ParamSpec((L, N, V), ("latent", "q_heads", "head_dim"), in_axes=IN0),
        o=ParamSpec((N, V, D), ("q_heads", "head_dim", "embed"), in_axes=(0, 1)),
        q=None if lora else ParamSpec((D, N, P + R), ("embed", "q_heads", "head_dim"), in_axes=IN0),
        q_a=ParamSpec((D, Q), ("embed", None), in_axes=IN0) if lora else None,
        q_a_norm=ParamSpec((Q,), (None,), Init.ONES) if lora else None,
        q_b=ParamSpec((Q, N, P + R), (None, "q_heads", "head_dim"), in_axes=IN0) if lora else None,
        # GLM-5's shared layers have no indexer: they reuse the last full layer's picks.
        indexer=_indexer_specs(c) if c.dsa is not None and c.dsa.runs_indexer(i) else None,
    )


def _indexer_specs(c: ModelConfig) -> IndexerWeights:
    D, Q, I, J = c.hidden_size, c.mla.q_lora_rank, c.dsa.heads, c.dsa.head_dim
    # Index heads are replicated: each query's top-k needs the sum over all of them.
    return IndexerWeights(
        q_b=ParamSpec((Q, I, J), (None, None, None)),
        k=ParamSpec((D, J), ("embed", None)),
        k_norm=ParamSpec((J,), (None,), Init.ONES),
        k_norm_bias=ParamSpec((J,), (None,), Init.ZEROS),
        head_weights=ParamSpec((D, I), ("embed", None)),
    )


def _mlp_specs(c: ModelConfig, F: int) -> MLPWeights:
    D = c.hidden_size
    return MLPWeights(
        gate=ParamSpec((D, F), ("embed", "ffw"), in_axes=IN0),
        up=ParamSpec((D, F), ("embed", "ffw"), in_axes=IN0),
        down=ParamSpec((F, D), ("ffw", "embed"), in_axes=IN0),
    )


def _moe_specs(c: ModelConfig, i: int) -> MoEWeights:
    D, E, F = c.hidden_size, c.moe.num_experts, c.moe.intermediate_size
    shared, biased = c.moe.shared_width, c.moe.expert_bias
    hashed = bool(c.moe.hash_layers) and c.moe.hash_layers[i]
    return MoEWeights(
        # The router's expert axis is left unsharded: every token needs all E scores for its top-k.
        router=ParamSpec((D, E), ("embed", None)),
        gate=ParamSpec((E, D, F), ("experts", "embed", "ffw"), in_axes=(1,)),
        up=ParamSpec((E, D, F), ("experts", "embed", "ffw"), in_axes=(1,)),
        down=ParamSpec((E, F, D), ("experts", "ffw", "embed"), in_axes=(1,)),
        # A hash-routed layer chooses by table, so it has no choice bias.
        score_bias=ParamSpec((E,), (None,), Init.ZEROS) if c.moe.score_bias and not hashed else None,
        shared=_mlp_specs(c, shared) if shared else None,
        shared_gate=ParamSpec((D,), ("embed",)) if c.moe.shared_gate else None,
        router_bias=ParamSpec((E,), (None,), Init.ZEROS) if c.moe.router_bias else None,
        gate_bias=ParamSpec((E, F), ("experts", "ffw"), Init.ZEROS) if biased else None,
        up_bias=ParamSpec((E, F), ("experts", "ffw"), Init.ZEROS) if biased else None,
        down_bias=ParamSpec((E, D), ("experts", "embed"), Init.ZEROS) if biased else None,
        # Whole on every device (3 MB for V4): any token may have any id, and a table split over
        # the vocabulary was all-gathered in every step (the expert-parallel dispatch reads it whole).
        tid2eid=ParamSpec((c.vocab_size, c.moe.experts_per_token), (None, None), Init.ZEROS,
                          jnp.dtype(jnp.int32)) if hashed else None,
    )


def _layer_specs(c: ModelConfig, i: int) -> LayerWeights:
    # The families' own attention and mixes are declared in their modules (imported here, as
    # they import this one for ParamSpec).
    D, hc = c.hidden_size, None
    if c.is_linear_layer(i):
        from dayzero.model.linear_weights import linear_attn_specs

        attn = linear_attn_specs(c)
    elif c.mla is not None:
        attn = _mla_specs(c, i)
    elif c.compressed is not None:
        from dayzero.model.compressed_weights import compressed_specs

        attn = compressed_specs(c, i)
    else:
        attn = _attention_specs(c)
    if c.hyper is not None:
        from dayzero.model.compressed_weights import block_hyper_specs

        hc = block_hyper_specs(c)
    return LayerWeights(
        attn_norm=ParamSpec((D,), ("embed",), norm_init(c)),
        attn=attn,
        mlp_norm=ParamSpec((D,), ("embed",), norm_init(c)),
        mlp=_moe_specs(c, i) if c.is_moe_layer(i) else _mlp_specs(c, c.intermediate_size),
        attn_hc=hc,
        mlp_hc=hc,
    )


def abstract_weights(config: ModelConfig, quant: QuantConfig | None = None) -> Weights:
    """The weight tree with a :class:`ParamSpec` at every leaf; with ``quant``, a
    :class:`QuantizedArray` of a values spec and a scale spec at each quantized projection."""
    from dayzero.model.compressed_weights import hyper_specs, mtp_specs
    from dayzero.model.hf_config_vision_kimi import KimiVisionConfig
    from dayzero.model.mtp import nextn_specs
    from dayzero.model.vision_kimi_weights import kimi_vision_specs
    from dayzero.model.vision_weights import vision_specs

    D, V = config.hidden_size, config.vocab_size
    specs = Weights(
        embed=ParamSpec((V, D), ("vocab", "embed")),
        layers=tuple(_layer_specs(config, i) for i in range(config.num_layers)),
        final_norm=ParamSpec((D,), ("embed",), norm_init(config)),
        lm_head=None if config.tie_word_embeddings else ParamSpec((D, V), ("embed", "vocab")),
        hc_head=None if config.hyper is None else hyper_specs(config, config.hyper.mult, 1),
        mtp=mtp_specs(config) or nextn_specs(config),
        vision=None if config.vision is None else
        (kimi_vision_specs if isinstance(config.vision, KimiVisionConfig) else vision_specs)(config.vision),
    )
    if quant is None or quant.weights is WeightQuant.NONE:
        return specs
    # The vision tower stays float under every scheme (as vLLM and llama.cpp keep it): it runs once
    # per image, and int8 moved a tiny random tower's output by 1.2%, fp8 by 5%.
    text = map_specs(lambda s: _quantized_spec(s, quant), specs.replace(vision=None))
    return text.replace(vision=specs.vision)


def _leaf_scheme(spec: ParamSpec, quant: QuantConfig) -> tuple[ValueFormat, tuple[int, int] | None] | None:
    """(stored format, block or None for per-channel) of one quantized projection; None where the
    scheme leaves it float (mxfp4 outside the routed experts)."""
    scheme = quant.weights
    if scheme is WeightQuant.INT4:
        # int4 only for routed experts (most of an MoE's bytes, and each token reads few of
        # them); per-channel int4 is too coarse, hence groups of inputs per output channel.
        return (ValueFormat.INT4, (INT4_GROUP, 1)) if spec.axes[0] == "experts" else (ValueFormat.INT8, None)
    if scheme is WeightQuant.INT4_ALL:
        return ValueFormat.INT4, (INT4_ALL_GROUP, 1)
    if scheme in (WeightQuant.MXFP4, WeightQuant.MXFP4_FP8_BLOCK):
        # gpt-oss's published format: routed experts only, everything else stays float;
        # DeepSeek-V4's: the other projections in fp8 blocks.
        rest = (ValueFormat.FP8, tuple(quant.block)) if scheme is WeightQuant.MXFP4_FP8_BLOCK else None
        return (ValueFormat.MXFP4, MXFP4_BLOCK) if spec.axes[0] == "experts" else rest
    if scheme is WeightQuant.FP8_BLOCK:
        return ValueFormat.FP8, tuple(quant.block)
    return (ValueFormat.INT8 if scheme is WeightQuant.INT8 else ValueFormat.FP8), None


def _quantized_spec(spec: ParamSpec, quant: QuantConfig) -> ParamSpec | QuantizedArray:
    scheme = None if spec.in_axes is None else _leaf_scheme(spec, quant)
    if scheme is None:
        return spec
    fmt, block = scheme
    if block is None:
        scale_axes = tuple(None if i in spec.in_axes else a for i, a in enumerate(spec.axes))
    else:  # block scales are tiny (one per block); only their batch (expert) axes are split
        scale_axes = spec.axes[: spec.in_axes[0]] + (None, None)
    return QuantizedArray(
        values=dataclasses.replace(spec, dtype=fmt.dtype),
        scale=ParamSpec(scale_shape(spec.shape, spec.in_axes, block), scale_axes, Init.ONES, fmt.scale_dtype),
        fmt=fmt, in_axes=spec.in_axes, block=block,
    )


def is_spec_node(x: Any) -> bool:
    """``is_leaf`` predicate stopping at a :class:`ParamSpec` or a quantized spec node."""
    return isinstance(x, (ParamSpec, QuantizedArray))


def float_specs(specs: Any) -> Any:
    """The spec tree with each quantized node replaced by the float spec it quantizes."""
    def one(s):
        return dataclasses.replace(s.values, dtype=None) if isinstance(s, QuantizedArray) else s
    return jax.tree.map(one, specs, is_leaf=is_spec_node)


_quantize = jax.jit(quantize, static_argnums=(1, 2, 3))


def quantize_weights(weights: Any, specs: Any) -> Any:
    """``weights`` with each float leaf quantized where ``specs`` (``abstract_weights(config,
    quant)``) has a quantized node; leaves already quantized are kept."""
    def one(spec, w):
        if isinstance(spec, QuantizedArray) and not isinstance(w, QuantizedArray):
            return _quantize(w, spec.fmt, spec.in_axes, spec.block)
        return w
    return jax.tree.map(one, specs, weights, is_leaf=is_spec_node)


def is_spec(x: Any) -> bool:
    """``is_leaf`` predicate for trees of :class:`ParamSpec`."""
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
    """``jax.tree.map`` over a spec tree, treating each :class:`ParamSpec` as a leaf."""
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def leaf_path(key_path: tuple) -> str:
    """A stable, human-readable name for a leaf, e.g. ``layers/3/attn/q``."""
    parts = []
    for key in key_path:
        if isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)


def named_leaves(tree: Any) -> dict[str, Any]:
    """``{leaf_path: leaf}`` for a weight tree (values or specs)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    return {leaf_path(path): leaf for path, leaf in flat}


def shape_structs(specs: Any, dtype: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` leaves (with shardings if given), e.g. as an Orbax restore target.

    ``dtype`` is for the leaves whose spec leaves it open; quantized values and scales keep theirs.
    """
    if shardings is None:
        return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype or dtype), specs)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype or dtype, sharding=sh), specs, shardings, is_leaf=is_spec
    )


def init_weights(specs: Any, key: jax.Array, dtype: Any = jnp.float32, scale: float = 0.02) -> Any:
    """Random weights for tests and benchmarks: N(0, scale) matrices, ones for norms, zero biases
    (drawn in float, then quantized where ``specs`` has quantized nodes); ``dtype`` for the
    leaves whose spec leaves it open."""
    quantized = specs
    specs = float_specs(specs)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(spec: ParamSpec, k: jax.Array) -> jax.Array:
        leaf_dtype = spec.dtype or dtype  # a fixed dtype (attention sinks) wins
        if spec.init is Init.ONES:
            return jnp.ones(spec.shape, leaf_dtype)
        if spec.init is Init.ZEROS:
            return jnp.zeros(spec.shape, leaf_dtype)
        return (scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(leaf_dtype)

    return quantize_weights(jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)]), quantized)


def parameter_count(specs: Any) -> int:
    """Total number of parameters in a spec tree (a quantized one counts its float parameters)."""
    return int(sum(np.prod(s.shape) for s in jax.tree.leaves(float_specs(specs), is_leaf=is_spec)))


# ---- quantized weights on a mesh ----------------------------------------------------------------
#
# A channel-layout scale (one per output channel) carries its values' logical axes except on the
# contracted ones, where it has size 1 (``_quantized_spec``): it is split exactly like its values
# on any mesh. A block-layout scale [*batch, ceil(In/bi), ceil(Out/bo)] is declared with its batch
# (expert) axes only, i.e. whole on every device: right under GSPMD whatever the mesh, but each
# device then holds every block's scale, and inside a ``shard_map`` (the expert-parallel MoE) the
# local values would be read with the scales of the first blocks. ``mesh_aligned_specs`` splits
# the scale with its values instead, re-blocking (exactly, ``quant.reblocked``) where a value shard
# would start inside a block.

AxisSizes = Mapping[str, int] | Callable[[str], int]


def axis_sizes(placement: Any) -> dict[str, int]:
    """How many ways ``placement`` (a ``dayzero.sharding.placement.Placement``; None: one device)
    splits each logical axis: the ``sizes`` of :func:`mesh_aligned_specs`."""
    from dayzero.sharding.rules import LOGICAL_AXES

    if placement is None:
        return {}
    mesh_axes = {a: placement.rules.mesh_axis(a) for a in LOGICAL_AXES}
    return {a: int(placement.axes.get(m, 1)) if m is not None else 1 for a, m in mesh_axes.items()}


def _ways(sizes: AxisSizes) -> Callable[[str | None], int]:
    get = sizes if callable(sizes) else (lambda a: sizes.get(a, 1))
    return lambda a: 1 if a is None else int(get(a))


def _dim_split(n: int, ways: int) -> int:
    # As dayzero.sharding.rules.spec_for: a dimension its mesh axis does not divide stays whole.
    return ways if ways > 1 and n % ways == 0 else 1


def aligned_block(shape: tuple[int, ...], axes: tuple[str | None, ...], in_axes: tuple[int, ...],
                  block: tuple[int, int], sizes: AxisSizes) -> tuple[tuple[int, int], tuple[str | None, str | None]]:
    """The block, and the logical axes of the scale's (In, Out) dimensions, that split a
    block-layout weight's scale with its values when ``sizes`` (logical axis -> ways split) lay it
    out; (``block``, (None, None)) where nothing is split.

    Per group (In, then Out) of the matrix view [*batch, In, Out]: when its major-most axis alone is
    split t ways, block b becomes b' = gcd(b, n / t) (n: the flattened group size, n / t: one
    shard's width) and the scale dimension takes that axis's name. Alignment: the shard s holds
    the contiguous columns [s n/t, (s+1) n/t) of the flattened group (only its major axis is cut);
    b' divides n/t and so n, so the re-blocked scale has exactly n / b' = t (n/t) / b' entries
    (no partial block is left), which the same t-way split of the scale dimension hands out as
    [s (n/t)/b', (s+1) (n/t)/b'): exactly the fine blocks covering shard s's columns. b' divides b,
    so ``quant.reblocked`` gives those fine blocks their coarse block's scale exactly, partial
    coarse blocks included (e.g. n = 576 = 4.5 x 128 over t = 4: shards of 144, b' = 16, the
    partial block [512, 576) becomes 4 whole fine ones). The scale dimension n / b' is a multiple
    of t, so ``spec_for`` splits it over the same mesh axis as the values.

    When a minor axis of a group is split, a shard's columns are strided in the flattened group and
    no split of the scale dimension matches them: the scale stays whole (correct under GSPMD, which
    is the only place such a leaf is split).
    """
    ways = _ways(sizes)
    first, last = in_axes[0], in_axes[-1]
    blocks, scale_axes = [], []
    for dims, b in zip((range(first, last + 1), range(last + 1, len(shape))), block):
        splits = [_dim_split(shape[d], ways(axes[d])) for d in dims]
        if not splits or splits[0] == 1 or any(t > 1 for t in splits[1:]):
            blocks.append(b)
            scale_axes.append(None)
            continue
        width = math.prod(shape[d] for d in dims) // splits[0]
        blocks.append(math.gcd(b, width))
        scale_axes.append(axes[dims[0]])
    return tuple(blocks), tuple(scale_axes)


def mesh_aligned_specs(specs: Any, sizes: AxisSizes) -> Any:
    """``specs`` (``abstract_weights(config, quant)``) for a mesh that splits each logical axis
    ``sizes`` ways (a mapping or a callable, e.g. :func:`axis_sizes` of a placement): each
    block-layout leaf gets the block and scale axes of :func:`aligned_block`, so that its scale
    splits with its values. Channel-layout and float leaves are returned as they are (a
    channel-layout scale already splits with its values). Idempotent; ``sizes`` of one device
    return ``specs`` unchanged."""
    def one(s):
        if not isinstance(s, QuantizedArray) or s.block is None:
            return s
        block, (in_axis, out_axis) = aligned_block(s.values.shape, s.values.axes, s.in_axes, s.block, sizes)
        batch = s.scale.axes[: len(s.scale.axes) - 2]
        scale = dataclasses.replace(s.scale, shape=scale_shape(s.values.shape, s.in_axes, block),
                                    axes=(*batch, in_axis, out_axis))
        return s.replace(scale=scale, block=block)
    return jax.tree.map(one, specs, is_leaf=is_spec_node)


def aligned_weights(weights: Any, specs: Any) -> Any:
    """``weights`` with each block-layout leaf re-blocked exactly (``quant.reblocked``, values
    unchanged) to its block in ``specs`` (from :func:`mesh_aligned_specs`); every other leaf is
    kept. Raises :class:`QuantError` naming the leaf where a stored block is not a multiple of the
    one ``specs`` ask for (the weights were quantized with another block than ``specs``)."""
    def one(path, spec, w):
        if not (isinstance(spec, QuantizedArray) and isinstance(w, QuantizedArray)) or spec.block == w.block:
            return w
        if spec.block is None or w.block is None:
            raise QuantError(f"{leaf_path(path)}: stored with block {w.block}, the specs ask for {spec.block}; "
                             "derive the specs from the checkpoint's own quantization")
        try:
            return reblocked(w, spec.block)
        except QuantError as e:
            raise QuantError(f"{leaf_path(path)}: {e}; derive the specs from the checkpoint's own quantization "
                             "(its QuantConfig block)") from None
    return jax.tree_util.tree_map_with_path(one, specs, weights, is_leaf=is_spec_node)
