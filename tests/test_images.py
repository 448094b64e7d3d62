"""Image loading and per-model preprocessing against HF transformers' processors.

Oracles: HF's ``Qwen2VLImageProcessorPil`` (what the qwen3_vl / qwen3_5 processors use, configured
with the published checkpoints' preprocessor_config.json), HF's ``load_image`` and
``convert_to_rgb``, and HF's ``Qwen3VLProcessor`` / ``Kimi_K25Processor`` token expansion. HF's
Kimi image processor only exists for torchvision, which does not load here: its own module is
imported with torchvision stubbed out, and its ``navit_resize`` and ``patchify`` with torch's
normalisation form the Kimi oracle (see ``_hf_kimi``).
"""

from __future__ import annotations

import base64
import importlib
import io
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image as hf_load_image
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.utils import is_torchvision_available

from dayzero.engine import images as images_module
from dayzero.engine.image_processing import (
    ImageConfigError, KimiImageConfig, QwenImageConfig, batch_pixels, expand_image_tokens, image_placeholder,
    num_image_tokens, preprocess_image, preprocess_images,
)
from dayzero.engine.images import ImageError, load_image

# Qwen/Qwen3.5-* and Qwen3-VL preprocessor_config.json as published.
QWEN_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
# Moonshot's media_proc_cfg of Kimi-K2.5 (its video keys included: they must be ignored).
KIMI_CONFIG = {"media_proc_cfg": {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}}
QWEN = QwenImageConfig.from_preprocessor_config(QWEN_CONFIG)
KIMI = KimiImageConfig.from_preprocessor_config(KIMI_CONFIG)


def _picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A photo-like HWC uint8 image: smooth gradients (so resampling means something) plus noise."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    base = np.stack(np.broadcast_arrays(200 * x + 40 * y, 255 * y * (1 - x), 128 + 100 * np.sin(6 * x + 3 * y)), -1)
    noise = rng.integers(-20, 21, base.shape, dtype=np.int16)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def _hf_qwen(config: dict = QWEN_CONFIG) -> Qwen2VLImageProcessorPil:
    ignored = ("processor_class", "image_processor_type")
    return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k not in ignored})


def _assert_qwen_equal(source, hf_input, config=QWEN, hf_config=QWEN_CONFIG):
    """Our preprocessing of ``source`` equals HF's PIL processor on ``hf_input``, bit for bit."""
    ours = preprocess_image(source, config)
    ref = _hf_qwen(hf_config)(images=[hf_input])
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0])
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == ref["pixel_values"].shape
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
    assert ours.num_tokens == ref["image_grid_thw"][0].prod() // 4


# --- Qwen3-VL / Qwen3.5 ---------------------------------------------------------------------------

# tiny (upscaled to min_pixels), not multiples of 32, very wide, very tall, odd and large.
@pytest.mark.parametrize("size", [(1, 1), (17, 23), (300, 500), (333, 1001), (40, 1500), (2000, 61), (1024, 1024)])
def test_qwen_sizes_match_hf(size):
    picture = Image.fromarray(_picture(*size))
    _assert_qwen_equal(picture, picture)


def test_qwen_larger_than_max_pixels_matches_hf():
    config = dict(QWEN_CONFIG, size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256})
    picture = Image.fromarray(_picture(700, 950))
    ours = QwenImageConfig.from_preprocessor_config(config)
    _assert_qwen_equal(picture, picture, ours, config)
    assert preprocess_image(picture, ours).pixel_values.shape[0] * 16 * 16 <= 256 * 256


@pytest.mark.parametrize("mode", ["L", "RGBA", "LA", "P", "P+transparency", "1", "CMYK"])
def test_qwen_modes_match_hf(mode):
    rgb = Image.fromarray(_picture(90, 130, seed=1))
    if mode == "RGBA":
        image = rgb.copy()
        image.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, 130), (90, 1)).astype(np.uint8)))
    elif mode == "P+transparency":
        image = rgb.quantize(16)
        image.info["transparency"] = 3
    else:
        image = rgb.convert(mode)
    _assert_qwen_equal(image, image)


def test_qwen_numpy_inputs_match_hf():
    pixels = _picture(120, 77, seed=2)
    _assert_qwen_equal(pixels, pixels)
    gray = pixels[..., 0]
    _assert_qwen_equal(gray, gray[..., None])  # HF takes (H, W, 1); ours also (H, W)
    rgba = np.concatenate([pixels, np.random.default_rng(3).integers(0, 256, (120, 77, 1), dtype=np.uint8)], -1)
    _assert_qwen_equal(rgba, rgba)


