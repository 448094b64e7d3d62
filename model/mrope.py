"""Image inputs of the Qwen multimodal text models (Qwen3-VL(-MoE), Qwen3.5): where the merged
image embeddings go in the token stream and the multi-axis (M-RoPE) positions of every token.

Host side (numpy), before a prefill:

- :func:`rope_index` gives each token its (temporal, height, width) position [3, B, T] as HF's
  ``get_rope_index`` does: text tokens count up on all three axes alike; the placeholders of an
  image (one run of ``image_token_id``, its grid (t, h, w) in patches, M the spatial merge size)
  take (start + frame, start + row, start + column) over its t x h/M x w/M merged grid, and
  the text after it continues from start + max(h, w) / M. ``rope_deltas`` [B] (the highest
  position + 1 minus the token count) is what every later position is shifted by: a decode token
  at cache position p sits at p + delta on all three axes.
- :func:`image_input` packs the tower's output (``vision_qwen.encode_images``) with those
  positions into an :class:`ImageInput`, the one optional argument ``transformer.forward`` takes
  for images. :func:`continuation` is the one for later steps (text only, positions shifted).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dayzero.model.hf_config_vision import VisionConfig


@struct.dataclass
class ImageInput:
    """What ``forward`` needs for images, for the B x T tokens of one call.

    ``position_ids`` [3, B, T] int32: each token's (temporal, height, width) rotary position; for
    a text model without M-RoPE (Kimi-K2.5, whose images take one position per token as text
    does) the three axes are equal and ``forward`` reads the first (:func:`plain_positions`).
    ``embeds`` [N, D] (or None: no image in this call, positions only): merged image embeddings,
    written over the token embeddings at (``rows``, ``cols``) [N] int32 before the first layer;
    a padding entry has row B (out of range: dropped).
    ``deepstack``: per DeepStack level k, features [N, D] added at the same places after
    decoder layer k (Qwen3-VL; empty for Qwen3.5).
    """

    position_ids: jax.Array
    embeds: jax.Array | None = None
    rows: jax.Array | None = None
    cols: jax.Array | None = None
    deepstack: tuple[jax.Array, ...] = ()

    def padded(self, n: int) -> "ImageInput":
        """The same input with its image entries padded to ``n`` (a bucket, so that calls with
        different image token counts share a compile); the padding rows are dropped."""
        have = 0 if self.embeds is None else self.embeds.shape[0]
        if self.embeds is None or n == have:
            return self
        if n < have:
            raise ValueError(f"cannot pad {have} image entries to {n}; pass n >= {have}")
        pad = lambda a, value: jnp.pad(a, [(0, n - have)] + [(0, 0)] * (a.ndim - 1),  # noqa: E731
                                       constant_values=value)
        B = self.position_ids.shape[1]
        return self.replace(embeds=pad(self.embeds, 0), rows=pad(self.rows, B), cols=pad(self.cols, 0),
                            deepstack=tuple(pad(d, 0) for d in self.deepstack))

    def scatter(self, x: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D] with the image embeddings written at their placeholders."""
        if self.embeds is None:
            return x
        return x.at[self.rows, self.cols].set(self.embeds.astype(x.dtype), mode="drop")

    def add_deepstack(self, x: jax.Array, layer: int) -> jax.Array:
        """Hidden states [B, T, D] after decoder ``layer``, plus that level's DeepStack features
        at the image tokens (unchanged past the last level)."""
        if self.embeds is None or layer >= len(self.deepstack):
            return x
        return x.at[self.rows, self.cols].add(self.deepstack[layer].astype(x.dtype), mode="drop")


def _runs(is_image: np.ndarray) -> list[tuple[bool, int, int]]:
    """Maximal runs (image?, start, end) of a row's token types, as HF groups them."""
    out, pos = [], 0
    for key, group in itertools.groupby(is_image.tolist()):
        n = len(list(group))
        out.append((bool(key), pos, pos + n))
        pos += n
    return out


