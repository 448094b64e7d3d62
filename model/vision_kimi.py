"""Kimi-K2.5's vision tower and projector (HF ``Kimi_K25VisionModel`` + ``Kimi_K25MultimodalProjection``)
as pure functions: pixel patches -> the image embeddings that replace the image placeholder tokens.

Split as the Qwen tower (``dayzero.model.vision_qwen``) is, so that one compiled step serves
every image set of the same padded patch count:

- :func:`kimi_vision_layout` (host, numpy) turns the grids (t, h, w) (in patches, per image)
  into per-patch arrays: the attention segment (one per image: HF's ``cu_seqlens`` cover all
  frames of a clip together), the (column, row) of the 2D rotary positions, the 16 bicubic taps
  and weights that resample the learned position grid to the image's grid (HF's
  ``F.interpolate(mode="bicubic", align_corners=False)``, border-clamped), the row of the
  sinusoidal time table (0, a zero row, for a single-frame image), and the output slot and
  weight of the frame mean before the projector. The patch count may be padded to a bucket:
  padding patches have segment -1, see no key and feed no output.
- :func:`kimi_vision_forward` (jittable; the config static) runs patch embedding, positions,
  the blocks, the final LayerNorm, the frame mean and the projector.

Patch order is the processor's (``dayzero.engine.image_processing``, HF's
``Kimi_K25ImageProcessor``): each frame's patches row-major, each patch [C, P, P]. The merge
takes each kh x kw block of a frame (blocks row-major, patches within a block row-major) as one
output embedding, after averaging the clip's frames (a still image has t = 1).

The blocks reuse the Qwen tower's attention and MLP; the only differences in the block are the
LayerNorm epsilon (1e-5 here) and the rotary layout (each frequency turns a column pair, then a
row pair: HF's ``Kimi_K25VisionRotaryEmbedding``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dayzero.model.config import RopeConfig
from dayzero.model.hf_config_vision import VisionAct
from dayzero.model.hf_config_vision_kimi import KimiVisionConfig
from dayzero.model.norm import layer_norm
from dayzero.model.quant import dequantized
from dayzero.model.rope import static_inv_freq
from dayzero.model.vision_kimi_weights import KimiVisionWeights
from dayzero.model.vision_qwen import num_patches, pad_patches, vision_attention, vision_mlp
from dayzero.model.vision_weights import VisionBlockWeights

Grid = tuple[int, int, int]  # (t, h, w) in patches, as the processor's image_grid_thw rows
TOWER_EPS = 1e-5  # every LayerNorm of the tower (HF builds nn.LayerNorm(eps=1e-5) there)
_CUBIC_A = -0.75  # the Keys kernel's parameter in torch's bicubic interpolation


@struct.dataclass
class KimiVisionLayout:
    """Per-patch inputs of :func:`kimi_vision_forward` that depend on the grids only (P: the patch
    count, padded or not): ``segment`` [P] int32 (the image a patch attends within, -1 for
    padding), ``rope_wh`` [P,2] int32 (its column and row), ``pos_index`` [P,16] int32 and
    ``pos_weight`` [P,16] float32 (bicubic taps into the flattened position grid), ``frame`` [P]
    int32 (its row of the time table), ``merge_slot`` [P] int32 and ``merge_weight`` [P] float32
    (the pooled row it adds into, output embedding * K + place in the kh x kw block, with weight
    1/t; padding adds 0 into its own row)."""

    segment: jax.Array
    rope_wh: jax.Array
    pos_index: jax.Array
    pos_weight: jax.Array
    frame: jax.Array
    merge_slot: jax.Array
    merge_weight: jax.Array


def check_kimi_grids(kc: KimiVisionConfig, grids: Sequence[Sequence[int]]) -> tuple[Grid, ...]:
    """``grids`` as a tuple of (t, h, w) int tuples; raises ValueError naming a bad one."""
    kh, kw = kc.merge_kernel
    out = []
    for i, g in enumerate(grids):
        g = tuple(int(x) for x in g)
        if len(g) != 3 or min(g) < 1 or g[1] % kh or g[2] % kw or g[0] > kc.pos_emb_time:
            raise ValueError(f"image {i}: grid (t, h, w)={g} must be 3 positive patch counts with h a multiple of "
                             f"{kh}, w a multiple of {kw} and t at most {kc.pos_emb_time} frames; take grids from "
                             "the image processor")
        out.append(g)
    if not out:
        raise ValueError("no image grids given; pass one (t, h, w) per image")
    return tuple(out)


def num_embeddings(kc: KimiVisionConfig, grids: Sequence[Grid]) -> int:
    """How many embeddings (image placeholder tokens) the images of ``grids`` give: h*w/K each,
    whatever their frame count (frames are averaged)."""
    return sum(h * w for _, h, w in grids) // kc.merge_unit


def _bicubic_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps (floor-1 .. floor+2, clamped to the grid) and Keys-kernel weights along one axis of
    the position grid for ``index`` in [0, size), half-pixel centres (``align_corners=False``).
    float32 in HF's order of operations, so the weights match its bit for bit."""
    src = (index.astype(np.float32) + np.float32(0.5)) * np.float32(side) / np.float32(size) - np.float32(0.5)
    floor = np.floor(src)
    offsets = np.arange(-1, 3)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    d = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    a = np.float32(_CUBIC_A)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return taps, np.where(d <= 1, near, far).astype(np.float32)


