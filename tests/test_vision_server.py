"""``dayzero serve`` with images: OpenAI ``image_url`` content parts (data URLs) in chat completions.

The HTTP server (engine/server.py) runs in process on a loopback port over a serving engine of
the converted tiny Qwen3-VL-MoE with the character tokenizer and Qwen-VL-style chat template of
tests/test_vision_cli.py (small pixel bounds: a 40 x 28 image is 20 tokens). Oracles:
``Engine.generate`` on the same image and the chat-encoded prompt (itself HF's, see
tests/test_vision_generate.py), and the engine's own refusal messages. Checked:

- a greedy request with one image_url part gives Engine.generate's tokens, and its usage counts
  the image's tokens;
- each bad input answers 400 with a message that names the problem (a remote URL or a local path,
  truncated or 16-bit or non-image data, bad base64, a bad ``detail``, an image outside a user
  message, too many images for the context, max_tokens past the context with the image, a
  text-only model), and the server goes on serving the same tokens;
- multi-process serving: an image request's record carries the images, and a follower's replay
  submits the same pixels (``server_mirror``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from dayzero.engine import server_mirror
from dayzero.engine.generate import Engine
from dayzero.engine.images import load_image
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.sampling import SamplingParams
from dayzero.engine.serving import ServingEngine
from tests.test_vision_cli import TOKENS, qwen3vl, vl  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

NEW = 4
CONTEXT = 96
SERVING = ServingConfig(slots=2, page_size=8, max_chunk=16, min_chunk=16, max_context=CONTEXT)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _picture(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (28, 40, 3), dtype=np.uint8))


def _message(*urls, text: str = "what is it?", detail=None) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u, **({"detail": detail} if detail else {})}} for u in urls]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


@contextlib.contextmanager
def _serving(engine: Engine):
    """The app over ``engine`` on a free loopback port; yields its base URL."""
    import uvicorn

    from dayzero.engine.server import ServerOptions, create_app
    from dayzero.engine.server_run import _listen

    sock = _listen("127.0.0.1", 0)
    ready = threading.Event()
    app = create_app(ServingEngine(engine, SERVING), ServerOptions(model_name="vl", on_ready=ready.set))
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        assert ready.wait(60)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(60)


def _chat(url: str, messages: list, **fields) -> tuple[int, dict]:
    """POST a greedy chat completion; (status, JSON body)."""
    body = dict(model="vl", messages=messages, max_tokens=NEW, temperature=0, ignore_eos=True, return_token_ids=True)
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps({**body, **fields}).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(vl):  # noqa: F811 (the imported fixture)
    with _serving(vl.engine) as url:
        yield url


@pytest.fixture(scope="module")
def reference(vl):  # noqa: F811
    """Engine.generate's completion of the chat-encoded prompt with the picture."""
    ids = vl.tokenizer.encode_chat("what is it?", images=1)
    return vl.engine.generate(ids, images=[_png(_picture())], max_new_tokens=NEW, ignore_eos=True)


def _assert_same(server, reference) -> None:
    status, body = _chat(server, [_message(_data_url(_png(_picture())), detail="low")])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference.token_ids and len(reference.token_ids) == NEW
    assert body["usage"]["prompt_tokens"] == len(reference.prompt_ids)  # the image's 20 tokens included


def test_image_url_request_equals_engine_generate(server, reference):
    _assert_same(server, reference)


def _sixteen_bit() -> bytes:
    return _png(Image.fromarray(np.full((28, 40), 40000, np.uint16)))


