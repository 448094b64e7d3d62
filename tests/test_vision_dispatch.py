"""Images through the Qwen multimodal text models (Qwen3-VL-MoE, Qwen3.5-MoE): M-RoPE positions,
the image embeddings over their placeholders, DeepStack, and decode after an image prompt,
against HF transformers' composite models in fp32 (the oracle).

The tiny random composites of tests/test_vision_convert.py (converted by the real converter),
their special tokens moved inside the 64-token vocabulary. Checked:

- :func:`rope_index` gives HF ``get_rope_index``'s positions and deltas (two rows, three images,
  one of two frames, right padding); the [3, B, T] rotary tables are HF's rotary module's, and
  equal axes give exactly the plain tables;
- logits over a prompt with one image and with two images equal HF's given the same
  ``input_ids``, ``pixel_values`` and ``image_grid_thw`` (and do not move when the image entries
  are padded to a bucket); plain 1-D positions, or (Qwen3-VL) no DeepStack, break that agreement;
- a prefill of the image prompt into the cache then three decode steps at the shifted positions
  equal HF's logits over the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dayzero.model.cache import append_to_cache, init_cache
from dayzero.model.mrope import ImageInput, continuation, image_input, rope_index
from dayzero.model.rope import rope_cos_sin
from dayzero.model.vision_qwen import encode_images
from tests.hf_helpers import forward_jit
from tests.test_vision_convert import qwen3vl_case, qwen35_case

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

# Special tokens inside the tiny vocabulary (HF's defaults are past it); text is drawn below them.
TOKENS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
TEXT_VOCAB = 60
ONE, TWO = [(1, 4, 6)], [(1, 6, 8), (1, 4, 4)]  # grids in patches (merge 2: 6, 12 and 4 tokens)
TOL = 1e-5  # relative to the largest logit; measured ~1e-6 (fp32 rounding)


@pytest.fixture(scope="module")
def qwen35(hf_factory, tmp_path_factory):
    return qwen35_case(hf_factory, tmp_path_factory, **TOKENS)


@pytest.fixture(scope="module")
def qwen3vl(hf_factory, tmp_path_factory):
    return qwen3vl_case(hf_factory, tmp_path_factory, **TOKENS)


@pytest.fixture(params=["qwen35", "qwen3vl"])
def case(request):
    return request.getfixturevalue(request.param)


def _prompt(grids, merge: int, seed: int, text=(5, 4, 3)) -> np.ndarray:
    """Text, then per image (vision_start, its placeholders, vision_end) and more text: [1, T]."""
    rng = np.random.default_rng(seed)
    ids = list(rng.integers(0, TEXT_VOCAB, text[0]))
    for i, (t, h, w) in enumerate(grids):
        ids += [TOKENS["vision_start_token_id"]] + [TOKENS["image_token_id"]] * (t * h * w // merge ** 2)
        ids += [TOKENS["vision_end_token_id"]] + list(rng.integers(0, TEXT_VOCAB, text[1 + min(i, 1)]))
    return np.asarray([ids], np.int64)


def _pixels(case, grids, seed: int) -> np.ndarray:
    rows = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((rows, case.config.vision.patch_dim), dtype=np.float32)


def _hf(case, ids: np.ndarray, pixels: np.ndarray, grids) -> np.ndarray:
    with torch.no_grad():
        out = case.hf(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(pixels),
                      image_grid_thw=torch.tensor(grids),
                      mm_token_type_ids=torch.from_numpy((ids == TOKENS["image_token_id"]).astype(np.int32)))
    return out.logits.numpy()


def _images(case, ids: np.ndarray, pixels: np.ndarray, grids) -> tuple[ImageInput, np.ndarray]:
    vc = case.config.vision
    merged, deepstack = encode_images(case.weights.vision, vc, pixels, grids)
    return image_input(vc, ids, grids, merged, deepstack)


def _ours(case, ids: np.ndarray, images: ImageInput) -> np.ndarray:
    logits, _ = forward_jit(case.weights, case.config, jnp.asarray(ids, jnp.int32), None, all_logits=True,
                            images=images)
    return np.asarray(logits)


def _error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_rope_index_is_hfs(qwen3vl):
    """Two rows (one image; two images, one of two frames), the second right-padded: HF's
    positions on every real token and HF's deltas."""
    M = qwen3vl.config.vision.spatial_merge_size
    rows = [_prompt([(1, 4, 6)], M, 1, text=(3, 7, 0)), _prompt([(2, 4, 4), (1, 2, 8)], M, 2, text=(2, 1, 2))]
    T = max(r.shape[1] for r in rows)
    ids = np.zeros((2, T), np.int64)
    lengths = [r.shape[1] for r in rows]
    for b, r in enumerate(rows):
        ids[b, :lengths[b]] = r[0]
    grids = [(1, 4, 6), (2, 4, 4), (1, 2, 8)]
    mask = np.arange(T)[None] < np.asarray(lengths)[:, None]
    ref, ref_deltas = qwen3vl.hf.model.get_rope_index(
        torch.from_numpy(ids), torch.from_numpy((ids == TOKENS["image_token_id"]).astype(np.int32)),
        image_grid_thw=torch.tensor(grids), attention_mask=torch.from_numpy(mask.astype(np.int64)))
    ours, deltas = rope_index(qwen3vl.config.vision, ids, grids, lengths)
    assert ours.shape == (3, 2, T) and ours.dtype == np.int32
    np.testing.assert_array_equal(ours[:, mask], ref.numpy()[:, mask])
    np.testing.assert_array_equal(deltas, ref_deltas.numpy()[:, 0])
    assert (deltas < 0).all()  # an image takes fewer positions than tokens
    with pytest.raises(ValueError, match="has 6 placeholders.*needs 8"):
        rope_index(qwen3vl.config.vision, ids[:1], [(1, 4, 8)], lengths[:1])
    with pytest.raises(ValueError, match="grids given"):
        rope_index(qwen3vl.config.vision, ids[:1], grids, lengths[:1])