def _encoded(pixels: np.ndarray, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **kwargs)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_every_input_kind_matches_hf(tmp_path, fmt):
    """File path (str and Path), data URL, bytes, PIL, numpy: the same pixels HF decodes."""
    data = _encoded(_picture(210, 330, seed=4), fmt, quality=90) if fmt == "JPEG" else _encoded(_picture(210, 330), fmt)
    path = tmp_path / f"picture.{fmt.lower()}"
    path.write_bytes(data)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    decoded = Image.open(path)
    for source in (str(path), path, url, data, Image.open(path), np.asarray(decoded.convert("RGB"))):
        _assert_qwen_equal(source, decoded)
    for source in (str(path), url):  # loading alone equals HF's load_image
        np.testing.assert_array_equal(np.asarray(load_image(source)), np.asarray(hf_load_image(source)))


def test_exif_orientation_applied_like_hf_load_image(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    path = tmp_path / "rotated.jpg"
    Image.fromarray(_picture(60, 100)).save(path, exif=exif.tobytes())
    ours = load_image(str(path))
    assert ours.size == (60, 100)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(hf_load_image(str(path))))


# --- Kimi-K2.5 ------------------------------------------------------------------------------------

def _hf_kimi_module():
    """HF's image_processing_kimi_k25, imported with torchvision stubbed (only its torch code is used)."""
    assert not is_torchvision_available()  # caches the answer before the stub exists
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    names.append("torchvision.transforms.v2.functional")
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision.transforms.v2"].functional = sys.modules[names[-1]]
    target = "transformers.models.kimi_k25.image_processing_kimi_k25"
    try:
        return importlib.import_module(target)
    finally:
        # Leave no trace: later imports of the module (elsewhere in this worker) fail as usual.
        sys.modules.pop(target, None)
        parent = importlib.import_module("transformers.models.kimi_k25")
        if "image_processing_kimi_k25" in vars(parent):
            delattr(parent, "image_processing_kimi_k25")
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@pytest.fixture(scope="module")
def hf_kimi():
    return _hf_kimi_module()


def _hf_kimi(module, image, max_patches=16384, side=512):
    """HF's Kimi pipeline on CPU: convert_to_rgb, navit_resize, zero pad, fused normalise, patchify.

    The one step not HF's: the downscale (only for images over the patch budget) uses Pillow's
    bicubic, as Moonshot's own processor does; HF's torchvision resize differs by a few levels.
    """
    rgb = convert_to_rgb(image, return_numpy=True) if isinstance(image, Image.Image) else image
    h, w = rgb.shape[:2]
    (rh, rw), (ph, pw) = module.navit_resize(h, w, 14, 2, max_patches, side)
    if (rh, rw) != (h, w):
        rgb = np.asarray(Image.fromarray(rgb).resize((rw, rh), Image.Resampling.BICUBIC))
    x = torch.nn.functional.pad(torch.from_numpy(rgb.copy()).permute(2, 0, 1), (0, pw - rw, 0, ph - rh), value=0)
    mean = std = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    x = (x.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    patches, gh, gw = module.Kimi_K25ImageProcessor.patchify(None, x[None], patch_size=14)
    return patches[0].numpy(), (1, gh, gw)


# tiny (padded, never upscaled), odd, very wide, over the per-side limit, over the patch budget.
@pytest.mark.parametrize("size", [(1, 1), (10, 30), (300, 500), (333, 1001), (20, 3000), (30, 7500), (1900, 2000)])
def test_kimi_sizes_match_hf(hf_kimi, size):
    picture = Image.fromarray(_picture(*size))
    ours = preprocess_image(picture, KIMI)
    pixels, grid = _hf_kimi(hf_kimi, picture)
    assert ours.grid_thw == grid
    np.testing.assert_array_equal(ours.pixel_values, pixels)
    patches_fn = hf_kimi.Kimi_K25ImageProcessor.get_number_of_image_patches
    defaults = dict(size={"max_height": 512}, patch_size=14, merge_size=2, max_patches=16384)
    # The processor itself needs torchvision; transformers >= 5.25 reads its settings through
    # _merge_and_standardize_kwargs (the instance's values where the call gives none).
    hf_self = types.SimpleNamespace(**defaults, _merge_and_standardize_kwargs=lambda **kw: {**defaults, **kw})
    assert ours.num_tokens == patches_fn(hf_self, *size) // 4 == num_image_tokens(*size, KIMI)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P+transparency"])
def test_kimi_modes_and_small_budget_match_hf(hf_kimi, mode):
    image = Image.fromarray(_picture(150, 260, seed=5))
    if mode == "RGBA":
        image.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, 260), (150, 1)).astype(np.uint8)))
    elif mode == "P+transparency":
        image = image.quantize(16)
        image.info["transparency"] = 3
    else:
        image = image.convert(mode)
    config = KimiImageConfig(max_patches=64, max_patches_per_side=12)
    ours = preprocess_image(image, config)
    pixels, grid = _hf_kimi(hf_kimi, image, max_patches=64, side=12)
    assert ours.grid_thw == grid
    np.testing.assert_array_equal(ours.pixel_values, pixels)


