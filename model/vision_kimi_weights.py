"""Kimi-K2.5's vision tower and projector weights
(:class:`~dayzero.model.hf_config_vision_kimi.KimiVisionConfig`), declared once abstractly.

The blocks and the projector are the Qwen vision tower's building blocks
(``dayzero.model.vision_weights``), declared by the same spec functions:

- ``patch`` [Q,Dv] and ``patch_bias`` [Dv]: HF's Conv2d (kernel = stride = the patch) as a
  matmul over the flattened [C, P, P] patch (Q = C*P*P).
- ``pos_embed`` [G,Dv]: the learned square position grid, flattened row-major (G = side*side).
- each block: :class:`~dayzero.model.vision_weights.VisionBlockWeights` (LayerNorms, attention
  q/k/v [Dv,N,H] with biases, o [N,H,Dv], MLP fc1 [Dv,F] / fc2 [F,Dv] with biases).
- ``final_norm`` / ``final_norm_bias`` [Dv]: the tower's last LayerNorm.
- ``projector``: :class:`~dayzero.model.vision_weights.MergerWeights`: a LayerNorm [Dv] per
  patch, then K = kh*kw patches side by side, fc1 [U,U] -> GELU -> fc2 [U,Dt] (U = K*Dv).

Logical axes as the Qwen tower's (the text model's names: ``embed``, ``q_heads``, ``head_dim``,
``ffw``), so one rules table shards both.
"""

from __future__ import annotations

from typing import Any

from flax import struct

from dayzero.model.hf_config_vision_kimi import KimiVisionConfig
from dayzero.model.vision_weights import MergerWeights, VisionBlockWeights, block_specs, merger_specs, norm_specs
from dayzero.model.weights import Init, ParamSpec


@struct.dataclass
class KimiVisionWeights:
    """The whole tower and its projector (module docstring)."""

    patch: Any
    patch_bias: Any
    pos_embed: Any
    blocks: tuple[VisionBlockWeights, ...]
    final_norm: Any
    final_norm_bias: Any
    projector: MergerWeights


def kimi_vision_specs(kc: KimiVisionConfig) -> KimiVisionWeights:
    """The :class:`ParamSpec` tree of the tower and projector ``kc`` describes."""
    D = kc.hidden_size
    final_norm, final_norm_bias = norm_specs(D, "embed")
    return KimiVisionWeights(
        patch=ParamSpec((kc.patch_dim, D), (None, "embed")),
        patch_bias=ParamSpec((D,), ("embed",), Init.ZEROS),
        pos_embed=ParamSpec((kc.num_position_embeddings, D), (None, "embed")),
        # The spec functions read hidden_size, num_heads, head_dim, intermediate_size, merge_unit and
        # out_hidden_size, which KimiVisionConfig names as VisionConfig does.
        blocks=tuple(block_specs(kc) for _ in range(kc.depth)),
        final_norm=final_norm,
        final_norm_bias=final_norm_bias,
        projector=merger_specs(kc, post_shuffle=False),
    )
