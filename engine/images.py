"""Image inputs: a file, a base64 data URL, encoded bytes, a PIL image or a numpy array -> RGB.

HF transformers is the reference. Transparent images are composited onto white, as HF's image
processors do (``convert_to_rgb``); encoded images (files, data URLs, bytes) get their EXIF
orientation applied, as HF's ``load_image`` does. Nothing is fetched over the network: http(s)
URLs are refused. Every refusal is one ``ImageError`` that names the input and says what to do.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import warnings
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps

# What callers may pass as one image.
ImageSource = Union[str, bytes, os.PathLike, Image.Image, np.ndarray]

# Decoders Pillow may use. Restricting them keeps exotic plugins (EPS runs Ghostscript) away from
# bytes a server receives from anyone.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

# Refuse images with more pixels than this before decoding them (Pillow's own bomb threshold,
# about 89.5 MP, ~270 MB as RGB): every model here downscales far below it anyway.
MAX_IMAGE_PIXELS = 89_478_485

# 16-bit and float modes: Pillow's conversion to RGB clips them to 0..255, which saturates almost
# every pixel, so HF would silently feed the model a white image.
_HIGH_BIT_MODES = ("I", "F", "I;16", "I;16L", "I;16B", "I;16N")

_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)", re.DOTALL)
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class ImageError(ValueError):
    """An image input that cannot be used; the message names the input and what to do."""


def describe_image_source(source: object) -> str:
    """A short human name for an image input, for error messages (never the whole payload)."""
    if isinstance(source, Image.Image):
        return f"PIL image ({source.mode}, {source.width}x{source.height})"
    if isinstance(source, np.ndarray):
        return f"numpy array of shape {tuple(source.shape)} and dtype {source.dtype}"
    if isinstance(source, (bytes, bytearray)):
        return f"{len(source)} bytes of image data"
    if isinstance(source, str) and source.startswith("data:"):
        mime = source[5:].split(",", 1)[0][:40]
        return f"data URL ({mime}, {len(source)} characters)"
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        return repr(text if len(text) <= 200 else text[:200] + "...")
    return f"a {type(source).__name__}"


def load_image(source: ImageSource) -> Image.Image:
    """Decode one image input into an 8-bit RGB PIL image.

    ``source`` is a file path (str or PathLike) of a PNG/JPEG (or WebP/GIF/BMP), a
    ``data:image/...;base64,...`` URL, the encoded bytes of such a file, a PIL image in any mode
    Pillow converts to RGB, or a numpy uint8 array of shape (H, W), (H, W, 1), (H, W, 3) or
    (H, W, 4) (channels last). Raises ``ImageError`` for anything else.
    """
    if isinstance(source, Image.Image):
        return _to_rgb(_loaded(source, describe_image_source(source)), describe_image_source(source))
    if isinstance(source, np.ndarray):
        return _from_array(source)
    if isinstance(source, (bytes, bytearray)):
        return _decode(bytes(source), describe_image_source(source))
    if isinstance(source, str) and source.startswith("data:"):
        return _decode(_data_url_bytes(source), describe_image_source(source))
    if isinstance(source, (str, os.PathLike)):
        return _decode(_file_bytes(source), describe_image_source(source))
    raise ImageError(
        f"unsupported image input {describe_image_source(source)}: pass a file path, a "
        "data:image/...;base64 URL, encoded image bytes, a PIL image or a uint8 numpy array"
    )


def _file_bytes(path: str | os.PathLike) -> bytes:
    """Read an image file, refusing URLs (no network) and naming missing files."""
    name = describe_image_source(path)
    text = os.fspath(path)
    if isinstance(text, str) and _URL_SCHEME.match(text):
        raise ImageError(
            f"image {name} is a URL; dayzero does not fetch images over the network (it reads local "
            "paths and data: URLs): download it and pass the file, or send a data:image/png;base64,... URL"
        )
    file = Path(text)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise ImageError(f"image file {name} {what}; pass the path of a PNG or JPEG file")
    try:
        return file.read_bytes()
    except OSError as e:
        raise ImageError(f"cannot read image file {name}: {e.strerror or e}") from None


def _data_url_bytes(url: str) -> bytes:
    """The bytes a ``data:image/...;base64,...`` URL carries."""
    name = describe_image_source(url)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise ImageError(f"image {name} is not a valid data URL; use data:image/png;base64,<base64 bytes>")
    mime = match["mime"].strip().lower()
    if not mime.startswith("image/"):
        raise ImageError(f"image {name} has media type {mime or 'none'!r}; send an image/png or image/jpeg data URL")
    if "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
        raise ImageError(f"image {name} is not base64-encoded; use data:{mime};base64,<base64 bytes>")
    payload = re.sub(r"\s+", "", match["payload"])
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"image {name} carries invalid base64; re-encode the image bytes with base64") from None


def _decode(data: bytes, name: str) -> Image.Image:
    """Decode encoded image bytes fully (so truncation shows here) and orient them like HF."""
    if not data:
        raise ImageError(f"image {name} is empty; pass a PNG or JPEG image")
    try:
        with warnings.catch_warnings():
            # Our own pixel limit below refuses these with a clearer message.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.UnidentifiedImageError:
        raise ImageError(
            f"image {name} is not a readable image; pass a PNG or JPEG "
            f"(formats read: {', '.join(ALLOWED_FORMATS)})"
        ) from None
    except Image.DecompressionBombError:
        raise ImageError(f"image {name} has more than {MAX_IMAGE_PIXELS} pixels; downscale it first") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"image {name} cannot be decoded ({e}); pass an intact PNG or JPEG") from None
    image = _loaded(image, name)
    try:
        image = ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, KeyError, TypeError) as e:
        raise ImageError(f"image {name} has unreadable EXIF metadata ({e}); strip it or re-save the image") from None
    return _to_rgb(image, name)


def _loaded(image: Image.Image, name: str) -> Image.Image:
    """Force the (lazy) decode, refusing oversized images before any pixel is decoded."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(
            f"image {name} has {width}x{height} = {width * height} pixels, more than the "
            f"{MAX_IMAGE_PIXELS} accepted; downscale it first"
        )
    if width == 0 or height == 0:
        raise ImageError(f"image {name} is empty ({width}x{height}); pass an image with pixels")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"image {name} cannot be decoded ({e}); the file may be truncated or corrupt") from None
    return image


