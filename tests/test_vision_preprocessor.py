"""A multimodal checkpoint's image preprocessing travels through ``convert`` into ``Engine.load``.

``dayzero convert`` copies ``preprocessor_config.json`` beside the tokenizer files when the model
has a vision tower, after checking it (``dayzero.convert.tokenizer_export.image_config_in``: it
parses, and its patch sizes are the tower's); ``Engine.load`` reads it into ``image_config``.
Oracle: HF's ``Qwen2VLImageProcessorPil`` loaded from the *converted* directory preprocesses an
image as dayzero does with the loaded ``image_config`` (bit for bit), and that differs from the
fallback (``vision_step.image_config_of``, the published pixel bounds) so the test can fail.

transformers 5's ``processor_config.json`` (the image processor nested under "image_processor")
comes first, as in HF's loader. Kimi-K2.5's ``media_proc_cfg`` goes the same way (a tiny
composite converted; the value is checked against ``KimiImageConfig``'s own parse, HF's Kimi
processor needing torchvision). A bad file is refused before anything is written (no
destination, no staging, not even the destination's parent). A text-only model and a GGUF source
ignore the file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from dayzero.convert import ConvertError
from dayzero.convert.tokenizer_export import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG, image_config_in
from dayzero.engine import Engine
from dayzero.engine.cli import main
from dayzero.engine.image_processing import KimiImageConfig, QwenImageConfig, preprocess_image
from dayzero.engine.vision_step import image_config_of
from dayzero.model.hf_config_vision_kimi import KimiVisionConfig
from tests.convert_helpers import assert_fails, convert, save_hf, small_hf_model
from tests.test_convert_gguf import byte_level_vocab, write_tiny_gguf
from tests.test_images import KIMI_CONFIG as KIMI_PREPROCESSOR  # Kimi-K2.5's media_proc_cfg as published
from tests.test_vision_convert import qwen35_case
from tests.test_vision_kimi_generate import _build_hf as build_kimi_k25

pytestmark = pytest.mark.usefixtures("quick_compiles")

# The tiny tower's sizes (tests/test_vision_convert.py VISION: 4-pixel patches, 2 frames, 2x2
# merge) with pixel bounds and statistics far from the published ones.
PREPROCESSOR = {
    "size": {"shortest_edge": 32 * 32, "longest_edge": 96 * 96}, "patch_size": 4, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}


@pytest.fixture(scope="module")
def qwen35(hf_factory, tmp_path_factory):
    return qwen35_case(hf_factory, tmp_path_factory)


def _source(case, tmp_path, preprocessor) -> Path:
    """A copy of the composite's HF directory with ``preprocessor`` (a dict, or raw text) beside it."""
    src = shutil.copytree(case.hf_dir, tmp_path / "hf")
    text = preprocessor if isinstance(preprocessor, str) else json.dumps(preprocessor)
    (src / PREPROCESSOR_CONFIG).write_text(text)
    return src


