"""The Qwen3-VL / Qwen3.5 vision tower (dayzero.model.vision_qwen) against HF's own
``Qwen3VLVisionModel`` / ``Qwen3_5MoeVisionModel`` in fp32 on CPU torch, the oracle.

Tiny towers with every parameter drawn at random (LayerNorm weights around 1, biases and the
position table non-zero), weights carried over by dayzero.convert.name_map_vision. Compared:
the merged embeddings and the DeepStack features of one image, of two images of different grids
in one call (where attention must stay within each image: a full mask is shown to break
parity), of a video-like grid of two frames, and of patch counts padded to a bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map_vision import vision_name_map, vision_weights_from_state_dict
from dayzero.model.config import ConfigError
from dayzero.model.hf_config_vision import VisionAct, VisionConfig, parse_vision_config, vision_config_from_hf
from dayzero.model.presets import preset_hf_config
from dayzero.model.vision_qwen import _vision_step, encode_images, vision_layout
from dayzero.model.vision_weights import vision_specs
from dayzero.model.weights import is_spec, named_leaves, parameter_count
from dayzero.sharding.rules import LOGICAL_AXES

# Depth 4, width 64 over 4 heads of 16, patches of 2 x 8 x 8 pixels in 3 channels, a 6 x 6 learned
# position grid (so images both larger and smaller than it are resampled), DeepStack after blocks 1, 2.
VISION = dict(depth=4, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=96, patch_size=8,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36,
              deepstack_visual_indexes=[1, 2])
# Relative to the largest |HF value|. fp32 rounding gives ~1e-6 here; a wrong position, mask,
# norm or activation moves the outputs by O(1e-1).
REL_TOL = 1e-5
ONE = [(1, 6, 8)]
TWO = [(1, 6, 8), (1, 4, 10)]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: norm weights 1 + N(0, 0.1), biases N(0, 0.1), the position table
    N(0, 1), matrices N(0, 1/fan_in) (activations O(1) through the blocks)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif name.startswith("pos_embed"):
                p.copy_(noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


def _tower(hf_class, hf_config, model_type: str, seed: int = 0):
    model = hf_class._from_config(hf_config, attn_implementation="eager").eval()
    _randomise(model, seed)
    vc = parse_vision_config(hf_config.to_dict(), model_type)
    # As a composite checkpoint spells the tower (model.visual.*).
    state = {"model.visual." + k: v.numpy() for k, v in model.state_dict().items()}
    w = jax.tree.map(jnp.asarray, vision_weights_from_state_dict(vc, state))
    return model, vc, w


@pytest.fixture(scope="module")
def qwen3vl():
    return _tower(Qwen3VLVisionModel, transformers.Qwen3VLVisionConfig(**VISION), "qwen3_vl")


def _pixels(vc: VisionConfig, grids, seed: int) -> np.ndarray:
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, vc.patch_dim), dtype=np.float32)


def _hf(model, pixels: np.ndarray, grids) -> tuple[np.ndarray, list[np.ndarray]]:
    with torch.no_grad():
        out = model(torch.from_numpy(pixels), torch.tensor(grids))
    return out.pooler_output.numpy(), [d.numpy() for d in (getattr(out, "deepstack_features", None) or [])]


def _rel(ours, ref: np.ndarray) -> float:
    ours = np.asarray(ours)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def two_images(qwen3vl):
    model, vc, w = qwen3vl
    pixels = _pixels(vc, TWO, 1)
    return pixels, _hf(model, pixels, TWO), encode_images(w, vc, pixels, TWO)


def test_one_image(qwen3vl):
    model, vc, w = qwen3vl
    pixels = _pixels(vc, ONE, 0)
    ref, ref_ds = _hf(model, pixels, ONE)
    merged, deepstack = encode_images(w, vc, pixels, ONE)
    assert merged.shape == (6 * 8 // 4, 96)
    assert _rel(merged, ref) < REL_TOL
    assert len(deepstack) == 2 and all(_rel(d, r) < REL_TOL for d, r in zip(deepstack, ref_ds))


def test_two_images_attend_within_each(qwen3vl, two_images):
    model, vc, w = qwen3vl
    pixels, (ref, _), (merged, _) = two_images
    assert merged.shape == ((48 + 40) // 4, 96)
    assert _rel(merged, ref) < REL_TOL
    # The same patches as one attention segment (a full mask) are far from HF: the block-diagonal
    # mask is what makes the parity above.
    layout = vision_layout(vc, TWO)
    full = dataclasses.replace(layout, segment=np.zeros_like(layout.segment))
    wrong, _ = _vision_step(w, vc, jnp.asarray(pixels), jax.tree.map(jnp.asarray, full))
    assert _rel(wrong, ref) > 1e-2


def test_deepstack_features(two_images):
    _, (_, ref_ds), (_, deepstack) = two_images
    assert len(ref_ds) == len(deepstack) == 2
    for ours, ref in zip(deepstack, ref_ds):
        assert _rel(ours, ref) < REL_TOL
    # Two different levels, not one feature twice.
    assert _rel(ref_ds[0], ref_ds[1]) > 1e-1


def test_padding_to_a_bucket(qwen3vl, two_images):
    """Padded patches change nothing for the real ones; one compile serves every image set of
    the bucket (a second grid set, with a two-frame grid whose frames attend separately)."""
    model, vc, w = qwen3vl
    pixels, (ref, ref_ds), (unpadded, _) = two_images
    bucket = 128
    before = _vision_step._cache_size()
    merged, deepstack = encode_images(w, vc, pixels, TWO, padded_patches=bucket)
    assert _rel(merged, ref) < REL_TOL and _rel(merged, np.asarray(unpadded)) < 1e-6
    assert all(_rel(d, r) < REL_TOL for d, r in zip(deepstack, ref_ds))
    # The padding's merged rows come out zero, inside the step.
    layout = jax.tree.map(jnp.asarray, vision_layout(vc, TWO, bucket))
    full, _ = _vision_step(w, vc, jnp.pad(jnp.asarray(pixels), ((0, bucket - len(pixels)), (0, 0))), layout)
    assert full.shape == (bucket // 4, 96) and not np.any(np.asarray(full[len(ref):]))

    other = [(1, 4, 10), (2, 4, 4)]  # 72 patches: an image and two frames of another
    other_pixels = _pixels(vc, other, 2)
    other_ref, other_ds = _hf(model, other_pixels, other)
    merged, deepstack = encode_images(w, vc, other_pixels, other, padded_patches=bucket)
    assert _rel(merged, other_ref) < REL_TOL
    assert all(_rel(d, r) < REL_TOL for d, r in zip(deepstack, other_ds))
    assert _vision_step._cache_size() == before + 1


def test_qwen35_tower():
    """Qwen3.5's copy of the tower: the same blocks and merger, no DeepStack (its published
    configs list "deepstack_visual_indexes": [], which HF never reads)."""
    small = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}
    hf_config = transformers.Qwen3_5MoeVisionConfig(**{**small, "depth": 2})
    model, vc, w = _tower(Qwen3_5MoeVisionModel, hf_config, "qwen3_5_moe", seed=3)
    assert vc.deepstack_indexes == () and w.deepstack == ()
    pixels = _pixels(vc, TWO, 4)
    ref, _ = _hf(model, pixels, TWO)
    merged, deepstack = encode_images(w, vc, pixels, TWO)
    assert deepstack == [] and _rel(merged, ref) < REL_TOL


def test_specs_follow_hf(qwen3vl):
    """The abstract specs count HF's parameters, name only known logical axes, and the name map
    makes each leaf exactly once in both HF spellings."""
    model, vc, _ = qwen3vl
    specs = vision_specs(vc)
    assert parameter_count(specs) == sum(p.numel() for p in model.parameters())
    for path, spec in named_leaves(specs).items():
        assert is_spec(spec) and all(a is None or a in LOGICAL_AXES for a in spec.axes), path
    name_map = vision_name_map(vc, dst="")
    for layout in (name_map.recipes, *name_map.alternatives):
        assert sorted(r.target for r in layout) == sorted(named_leaves(specs))
    assert name_map.is_ignored("model.visual.rotary_pos_emb.inv_freq")
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert vision_weights_from_state_dict(vc, {"visual." + k: v for k, v in state.items()}).patch.shape == (384, 64)
    missing = {"model.visual." + k: v for k, v in state.items() if k != "deepstack_merger_list.1.norm.weight"}
    with pytest.raises(ConvertError, match="no tensor 'model.visual.deepstack_merger_list.1.norm.weight'"):
        vision_weights_from_state_dict(vc, missing)


def test_config_parsing():
    # Every composite model_type's HF vision_config, as its to_dict writes it.
    for cls, model_type, deepstack in ((transformers.Qwen3VLConfig, "qwen3_vl", (8, 16, 24)),
                                       (transformers.Qwen3VLMoeConfig, "qwen3_vl_moe", (8, 16, 24)),
                                       (transformers.Qwen3_5Config, "qwen3_5", ()),
                                       (transformers.Qwen3_5MoeConfig, "qwen3_5_moe", ())):
        raw = cls().to_dict()
        vc = vision_config_from_hf(raw)
        assert (vc.depth, vc.hidden_size, vc.num_heads, vc.head_dim, vc.patch_dim) == (27, 1152, 16, 72, 1536)
        assert vc.deepstack_indexes == deepstack and vc.hidden_act is VisionAct.GELU_TANH
        assert VisionConfig.from_json(vc.to_json()) == vc
    # The published Qwen3.5-397B-A17B config (with its "deepstack_visual_indexes": []).
    raw = preset_hf_config("qwen3.5-397b-a17b")
    vc = vision_config_from_hf(raw, text_hidden_size=raw["text_config"]["hidden_size"])
    assert vc.out_hidden_size == 4096 and vc.deepstack_indexes == ()
    # A file written before HF's rename (vision model_type "qwen3_vl_moe"), minimal keys: HF's defaults.
    vc = parse_vision_config({"model_type": "qwen3_vl_moe", "num_attention_heads": 8}, "qwen3_vl_moe")
    assert (vc.depth, vc.num_heads, vc.patch_size, vc.deepstack_indexes, vc.rope_theta) == (27, 8, 16, (8, 16, 24), 1e4)


@pytest.mark.parametrize("raw, match", [
    ({"window_size": 112, "fullatt_block_indexes": [1]}, "fullatt_block_indexes, window_size"),
    ({"hidden_act": "silu"}, "hidden_act='silu'"),
    ({"num_position_embeddings": 2300}, "not a square"),
    ({"model_type": "qwen3_5_vision"}, "does not belong in a 'qwen3_vl' config"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "only the axial rope"),
    ({"deepstack_visual_indexes": [3, 30]}, r"\[0, 27\)"),
    ({"hidden_size": 1000}, "not a multiple of num_heads"),
])
def test_config_errors(raw, match):
    """A bad vision_config is one ConfigError naming what is wrong (unknown keys all listed)."""
    with pytest.raises(ConfigError, match=match):
        parse_vision_config(raw, "qwen3_vl")


@pytest.mark.slow
def test_published_widths():
    """The published tower's widths (1152 over 16 heads of 72, patches of 16, a 48 x 48 position
    grid) at depth 2, on a 28 x 36 image of 1008 patches."""
    hf_config = transformers.Qwen3VLVisionConfig(depth=2, out_hidden_size=256, deepstack_visual_indexes=[0])
    model, vc, w = _tower(Qwen3VLVisionModel, hf_config, "qwen3_vl", seed=5)
    grids = [(1, 28, 36)]
    pixels = _pixels(vc, grids, 6)
    ref, ref_ds = _hf(model, pixels, grids)
    merged, deepstack = encode_images(w, vc, pixels, grids, padded_patches=1024)
    assert _rel(merged, ref) < REL_TOL and _rel(deepstack[0], ref_ds[0]) < REL_TOL