def _to_rgb(image: Image.Image, name: str) -> Image.Image:
    """RGB like HF's ``convert_to_rgb``: alpha (or a palette transparency) composited onto white."""
    if image.mode in _HIGH_BIT_MODES:
        raise ImageError(
            f"image {name} has mode {image.mode!r} (16-bit or floating point), which converts to "
            "8-bit RGB only by clipping; convert it to an 8-bit RGB or grayscale image first"
        )
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except (OSError, ValueError) as e:
        raise ImageError(f"image {name} has mode {image.mode!r}, which cannot be converted to RGB ({e})") from None


def _from_array(array: np.ndarray) -> Image.Image:
    """A channels-last uint8 array as an RGB image (grayscale repeated, RGBA onto white)."""
    name = describe_image_source(array)
    if array.dtype != np.uint8:
        raise ImageError(
            f"image {name} must have dtype uint8 (0..255); convert it, e.g. "
            "(x * 255).round().astype(np.uint8) for floats in [0, 1]"
        )
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (3, 4))):
        raise ImageError(
            f"image {name} must be (height, width) grayscale or (height, width, channels) with 1, 3 "
            "or 4 channels last; transpose a channels-first array with x.transpose(1, 2, 0)"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"image {name} is empty; pass an image with pixels")
    if array.shape[0] * array.shape[1] > MAX_IMAGE_PIXELS:
        raise ImageError(f"image {name} has more than {MAX_IMAGE_PIXELS} pixels; downscale it first")
    # Pillow infers the mode from the shape: L, RGB or RGBA.
    return _to_rgb(Image.fromarray(np.ascontiguousarray(array)), name)