def rope_index(vc: VisionConfig, ids: np.ndarray, grids: Sequence[Sequence[int]],
               lengths: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE positions [3, B, T] int32 and ``rope_deltas`` [B] int32 of the token ids [B, T].

    ``grids``: one (t, h, w) (in patches, the processor's ``image_grid_thw``) per image, in order
    over the rows. ``lengths`` [B]: real tokens per row (default all T); the padding after them
    continues as text and counts in no delta. Raises ValueError when an image's placeholder run
    does not have t * h * w / M^2 tokens or the image count differs from the grids'.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids has shape {ids.shape}; pass token ids [B, T]")
    B, T = ids.shape
    lengths = [T] * B if lengths is None else [int(n) for n in lengths]
    M = vc.spatial_merge_size
    todo = iter([tuple(int(x) for x in g) for g in grids])
    positions = np.zeros((3, B, T), np.int64)
    deltas = np.zeros((B,), np.int64)
    used = 0
    for b in range(B):
        n = lengths[b]
        pos, parts = 0, []
        for image, start, end in _runs(ids[b, :n] == vc.image_token_id):
            if not image:
                parts.append(np.broadcast_to(np.arange(end - start) + pos, (3, end - start)))
                pos += end - start
                continue
            g = next(todo, None)
            if g is None:
                raise ValueError(f"row {b} has more image placeholder runs than the {len(grids)} grids given; "
                                 "pass one grid per image")
            used += 1
            t, h, w = g[0], g[1] // M, g[2] // M
            if t * h * w != end - start:
                raise ValueError(f"image {used - 1} (row {b}, tokens {start}..{end}) has {end - start} placeholders; "
                                 f"its grid {g} needs {t * h * w}: insert t*h*w/{M * M} image tokens per image")
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
            parts.append(grid + pos)
            pos += max(h, w)
        row = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
        deltas[b] = (row.max() + 1 - n) if n else 0
        # Padding continues the text positions (never attended; any position would do).
        pad = np.broadcast_to(np.arange(T - n) + (row.max() + 1 if n else 0), (3, T - n))
        positions[:, b] = np.concatenate([row, pad], axis=1)
    if used != len(grids):
        raise ValueError(f"{len(grids)} image grids given for {used} image placeholder runs in the ids")
    return positions.astype(np.int32), deltas.astype(np.int32)


def image_input(vc: VisionConfig, ids: np.ndarray, grids: Sequence[Sequence[int]], embeds: jax.Array,
                deepstack: Sequence[jax.Array] = (), lengths: Sequence[int] | None = None
                ) -> tuple[ImageInput, np.ndarray]:
    """The :class:`ImageInput` of a prefill over ``ids`` [B, T] whose images (``grids``, in
    order) the tower encoded to ``embeds`` [N, D] and ``deepstack`` (``encode_images``), and the
    rows' ``rope_deltas`` [B] that later positions continue from."""
    ids = np.asarray(ids)
    positions, deltas = rope_index(vc, ids, grids, lengths)
    mask = ids == vc.image_token_id
    if lengths is not None:
        mask &= np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
    rows, cols = np.nonzero(mask)  # row-major: the order of the images' merged tokens
    if len(rows) != embeds.shape[0]:
        raise ValueError(f"{len(rows)} image placeholders in the ids for {embeds.shape[0]} image embeddings")
    as_i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return ImageInput(position_ids=as_i32(positions), embeds=embeds, rows=as_i32(rows), cols=as_i32(cols),
                      deepstack=tuple(deepstack)), deltas


def plain_positions(B: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions [3, B, T] int32, ``rope_deltas`` [B] int32) of a model without M-RoPE: token t
    at position t on all three axes, no delta (Kimi-K2.5's images count as text does)."""
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (3, B, T)).copy()
    return positions, np.zeros((B,), np.int32)


def continuation(starts: jax.Array, T: int, rope_deltas: jax.Array) -> ImageInput:
    """The :class:`ImageInput` of a text step after an image prompt: T tokens per row from cache
    position ``starts`` [B], at positions shifted by the rows' ``rope_deltas`` [B] on all three
    axes (jittable)."""
    plain = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :] + rope_deltas[:, None]
    return ImageInput(position_ids=jnp.broadcast_to(plain.astype(jnp.int32), (3,) + plain.shape))