# --- placeholder tokens: HF's processors expand the chat's image tokens ---------------------------

def _tokenizer(words: list[str], specials: list[str]) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["[UNK]"] + words + specials)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", additional_special_tokens=specials)


class _NoVideo:
    """Processors insist on a video processor, whose class needs torchvision: allow none."""

    def check_argument_for_proper_class(self, name, argument):
        if name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(name, argument)


class _QwenProcessor(_NoVideo, Qwen3VLProcessor):
    pass


class _KimiProcessor(_NoVideo, Kimi_K25Processor):
    pass


class _KimiOracleImageProcessor(BaseImageProcessor):
    """HF's Kimi pipeline (``_hf_kimi``) as the image processor Kimi_K25Processor calls."""

    merge_size = 2

    def __init__(self, module, **kwargs):
        super().__init__(**kwargs)
        self.module = module

    def preprocess(self, images, **kwargs):
        flat = [im for group in images for im in (group if isinstance(group, list) else [group])]
        out = [_hf_kimi(self.module, im) for im in flat]
        return BatchFeature({"pixel_values": np.concatenate([p for p, _ in out]),
                             "image_grid_thw": np.array([g for _, g in out])})


QWEN_TEMPLATE = (  # the image part of Qwen3-VL's chat template, around plain text parts
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }} {% endif %}"
    "{% endfor %}<|im_end|> {% endfor %}"
)
KIMI_TEMPLATE = QWEN_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
)


@pytest.mark.parametrize("sizes", [[(300, 500)], [(300, 500), (45, 1200)]])
@pytest.mark.parametrize("scheme", ["qwen", "kimi"])
def test_placeholder_expansion_matches_hf_processor(hf_kimi, scheme, sizes):
    pictures = [Image.fromarray(_picture(*s, seed=i)) for i, s in enumerate(sizes)]
    content = [{"type": "text", "text": "look"}] + [{"type": "image", "image": p} for p in pictures]
    messages = [{"role": "user", "content": content + [{"type": "text", "text": "describe"}]}]
    if scheme == "qwen":
        config = QWEN
        specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
        specials.append("<|video_pad|>")
        tok = _tokenizer(["user", "look", "describe"], specials)
        processor = _QwenProcessor(image_processor=_hf_qwen(), tokenizer=tok, chat_template=QWEN_TEMPLATE)
    else:
        config = KIMI
        specials = ["<|im_start|>", "<|im_end|>", "<|media_begin|>", "<|media_content|>", "<|media_pad|>",
                    "<|media_end|>", "<|kimi_k25_video_placeholder|>"]
        tok = _tokenizer(["user", "look", "describe", "image"], specials)
        processor = _KimiProcessor(image_processor=_KimiOracleImageProcessor(hf_kimi), tokenizer=tok,
                                   chat_template=KIMI_TEMPLATE)
    ref = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
    ours = preprocess_images(pictures, config)
    text = expand_image_tokens(processor.apply_chat_template(messages, tokenize=False), ours, config)
    assert tok(text)["input_ids"] == list(ref["input_ids"][0])
    image_id = tok.convert_tokens_to_ids(config.image_token)
    assert sum(i == image_id for i in ref["input_ids"][0]) == sum(im.num_tokens for im in ours)
    assert [im.num_tokens for im in ours] == [num_image_tokens(*s, config) for s in sizes]
    pixels, grids = batch_pixels(ours)
    np.testing.assert_array_equal(pixels, ref["pixel_values"])
    np.testing.assert_array_equal(grids, ref["image_grid_thw"])
    first = image_placeholder(ours[0].num_tokens, config)
    assert first.count(config.image_token) == ours[0].num_tokens and first in text


