"""A served request's images, from ``ServingEngine.submit`` to its last prefill chunk.

- At submit the images are preprocessed and their placeholders expanded
  (``Engine.image_prompt``: a bad image is refused before anything is queued).
- The tower runs once, at the request's first prefill chunk, on the replica that serves it; the
  encoded images stay with the request, so a recomputation after preemption does not run it again.
- Each prefill chunk gets its slice of the M-RoPE positions and image entries
  (``vision_step.ImagePrefill``), built over the tokens prefill covers (after a preemption those
  include generated text, which continues the positions).
- Decode steps shift every row's positions by its ``rope_delta``.
- Prefix-cache keys: every image placeholder has the same token id, so pages are hashed over the
  prompt with each placeholder replaced by a key derived from its image's digest and its index
  within the image (negative, never a token id): the same image at the same place reuses pages,
  another image never does.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dayzero.engine.image_processing import ProcessedImage
from dayzero.model.mrope import ImageInput


def placeholder_keys(prompt: Sequence[int], images: Sequence[ProcessedImage], image_token_id: int) -> list[int]:
    """``prompt`` (placeholders expanded) with the k-th placeholder of image j replaced by
    ``-(1 + d_j + k)``, d_j the first 56 bits of image j's digest: the tokens its pages are hashed over."""
    keys, placed = list(prompt), [0] * len(images)
    bases = [int(im.digest[:14], 16) for im in images]
    runs = iter(range(len(images)))
    j = None
    for i, token in enumerate(keys):
        if token != image_token_id:
            j = None
            continue
        if j is None or placed[j] == images[j].num_tokens:  # the next image's run starts here
            j = next(runs)
        keys[i] = -(1 + bases[j] + placed[j])
        placed[j] += 1
    return keys


@dataclasses.dataclass
class RequestImages:
    """The images of one served request and what was computed from them."""

    images: list[ProcessedImage]  # preprocessed, in prompt order
    keys: list[int]  # the prompt as its pages are hashed (``placeholder_keys``)
    encoded: tuple | None = None  # (grids, embeds, deepstack) once the tower ran
    prefill: object | None = None  # vision_step.ImagePrefill over ``covered`` tokens
    covered: int = 0

    @classmethod
    def of(cls, prompt: list[int], images: list[ProcessedImage], image_token_id: int) -> "RequestImages":
        """The images of a request whose expanded prompt is ``prompt``."""
        return cls(images, placeholder_keys(prompt, images, image_token_id))

    def hash_tokens(self, tokens: Sequence[int]) -> list[int]:
        """What the pages of ``tokens`` (prompt, then generated text) are hashed over."""
        return self.keys + list(tokens[len(self.keys):])

    def chunk(self, engine, tokens: Sequence[int], start: int, T: int) -> ImageInput:
        """The ImageInput of the prefill chunk [start, start + T) of ``tokens`` (every position
        prefill computes), running the tower (``engine``'s weights) on the first call."""
        from dayzero.engine import vision_step  # loads with the first image request

        if self.encoded is None:
            embeds, deepstack = vision_step.encode(engine.weights, engine.config, self.images)
            self.encoded = ([im.grid_thw for im in self.images], embeds, deepstack)
        if self.prefill is None or self.covered != len(tokens):
            self.prefill = vision_step.ImagePrefill.build(engine.config, [list(tokens)], np.array([len(tokens)]),
                                                          *self.encoded)
            self.covered = len(tokens)
        return self.prefill.chunk(start, T)

    @property
    def rope_delta(self) -> int:
        """What the request's decode positions are shifted by (0 before its first prefill chunk)."""
        return 0 if self.prefill is None else int(self.prefill.deltas[0])
