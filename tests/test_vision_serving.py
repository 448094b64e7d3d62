"""Image prompts through the continuous-batching engine (``ServingEngine.submit(..., images=...)``)
on the converted tiny Qwen3-VL-MoE and Qwen3.5 (a linear-attention hybrid), against
``Engine.generate`` with the same images, itself equal to HF's ``generate``
(tests/test_vision_generate.py), and, for the first case, against HF directly.

Small pages (8 positions) and chunks (16 tokens) so that the image's 20 tokens span pages and
prefill chunks. Checked:

- one image request: HF's greedy tokens and log-probabilities (the tower at the first chunk,
  each chunk its slice of positions and entries, decode shifted by the rope delta);
- image, text and another-image requests served at once: each row is ``Engine.generate``'s alone;
- the prefix cache: the same image prompt again reuses its pages (and on the hybrid, its state
  snapshot) with the same tokens; the same prompt with a different image of the same size reuses
  only the pages before the image (placeholders keyed by the image digest);
- preemption (a pool too small for both requests): the recomputed request's tokens are unchanged
  and the tower does not run again;
- refusals at submit, nothing queued: an unreadable image, a text-only model, too many image
  tokens for ``max_context``; images with speculative decoding;
- Kimi-K2.5 (latent attention, plain positions): image and text requests at once;
- the Pallas kernels (interpreted): served, and through ``Engine.generate``, the reference tokens.

Meshes: tests/test_vision_mesh.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from dayzero.engine import vision_step
from dayzero.engine.generate import Engine, GenerationError
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.serving import ServingEngine
from dayzero.engine.speculative import SpecConfig
from tests.test_vision_dispatch import TOKENS, qwen35, qwen3vl  # noqa: F401 (fixtures)
from tests.test_vision_generate import _assert_hfs, _engine, _hf_greedy, _image, _prompt
from tests.test_vision_kimi_generate import kimi  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

NEW = 8
SERVING = ServingConfig(slots=4, page_size=8, max_chunk=16, min_chunk=16, max_context=64)


def _other_image(seed: int = 7) -> Image.Image:
    """Same size as ``_image`` (same grid and token count), other pixels."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (28, 40, 3), dtype=np.uint8))


