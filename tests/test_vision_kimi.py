"""Kimi-K2.5's vision tower and projector (dayzero.model.vision_kimi) against HF's own
``Kimi_K25Model.get_image_features`` (``Kimi_K25VisionModel`` + ``Kimi_K25MultimodalProjection``)
in fp32 on CPU torch, the oracle. HF's tower needs neither flash-attn nor torchvision: with
``attn_implementation="eager"`` it attends over each image's ``cu_seqlens`` chunk separately.

A tiny composite model (a one-layer DeepSeek-V3 text model HF builds beside the tower, unused
here) with every vision and projector parameter drawn at random. Compared: one image, two images
of different grids in one call (attention stays within each image: a full mask is shown to break
parity), a two-frame clip (time table and frame mean), patch counts padded to a bucket, the
engine's preprocessed image fed to both, and the weights read from the state dict in each of the
map's spellings: transformers' modules, and Moonshot's fused, rotary-interleaved ``wqkv`` as
``save_pretrained`` and the published checkpoint write it (HF's own loader converts those, so
the test checks dayzero's reordering against it).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.numpy import load_file

from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map_vision_kimi import kimi_vision_name_map, kimi_vision_weights_from_state_dict
from dayzero.engine.image_processing import KimiImageConfig, preprocess_image
from dayzero.model.config import ConfigError
from dayzero.model.hf_config_vision_kimi import (
    KimiVisionConfig, kimi_vision_config_from_hf, parse_kimi_vision_config,
)
from dayzero.model.vision_kimi import (
    TOWER_EPS, _kimi_vision_step, encode_kimi_images, kimi_vision_layout, num_embeddings, time_table,
)
from dayzero.model.vision_kimi_weights import kimi_vision_specs
from dayzero.model.weights import is_spec, named_leaves, parameter_count
from dayzero.sharding.rules import LOGICAL_AXES

# Depth 3, width 64 over 4 heads of 16, patches of 3 x 4 x 4 pixels, a 6 x 6 learned position
# grid (images larger and smaller than it are resampled), a non-default rotary base and projector
# epsilon (1e-3: a wrong epsilon moves the outputs past the tolerance), 80-wide text model.
VISION = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=96, patch_size=4,
              pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 500.0})
TEXT = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=80, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
            first_k_dense_replace=1)
# Relative to the largest |HF value|. fp32 rounding gives ~1e-6 here; a wrong position, mask,
# norm or rotary pair moves the outputs by O(1e-1).
REL_TOL = 1e-5
ONE = [(1, 6, 8)]
TWO = [(1, 6, 8), (1, 4, 10)]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every vision and projector parameter random: norm weights 1 + N(0, 0.1), biases N(0, 0.1),
    the position grid N(0, 1), matrices N(0, 1/fan_in) (activations O(1) through the blocks)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" not in name and "mm_projector" not in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "pos_emb" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


def _vision_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The tower's and projector's tensors under the composite model's module names."""
    return {k: v.numpy() for k, v in model.state_dict().items() if "vision_tower" in k or "mm_projector" in k}


def _build(vision: dict, seed: int = 0, **top):
    hf_config = transformers.Kimi_K25Config(text_config=TEXT, vision_config=vision,
                                            projection_hidden_size=vision["hidden_size"], **top)
    model = transformers.Kimi_K25ForConditionalGeneration._from_config(hf_config, attn_implementation="eager").eval()
    _randomise(model, seed)
    kc = kimi_vision_config_from_hf(hf_config.to_dict())
    w = jax.tree.map(jnp.asarray, kimi_vision_weights_from_state_dict(kc, _vision_state(model)))
    return model, kc, w


@pytest.fixture(scope="module")
def kimi():
    return _build(VISION, projection_layer_norm_eps=1e-3)


def _pixels(kc: KimiVisionConfig, grids, seed: int) -> np.ndarray:
    """Random pixel patches [N, C, P, P], as the processor lays them out."""
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, 3, kc.patch_size, kc.patch_size), dtype=np.float32)


def _hf(model, pixels: np.ndarray, grids) -> np.ndarray:
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels), torch.tensor(grids))
    return torch.cat(out.pooler_output).numpy()


