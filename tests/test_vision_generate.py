"""``Engine.generate(..., images=[...])`` on the converted tiny Qwen3-VL-MoE, against HF's
``generate`` on the composite model in fp32 (the oracle).

The image is made with Pillow and goes through the real preprocessing (``image_processing``,
equal to HF's processor: tests/test_image_processing.py); HF gets the same pixel values and grid
and the prompt with the placeholder expanded as its processor expands it. Checked:

- 32 greedy tokens after a prompt with one image are HF's, on Qwen3-VL-MoE and Qwen3.5 (prefill
  with M-RoPE positions and the tower's embeddings, then decode steps at cache position + rope
  delta);
- with a prefill chunk smaller than the prompt (image entries sliced per chunk): the same tokens,
  and seeded sampling after an image repeats itself;
- a text-only prompt on the vision model gives HF's tokens and compiles no image step;
- a batch of an image prompt and a text prompt: each row HF's alone;
- the refusals: no vision tower, placeholders != images, image tokens past the context.

Default: the greedy parity and the refusals (~12 s, most of it the fixture and the compiles);
the text-only and chunked runs under -m slow.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from dayzero.engine import generate as gen
from dayzero.engine.generate import Engine, GenerationError
from dayzero.engine.image_processing import QwenImageConfig, batch_pixels, preprocess_images
from dayzero.engine.sampling import SamplingParams
from tests.test_vision_dispatch import TEXT_VOCAB, TOKENS, qwen35, qwen3vl  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

NEW = 32  # the 32 greedy tokens
LOGPROB_TOL = 1e-4  # fp32 on both sides; decode positions off by the rope delta move them by > 1e-2
# The tiny tower's 4-pixel patches: a 40 x 28 image is a (1, 8, 10) grid, 20 image tokens.
SMALL = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=64 * 64)


def _image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (28, 40, 3), dtype=np.uint8))


def _prompt(seed: int = 1) -> list[int]:
    """Text, the image as the chat template writes it (start, one placeholder, end), text."""
    rng = np.random.default_rng(seed)
    text = lambda n: [int(i) for i in rng.integers(0, TEXT_VOCAB, n)]  # noqa: E731
    image = [TOKENS["vision_start_token_id"], TOKENS["image_token_id"], TOKENS["vision_end_token_id"]]
    return text(5) + image + text(3)


def _engine(case) -> Engine:
    engine = Engine(case.config, case.weights, kernels="reference")
    engine.image_config = QwenImageConfig(**SMALL)
    return engine


def _hf_greedy(case, ids: list[int], image=None) -> tuple[list[int], np.ndarray]:
    """HF's greedy tokens and their log-probabilities; with ``image``, its placeholder expanded
    and its pixels from our preprocessing (HF's processor's output)."""
    kwargs = {}
    if image is not None:
        processed = preprocess_images([image], QwenImageConfig(**SMALL))
        pixels, grids = batch_pixels(processed)
        at = ids.index(TOKENS["image_token_id"])
        ids = ids[:at] + [TOKENS["image_token_id"]] * processed[0].num_tokens + ids[at + 1:]
        kwargs = dict(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(grids))
    x = torch.tensor([ids])
    kwargs["mm_token_type_ids"] = (x == TOKENS["image_token_id"]).int()
    with torch.no_grad():
        out = case.hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, np.asarray(logprobs)


def _assert_hfs(out, ref) -> None:
    """The tokens, and (sensitive to every position) their log-probabilities, are HF's."""
    assert out.token_ids == ref[0]
    np.testing.assert_allclose(out.logprobs, ref[1], rtol=0, atol=LOGPROB_TOL)


@pytest.mark.parametrize("name", ["qwen3vl", "qwen35"])
def test_image_prompt_greedy_is_hfs(name, request):
    """One Pillow image: HF's 32 greedy tokens (Qwen3-VL-MoE, and Qwen3.5: linear-attention
    hybrid); the prompt ids come back expanded."""
    case = request.getfixturevalue(name)
    engine = _engine(case)
    prompt = _prompt()
    ref = _hf_greedy(case, prompt, _image())
    out = engine.generate(prompt, images=[_image()], max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    _assert_hfs(out, ref)
    assert out.prompt_ids.count(TOKENS["image_token_id"]) == 20
    assert any("images" in key for key in engine._steps.signatures())


@pytest.mark.slow
def test_text_prompt_is_unchanged(qwen3vl):
    """A text-only prompt on the vision model: HF's tokens, and only the text steps compiled."""
    engine = _engine(qwen3vl)
    prompt = _prompt()[:5] + _prompt(2)[-3:]
    out = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    _assert_hfs(out, _hf_greedy(qwen3vl, prompt))
    assert not any("images" in key or "rope_deltas" in key for key in engine._steps.signatures())


@pytest.mark.slow
def test_image_entries_sliced_per_chunk(qwen3vl, monkeypatch):
    """Prefill chunks of 16 tokens (the image's 20 tokens over two chunks): still HF's tokens;
    sampling with a seed runs and repeats itself."""
    prompt = _prompt()
    ref = _hf_greedy(qwen3vl, prompt, _image())
    monkeypatch.setattr(gen, "PREFILL_CHUNK", 16)
    engine = _engine(qwen3vl)
    out = engine.generate(prompt, images=[_image()], max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    assert len(out.prompt_ids) > 16
    _assert_hfs(out, ref)
    hot = SamplingParams(temperature=1.0, seed=3)
    a, b = (engine.generate(prompt, images=[_image()], max_new_tokens=NEW, ignore_eos=True, sampling=hot)
            for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == NEW


def test_refusals(qwen3vl):
    """One-line GenerationErrors, before anything compiles."""
    engine = _engine(qwen3vl)
    prompt = _prompt()
    with pytest.raises(GenerationError, match="2 image placeholders .* for 1 images"):
        engine.generate(prompt + [TOKENS["image_token_id"]], images=[_image()], max_new_tokens=2)
    with pytest.raises(GenerationError, match="0 image placeholders .* for 1 images"):
        engine.generate(prompt[:5], images=[_image()], max_new_tokens=2)
    # The published pixel bounds upscale the image past 256 x 256: 1053 image tokens, context 256.
    engine.image_config = None
    with pytest.raises(GenerationError, match=r"1063 tokens with its images. 1053 image tokens.*context of 256"):
        engine.generate(prompt, images=[_image()], max_new_tokens=2)
    text_only = Engine(dataclasses.replace(qwen3vl.config, vision=None), qwen3vl.weights.replace(vision=None),
                       kernels="reference")
    with pytest.raises(GenerationError, match="no vision tower"):
        text_only.generate(prompt, images=[_image()], max_new_tokens=2)
    assert not engine._steps.signatures() and not text_only._steps.signatures()


@pytest.mark.slow
def test_batch_of_image_and_text_prompts(qwen3vl):
    """Two prompts of different lengths in one batch, one with the image and one without: each
    row's tokens and log-probabilities are HF's for that prompt alone (per-row rope deltas)."""
    engine = _engine(qwen3vl)
    with_image, text = _prompt(), _prompt(4)[:6]
    outs = engine.generate([with_image, text], images=[[_image()], []], max_new_tokens=NEW, ignore_eos=True,
                           logprobs=True)
    _assert_hfs(outs[0], _hf_greedy(qwen3vl, with_image, _image()))
    _assert_hfs(outs[1], _hf_greedy(qwen3vl, text))
