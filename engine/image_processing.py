"""Per-model image preprocessing, numerically equal to HF's image processors (Pillow + numpy).

Two schemes, each a frozen config dataclass:

- ``QwenImageConfig``: Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE (HF ``Qwen2VLImageProcessorPil``
  with the checkpoints' preprocessor_config.json: 16-pixel patches, 2x2 merge, mean = std = 0.5).
  ``smart_resize`` to a multiple of patch*merge within [min_pixels, max_pixels], bicubic, rescale
  by 1/255 and normalise, then patches in merge-block order with the single image repeated over the
  temporal patch: pixel_values [grid_h*grid_w, C*T*P*P].
- ``KimiImageConfig``: Kimi-K2.5 (HF ``Kimi_K25ImageProcessor``): never upscaled, downscaled only
  past a patch budget, zero-padded to a multiple of patch*merge, normalised, then row-major
  patches: pixel_values [grid_h*grid_w, C, P, P].

Both give grid_thw = (1, grid_h, grid_w) and grid_h*grid_w / merge**2 placeholder tokens per image.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
from PIL import Image

from dayzero.engine.images import ImageError, ImageSource, describe_image_source, load_image

# HF's PILImageResampling.BICUBIC, the only filter these processors use.
_BICUBIC = 3


class ImageConfigError(ValueError):
    """A preprocessor configuration dayzero cannot honour."""


def _check_common(config: Any) -> None:
    """Shared validation: positive sizes, three channel statistics, no zero std."""
    for name in ("patch_size", "merge_size"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
            raise ImageConfigError(f"{name} must be a positive integer, got {getattr(config, name)!r}")
    if len(config.image_mean) != 3 or len(config.image_std) != 3 or 0 in config.image_std:
        raise ImageConfigError(
            f"image_mean and image_std need 3 values and a non-zero std, got {config.image_mean}, {config.image_std}"
        )


@dataclass(frozen=True)
class QwenImageConfig:
    """Qwen3-VL / Qwen3.5 image preprocessing; the defaults are the published checkpoints'."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    # Token strings of the Qwen chat template and processor.
    image_token: str = field(default="<|image_pad|>", init=False)
    start_token: str = field(default="<|vision_start|>", init=False)
    end_token: str = field(default="<|vision_end|>", init=False)

    def __post_init__(self):
        _check_common(self)
        if self.temporal_patch_size < 1 or not 1 <= self.min_pixels <= self.max_pixels:
            raise ImageConfigError(
                f"need temporal_patch_size >= 1 and 1 <= min_pixels <= max_pixels, got "
                f"{self.temporal_patch_size}, {self.min_pixels}, {self.max_pixels}"
            )

    @classmethod
    def from_preprocessor_config(cls, config: dict[str, Any]) -> QwenImageConfig:
        """Parse a Qwen preprocessor_config.json (HF ``Qwen2VLImageProcessor`` keys), strictly."""
        rest = _common_fields(config, ignored=("processor_class", "image_processor_type"))
        size = dict(rest.pop("size", None) or {})
        unknown_size = set(size) - {"shortest_edge", "longest_edge"}
        # Legacy top-level min/max_pixels override ``size``, as in HF's constructor.
        min_pixels = rest.pop("min_pixels", None) or size.get("shortest_edge", cls.min_pixels)
        max_pixels = rest.pop("max_pixels", None) or size.get("longest_edge", cls.max_pixels)
        known = {"patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "rescale_factor"}
        _refuse_unknown(set(rest) - known, {f"size.{k}" for k in unknown_size})
        return cls(min_pixels=int(min_pixels), max_pixels=int(max_pixels), **rest)


@dataclass(frozen=True)
class KimiImageConfig:
    """Kimi-K2.5 image preprocessing; the defaults are the published checkpoint's."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384  # patch budget before padding ("in_patch_limit")
    max_patches_per_side: int = 512  # ("patch_limit_on_one_side"; HF's size.max_height)
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    # Token strings of the Kimi chat template and HF processor.
    image_token: str = field(default="<|media_pad|>", init=False)
    start_token: str = field(default="<|media_begin|>image<|media_content|>", init=False)
    end_token: str = field(default="<|media_end|>", init=False)

    def __post_init__(self):
        _check_common(self)
        if self.max_patches < 1 or self.max_patches_per_side < 1:
            raise ImageConfigError(
                f"max_patches and max_patches_per_side must be positive, got "
                f"{self.max_patches}, {self.max_patches_per_side}"
            )

    @classmethod
    def from_preprocessor_config(cls, config: dict[str, Any]) -> KimiImageConfig:
        """Parse Kimi-K2.5's preprocessor_config.json: HF's keys, or Moonshot's ``media_proc_cfg``."""
        if "media_proc_cfg" in config:
            return cls._from_media_proc_cfg(config)
        rest = _common_fields(config, ignored=("processor_class", "image_processor_type"))
        size = dict(rest.pop("size", None) or {})
        side = size.pop("max_height", cls.max_patches_per_side)
        if size.pop("max_width", side) != side or size:
            raise ImageConfigError(f"size must be {{'max_height': N, 'max_width': N}}, got {config['size']}")
        known = {"patch_size", "merge_size", "max_patches", "image_mean", "image_std", "rescale_factor"}
        _refuse_unknown(set(rest) - known)
        return cls(max_patches_per_side=int(side), **rest)

    @classmethod
    def _from_media_proc_cfg(cls, config: dict[str, Any]) -> KimiImageConfig:
        """Moonshot's own format; its video-only keys are ignored (dayzero takes images only)."""
        _refuse_unknown(set(config) - {"media_proc_cfg", "auto_map", "processor_class", "config_type"})
        media = dict(config["media_proc_cfg"])
        video_keys = {"in_patch_limit_each_frame", "in_patch_limit_video", "sample_fps",
                      "max_num_frames_each_video", "temporal_merge_kernel_size", "timestamp_mode", "config_type"}
        if media.get("fixed_output_tokens") is not None:
            raise ImageConfigError(f"fixed_output_tokens={media['fixed_output_tokens']} is not supported; use null")
        media.pop("fixed_output_tokens", None)
        names = {"patch_size": "patch_size", "merge_kernel_size": "merge_size", "in_patch_limit": "max_patches",
                 "patch_limit_on_one_side": "max_patches_per_side", "image_mean": "image_mean",
                 "image_std": "image_std"}
        _refuse_unknown({f"media_proc_cfg.{k}" for k in set(media) - set(names) - video_keys})
        kwargs = {names[k]: v for k, v in media.items() if k in names}
        if isinstance(kwargs.get("merge_size"), (list, tuple)):
            if len(set(kwargs["merge_size"])) != 1:
                raise ImageConfigError(f"merge_kernel_size must be square, got {kwargs['merge_size']}")
            kwargs["merge_size"] = kwargs["merge_size"][0]
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})


