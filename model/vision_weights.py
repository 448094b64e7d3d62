"""The Qwen3-VL / Qwen3.5 vision tower's weights (:class:`~dayzero.model.hf_config_vision.VisionConfig`),
declared once abstractly as ``dayzero.model.weights`` declares the text model's.

Letters: Dv the tower's width, F its MLP width, N heads of H, U = M*M*Dv a merged patch (M the
spatial merge size), Dt ``out_hidden_size`` (the text model's width), Q = C*T*P*P a flattened
patch, G the learned position grid's size (``num_position_embeddings``).

- ``patch`` [Q,Dv] and ``patch_bias`` [Dv]: HF's Conv3d (kernel = stride = the patch) as the
  matmul it is over the flattened patch, whose order (C, T, P, P) is the conv weight's.
- ``pos_embed`` [G,Dv]: the learned square position grid.
- each block: LayerNorm ``norm1`` / ``norm1_bias`` [Dv]; attention as the text model's
  :class:`~dayzero.model.weights.AttentionWeights` (q/k/v [Dv,N,H] with biases [N,H], o [N,H,Dv]
  with o_bias [Dv]; HF's fused ``qkv`` split); LayerNorm ``norm2``; MLP ``fc1`` [Dv,F] ->
  activation -> ``fc2`` [F,Dv], with biases.
- ``merger``: LayerNorm [Dv] on each patch, then M*M patches side by side, ``fc1`` [U,U] -> GELU
  -> ``fc2`` [U,Dt]. ``deepstack``: one merger per DeepStack block whose LayerNorm is over the
  merged U instead (HF's ``use_postshuffle_norm``).

Logical axes: the tower's width as ``embed``, heads over ``q_heads``/``head_dim``, the MLP and
the mergers' hidden width over ``ffw``: the text model's names, so one rules table shards both
(a merged patch's U and the patch Q stay unnamed, i.e. whole). Projections declare ``in_axes``
as the text model's do, so a weight-quantization scheme can cover them; the forward reads every
weight through ``dayzero.model.quant.dequantized``.
"""

from __future__ import annotations

from typing import Any

from flax import struct

from dayzero.model.hf_config_vision import VisionConfig
from dayzero.model.weights import IN0, AttentionWeights, Init, ParamSpec


@struct.dataclass
class VisionMLPWeights:
    """Two biased projections around an activation: fc1 [In,F], fc2 [F,Out]."""

    fc1: Any
    fc1_bias: Any
    fc2: Any
    fc2_bias: Any


@struct.dataclass
class MergerWeights:
    """A patch merger: LayerNorm (``norm``, ``norm_bias``: [Dv], or [U] after the shuffle) and its MLP."""

    norm: Any
    norm_bias: Any
    mlp: VisionMLPWeights


@struct.dataclass
class VisionBlockWeights:
    """One pre-norm transformer block of the tower."""

    norm1: Any
    norm1_bias: Any
    attn: AttentionWeights
    norm2: Any
    norm2_bias: Any
    mlp: VisionMLPWeights


@struct.dataclass
class VisionWeights:
    """The whole tower (module docstring); ``deepstack`` is empty for Qwen3.5."""

    patch: Any
    patch_bias: Any
    pos_embed: Any
    blocks: tuple[VisionBlockWeights, ...]
    merger: MergerWeights
    deepstack: tuple[MergerWeights, ...] = ()


def norm_specs(n: int, axis: str | None) -> tuple[ParamSpec, ParamSpec]:
    """A LayerNorm's weight (ones) and bias (zeros) over ``n`` channels on logical ``axis``."""
    return ParamSpec((n,), (axis,), Init.ONES), ParamSpec((n,), (axis,), Init.ZEROS)


def _mlp_specs(n_in: int, f: int, n_out: int, in_axis: str | None, out_axis: str | None) -> VisionMLPWeights:
    return VisionMLPWeights(
        fc1=ParamSpec((n_in, f), (in_axis, "ffw"), in_axes=IN0),
        fc1_bias=ParamSpec((f,), ("ffw",), Init.ZEROS),
        fc2=ParamSpec((f, n_out), ("ffw", out_axis), in_axes=IN0),
        fc2_bias=ParamSpec((n_out,), (out_axis,), Init.ZEROS),
    )


def block_specs(vc: VisionConfig) -> VisionBlockWeights:
    """One encoder block of the tower declared (norms, biased q/k/v/o over heads, the MLP)."""
    D, N, H = vc.hidden_size, vc.num_heads, vc.head_dim
    heads = ("embed", "q_heads", "head_dim")
    norm1, norm1_bias = norm_specs(D, "embed")
    norm2, norm2_bias = norm_specs(D, "embed")
    bias = ParamSpec((N, H), ("q_heads", "head_dim"), Init.ZEROS)
    attn = AttentionWeights(
        q=ParamSpec((D, N, H), heads, in_axes=IN0), k=ParamSpec((D, N, H), heads, in_axes=IN0),
        v=ParamSpec((D, N, H), heads, in_axes=IN0),
        o=ParamSpec((N, H, D), ("q_heads", "head_dim", "embed"), in_axes=(0, 1)),
        q_bias=bias, k_bias=bias, v_bias=bias, o_bias=ParamSpec((D,), ("embed",), Init.ZEROS),
    )
    return VisionBlockWeights(norm1=norm1, norm1_bias=norm1_bias, attn=attn, norm2=norm2, norm2_bias=norm2_bias,
                              mlp=_mlp_specs(D, vc.intermediate_size, D, "embed", "embed"))


def merger_specs(vc: VisionConfig, post_shuffle: bool) -> MergerWeights:
    """A patch merger declared: its norm over the merged unit (``post_shuffle``) or over each
    patch, then the MLP to the text width."""
    U = vc.hidden_size * vc.merge_unit
    norm, norm_bias = norm_specs(U, None) if post_shuffle else norm_specs(vc.hidden_size, "embed")
    return MergerWeights(norm=norm, norm_bias=norm_bias, mlp=_mlp_specs(U, U, vc.out_hidden_size, None, "embed"))


def vision_specs(vc: VisionConfig) -> VisionWeights:
    """The :class:`ParamSpec` tree of the tower ``vc`` describes."""
    D = vc.hidden_size
    return VisionWeights(
        patch=ParamSpec((vc.patch_dim, D), (None, "embed")),
        patch_bias=ParamSpec((D,), ("embed",), Init.ZEROS),
        pos_embed=ParamSpec((vc.num_position_embeddings, D), (None, "embed")),
        blocks=tuple(block_specs(vc) for _ in range(vc.depth)),
        merger=merger_specs(vc, post_shuffle=False),
        deepstack=tuple(merger_specs(vc, post_shuffle=True) for _ in vc.deepstack_indexes),
    )