BAD = {
    "remote URL": ([_message("https://example.com/cat.png")], {}, "only data URLs are accepted"),
    "local path": ([_message("/etc/hostname")], {}, "fetches nothing"),
    "truncated PNG": ([_message(_data_url(_png(_picture())[:300]))], {}, "truncated"),
    "16-bit PNG": ([_message(_data_url(_sixteen_bit()))], {}, "16-bit"),
    "not an image": ([_message(_data_url(b"hello there"))], {}, "not a readable image"),
    "bad base64": ([_message("data:image/png;base64,@@@")], {}, "invalid base64"),
    "text media type": ([_message(_data_url(b"hi", "text/plain"))], {}, "media type 'text/plain'"),
    "bad detail": ([_message(_data_url(b"x"), detail="ultra")], {}, "detail 'ultra'"),
    "no url": ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], {}, "needs {\"url\""),
    "assistant image": ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}],
                        {}, "user messages only"),
    "too many images": ([_message(*[_data_url(_png(_picture(i))) for i in range(5)])], {},
                        "of 5 images, which leaves no room in this server's context of 96"),
    "max_tokens past the context": ([_message(_data_url(_png(_picture())))], {"max_tokens": CONTEXT - 20},
                                    "context of 96"),
}


def test_bad_inputs_answer_400_and_serving_goes_on(server, reference):
    """Every bad input: 400 and an OpenAI error object naming the problem; then the same good
    request still gives the same tokens."""
    for name, (messages, fields, fragment) in BAD.items():
        status, body = _chat(server, messages, **fields)
        assert status == 400, (name, body)
        assert fragment in body["error"]["message"], (name, body["error"]["message"])
    _assert_same(server, reference)


def test_text_only_model_answers_400(vl):  # noqa: F811
    """The same model without its tower: an image request is refused before anything is decoded."""
    text_only = Engine(dataclasses.replace(vl.config, vision=None), vl.weights.replace(vision=None), vl.tokenizer,
                       kernels="reference")
    with _serving(text_only) as url:
        status, body = _chat(url, [_message(_data_url(b"not even decoded"))])
    assert status == 400 and "no vision tower" in body["error"]["message"], body


class _Recorder:
    """A serving engine that records what it was submitted."""

    def __init__(self):
        self.submitted = []

    def submit(self, prompt, **kwargs):
        self.submitted.append((list(prompt), kwargs))
        return len(self.submitted) - 1


def test_mirror_record_carries_the_images():
    """The leader's record of an image request, through JSON as it is broadcast, makes a
    follower submit images whose pixels are the leader's; a text request's record is unchanged."""
    leader, follower = _Recorder(), _Recorder()
    mirror = server_mirror.LeaderServing(leader)
    picture = _picture(3)
    pad = TOKENS["image_token_id"]
    mirror.submit([1, pad, 2], max_new_tokens=3, sampling=SamplingParams(seed=5), images=[picture])
    mirror.submit([1, 2], max_new_tokens=3)
    assert leader.submitted[0][1]["images"] == [picture] and "images" not in leader.submitted[1][1]
    ops = json.loads(json.dumps(mirror._ops))
    assert len(ops[1]) == 8  # as before images: the record format of text requests is unchanged
    for op in ops:
        server_mirror._replay(follower, None, op)
    (prompt, kwargs), (_, text_kwargs) = follower.submitted
    assert prompt == [1, pad, 2] and kwargs["sampling"] == SamplingParams(seed=5) and "images" not in text_kwargs
    np.testing.assert_array_equal(np.asarray(load_image(kwargs["images"][0])), np.asarray(picture))


@pytest.mark.slow
def test_two_process_serve_equals_engine_generate(vl, reference):  # noqa: F811
    """``launch-local --processes 2 -- serve --mesh tensor=2``: the image request's record
    reaches process 1, both processes prefill the same image, and the tokens are one device's;
    a bad image is a 400 there too, and the run goes on."""
    from tests.test_server import start_server, stop_server

    s = start_server(["--model", str(vl.dz_dir), "--served-model-name", "vl", "--mesh", "tensor=2", "--slots", "2",
                      "--max-context", str(CONTEXT), "--max-chunk", "16", "--kernels", "reference", "--no-warmup"],
                     timeout=400, launch=("launch-local", "--processes", "2", "--devices-per-process", "1", "--"))
    try:
        status, body = _chat(s.root, BAD["truncated PNG"][0])
        assert status == 400 and "truncated" in body["error"]["message"], body
        _assert_same(s.root, reference)
    finally:
        stop_server(s)
