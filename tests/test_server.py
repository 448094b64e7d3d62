"""``dayzero serve`` end to end: the official ``openai`` client against a live server on loopback.

One server per module, started as ``dayzero serve`` in a subprocess on a free port, over the tiny
byte-tokenizer llama of ``conftest.tiny_model`` (random weights: its text is noise, but every
token is a byte, so text, stop strings and JSON are checked exactly). Every request loop is
bounded in count and in time (client timeouts, deadlines). The independent oracles: the
contiguous-cache ``Engine.generate`` (tokens and logprobs), the schema (``jsonschema``), the
request's own stop strings, and the engine's page counts before and after (``/metrics``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import jsonschema
import openai
import pytest

MODEL = "tiny"
SLOTS, MAX_QUEUE, CONTEXT = 4, 28, 128  # capacity: 32 requests outstanding, then 429


def start_server(args: list[str], timeout: float = 300.0, launch: tuple[str, ...] = ()) -> SimpleNamespace:
    """``dayzero [LAUNCH] serve ARGS --port 0`` in a subprocess; returns once it announced its URL
    (``launch``: e.g. ``launch-local ... --``, to serve from several processes)."""
    cmd = [sys.executable, "-m", "dayzero.engine.cli", *launch, "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if selector.select(timeout=1.0):
            line = proc.stdout.readline()
            if " at http://" in line:
                url = line.split(" at ")[1].split()[0]  # http://127.0.0.1:PORT/v1
                return SimpleNamespace(proc=proc, url=url, root=url.rsplit("/v1", 1)[0])
    proc.kill()
    raise AssertionError(f"the server did not start: {proc.stderr.read()[-3000:]}")


def stop_server(server: SimpleNamespace) -> int:
    """SIGTERM, then the exit status (killed after 60 s)."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return -9