def _rel(ours, ref: np.ndarray) -> float:
    ours = np.asarray(ours)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def two_images(kimi):
    model, kc, w = kimi
    pixels = _pixels(kc, TWO, 1)
    return pixels, _hf(model, pixels, TWO), encode_kimi_images(w, kc, pixels, TWO)


def test_one_image(kimi):
    model, kc, w = kimi
    pixels = _pixels(kc, ONE, 0)
    merged = encode_kimi_images(w, kc, pixels, ONE)
    assert merged.shape == (6 * 8 // 4, 80) == (num_embeddings(kc, ONE), kc.out_hidden_size)
    assert _rel(merged, _hf(model, pixels, ONE)) < REL_TOL


def test_two_images_attend_within_each(kimi, two_images):
    model, kc, w = kimi
    pixels, ref, merged = two_images
    assert merged.shape == ((48 + 40) // 4, 80)
    assert _rel(merged, ref) < REL_TOL
    # The same patches as one attention segment (a full mask) are far from HF: the block-diagonal
    # mask is what makes the parity above.
    layout = kimi_vision_layout(kc, TWO)
    full = dataclasses.replace(layout, segment=np.zeros_like(layout.segment))
    wrong = _kimi_vision_step(w, kc, jnp.asarray(pixels.reshape(len(pixels), -1)), jax.tree.map(jnp.asarray, full))
    assert _rel(wrong, ref) > 1e-2


def test_padding_to_a_bucket(kimi, two_images):
    """Padded patches change nothing for the real ones; one compile serves every image set of
    the bucket (a second set, with a two-frame clip: one attention segment over both frames, the
    time table's rows 1 and 2, and the frame mean)."""
    model, kc, w = kimi
    pixels, ref, unpadded = two_images
    bucket = 128
    before = _kimi_vision_step._cache_size()
    merged = encode_kimi_images(w, kc, pixels, TWO, padded_patches=bucket)
    assert _rel(merged, ref) < REL_TOL and _rel(merged, np.asarray(unpadded)) < 1e-6
    # The padding's output rows come out zero, inside the step.
    layout = jax.tree.map(jnp.asarray, kimi_vision_layout(kc, TWO, bucket))
    padded = jnp.pad(jnp.asarray(pixels.reshape(len(pixels), -1)), ((0, bucket - len(pixels)), (0, 0)))
    full = _kimi_vision_step(w, kc, padded, layout)
    assert full.shape == (bucket // 4, 80) and not np.any(np.asarray(full[len(ref):]))

    clip = [(1, 4, 10), (2, 4, 4)]  # 72 patches: an image and a clip of two 4 x 4 frames
    clip_pixels = _pixels(kc, clip, 2)
    clip_ref = _hf(model, clip_pixels, clip)
    assert clip_ref.shape == (10 + 4, 80)
    assert _rel(encode_kimi_images(w, kc, clip_pixels, clip, padded_patches=bucket), clip_ref) < REL_TOL
    # An image of the position grid's own size (6 x 6) reads the grid as it is: bicubic at
    # matching sizes puts weight 1 on one tap.
    square = [(1, 6, 6)]
    square_layout = kimi_vision_layout(kc, square)
    assert np.array_equal(square_layout.pos_weight.max(1), np.ones(36, np.float32))
    assert np.array_equal(square_layout.pos_index[np.arange(36), square_layout.pos_weight.argmax(1)], np.arange(36))
    square_pixels = _pixels(kc, square, 3)
    assert _rel(encode_kimi_images(w, kc, square_pixels, square, padded_patches=bucket),
                _hf(model, square_pixels, square)) < REL_TOL
    assert _kimi_vision_step._cache_size() == before + 1
    # A still image gets no time term; a clip's frames get rows 1.. of the sinusoid table (sin 0, cos 1 first).
    assert not time_table(kc)[0].any() and np.allclose(time_table(kc)[1], np.repeat([0.0, 1.0], 32))


def test_processor_output_feeds_the_tower(kimi):
    """What dayzero's Kimi preprocessing produces (pixel_values [N, 3, P, P] row-major, grid
    (1, h, w), h*w/4 placeholder tokens) is what HF's model consumes: a photo-like image of
    29 x 45 pixels, padded to 32 x 48, through both towers (in the bucket the test above compiled)."""
    model, kc, w = kimi
    rng = np.random.default_rng(7)
    gradient = np.linspace(0, 255, 45)[None, :, None] * np.linspace(0.2, 1, 29)[:, None, None]
    picture = np.clip(gradient + rng.normal(0, 20, (29, 45, 3)), 0, 255).astype(np.uint8)
    image = preprocess_image(Image.fromarray(picture), KimiImageConfig(patch_size=kc.patch_size, merge_size=2))
    assert image.grid_thw == (1, 8, 12) and image.pixel_values.shape == (96, 3, 4, 4)
    merged = encode_kimi_images(w, kc, image.pixel_values, [image.grid_thw], padded_patches=128)
    assert merged.shape[0] == image.num_tokens == 24
    assert _rel(merged, _hf(model, image.pixel_values, [image.grid_thw])) < REL_TOL


def test_checkpoint_spellings(kimi, tmp_path):
    """Moonshot's names and fused rotary-interleaved ``wqkv`` (save_pretrained's spelling, and the
    published checkpoint's, which differs in two prefixes) give the same weights as HF's modules,
    and so the same outputs as HF (whose loader reorders wqkv by its own PermuteForRope)."""
    model, kc, w = kimi
    model.save_pretrained(tmp_path)
    saved = {k: v for k, v in load_file(os.path.join(tmp_path, "model.safetensors")).items()
             if "vision_tower" in k or "mm_projector" in k}
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in saved
    published = {k.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
                 .replace("model.mm_projector.", "mm_projector."): v for k, v in saved.items()}
    for state in (saved, published):
        ours = jax.tree.map(jnp.asarray, kimi_vision_weights_from_state_dict(kc, state))
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), ours, w))
    # The reordering matters: q taken straight from wqkv (no per-head reordering) is another matrix.
    D = kc.hidden_size
    straight = published["vision_tower.encoder.blocks.0.wqkv.weight"][:D].T.reshape(D, kc.num_heads, -1)
    assert not np.allclose(straight, np.asarray(w.blocks[0].attn.q))


