"""The Qwen3-VL / Qwen3.5 vision tower (HF ``Qwen3VLVisionModel``, ``Qwen3_5VisionModel``) as pure
functions: pixel patches -> merged image embeddings for the text model, plus DeepStack features.

The work is split so that one compiled step serves every image set of the same padded size:

- :func:`vision_layout` (host, numpy) turns the image grids (t, h, w) (in patches, per image)
  into per-patch arrays: the attention segment (one per frame: HF's ``cu_seqlens`` attend over
  each frame's patches only), the (row, column) of the 2D rotary positions, and the four taps
  and weights that resample the learned position grid bilinearly to the image's grid
  (``align_corners=True``, as HF's ``get_vision_interpolation_indices_and_weights``). The patch
  count may be padded to a bucket: padding patches have segment -1 and see no key.
- :func:`vision_forward` (jittable; the config static, shapes fixed by the bucket) runs patch
  embedding, position table, the blocks, the merger and the DeepStack mergers.

Patch order is the processor's: within each frame, M x M blocks of neighbouring patches in
raster order of blocks, each block's patches in raster order (HF's "merge-window order"), so
that M*M consecutive patches merge into one embedding.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dayzero.model.config import RopeConfig
from dayzero.model.hf_config_vision import VisionAct, VisionConfig
from dayzero.model.norm import layer_norm  # nn.LayerNorm(eps=1e-6), as every norm of the tower
from dayzero.model.quant import dequantized
from dayzero.model.rope import apply_rope, static_inv_freq
from dayzero.model.transformer import attend
from dayzero.model.vision_weights import MergerWeights, VisionBlockWeights, VisionMLPWeights, VisionWeights
from dayzero.model.weights import AttentionWeights

Grid = tuple[int, int, int]  # (t, h, w) in patches, as the processor's image_grid_thw rows


@struct.dataclass
class VisionLayout:
    """Per-patch inputs of :func:`vision_forward` that depend on the grids only (P: the patch
    count, padded or not): ``segment`` [P] int32 (the frame a patch attends within, -1 for
    padding), ``rope_hw`` [P,2] int32 (its row and column in its frame), ``pos_index`` [P,4]
    int32 and ``pos_weight`` [P,4] float32 (bilinear taps into the flattened position grid)."""

    segment: jax.Array
    rope_hw: jax.Array
    pos_index: jax.Array
    pos_weight: jax.Array


def check_grids(vc: VisionConfig, grids: Sequence[Sequence[int]]) -> tuple[Grid, ...]:
    """``grids`` as a tuple of (t, h, w) int tuples; raises ValueError naming a bad one."""
    out = []
    M = vc.spatial_merge_size
    for i, g in enumerate(grids):
        g = tuple(int(x) for x in g)
        if len(g) != 3 or min(g) < 1 or g[1] % M or g[2] % M:
            raise ValueError(f"image {i}: grid (t, h, w)={g} must be 3 positive patch counts with h and w multiples "
                             f"of the spatial merge size {M}; take grids from the image processor")
        out.append(g)
    if not out:
        raise ValueError("no image grids given; pass one (t, h, w) per image")
    return tuple(out)


def num_patches(grids: Sequence[Grid]) -> int:
    """How many patches (pixel_values rows) the images of ``grids`` have."""
    return sum(t * h * w for t, h, w in grids)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor+1, clamped) and weights along one axis of the position grid,
    for ``index`` in [0, size): ``align_corners=True`` puts index 0 on grid 0 and size-1 on side-1.
    float32 throughout, as HF computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)), 0)
    return taps, weights.astype(np.float32)


def _frame_layout(vc: VisionConfig, h: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rope_hw [h*w,2], pos_index [h*w,4], pos_weight [h*w,4]) of one frame, in merge-window order."""
    M, side = vc.spatial_merge_size, vc.grid_side
    blocks = np.arange(h * w).reshape(h // M, w // M, M, M)  # (block row, block col, row in, col in)
    block_row, block_col, row_in, col_in = np.unravel_index(blocks.reshape(-1), blocks.shape)
    row, col = block_row * M + row_in, block_col * M + col_in
    row_taps, row_w = _axis_taps(row, h, side)
    col_taps, col_w = _axis_taps(col, w, side)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weight = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return np.stack([row, col], axis=-1), index, weight


def vision_layout(vc: VisionConfig, grids: Sequence[Sequence[int]], padded_patches: int | None = None) -> VisionLayout:
    """The :class:`VisionLayout` of images with ``grids`` (t, h, w), padded to ``padded_patches``
    (a bucket: at least the real patch count and a multiple of the merge unit M*M; None: no padding).
    Host-side numpy: the grids never enter a compiled step, only these arrays do."""
    grids = check_grids(vc, grids)
    real = num_patches(grids)
    P = real if padded_patches is None else int(padded_patches)
    if P < real or P % vc.merge_unit:
        raise ValueError(f"padded_patches={padded_patches} must be at least the {real} patches of the images and a "
                         f"multiple of {vc.merge_unit} (the patches merged into one embedding)")
    segment = np.full(P, -1, np.int32)
    rope_hw, pos_index = np.zeros((P, 2), np.int32), np.zeros((P, 4), np.int32)
    pos_weight = np.zeros((P, 4), np.float32)
    start, frame = 0, 0
    for t, h, w in grids:
        hw, index, weight = _frame_layout(vc, h, w)
        for _ in range(t):  # every frame its own attention segment, at the same positions
            rows = slice(start, start + h * w)
            segment[rows], rope_hw[rows], pos_index[rows], pos_weight[rows] = frame, hw, index, weight
            start, frame = start + h * w, frame + 1
    return VisionLayout(segment=segment, rope_hw=rope_hw, pos_index=pos_index, pos_weight=pos_weight)


def pad_patches(pixel_values: np.ndarray | jax.Array, padded_patches: int) -> np.ndarray | jax.Array:
    """``pixel_values`` [P, Q] with zero rows appended up to ``padded_patches``."""
    extra = padded_patches - pixel_values.shape[0]
    if extra < 0:
        raise ValueError(f"{pixel_values.shape[0]} patches do not fit in a bucket of {padded_patches}")
    xp = np if isinstance(pixel_values, np.ndarray) else jnp
    return xp.pad(pixel_values, ((0, extra), (0, 0)))


def _rope_tables(vc: VisionConfig, rope_hw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [1,P,H]: a head's first half rotates by (row, column) angles [row * f, col * f]
    with the H/4 frequencies f of a head of H/2 (HF's axial rope), repeated for rotate-half pairs."""
    inv_freq = jnp.asarray(static_inv_freq(RopeConfig(theta=vc.rope_theta), vc.head_dim // 2))
    angles = (rope_hw.astype(jnp.float32)[..., None] * inv_freq).reshape(rope_hw.shape[0], -1)  # [P, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[None]
    return jnp.cos(angles), jnp.sin(angles)


def _act(x: jax.Array, act: VisionAct) -> jax.Array:
    return jax.nn.gelu(x, approximate=act is VisionAct.GELU_TANH)


def vision_mlp(w: VisionMLPWeights, x: jax.Array, act: VisionAct) -> jax.Array:
    """fc2(act(fc1 x)), each with its bias."""
    h = _act(x @ dequantized(w.fc1, x.dtype) + w.fc1_bias, act)
    return h @ dequantized(w.fc2, x.dtype) + w.fc2_bias


# Queries per attention block: scratch is N x block x P scores, linear in the patch count P.
# A tower call of at most this many patches attends in one block (the plain dense product).
VISION_QUERY_BLOCK = 512


def _segment_mask(query_segment: jax.Array, key_segment: jax.Array) -> jax.Array:
    """[1,Tq,P]: a query sees the keys of its own segment; padding (segment -1) sees none."""
    return ((query_segment[:, None] == key_segment[None, :]) & (query_segment[:, None] >= 0))[None]


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array,
                      block: int | None = None) -> jax.Array:
    """Bidirectional attention of ``q`` [1,P,N,H] over ``k``, ``v`` [1,P,N,H] within equal
    ``segment`` [P] ids (-1: padding, sees nothing, gives zeros) -> [1,P,N,H].

    Above ``block`` patches (None: :data:`VISION_QUERY_BLOCK`, read at trace time) the queries go
    in blocks of ``block`` (the last padded with segment -1), each over all keys with its slice of
    the mask, so scratch grows as block x P per head instead of P x P; a block of padding only
    is skipped. Each query row's softmax is the one-block (dense) path's, to fp32 rounding."""
    P, block = q.shape[1], block or VISION_QUERY_BLOCK
    if P <= block:
        return attend(q, None, None, k, v, (None, _segment_mask(segment, segment)))
    nb = -(-P // block)
    q_blocks = jnp.pad(q, ((0, 0), (0, nb * block - P), (0, 0), (0, 0))).reshape(nb, 1, block, *q.shape[2:])
    seg_blocks = jnp.pad(segment, (0, nb * block - P), constant_values=-1).reshape(nb, block)

    def one(args):
        qb, sb = args
        dense = lambda: attend(qb, None, None, k, v, (None, _segment_mask(sb, segment)))  # noqa: E731
        return jax.lax.cond(jnp.any(sb >= 0), dense, lambda: jnp.zeros_like(qb))

    out = jax.lax.map(one, (q_blocks, seg_blocks))  # [nb, 1, block, N, H]
    return out.reshape(1, nb * block, *q.shape[2:])[:, :P]


def vision_attention(w: AttentionWeights, x: jax.Array, cos_sin: tuple[jax.Array, jax.Array],
                     segment: jax.Array) -> jax.Array:
    """Bidirectional self-attention of ``x`` [1,P,Dv] within each ``segment`` [P] (an image or
    frame; -1 padding): :func:`segment_attention`."""
    q, k, v = (jnp.einsum("btd,dnh->btnh", x, dequantized(p, x.dtype)) + b
               for p, b in ((w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias)))
    q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
    out = segment_attention(q, k, v, segment)
    B, T, N, H = out.shape
    return out.reshape(B, T, N * H) @ dequantized(w.o, x.dtype).reshape(N * H, -1) + w.o_bias


def vision_block(w: VisionBlockWeights, vc: VisionConfig, x: jax.Array, cos_sin, segment: jax.Array) -> jax.Array:
    """One pre-norm block: x + attn(LN x), then + mlp(LN x); attention within ``segment`` [P]."""
    x = x + vision_attention(w.attn, layer_norm(x, w.norm1, w.norm1_bias), cos_sin, segment)
    return x + vision_mlp(w.mlp, layer_norm(x, w.norm2, w.norm2_bias), vc.hidden_act)


def merge_patches(w: MergerWeights, vc: VisionConfig, x: jax.Array, post_shuffle: bool) -> jax.Array:
    """M*M consecutive patches of ``x`` [P,Dv] -> [P/(M*M), Dt]: LayerNorm per patch (or over the
    merged row, ``post_shuffle``: the DeepStack mergers), then the MLP with exact GELU."""
    U = vc.hidden_size * vc.merge_unit
    if post_shuffle:
        merged = layer_norm(x.reshape(-1, U), w.norm, w.norm_bias)
    else:
        merged = layer_norm(x, w.norm, w.norm_bias).reshape(-1, U)
    return vision_mlp(w.mlp, merged, VisionAct.GELU)


def vision_forward(w: VisionWeights, vc: VisionConfig, pixel_values: jax.Array,
                   layout: VisionLayout) -> tuple[jax.Array, list[jax.Array]]:
    """The tower over ``pixel_values`` [P, C*T*P*P] (the processor's rows, padded to the layout's
    P): the merged embeddings [P/(M*M), Dt] and the DeepStack features (a list, one [P/(M*M), Dt]
    per ``vc.deepstack_indexes`` entry, in block order). Rows of padding merge groups are zero.
    Computes in the dtype of ``w.patch``; jit it with ``vc`` static (one compile per P)."""
    P, Q = pixel_values.shape
    if Q != vc.patch_dim or layout.segment.shape != (P,) or P % vc.merge_unit:
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected [P, {vc.patch_dim}] with P the "
                         f"layout's {layout.segment.shape[0]} patches, a multiple of {vc.merge_unit}")
    dtype = w.patch.dtype  # the patch embedding is never quantized (its spec has no in_axes)
    x = pixel_values.astype(dtype) @ dequantized(w.patch, dtype) + w.patch_bias
    table = dequantized(w.pos_embed, dtype)
    x = x + jnp.sum(table[layout.pos_index] * layout.pos_weight[..., None].astype(dtype), axis=1)
    cos_sin = _rope_tables(vc, layout.rope_hw)
    seg = layout.segment
    x = x[None]
    deepstack = []
    for i, block in enumerate(w.blocks):
        x = vision_block(block, vc, x, cos_sin, seg)
        if i in vc.deepstack_indexes:
            deepstack.append(merge_patches(w.deepstack[vc.deepstack_indexes.index(i)], vc, x[0], post_shuffle=True))
    merged = merge_patches(w.merger, vc, x[0], post_shuffle=False)
    real = (seg.reshape(-1, vc.merge_unit)[:, 0] >= 0)[:, None]
    return jnp.where(real, merged, 0), [jnp.where(real, d, 0) for d in deepstack]


_vision_step = jax.jit(vision_forward, static_argnums=(1,))


def encode_images(w: VisionWeights, vc: VisionConfig, pixel_values: np.ndarray | jax.Array,
                  grids: Sequence[Sequence[int]], padded_patches: int | None = None
                  ) -> tuple[jax.Array, list[jax.Array]]:
    """The tower over the images of ``grids`` (the processor's ``pixel_values`` and
    ``image_grid_thw``), compiled once per padded patch count: the merged embeddings
    [num_merged, Dt] of the real patches and the DeepStack features, padding rows dropped."""
    grids = check_grids(vc, grids)
    real = num_patches(grids)
    if tuple(pixel_values.shape) != (real, vc.patch_dim):
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; the grids {list(grids)} need "
                         f"[{real}, {vc.patch_dim}]")
    layout = vision_layout(vc, grids, padded_patches)
    pixels = pad_patches(pixel_values, layout.segment.shape[0])
    merged, deepstack = _vision_step(w, vc, jnp.asarray(pixels), jax.tree.map(jnp.asarray, layout))
    n = real // vc.merge_unit
    return merged[:n], [d[:n] for d in deepstack]