# --- configs --------------------------------------------------------------------------------------

def test_preprocessor_configs_parse_and_refuse():
    assert QWEN == QwenImageConfig()
    assert KIMI == KimiImageConfig()
    hf_kimi_form = {"size": {"max_height": 512, "max_width": 512}, "max_patches": 16384, "patch_size": 14,
                    "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3}
    assert KimiImageConfig.from_preprocessor_config(hf_kimi_form) == KIMI
    with pytest.raises(ImageConfigError, match=r"unknown preprocessor_config keys \['crop_size'\]"):
        QwenImageConfig.from_preprocessor_config(dict(QWEN_CONFIG, crop_size=224))
    with pytest.raises(ImageConfigError, match="do_resize=False"):
        QwenImageConfig.from_preprocessor_config(dict(QWEN_CONFIG, do_resize=False))
    with pytest.raises(ImageConfigError, match="fixed_output_tokens"):
        KimiImageConfig.from_preprocessor_config({"media_proc_cfg": {"fixed_output_tokens": 256}})
    with pytest.raises(ImageConfigError, match="min_pixels <= max_pixels"):
        QwenImageConfig(min_pixels=100, max_pixels=10)


# --- bad input: one clear ImageError each ---------------------------------------------------------

def _bad_files(tmp_path):
    png = _encoded(_picture(64, 64), "PNG")
    jpeg = _encoded(_picture(64, 64), "JPEG")
    files = {"truncated.png": png[: len(png) // 2], "truncated.jpg": jpeg[: len(jpeg) // 2],
             "notes.png": b"this is not an image", "empty.png": b""}
    tiff = io.BytesIO()
    Image.fromarray(_picture(8, 8)).save(tiff, format="TIFF")
    files["picture.tiff"] = tiff.getvalue()
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return png


def test_bad_inputs_each_refused_with_a_named_reason(tmp_path):
    png = _bad_files(tmp_path)
    b64 = base64.b64encode(png).decode()
    cases = [
        ("http://example.com/cat.png", "does not fetch images over the network"),
        ("https://example.com/cat.png", "does not fetch images over the network"),
        (str(tmp_path / "missing.png"), "does not exist"),
        (str(tmp_path), "is a directory"),
        (str(tmp_path / "truncated.png"), "truncated or corrupt"),
        (str(tmp_path / "truncated.jpg"), "truncated or corrupt"),
        (str(tmp_path / "notes.png"), "is not a readable image"),
        (str(tmp_path / "empty.png"), "is empty"),
        (str(tmp_path / "picture.tiff"), "is not a readable image"),  # decoders are allow-listed
        ("data:image/png," + b64, "is not base64-encoded"),
        ("data:text/plain;base64," + b64, "has media type 'text/plain'"),
        ("data:image/png;base64,@@@" + b64, "invalid base64"),
        ("data:image/png;base64," + base64.b64encode(b"garbage").decode(), "is not a readable image"),
        (np.zeros((8, 8, 3), np.float32), "must have dtype uint8"),
        (np.zeros((3, 8, 9), np.uint8), "channels last"),
        (np.zeros((8, 8, 2), np.uint8), "channels last"),
        (np.zeros((0, 8, 3), np.uint8), "is empty"),
        (Image.fromarray(np.zeros((8, 8), np.uint16)), "16-bit or floating point"),
        (Image.fromarray(np.zeros((8, 8), np.float32)), "16-bit or floating point"),
        (42, "unsupported image input a int"),
    ]
    for source, reason in cases:
        with pytest.raises(ImageError, match=reason):
            load_image(source)
    assert issubclass(ImageError, ValueError)


def test_limits_and_counts_refused(monkeypatch):
    with pytest.raises(ImageError, match="aspect ratio over 200"):
        preprocess_image(np.zeros((2, 500, 3), np.uint8), QWEN)
    with pytest.raises(ImageError, match=r"image 2 of 2: .*must have dtype uint8"):
        preprocess_images([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3))], QWEN)
    one = preprocess_images([np.zeros((32, 32, 3), np.uint8)], QWEN)
    with pytest.raises(ImageError, match=r"has 2 image placeholder\(s\) '<\|image_pad\|>' but 1 image"):
        expand_image_tokens("<|image_pad|> and <|image_pad|>", one, QWEN)
    monkeypatch.setattr(images_module, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageError, match="more than the 1000 accepted"):
        load_image(_encoded(_picture(40, 40), "PNG"))