def test_specs_follow_hf(kimi):
    """The abstract specs count HF's tower and projector parameters, name only known logical
    axes, and every spelling of the map makes each leaf exactly once."""
    model, kc, _ = kimi
    specs = kimi_vision_specs(kc)
    hf_count = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n or "mm_projector" in n)
    assert parameter_count(specs) == hf_count
    # The tower's LayerNorm epsilon is HF's (1e-5 against 1e-6 moves these outputs by only ~3e-6,
    # under the parity tolerance, so it is checked here); the projector's comes from the config.
    tower = model.model.vision_tower
    assert {m.eps for m in tower.modules() if isinstance(m, torch.nn.LayerNorm)} == {TOWER_EPS}
    assert model.model.mm_projector.pre_norm.eps == kc.projector_eps == 1e-3
    for path, spec in named_leaves(specs).items():
        assert is_spec(spec) and all(a is None or a in LOGICAL_AXES for a in spec.axes), path
    name_map = kimi_vision_name_map(kc, dst="")
    assert len(name_map.alternatives) == 2
    for layout in (name_map.recipes, *name_map.alternatives):
        assert sorted(r.target for r in layout) == sorted(named_leaves(specs))
    assert name_map.is_ignored("model.vision_tower.rotary_emb.inv_freq")
    assert name_map.is_ignored("model.vision_tower.patch_embed.pos_emb.time_position_embeddings")
    state = _vision_state(model)
    del state["model.vision_tower.layers.2.attn.k_proj.bias"]
    # A source matching no spelling completely is reported against the published checkpoint's.
    with pytest.raises(ConvertError, match="no tensor 'vision_tower.patch_embed.proj.weight'"):
        kimi_vision_weights_from_state_dict(kc, state)
    state = {**_vision_state(model), "model.vision_tower.extra.weight": np.zeros(3)}
    with pytest.raises(ConvertError, match="unexpected tensor 'model.vision_tower.extra.weight'"):
        kimi_vision_weights_from_state_dict(kc, state)


# The published moonshotai/Kimi-K2.5 config.json (its vision_config and the text width), Moonshot's spelling.
PUBLISHED = {
    "model_type": "kimi_k25", "media_placeholder_token_id": 163605, "use_unified_vision_chunk": True,
    "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168},
    "vision_config": {
        "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool", "mm_hidden_size": 1152, "mm_projector_type": "patchmerger", "model_type": "",
        "patch_size": 14, "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "text_hidden_size": 7168, "video_attn_type": "spatial_temporal", "vt_hidden_size": 1152,
        "vt_intermediate_size": 4304, "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
    },
}