ImageConfig = Union[QwenImageConfig, KimiImageConfig]


def _common_fields(config: dict[str, Any], ignored: tuple[str, ...]) -> dict[str, Any]:
    """Check the HF processor switches are at the behaviour implemented here; return the rest."""
    rest = {k: v for k, v in config.items() if k not in ignored}
    expected = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                "resample": _BICUBIC}
    for key, value in expected.items():
        if key in rest and rest.pop(key) not in (value, None):
            raise ImageConfigError(f"{key}={config[key]!r} is not supported; dayzero implements {key}={value!r}")
    for key in ("image_mean", "image_std"):
        if key in rest:
            rest[key] = tuple(float(v) for v in rest[key])
    return rest


def _refuse_unknown(*key_sets: set[str]) -> None:
    """One error listing every preprocessor key that is neither handled nor ignored."""
    unknown = sorted(set().union(*key_sets))
    if unknown:
        raise ImageConfigError(f"unknown preprocessor_config keys {unknown}; dayzero does not know how to honour them")


@dataclass(frozen=True)
class ProcessedImage:
    """One preprocessed image: the vision encoder's input and its placeholder-token count."""

    pixel_values: np.ndarray  # float32; Qwen [N, C*T*P*P], Kimi [N, C, P, P]; N = grid_h * grid_w
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches
    num_tokens: int  # placeholder tokens in the prompt: grid_h * grid_w / merge**2

    @property
    def digest(self) -> str:
        """sha256 over the grid and pixel values: the image's identity, e.g. in prefix-cache keys."""
        h = hashlib.sha256(np.asarray(self.grid_thw, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.pixel_values).tobytes())
        return h.hexdigest()