def _picture(height: int, width: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_convert_copies_it_and_engine_load_reads_it(qwen35, tmp_path):
    src = _source(qwen35, tmp_path, PREPROCESSOR)
    dst = convert(src, tmp_path / "dz")
    assert (dst / PREPROCESSOR_CONFIG).read_bytes() == (src / PREPROCESSOR_CONFIG).read_bytes()
    assert PREPROCESSOR_CONFIG in json.loads((dst / "manifest.json").read_text())["tokenizer_files"]
    engine = Engine.load(dst, progress=False)
    got = engine.image_config
    assert got == QwenImageConfig(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                                  max_pixels=96 * 96, image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
    assert got != image_config_of(engine.config)  # without the file: the published bounds
    # HF's processor reading the converted directory's file agrees, pixel for pixel, on images
    # smaller and larger than the bounds (resized up and down).
    hf = Qwen2VLImageProcessorPil.from_pretrained(dst)
    for h, w in ((20, 28), (150, 210)):
        ours, ref = preprocess_image(_picture(h, w), got), hf(images=[_picture(h, w)])
        assert ours.grid_thw == tuple(ref["image_grid_thw"][0])
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
        assert ours.grid_thw != preprocess_image(_picture(h, w), image_config_of(engine.config)).grid_thw


def test_a_nested_processor_config_comes_first_as_in_hf(qwen35, tmp_path):
    """transformers 5 saves a processor's image processor under "image_processor" in
    processor_config.json, which HF's loader reads before preprocessor_config.json: so does
    dayzero, and convert copies that file."""
    src = _source(qwen35, tmp_path, PREPROCESSOR)  # its bounds are not the ones used
    nested = dict(PREPROCESSOR, size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48})
    (src / PROCESSOR_CONFIG).write_text(json.dumps({"image_processor": nested, "processor_class": "Qwen3VLProcessor"}))
    dst = convert(src, tmp_path / "dz")
    assert (dst / PROCESSOR_CONFIG).is_file() and not (dst / PREPROCESSOR_CONFIG).exists()
    got = Engine.load(dst, progress=False).image_config
    assert (got.min_pixels, got.max_pixels) == (16 * 16, 48 * 48)
    hf = Qwen2VLImageProcessorPil.from_pretrained(src)  # HF's choice between the two source files
    for h, w in ((10, 14), (150, 210)):
        assert preprocess_image(_picture(h, w), got).grid_thw == tuple(hf(images=[_picture(h, w)])["image_grid_thw"][0])
    # A processor_config.json without an image processor leaves preprocessor_config.json in charge.
    (src / PROCESSOR_CONFIG).write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    assert image_config_in(src, qwen35.config).min_pixels == 32 * 32
    (src / PROCESSOR_CONFIG).write_text(json.dumps({"image_processor": [1]}))
    with pytest.raises(ConvertError, match="processor_config.json is not a usable image preprocessor config"):
        image_config_in(src, qwen35.config)


@pytest.mark.parametrize("text, needles", [
    ("{not json", ["is not a usable image preprocessor config"]),
    ("[1, 2]", ["JSON list where an object of image processor keys belongs"]),
    (dict(PREPROCESSOR, crop_size=224), ["unknown preprocessor_config keys ['crop_size']"]),
    (dict(PREPROCESSOR, do_resize=False), ["do_resize=False is not supported"]),
    (dict(PREPROCESSOR, size={"shortest_edge": 9000, "longest_edge": 100}), ["min_pixels <= max_pixels"]),
    (dict(PREPROCESSOR, patch_size=16), ["patch_size=16 where the vision tower has 4"]),
    (dict(PREPROCESSOR, temporal_patch_size=1, merge_size=4),
     ["merge_size=4 where the vision tower has 2", "temporal_patch_size=1 where the vision tower has 2"]),
])
def test_a_bad_one_is_refused_before_anything_is_written(qwen35, tmp_path, text, needles):
    src = _source(qwen35, tmp_path, text)
    out = tmp_path / "out"
    assert_fails(src, out / "dz", str(src / PREPROCESSOR_CONFIG), *needles)
    assert not out.exists()  # refused while planning: not even DST's parent was made


def test_the_cli_refusal_is_one_line(qwen35, tmp_path, capsys):
    src = _source(qwen35, tmp_path, dict(PREPROCESSOR, patch_size=16))
    assert main(["convert", str(src), str(tmp_path / "dz"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "patch_size=16 where the vision tower has 4" in err and "Traceback" not in err
    assert not (tmp_path / "dz").exists()


def test_text_only_and_gguf_sources_ignore_it(tmp_path):
    """No vision tower: the file is neither checked nor copied (a broken one does no harm), and
    the engine keeps ``image_config`` None; a GGUF source never has one."""
    tokens, _, _ = byte_level_vocab()
    model = small_hf_model("llama", vocab_size=len(tokens))
    hf_dir = save_hf(model, tmp_path / "hf")
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    for d in (hf_dir, gguf_dir):
        (d / PREPROCESSOR_CONFIG).write_text("{not json")
    for src in (hf_dir, write_tiny_gguf(gguf_dir / "tiny.gguf", model)):
        dst = convert(src, tmp_path / f"dz-{src.name}")
        assert not (dst / PREPROCESSOR_CONFIG).exists()
        assert PREPROCESSOR_CONFIG not in json.loads((dst / "manifest.json").read_text())["tokenizer_files"]
        assert Engine.load(dst, progress=False).image_config is None


def test_kimi_k25_checkpoint_keeps_its_media_proc_cfg(tmp_path):
    """A tiny Kimi-K2.5 composite (tests/test_vision_kimi_generate.py: 4-pixel patches, 2x2 merge)
    with Moonshot's ``media_proc_cfg`` at a small patch budget: copied, and ``Engine.load`` has it;
    the published 14-pixel patches do not fit this tower and are refused."""
    hf_dir = tmp_path / "hf"
    build_kimi_k25().save_pretrained(hf_dir)
    media = dict(KIMI_PREPROCESSOR["media_proc_cfg"], patch_size=4, in_patch_limit=64, patch_limit_on_one_side=16)
    (hf_dir / PREPROCESSOR_CONFIG).write_text(json.dumps({"media_proc_cfg": media}))
    engine = Engine.load(convert(hf_dir, tmp_path / "dz"), progress=False)
    assert engine.image_config == KimiImageConfig(patch_size=4, merge_size=2, max_patches=64, max_patches_per_side=16)
    assert engine.image_config != image_config_of(engine.config)
    (hf_dir / PREPROCESSOR_CONFIG).write_text(json.dumps(KIMI_PREPROCESSOR))
    assert_fails(hf_dir, tmp_path / "out" / "dz", "patch_size=14 where the vision tower has 4")


def test_kimi_towers_read_media_proc_cfg(tmp_path):
    """Kimi-K2.5's tower takes Moonshot's ``media_proc_cfg`` (as published), checked against its
    patch and merge sizes; Qwen's parser would refuse that file."""
    tower = KimiVisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=32)
    config = SimpleNamespace(vision=tower)
    (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps(KIMI_PREPROCESSOR))
    assert image_config_in(tmp_path, config) == KimiImageConfig.from_preprocessor_config(KIMI_PREPROCESSOR)
    assert image_config_in(tmp_path, SimpleNamespace(vision=None)) is None
    odd = {"media_proc_cfg": dict(KIMI_PREPROCESSOR["media_proc_cfg"], patch_size=16)}
    (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps(odd))
    with pytest.raises(ConvertError, match=r"patch_size=16 where the vision tower has 14"):
        image_config_in(tmp_path, config)
    wide = KimiVisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=32,
                            merge_kernel=(2, 3))
    (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps(KIMI_PREPROCESSOR))
    with pytest.raises(ConvertError, match=r"merge_size=\(2, 2\) where the vision tower has \(2, 3\)"):
        image_config_in(tmp_path, SimpleNamespace(vision=wide))