def test_config_parsing():
    published = kimi_vision_config_from_hf(PUBLISHED)
    assert (published.depth, published.hidden_size, published.num_heads, published.head_dim) == (27, 1152, 16, 72)
    assert (published.patch_dim, published.pos_emb_side, published.merge_unit, published.out_hidden_size) == \
        (588, 64, 4, 7168)
    assert published.rope_theta == 1e4 and published.projector_eps == 1e-5
    # transformers' spelling of the same model (HF's defaults, a 7168-wide text model) is the same config.
    raw = transformers.Kimi_K25Config(text_config={"model_type": "deepseek_v3", "hidden_size": 7168}).to_dict()
    assert kimi_vision_config_from_hf(raw) == published
    assert KimiVisionConfig.from_json(published.to_json()) == published
    assert kimi_vision_config_from_hf({"model_type": "kimi_k25", "text_config": {}}) is None
    # Both spellings at once must agree; agreeing ones are fine.
    both = {**PUBLISHED["vision_config"], "hidden_size": 1152, "num_hidden_layers": 27}
    assert parse_kimi_vision_config(both, text_hidden_size=7168) == published


@pytest.mark.parametrize("raw, match", [
    ({"window_size": 112, "fullatt_block_indexes": [1]}, "fullatt_block_indexes, window_size"),
    ({"merge_type": "sd2"}, "merge_type='sd2'"),
    ({"video_attn_type": "spatial"}, "video_attn_type='spatial'"),
    ({"mm_projector_type": "patchmergerv2"}, "mm_projector_type='patchmergerv2'"),
    ({"hidden_act": "silu"}, "hidden_act='silu'"),
    ({"mm_hidden_size": 1024}, "projection_hidden_size / mm_hidden_size=1024"),
    ({"vt_hidden_size": 1024, "hidden_size": 1152}, "vt_hidden_size=1024 and hidden_size=1152 disagree"),
    ({"text_hidden_size": 4096}, "text_hidden_size=4096, text_config_hidden_size=7168 disagree"),
    ({"pos_emb_height": 64, "pos_emb_width": 32}, "must be square"),
    ({"num_attention_heads": 4, "hidden_size": 120}, r"head_dim=30 \(.*\) is not a multiple of 4"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "only the axial rope"),
    ({"model_type": "qwen3_vl"}, "does not belong in a kimi_k25 config"),
])
def test_config_errors(raw, match):
    """A bad vision_config is one ConfigError naming what is wrong (unknown keys all listed)."""
    with pytest.raises(ConfigError, match=match):
        parse_kimi_vision_config(raw, text_hidden_size=7168)


def test_bad_grids_and_shapes(kimi):
    _, kc, w = kimi
    with pytest.raises(ValueError, match=r"grid \(t, h, w\)=\(1, 5, 8\)"):
        encode_kimi_images(w, kc, _pixels(kc, [(1, 5, 8)], 0), [(1, 5, 8)])
    with pytest.raises(ValueError, match="at most 4 frames"):
        kimi_vision_layout(kc, [(5, 2, 2)])
    with pytest.raises(ValueError, match="pixel_values has shape"):
        encode_kimi_images(w, kc, _pixels(kc, ONE, 0)[:-1], ONE)
    with pytest.raises(ValueError, match="padded_patches=50"):
        kimi_vision_layout(kc, ONE, 50)


@pytest.mark.slow
def test_published_widths():
    """The published tower's widths (1152 over 16 heads of 72, 14-pixel patches, a 64 x 64
    position grid, 4304-wide MLP) at depth 2, on a 30 x 36 image of 1080 patches padded to 1152."""
    vision = dict(num_hidden_layers=2, hidden_size=1152, num_attention_heads=16, intermediate_size=4304,
                  patch_size=14, pos_emb_height=64, pos_emb_width=64)
    model, kc, w = _build(vision, seed=5)
    grids = [(1, 30, 36)]
    pixels = _pixels(kc, grids, 6)
    assert _rel(encode_kimi_images(w, kc, pixels, grids, padded_patches=1152), _hf(model, pixels, grids)) < REL_TOL