@pytest.fixture(scope="module")
def server(tiny_model):
    s = start_server(["--model", str(tiny_model.dir), "--served-model-name", MODEL, "--slots", str(SLOTS),
                      "--max-context", str(CONTEXT), "--max-chunk", "32", "--max-queue", str(MAX_QUEUE),
                      "--shutdown-timeout", "20", "--no-warmup"])
    s.client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=60)
    yield s
    stop_server(s)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _complete(server, prompt, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("extra_body", {"return_token_ids": True})
    return server.client.completions.create(model=MODEL, prompt=prompt, **kw)


class _Reply(SimpleNamespace):
    def json(self):
        return json.loads(self.text)


def _http(url: str, body=None) -> _Reply:
    """GET ``url``, or POST ``body`` (bytes as they are, else as JSON) to it; any status."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return _Reply(status_code=r.status, headers=r.headers, text=r.read().decode())
    except urllib.error.HTTPError as e:
        return _Reply(status_code=e.code, headers=e.headers, text=e.read().decode())


def _metrics(server) -> dict[str, float]:
    text = _http(server.root + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_text_stream_holds_back_stop_prefixes(tiny_model):
    """The detokenizer alone (byte tokens): a tail that may start a stop string waits; a stop
    string cuts the text before it; a false start is released; UTF-8 is never split."""
    from dayzero.engine.server_loop import TextStream
    from dayzero.engine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model.dir)
    stream = TextStream(tok, ["STOP", "é!"])
    out = [stream.push(b) for b in "ab STX S".encode()]
    assert "".join(t for t, _ in out) == "ab STX " and not any(hit for _, hit in out)
    out = [stream.push(b) for b in "TOP".encode()]  # the server ends the request at the hit
    assert out == [("", False), ("", False), ("", True)]  # "S" was held: nothing of "STOP" is shown
    stream = TextStream(tok, ["é!"])
    pieces = [stream.push(b)[0] for b in "xé?".encode()]  # é is two bytes: held until whole, then released
    assert pieces == ["x", "", "", "é?"] and stream.finish() == ""


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert _http(server.root + "/health").status_code == 200
    m = _metrics(server)
    for name in ("dayzero_kv_pages_used", "dayzero_kv_pages_free", "dayzero_queue_depth", "dayzero_running_requests",
                 "dayzero_prefix_cache_hit_rate", "dayzero_preemptions_total", "dayzero_prompt_tokens_total",
                 "dayzero_generated_tokens_total", "dayzero_time_to_first_token_seconds_count"):
        assert name in m, name


def test_greedy_equals_engine_generate(server, tiny_engine):
    """Text and token-id prompts through the server give ``Engine.generate``'s greedy tokens and
    logprobs (the contiguous cache: an independent path)."""
    text = "The quick brown fox"
    ids = tiny_engine.tokenizer.encode(text)
    expected = tiny_engine.generate(ids, max_new_tokens=12, logprobs=True, ignore_eos=True)
    for prompt in (text, ids):
        r = _complete(server, prompt, max_tokens=12, logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        assert _ids(r.choices[0]) == expected.token_ids
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text == tiny_engine.tokenizer.decode(expected.token_ids)


def test_chat_stream_matches_whole_and_reports_usage(server):
    messages = [{"role": "user", "content": "Say something."}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_stop_strings_cut_and_never_emitted(server):
    # Seeded sampling (greedy repeats one byte on this random model), the same in every call.
    kw = dict(max_tokens=24, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    text = _complete(server, "Once upon a time", **kw).choices[0].text
    # The random model's bytes are mostly invalid UTF-8; stop at a printable character it wrote.
    stop = next(ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd")
    expected = text[: text.find(stop)]
    r = _complete(server, "Once upon a time", stop=[stop, "never-appears"], **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(_complete(server, "Once upon a time", stop=stop, stream=True, **kw))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected and all(stop not in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeds_reproduce_and_n_choices(server):
    """Choice i of a request with seed s is the request with seed s + i (the documented policy)."""
    kw = dict(max_tokens=10, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True,
                                                                                  "return_token_ids": True})
    a, b = _complete(server, "Seeds", **kw), _complete(server, "Seeds", **kw)
    runs = [[_ids(c) for c in sorted(r.choices, key=lambda c: c.index)] for r in (a, b)]
    assert runs[0] == runs[1] and len(runs[0]) == 3 and len({tuple(t) for t in runs[0]}) > 1
    third = _complete(server, "Seeds", **dict(kw, n=1, seed=9))
    assert _ids(third.choices[0]) == runs[0][2]
    assert a.usage.completion_tokens == 30


def test_top_logprobs(server):
    r = _complete(server, "Logprobs", max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())  # keyed by text: tokens that decode alike (bad UTF-8) share a key
        assert 1 <= len(values) <= 3
        assert chosen == pytest.approx(max(values), abs=1e-6)  # greedy: the chosen token is the most likely
    c = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              temperature=0, logprobs=True, top_logprobs=2)
    entries = c.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6) for e in entries)


SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "size": {"enum": ["S", "M", "L"]},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}, "mode": {"enum": ["a", "b"]},
                                                   "deep": {"type": "object", "properties": {"x": {"enum": [1, 2, 3]}},
                                                            "required": ["x"], "additionalProperties": False}},
                  "required": ["flag", "mode", "deep"], "additionalProperties": False}},
     "required": ["size", "inner"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1,
                                               "maxItems": 3},
                                      "level": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["tags", "level"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum-bool", "nested", "array-int"])
def test_structured_output_validates(server, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in (0, 1):
        r = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                                  max_tokens=80, temperature=1.0, seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def _error(response: _Reply, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
                                         ("temperature", "hot"), ("max_tokens", "ten"), ("n", 0),
                                         ("prompt", list(range(CONTEXT + 10))),
                                         ("presence_penalty", 0.5)])
def test_bad_requests_answer_400_and_serving_goes_on(server, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    error = _error(_http(server.url + "/completions", body), 400)
    assert error["param"] is None or field in error["param"]
    assert _complete(server, "still here", max_tokens=2).choices[0].finish_reason == "length"


def test_a_schema_the_grammar_library_cannot_compile_answers_400(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
    assert _error(_http(server.url + "/chat/completions", body), 400)["param"] == "response_format"
    assert _complete(server, "still here", max_tokens=2).choices[0].finish_reason == "length"


def test_malformed_json_and_unknown_model(server):
    _error(_http(server.url + "/completions", b'{"model": "tiny", "prompt": '), 400)
    assert _error(_http(server.url + "/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}), 404)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert _complete(server, "still here", max_tokens=2).usage.completion_tokens == 2


def _wait_idle(server, pages_total: float, seconds: float = 30.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m["dayzero_running_requests"] == 0 and m["dayzero_queue_depth"] == 0 and \
                m["dayzero_kv_pages_free"] == pages_total:
            return m
        time.sleep(0.1)
    raise AssertionError(f"the engine did not become idle: {m}")


def test_full_queue_429_then_disconnects_free_every_page(server):
    """Capacity streams held open (4 running, 28 queued), one more is refused with 429 and
    Retry-After; closing the streams mid-way cancels them: every page comes back."""
    before = _metrics(server)
    total = before["dayzero_kv_pages_used"] + before["dayzero_kv_pages_free"]
    streams = [_complete(server, f"hold {i}", max_tokens=100, temperature=1.0, stream=True,
                         extra_body={"ignore_eos": True}) for i in range(SLOTS + MAX_QUEUE)]
    try:
        next(iter(streams[0]))  # a running one is producing
        r = _http(server.url + "/completions", {"model": MODEL, "prompt": "one more", "max_tokens": 2})
        assert _error(r, 429)["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
        m = _metrics(server)
        assert m["dayzero_running_requests"] == SLOTS and m["dayzero_kv_pages_used"] > 0
    finally:
        for s in streams:
            s.close()
    after = _wait_idle(server, total)
    assert after['dayzero_requests_total{outcome="cancelled"}'] >= SLOTS + MAX_QUEUE
    assert _complete(server, "after", max_tokens=2).usage.completion_tokens == 2


def test_32_concurrent_streams_lose_and_duplicate_nothing(server):
    """32 streaming clients at once (4 running, the rest queued, joining as slots free): each gets
    exactly the tokens the same prompt gets alone, every token once, text and ids agreeing."""
    prompts = [f"client {i % 8} says" for i in range(32)]
    alone = _complete(server, sorted(set(prompts)), max_tokens=16, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True})
    expected = {p: _ids(c) for p, c in zip(sorted(set(prompts)), sorted(alone.choices, key=lambda c: c.index))}

    def stream(prompt: str) -> tuple[list[int], str]:
        ids, text = [], ""
        for chunk in _complete(server, prompt, max_tokens=16, stream=True,
                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            ids += chunk.choices[0].model_extra["token_ids"]
            text += chunk.choices[0].text
        return ids, text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, prompts, timeout=120))
    for prompt, (ids, text) in zip(prompts, results):
        assert ids == expected[prompt]
        assert text == alone.choices[sorted(set(prompts)).index(prompt)].text


def test_sigterm_finishes_running_requests_and_exits_0(server):
    """Last (it stops the module's server): SIGTERM mid-stream, the stream still ends normally,
    then the process exits 0."""
    stream = _complete(server, "bye", max_tokens=30, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert [first, *rest][-1].choices[0].finish_reason == "length" and len(rest) == 29
    assert stop_server(server) == 0, server.proc.stderr.read()[-2000:]
    with pytest.raises(openai.APIConnectionError):
        _complete(server, "gone", max_tokens=2)


@pytest.fixture(scope="module")
def smol_server():
    """``dayzero serve`` with no --model: the embedded SmolLM2-135M-Instruct."""
    s = start_server(["--slots", "4", "--max-context", "512", "--no-warmup", "--served-model-name", "smol"], 600)
    s.client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=300)
    yield s
    assert stop_server(s) == 0


@pytest.mark.slow
def test_embedded_model_greedy_equals_engine_generate_and_json(smol_server):
    """The real model: greedy tokens through the server are ``Engine.generate``'s, concurrently
    too; ``json_object`` output parses."""
    from dayzero.engine import Engine

    engine = Engine.load(progress=False)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    expected = engine.generate(prompts, max_new_tokens=24)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda p: smol_server.client.completions.create(
            model="smol", prompt=p, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}), prompts))
    for e, g in zip(expected, got):
        assert _ids(g.choices[0]) == e.token_ids and g.choices[0].text == e.text
    r = smol_server.client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Describe a cat as a JSON object with name and age."}],
        max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
