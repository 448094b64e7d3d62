"""Images in ``Engine.generate`` for the multimodal models: Qwen3-VL(-MoE), Qwen3.5 and Kimi-K2.5.

Host side, once per request, before the prefill:

- :func:`image_config_of` is the preprocessing of a model whose checkpoint carries no
  preprocessor config: the tower's patch, merge and temporal sizes, the published pixel bounds
  (Qwen), or the tower's patch and merge sizes with the published patch budget (Kimi);
- :func:`expand_placeholders` turns each image's one ``image_token_id`` (as the chat template
  writes it, between vision start and end) into the image's ``num_tokens`` placeholders;
- :func:`encode` runs the tower once over all images of the batch, compiled per padded patch
  count (:func:`patch_bucket`), never inside the decode loop;
- :class:`ImagePrefill` holds the M-RoPE positions of the padded prompt and the image entries,
  and hands each prefill chunk its slice (:meth:`ImagePrefill.chunk`, columns relative to the
  chunk, entries padded to a bucket so chunks share compiles); ``deltas`` [B] are what every
  decode step's positions are shifted by (``mrope.continuation``).

Each function dispatches on the kind of ``config.vision``: Kimi-K2.5's tower
(``KimiVisionConfig``) has no DeepStack and its text model no M-RoPE, so its images take plain
positions, one per placeholder (``mrope.plain_positions``), and its deltas are all zero.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.image_processing import (
    ImageConfig, KimiImageConfig, ProcessedImage, QwenImageConfig, batch_pixels, preprocess_images,
)
from dayzero.model.config import ModelConfig
from dayzero.model.hf_config_vision_kimi import KimiVisionConfig
from dayzero.model.mrope import ImageInput, plain_positions, rope_index
from dayzero.model.vision_kimi import encode_kimi_images
from dayzero.model.vision_qwen import VISION_QUERY_BLOCK, encode_images

MIN_PATCH_BUCKET = 64  # patches per tower call, rounded up to a bucket (patch_bucket) from here
MIN_ENTRY_BUCKET = 16  # image entries per prefill chunk, likewise


def _pow2(n: int, minimum: int) -> int:
    return 1 << max(n - 1, minimum - 1).bit_length()


def _is_kimi(config: ModelConfig) -> bool:
    return isinstance(config.vision, KimiVisionConfig)


def image_config_of(config: ModelConfig) -> ImageConfig:
    """The image preprocessing of ``config``'s vision tower (sizes from the tower; pixel bounds or
    patch budget and normalisation as the published Qwen3-VL / Qwen3.5 or Kimi-K2.5 processors)."""
    vc = config.vision
    if _is_kimi(config):
        kh, kw = vc.merge_kernel
        if kh != kw:
            raise ValueError(f"the Kimi tower's merge_kernel_size={[kh, kw]} is not square; its image processor "
                             "merges square blocks only")
        return KimiImageConfig(patch_size=vc.patch_size, merge_size=kh)
    return QwenImageConfig(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                           temporal_patch_size=vc.temporal_patch_size)


def preprocess(sources: Sequence, image_config: ImageConfig) -> list[ProcessedImage]:
    """Every image of a request (anything ``engine.images.load_image`` accepts), preprocessed."""
    return preprocess_images(list(sources), image_config)


def expand_placeholders(ids: list[int], images: Sequence[ProcessedImage], image_token_id: int) -> list[int]:
    """``ids`` with its k-th ``image_token_id`` repeated ``images[k].num_tokens`` times. Raises
    ValueError when the prompt's placeholder count is not the image count."""
    found = sum(1 for i in ids if i == image_token_id)
    if found != len(images):
        raise ValueError(f"the prompt has {found} image placeholders (token {image_token_id}) for {len(images)} "
                         "images; put one placeholder per image, between the vision start and end tokens")
    out, k = [], 0
    for i in ids:
        if i == image_token_id:
            out += [i] * images[k].num_tokens
            k += 1
        else:
            out.append(i)
    return out