def test_mrope_tables_are_hfs(case):
    """Distinct positions on the three axes: HF's rotary tables; equal axes: exactly the plain ones."""
    c = case.config
    pos = np.random.default_rng(0).integers(0, 200, (3, 2, 9)).astype(np.int32)
    ref_cos, ref_sin = case.hf.model.language_model.rotary_emb(torch.zeros(1), torch.from_numpy(pos).long())
    cos, sin = rope_cos_sin(c.rope, c.head_dim, c.max_position_embeddings, jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(cos), ref_cos.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), ref_sin.numpy(), rtol=0, atol=1e-6)
    same = jnp.broadcast_to(jnp.asarray(pos[0]), (3, 2, 9))
    for a, b in zip(rope_cos_sin(c.rope, c.head_dim, 256, same), rope_cos_sin(c.rope, c.head_dim, 256, same[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Two images and prefill + decode (~18 s of compiles) under -m slow; one image per model by default.
@pytest.mark.parametrize("grids", [ONE, pytest.param(TWO, marks=pytest.mark.slow)], ids=["one_image", "two_images"])
def test_image_prompt_logits_are_hfs(case, grids):
    """Logits at every token of a prompt with images are HF's; with plain 1-D positions (and,
    for Qwen3-VL, without DeepStack) they are not."""
    ids = _prompt(grids, case.config.vision.spatial_merge_size, seed=len(grids))
    pixels = _pixels(case, grids, seed=len(grids))
    ref = _hf(case, ids, pixels, grids)
    images, _ = _images(case, ids, pixels, grids)
    assert np.abs(ref).max() > 0.5
    ours = _ours(case, ids, images)
    assert _error(ours, ref) <= TOL
    if len(grids) == 1:  # padded to a bucket of entries, the padding dropped: the same logits
        np.testing.assert_array_equal(_ours(case, ids, images.padded(images.embeds.shape[0] + 3)), ours)
    plain = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), images.position_ids.shape)
    assert _error(_ours(case, ids, images.replace(position_ids=plain)), ref) > 100 * TOL
    if case.config.vision.deepstack_indexes:
        assert _error(_ours(case, ids, images.replace(deepstack=())), ref) > 100 * TOL


@pytest.mark.slow
def test_prefill_then_decode_is_hfs(case):
    """The image prompt into the cache, then three text tokens one step each at cache position +
    rope delta: each step's logits are HF's over the whole sequence at that token."""
    grids, steps = ONE, 3
    prompt = _prompt(grids, case.config.vision.spatial_merge_size, seed=9)
    more = np.random.default_rng(9).integers(0, TEXT_VOCAB, (1, steps))
    pixels = _pixels(case, grids, seed=9)
    ref = _hf(case, np.concatenate([prompt, more], axis=1), pixels, grids)
    images, deltas = _images(case, prompt, pixels, grids)
    cache = jax.device_put(init_cache(case.config, 1, 64), jax.devices()[0])
    last, new = forward_jit(case.weights, case.config, jnp.asarray(prompt, jnp.int32), None, images=images)
    cache = prefilled = append_to_cache(cache, new)
    got = [np.asarray(last)]
    for k in range(steps):
        step = continuation(cache.lengths, 1, jnp.asarray(deltas))
        logits, new = forward_jit(case.weights, case.config, jnp.asarray(more[:, k:k + 1], jnp.int32), cache,
                                  images=step)
        cache = append_to_cache(cache, new)
        got.append(np.asarray(logits))
    T = prompt.shape[1]
    assert _error(np.stack(got, axis=1), ref[:, T - 1:T + steps]) <= TOL
    # Without the shift (the cache positions alone) the first step is not HF's.
    plain, _ = forward_jit(case.weights, case.config, jnp.asarray(more[:, :1], jnp.int32), prefilled)
    assert _error(np.asarray(plain)[:, None], ref[:, T:T + 1]) > 100 * TOL