def qwen_resized_size(height: int, width: int, config: QwenImageConfig) -> tuple[int, int]:
    """Qwen's ``smart_resize``: (height, width) rounded to multiples of patch*merge, area bounded.

    The aspect ratio is kept as well as the rounding allows; an image smaller than min_pixels is
    scaled up, one larger than max_pixels scaled down. Aspect ratios over 200 are refused.
    """
    if max(height, width) / min(height, width) > 200:
        raise ImageError(
            f"image of {width}x{height} has an aspect ratio over 200, which Qwen's preprocessing "
            "refuses; crop or pad it"
        )
    factor = config.patch_size * config.merge_size
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def kimi_resized_size(height: int, width: int, config: KimiImageConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kimi's resize rule: ((resized h, w), (padded h, w)).

    Scale = the tightest of 1 (never upscale), sqrt(max_patches / whole patches) and
    max_patches_per_side * patch / side; sizes truncate to int; then zero padding up to a
    multiple of patch*merge.
    """
    patch, side_limit = config.patch_size, config.max_patches_per_side * config.patch_size
    patches = max(1, height // patch) * max(1, width // patch)
    scale = min(1.0, math.sqrt(config.max_patches / patches), side_limit / height, side_limit / width)
    h = min(max(1, int(height * scale)), side_limit)
    w = min(max(1, int(width * scale)), side_limit)
    factor = patch * config.merge_size
    return (h, w), (-(-h // factor) * factor, -(-w // factor) * factor)


def image_grid(height: int, width: int, config: ImageConfig) -> tuple[int, int, int]:
    """grid_thw of an image of this size, without touching pixels."""
    if isinstance(config, QwenImageConfig):
        h, w = qwen_resized_size(height, width, config)
    else:
        _, (h, w) = kimi_resized_size(height, width, config)
    return 1, h // config.patch_size, w // config.patch_size


def num_image_tokens(height: int, width: int, config: ImageConfig) -> int:
    """Placeholder tokens an image of this size takes in the prompt (HF's processor count)."""
    t, h, w = image_grid(height, width, config)
    return t * h * w // config.merge_size**2


def preprocess_image(source: ImageSource, config: ImageConfig) -> ProcessedImage:
    """Load one image (any ``load_image`` input) and preprocess it as HF does for ``config``."""
    image = load_image(source)
    if isinstance(config, QwenImageConfig):
        return _qwen(image, config)
    if isinstance(config, KimiImageConfig):
        return _kimi(image, config)
    raise ImageConfigError(f"unknown image config {type(config).__name__}; use QwenImageConfig or KimiImageConfig")


def preprocess_images(sources: list, config: ImageConfig) -> list[ProcessedImage]:
    """``preprocess_image`` over several images; an error names the image's position."""
    out = []
    for i, source in enumerate(sources):
        try:
            out.append(preprocess_image(source, config))
        except ImageError as e:
            raise ImageError(f"image {i + 1} of {len(sources)}: {e}") from None
    return out


def batch_pixels(images: list[ProcessedImage]) -> tuple[np.ndarray, np.ndarray]:
    """HF's batched processor outputs: (pixel_values concatenated over images, image_grid_thw [n, 3])."""
    if not images:
        raise ImageError("no images to batch")
    pixels = np.concatenate([im.pixel_values for im in images], axis=0)
    return pixels, np.array([im.grid_thw for im in images], dtype=np.int64)


def _qwen(image: Image.Image, config: QwenImageConfig) -> ProcessedImage:
    """Resize, rescale+normalise, then patchify in merge-block order with temporal repetition."""
    h, w = qwen_resized_size(image.height, image.width, config)
    # HF resizes even when the size is unchanged; Pillow then returns an identical copy.
    pixels = np.asarray(image.resize((w, h), resample=Image.Resampling.BICUBIC))
    # HF's order of operations (rescale in float64, cast, normalise in float32) so values match bit for bit.
    x = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    x = (x - np.asarray(config.image_mean, np.float32)) / np.asarray(config.image_std, np.float32)
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = h // p, w // p
    # [H, W, C] -> [gh/m, m, p, gw/m, m, p, C] -> [gh/m, gw/m, m, m, C, p, p]: consecutive rows are
    # the m*m patches one merged token covers, as the Qwen vision merger expects.
    x = x.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    # A still image fills every temporal slot of the Conv3d patch embedding.
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    x = x.reshape(gh * gw, 3 * t * p * p)
    return ProcessedImage(np.ascontiguousarray(x), (1, gh, gw), gh * gw // m**2)


def _kimi(image: Image.Image, config: KimiImageConfig) -> ProcessedImage:
    """Downscale if over budget, zero-pad, normalise, then patchify row-major."""
    (h, w), (ph, pw) = kimi_resized_size(image.height, image.width, config)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    pixels = np.zeros((ph, pw, 3), dtype=np.uint8)
    pixels[:h, :w] = np.asarray(image)
    # HF fuses the rescale into float32 statistics: (x - mean*255) / (std*255).
    scale = np.float32(1.0 / config.rescale_factor)
    mean = np.asarray(config.image_mean, np.float32) * scale
    std = np.asarray(config.image_std, np.float32) * scale
    x = (pixels.astype(np.float32) - mean) / std
    p = config.patch_size
    gh, gw = ph // p, pw // p
    x = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return ProcessedImage(np.ascontiguousarray(x), (1, gh, gw), gh * gw // config.merge_size**2)


def image_placeholder(num_tokens: int, config: ImageConfig) -> str:
    """The prompt text of one image after expansion: start, num_tokens image tokens, end."""
    return config.start_token + config.image_token * num_tokens + config.end_token


def expand_image_tokens(text: str, images: list[ProcessedImage], config: ImageConfig) -> str:
    """Replace the i-th image token of a rendered chat with num_tokens copies, as HF's processor does.

    The chat template writes one image token per image (inside its start/end markers); the
    counts of tokens and images must agree.
    """
    parts = text.split(config.image_token)
    if len(parts) - 1 != len(images):
        raise ImageError(
            f"the prompt has {len(parts) - 1} image placeholder(s) {config.image_token!r} but "
            f"{len(images)} image(s) were given; give one image per placeholder"
        )
    out = [parts[0]]
    for image, part in zip(images, parts[1:]):
        out += [config.image_token * image.num_tokens, part]
    return "".join(out)


__all__ = [
    "ImageConfig", "ImageConfigError", "ImageError", "KimiImageConfig", "ProcessedImage", "QwenImageConfig",
    "batch_pixels", "describe_image_source", "expand_image_tokens", "image_grid", "image_placeholder",
    "kimi_resized_size", "num_image_tokens", "preprocess_image", "preprocess_images", "qwen_resized_size",
]
