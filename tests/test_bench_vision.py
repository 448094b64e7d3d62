"""bench/vision.py (issue #17) at toy sizes: its two parts run through the real preprocessing,
``vision_step.encode`` and ``Engine.generate``, and report consistent counts; its published
tower sizes are transformers' Qwen3-VL vision defaults."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

# A 2-block tower of width 64 (2 heads of 32) over a 1-layer text model of width 128.
TOY = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=96, deepstack_visual_indexes=[0])


def _bench():
    """bench/vision.py as a module (bench/ is scripts, not a package)."""
    path = Path(__file__).parents[1] / "bench" / "vision.py"
    spec = importlib.util.spec_from_file_location("bench_vision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def engine(bench):
    engine = bench.random_engine(bench.bench_config("qwen3-vl", 1, 128, **TOY))
    engine.image_config = bench.vision_step.image_config_of(engine.config)
    return engine


def test_published_tower_sizes(bench):
    """The default tower is HF's Qwen3VLVisionConfig (the published Qwen3-VL-8B.. tower)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3VLVisionConfig()
    vc = bench.bench_config("qwen3-vl", 1, 256).vision
    assert (vc.depth, vc.hidden_size, vc.num_heads, vc.intermediate_size, vc.patch_size, vc.spatial_merge_size,
            vc.temporal_patch_size, vc.num_position_embeddings, tuple(vc.deepstack_indexes)) == (
        hf.depth, hf.hidden_size, hf.num_heads, hf.intermediate_size, hf.patch_size, hf.spatial_merge_size,
        hf.temporal_patch_size, hf.num_position_embeddings, tuple(hf.deepstack_visual_indexes))
    assert vc.out_hidden_size == 256


def test_vision_rows(bench, engine):
    """224 px is upscaled to the 256 x 256 minimum (16 x 16 patches, one bucket); 480 px is 30 x 30
    patches padded to 1024. XLA's arguments hold at least the tower's fp32 weights."""
    rows = [bench.vision_row(engine, side, repeats=2) for side in (224, 480)]
    assert [(r["patches"], r["padded_patches"], r["image_tokens"]) for r in rows] == [(256, 256, 64), (900, 1024, 225)]
    weights_mb = sum(x.nbytes for x in bench.jax.tree.leaves(engine.weights.vision)) / 2**20
    for r in rows:
        assert r["xla_args_mb"] >= weights_mb and r["xla_temp_mb"] > 0 and r["gflop"] > 0
        assert r["encode_ms"] > 0 and r["compile_call_s"] > 0
    # Attention over the bucket grows faster than linearly in the patches.
    assert rows[1]["gflop"] > 4 * rows[0]["gflop"]


def test_ttft_and_outputs(bench, engine, tmp_path):
    """The image prompt's token count is its text, the vision start/end and the image's tokens;
    the table prints and the JSON round-trips (and the plot is written where matplotlib is)."""
    t = bench.ttft_rows(engine, 224, text_tokens=10, repeats=1)
    assert (t["prompt_tokens"], t["image_tokens"], t["text_tokens"]) == (76, 64, 12)
    assert min(t[k] for k in ("ttft_image_ms", "ttft_text_ms", "preprocess_ms", "tower_ms")) > 0
    assert t["prefill_ms"] == t["ttft_image_ms"] - t["preprocess_ms"] - t["tower_ms"]
    result = {"settings": {"tower": "toy", "repeats": 1, "text_layers": 1, "text_width": 128}, "backend": "cpu",
              "threads": 1, "load_average_before": 0.0, "load_average_after": 0.0, "tower_params_m": 0.1,
              "vision": [bench.vision_row(engine, 224, repeats=1)], "ttft": t}
    bench.print_tables(result)
    assert json.loads(json.dumps(result)) == result
    pytest.importorskip("matplotlib")
    bench.plot(result, tmp_path / "vision.png")
    assert (tmp_path / "vision.png").stat().st_size > 0