def _served(server: ServingEngine, prompts, images) -> list:
    ids = [server.submit(p, images=im, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
           for p, im in zip(prompts, images)]
    for _ in server.stream():
        pass
    return [server.completion(i) for i in ids]


def _alone(engine: Engine, prompt, images):
    return engine.generate(prompt, images=images, max_new_tokens=NEW, ignore_eos=True, logprobs=True)


def _same(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=0, atol=1e-5)


def test_image_request_is_hfs(qwen3vl):
    engine = _engine(qwen3vl)
    server = ServingEngine(engine, SERVING)
    (out,) = _served(server, [_prompt()], [[_image()]])
    tokens, logprobs = _hf_greedy(qwen3vl, _prompt(), _image())  # HF's 32 tokens: the first NEW compared
    _assert_hfs(out, (tokens[:NEW], logprobs[:NEW]))
    assert out.prompt_ids.count(TOKENS["image_token_id"]) == 20
    assert server.stats.prefill_chunks >= 2  # the image's entries were sliced over chunks


@pytest.mark.parametrize("name", ["qwen3vl", pytest.param("qwen35", marks=pytest.mark.slow)])
def test_concurrent_requests_and_prefix_cache(name, request):
    case = request.getfixturevalue(name)
    engine = _engine(case)
    server = ServingEngine(engine, SERVING)
    prompts = [_prompt(), _prompt(3)[:6], _prompt()]
    images = [[_image()], None, [_other_image()]]
    outs = _served(server, prompts, images)
    for out, prompt, im in zip(outs, prompts, images):
        _same(out, _alone(engine, prompt, im))
    assert outs[0].token_ids != outs[2].token_ids or outs[0].logprobs != outs[2].logprobs

    # The same image prompt again: its pages come from the prefix cache, its tokens do not move.
    before = server.stats.cached_tokens
    (again,) = _served(server, [_prompt()], [[_image()]])
    _same(again, outs[0])
    assert server.stats.cached_tokens - before >= 16
    # An image not seen before, of the same size at the same place: no page is reused (the
    # image starts at token 6, so no 8-token page is all text before it).
    before = server.stats.cached_tokens
    (other,) = _served(server, [_prompt()], [[_other_image(9)]])
    _same(other, _alone(engine, _prompt(), [_other_image(9)]))
    assert server.stats.cached_tokens == before


@pytest.mark.slow
def test_preemption_recomputes_the_same_tokens(qwen3vl, monkeypatch):
    engine = _engine(qwen3vl)
    small = dataclasses.replace(SERVING, num_pages=9, prefix_cache=False)
    server = ServingEngine(engine, small)
    prompts, images = [_prompt(), _prompt(5)], [[_image()], [_other_image()]]
    refs = [_alone(engine, prompt, im) for prompt, im in zip(prompts, images)]
    encodes = []
    monkeypatch.setattr(vision_step, "encode", lambda *a, _f=vision_step.encode: encodes.append(1) or _f(*a))
    outs = _served(server, prompts, images)
    assert server.stats.preemptions > 0
    assert len(encodes) == 2  # once per request, not again when recomputed
    for out, ref in zip(outs, refs):
        _same(out, ref)


def test_refusals_queue_nothing(qwen3vl, tmp_path):
    engine = _engine(qwen3vl)
    server = ServingEngine(engine, SERVING)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    with pytest.raises(GenerationError, match="broken.png"):
        server.submit(_prompt(), images=[str(broken)], max_new_tokens=2)
    with pytest.raises(GenerationError, match="1 image placeholders .* for 2 images"):
        server.submit(_prompt(), images=[_image(), _image()], max_new_tokens=2)
    tight = ServingEngine(engine, dataclasses.replace(SERVING, max_context=24))
    with pytest.raises(GenerationError, match="30 tokens with its images. 20 image tokens.*context of 24"):
        tight.submit(_prompt(), images=[_image()], max_new_tokens=2)
    text_only = Engine(dataclasses.replace(qwen3vl.config, vision=None), qwen3vl.weights.replace(vision=None),
                       kernels="reference")
    with pytest.raises(GenerationError, match="no vision tower"):
        ServingEngine(text_only, SERVING).submit(_prompt(), images=[_image()], max_new_tokens=2)
    with pytest.raises(GenerationError, match="speculative decoding does not take images"):
        engine.generate(_prompt(), images=[_image()], max_new_tokens=2, speculative=SpecConfig())
    assert not server.has_work and not tight.has_work


@pytest.mark.slow  # the interpreted kernels compile slowly (~40 s)
def test_images_on_the_kernels(qwen3vl):
    """On the Pallas kernels (interpreted): a served image request, and ``Engine.generate`` (which
    serves its rows on the paged kernels), give the reference path's tokens."""
    ref = _alone(_engine(qwen3vl), _prompt(), [_image()])
    kernels = Engine(qwen3vl.config, qwen3vl.weights, kernels="pallas_interpret")
    kernels.image_config = _engine(qwen3vl).image_config
    _same(_alone(kernels, _prompt(), [_image()]), ref)
    server = ServingEngine(_engine(qwen3vl), dataclasses.replace(SERVING, kernels="pallas_interpret"))
    (out,) = _served(server, [_prompt()], [[_image()]])
    _same(out, ref)


@pytest.mark.slow  # ~21 s; Qwen3-VL image requests are served by default
def test_kimi_image_requests(kimi):
    """Kimi-K2.5 (latent attention, plain positions): two image requests and a text request served
    at once, each ``Engine.generate``'s alone (itself HF's: tests/test_vision_kimi_generate.py)."""
    from tests.test_vision_kimi_generate import _image as kimi_image, _prompt as kimi_prompt

    server = ServingEngine(kimi.engine, SERVING)
    prompts = [kimi_prompt(1), kimi_prompt(2, seed=3), kimi_prompt(0, seed=4)]
    images = [[kimi_image(0)], [kimi_image(1), kimi_image(0)], None]
    for out, prompt, im in zip(_served(server, prompts, images), prompts, images):
        _same(out, _alone(kimi.engine, prompt, im))