def _frame_layout(kc: KimiVisionConfig, h: int, w: int) -> tuple[np.ndarray, ...]:
    """(rope_wh [h*w,2], pos_index [h*w,16], pos_weight [h*w,16], slot [h*w]) of one frame,
    row-major; ``slot`` counts from the frame's first output embedding."""
    kh, kw = kc.merge_kernel
    side = kc.pos_emb_side
    row, col = np.divmod(np.arange(h * w), w)
    row_taps, row_w = _bicubic_taps(row, h, side)
    col_taps, col_w = _bicubic_taps(col, w, side)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 16)
    weight = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 16)
    slot = ((row // kh) * (w // kw) + col // kw) * kc.merge_unit + (row % kh) * kw + col % kw
    return np.stack([col, row], axis=-1), index, weight, slot


def kimi_vision_layout(kc: KimiVisionConfig, grids: Sequence[Sequence[int]],
                       padded_patches: int | None = None) -> KimiVisionLayout:
    """The :class:`KimiVisionLayout` of images with ``grids`` (t, h, w), padded to
    ``padded_patches`` (a bucket: at least the real patch count and a multiple of K; None: no
    padding). Host-side numpy: the grids never enter a compiled step, only these arrays do."""
    grids = check_kimi_grids(kc, grids)
    real = num_patches(grids)
    P = real if padded_patches is None else int(padded_patches)
    if P < real or P % kc.merge_unit:
        raise ValueError(f"padded_patches={padded_patches} must be at least the {real} patches of the images and a "
                         f"multiple of {kc.merge_unit} (the patches merged into one embedding)")
    segment, frame = np.full(P, -1, np.int32), np.zeros(P, np.int32)
    rope_wh, pos_index = np.zeros((P, 2), np.int32), np.zeros((P, 16), np.int32)
    pos_weight = np.zeros((P, 16), np.float32)
    merge_slot, merge_weight = np.arange(P, dtype=np.int32), np.zeros(P, np.float32)
    start, first_slot = 0, 0
    for image, (t, h, w) in enumerate(grids):
        hw, index, weight, slot = _frame_layout(kc, h, w)
        for f in range(t):  # the frames of a clip: one attention segment, one pooled output
            rows = slice(start, start + h * w)
            segment[rows], rope_wh[rows], pos_index[rows], pos_weight[rows] = image, hw, index, weight
            # Row 0 of the time table is zero: a still image gets no temporal term (HF's frame index).
            frame[rows] = f + 1 if t > 1 else 0
            merge_slot[rows], merge_weight[rows] = first_slot + slot, np.float32(1.0) / np.float32(t)
            start += h * w
        first_slot += h * w
    return KimiVisionLayout(segment=segment, rope_wh=rope_wh, pos_index=pos_index, pos_weight=pos_weight,
                            frame=frame, merge_slot=merge_slot, merge_weight=merge_weight)


def time_table(kc: KimiVisionConfig) -> np.ndarray:
    """The fixed temporal table [pos_emb_time + 1, Dv]: a zero row (single-frame images), then
    [sin | cos] of frame position f times the Dv/2 frequencies 10000^(-2i/Dv), float32 as HF."""
    D = kc.hidden_size
    inv_freq = np.float32(1.0) / np.float32(10000) ** (np.arange(0, D, 2).astype(np.float32) / np.float32(D))
    freqs = np.outer(np.arange(kc.pos_emb_time, dtype=np.float32), inv_freq)
    return np.concatenate([np.zeros((1, D), np.float32), np.concatenate([np.sin(freqs), np.cos(freqs)], 1)])


def _rope_tables(kc: KimiVisionConfig, rope_wh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [1,P,H]: the first half of a head turns by [col*f0, row*f0, col*f1, row*f1, ...]
    with the H/4 frequencies f of a head of H/2, repeated for the rotate-half pairs (HF's
    ``recomposition_frequencies``)."""
    inv_freq = jnp.asarray(static_inv_freq(RopeConfig(theta=kc.rope_theta), kc.head_dim // 2))
    angles = (rope_wh.astype(jnp.float32)[:, None, :] * inv_freq[None, :, None]).reshape(rope_wh.shape[0], -1)
    angles = jnp.concatenate([angles, angles], axis=-1)[None]
    return jnp.cos(angles), jnp.sin(angles)


def _positions(w: KimiVisionWeights, kc: KimiVisionConfig, layout: KimiVisionLayout, dtype) -> jax.Array:
    """[P,Dv]: the resampled learned grid plus the time term of each patch."""
    table = dequantized(w.pos_embed, dtype)
    weight = layout.pos_weight.astype(dtype)
    # Tap by tap, so no [P, 16, Dv] gather is ever materialised.
    pos = sum(table[layout.pos_index[:, k]] * weight[:, k, None] for k in range(layout.pos_index.shape[1]))
    return pos + jnp.asarray(time_table(kc), dtype)[layout.frame]


def kimi_vision_block(w: VisionBlockWeights, kc: KimiVisionConfig, x: jax.Array, cos_sin,
                      segment: jax.Array) -> jax.Array:
    """One pre-norm block over ``x`` [1,P,Dv]: x + attn(LN x) within ``segment`` [P], then + mlp(LN x)."""
    x = x + vision_attention(w.attn, layer_norm(x, w.norm1, w.norm1_bias, TOWER_EPS), cos_sin, segment)
    return x + vision_mlp(w.mlp, layer_norm(x, w.norm2, w.norm2_bias, TOWER_EPS), kc.hidden_act)


def kimi_vision_forward(w: KimiVisionWeights, kc: KimiVisionConfig, pixel_values: jax.Array,
                        layout: KimiVisionLayout) -> jax.Array:
    """The tower and projector over ``pixel_values`` [P, C*P*P] (the processor's patches
    flattened, padded to the layout's P): [P/K, Dt], the first :func:`num_embeddings` rows the
    images' embeddings in order, the rest zero. Computes in the dtype of ``w.patch``; jit it
    with ``kc`` static (one compile per P)."""
    P, Q = pixel_values.shape
    if Q != kc.patch_dim or layout.segment.shape != (P,) or P % kc.merge_unit:
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected [P, {kc.patch_dim}] with P the "
                         f"layout's {layout.segment.shape[0]} patches, a multiple of {kc.merge_unit}")
    dtype = w.patch.dtype  # the patch embedding is never quantized (its spec has no in_axes)
    x = pixel_values.astype(dtype) @ dequantized(w.patch, dtype) + w.patch_bias
    x = x + _positions(w, kc, layout, dtype)
    cos_sin = _rope_tables(kc, layout.rope_wh)
    x = x[None]
    for block in w.blocks:
        x = kimi_vision_block(block, kc, x, cos_sin, layout.segment)
    x = layer_norm(x[0], w.final_norm, w.final_norm_bias, TOWER_EPS)
    # Mean over each clip's frames into its output rows (HF's temporal_merge, in float32).
    pooled = jax.ops.segment_sum(x.astype(jnp.float32) * layout.merge_weight[:, None], layout.merge_slot,
                                 num_segments=P).astype(dtype)
    normed = layer_norm(pooled, w.projector.norm, w.projector.norm_bias, kc.projector_eps)
    merged = vision_mlp(w.projector.mlp, normed.reshape(P // kc.merge_unit, -1), VisionAct.GELU)
    filled = jax.ops.segment_sum(layout.merge_weight, layout.merge_slot, num_segments=P)
    return jnp.where((filled.reshape(-1, kc.merge_unit)[:, 0] > 0)[:, None], merged, 0)


_kimi_vision_step = jax.jit(kimi_vision_forward, static_argnums=(1,))


def encode_kimi_images(w: KimiVisionWeights, kc: KimiVisionConfig, pixel_values: np.ndarray | jax.Array,
                       grids: Sequence[Sequence[int]], padded_patches: int | None = None) -> jax.Array:
    """The image embeddings [num_embeddings, Dt] of the images of ``grids`` (the processor's
    ``pixel_values`` [N, C, P, P] or already flattened [N, C*P*P], and ``image_grid_thw``), in
    image order, compiled once per padded patch count."""
    grids = check_kimi_grids(kc, grids)
    real = num_patches(grids)
    shape = tuple(pixel_values.shape)
    if shape not in ((real, kc.patch_dim), (real, kc.in_channels, kc.patch_size, kc.patch_size)):
        raise ValueError(f"pixel_values has shape {shape}; the grids {list(grids)} need [{real}, {kc.in_channels}, "
                         f"{kc.patch_size}, {kc.patch_size}] (or [{real}, {kc.patch_dim}])")
    layout = kimi_vision_layout(kc, grids, padded_patches)
    pixels = pad_patches(pixel_values.reshape(real, kc.patch_dim), layout.segment.shape[0])
    merged = _kimi_vision_step(w, kc, jnp.asarray(pixels), jax.tree.map(jnp.asarray, layout))
    return merged[:num_embeddings(kc, grids)]