def encode(weights, config: ModelConfig, images: Sequence[ProcessedImage]) -> tuple[jax.Array, list[jax.Array]]:
    """The tower over ``images`` in one call, padded to a :func:`patch_bucket` (one compile per
    bucket): merged embeddings [N, D] (N: the images' tokens, in order) and DeepStack features
    (none for Kimi-K2.5)."""
    pixels, grids = batch_pixels(list(images))
    padded = patch_bucket(config, pixels.shape[0])
    grids = [tuple(g) for g in grids]
    if _is_kimi(config):
        return encode_kimi_images(weights.vision, config.vision, pixels, grids, padded_patches=padded), []
    return encode_images(weights.vision, config.vision, pixels, grids, padded_patches=padded)


def patch_bucket(config: ModelConfig, patches: int) -> int:
    """The padded patch count :func:`encode` runs ``patches`` patches at (its compile key), a
    multiple of the merge unit: the next power of two from ``MIN_PATCH_BUCKET`` on, or, where an
    eighth of that power of two is at least the tower's query block (above 2048 patches, with
    blocks of 512), the next multiple of that eighth: four buckets per octave (at most 25% padding,
    not 100%), each a whole number of query blocks (896 px: 3136 patches run as 3584, not 4096)."""
    unit = config.vision.merge_unit
    padded = _pow2(patches, max(MIN_PATCH_BUCKET, unit))
    if padded // 8 >= VISION_QUERY_BLOCK:
        padded = -(-patches // (padded // 8)) * (padded // 8)
    return -(-padded // unit) * unit


@dataclasses.dataclass
class ImagePrefill:
    """The image side of one batch's prefill."""

    positions: np.ndarray  # [3, B, L] int32, M-RoPE positions (rope_index; Kimi: plain); L the longest prompt
    deltas: np.ndarray  # [B] int32, rope deltas of the rows (0 for a row without images)
    rows: np.ndarray  # [N] placeholder rows, in the order of the tower's output
    cols: np.ndarray  # [N] placeholder columns in the padded prompt
    embeds: jax.Array  # [N, D]
    deepstack: tuple[jax.Array, ...]

    @classmethod
    def build(cls, config: ModelConfig, ids: Sequence[Sequence[int]], lengths: np.ndarray, grids, embeds,
              deepstack) -> "ImagePrefill":
        """From the prompts' expanded ``ids`` (``lengths`` tokens each), the images' ``grids`` in
        order over the rows and the tower's output (``encode``)."""
        vc = config.vision
        tokens = np.zeros((len(ids), int(lengths.max())), np.int64)
        for b, row in enumerate(ids):
            tokens[b, :len(row)] = row
        if _is_kimi(config):  # no M-RoPE: an image's tokens count on as text does
            positions, deltas = plain_positions(*tokens.shape)
        else:
            positions, deltas = rope_index(vc, tokens, grids, lengths)
        mask = (tokens == vc.image_token_id) & (np.arange(tokens.shape[1])[None] < lengths[:, None])
        rows, cols = np.nonzero(mask)  # row-major: the order of the images' merged tokens
        if len(rows) != embeds.shape[0]:
            raise ValueError(f"{len(rows)} image placeholders for {embeds.shape[0]} image embeddings")
        return cls(positions, deltas, rows, cols, embeds, tuple(deepstack))

    def chunk(self, start: int, T: int) -> ImageInput:
        """The :class:`ImageInput` of the prefill chunk of tokens [start, start + T): its
        positions, and its image entries (columns relative to the chunk) padded to a bucket."""
        take = np.flatnonzero((self.cols >= start) & (self.cols < start + T))
        idx = jnp.asarray(take, jnp.int32)
        as_i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
        positions = self.positions[:, :, start:start + T]
        # Past the longest prompt (the last chunk's padding, never attended) any position will do.
        positions = np.pad(positions, [(0, 0), (0, 0), (0, T - positions.shape[2])], mode="edge")
        out = ImageInput(position_ids=as_i32(positions), embeds=self.embeds[idx],
                         rows=as_i32(self.rows[take]), cols=as_i32(self.cols[take] - start),
                         deepstack=tuple(d[idx] for d in self.deepstack))
        return out.padded(_pow2(len(take), MIN_ENTRY_BUCKET))
