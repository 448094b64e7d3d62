"""``dayzero serve`` over two processes: ``launch-local --processes 2 --devices-per-process D --
serve --mesh tensor=2D``. Process 0 serves HTTP; process 1 replays its steps (engine/server_mirror.py).
D = 1 in the default suite; D = 4 (tensor=8, the issue's example) with ``-m slow`` (its compiles
over 8 faked devices in two processes take minutes on two cores).

The oracle is one device in this process: ``Engine.generate`` for greedy and seeded tokens, and a
one-device ``ServingEngine`` given the same grammar for structured output. A follower out of step
with the leader would hang the collectives or change the tokens; a cancelled stream must give its
pages back on the leader and leave both processes in step for the next request; SIGTERM to
process 0 must end both processes with status 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import jsonschema
import openai
import pytest

from tests.test_server import _metrics, _wait_idle, start_server, stop_server

MODEL = "tiny8"
SCHEMA = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
          "required": ["pet", "age"], "additionalProperties": False}


@pytest.mark.parametrize("ops", [[], [["cancel", 3]], [["submit", 1, list(range(400)), 6, {}, True, 0, "g"]]])
def test_step_records_round_trip_through_the_broadcasts(monkeypatch, ops):
    """The leader's framing read back by a follower, with the collective replaced by a list: an
    empty record is the header alone, a short one rides in the first broadcast, a long one (> 1 KiB)
    in a second one padded to a power of two."""
    from dayzero.engine import server_mirror

    sent = []
    monkeypatch.setattr(server_mirror, "_broadcast", lambda values: sent.append(values.copy()) or values)
    server_mirror.send(server_mirror._STEP, ops)
    assert [b.size for b in sent] == [server_mirror.FIRST] + ([2048] if len(json.dumps(ops)) > 1000 else [])
    monkeypatch.setattr(server_mirror, "_broadcast", lambda values: sent.pop(0))
    assert server_mirror.receive() == (server_mirror._STEP, ops) and not sent


@pytest.fixture(scope="module")
def model_dir(hf_factory, tmp_path_factory):
    """A tiny byte-tokenizer llama whose 8 heads, 8 kv heads, MLP and vocabulary split over tensor=8."""
    model = hf_factory.build("llama", seed=6, num_attention_heads=8, num_key_value_heads=8, vocab_size=264,
                             max_position_embeddings=256)
    _, dz = hf_factory.save_and_convert(model, tmp_path_factory.mktemp("serve_multihost"), tokenizer=True)
    return dz


@pytest.fixture(scope="module")
def engine(model_dir):
    """The same model on one device of this process."""
    from dayzero.engine import Engine

    return Engine.load(model_dir)


@pytest.fixture(scope="module", params=[1, pytest.param(4, marks=pytest.mark.slow)], ids=["tensor=2", "tensor=8"])
def server(model_dir, request):
    per_process = request.param
    launch = ("launch-local", "--processes", "2", "--devices-per-process", str(per_process), "--")
    s = start_server(["--model", str(model_dir), "--served-model-name", MODEL, "--mesh", f"tensor={2 * per_process}",
                      "--slots", "4", "--max-context", "96", "--max-chunk", "32", "--shutdown-timeout", "20",
                      "--no-warmup"], timeout=400, launch=launch)
    s.client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=120)
    yield s
    stop_server(s)


def _complete(server, prompt, **kw):
    kw.setdefault("extra_body", {"return_token_ids": True, "ignore_eos": True})
    return server.client.completions.create(model=MODEL, prompt=prompt, **kw)


def test_concurrent_greedy_and_seeded_streams_equal_one_device(server, engine):
    """Six streams at once (four slots: two queue and join as slots free), greedy and seeded
    sampling, each token for token what one device gives."""
    from dayzero.engine.sampling import SamplingParams

    cases = [(f"host {i} says", 0.0 if i % 2 else 1.0, 100 + i) for i in range(6)]

    def stream(case):
        prompt, temperature, seed = case
        ids = []
        for chunk in _complete(server, prompt, max_tokens=12, temperature=temperature, seed=seed, stream=True):
            ids += chunk.choices[0].model_extra["token_ids"]
        return ids

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        served = list(pool.map(stream, cases, timeout=300))
    for (prompt, temperature, seed), ids in zip(cases, served):
        one = engine.generate(prompt, max_new_tokens=12, ignore_eos=True,
                              sampling=SamplingParams(temperature=temperature, seed=seed))
        assert ids == one.token_ids, (prompt, temperature)


@pytest.mark.slow
def test_n_choices_of_a_long_prompt_equal_one_device(server, engine):
    """Four seeded choices of a 70-token prompt are submitted in one step: their record (> 1 KiB)
    travels in the second broadcast (``server_mirror.FIRST``). Slow: its prefill chunks are more
    shapes to compile (the framing itself is checked in one process below)."""
    from dayzero.engine.sampling import SamplingParams

    prompt = "the quick brown fox jumps over the lazy dog, again and again and again!"
    reply = _complete(server, prompt, max_tokens=6, temperature=1.0, seed=7, n=4)
    for choice in sorted(reply.choices, key=lambda c: c.index):
        one = engine.generate(prompt, max_new_tokens=6, ignore_eos=True,
                              sampling=SamplingParams(temperature=1.0, seed=7 + choice.index))
        assert choice.model_extra["token_ids"] == one.token_ids


def test_structured_output_equals_one_device(server, engine):
    """The followers rebuild the grammar from its text: the served JSON validates and equals a
    one-device serving engine's under the same grammar."""
    from dayzero.engine.grammar import Grammars
    from dayzero.engine.server_protocol import ResponseFormat
    from dayzero.engine.serving import ServingEngine

    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    reply = server.client.completions.create(model=MODEL, prompt="a pet:", max_tokens=40, temperature=0,
                                             extra_body={"response_format": fmt, "return_token_ids": True})
    value = json.loads(reply.choices[0].text)
    jsonschema.validate(value, SCHEMA)
    grammars = Grammars(engine.tokenizer, engine.config.vocab_size, engine.eos_ids)
    one = ServingEngine(engine)
    rid = one.submit("a pet:", max_new_tokens=40, constraint=grammars.constraint(ResponseFormat.model_validate(fmt)))
    list(one.stream())
    assert reply.choices[0].model_extra["token_ids"] == one.completion(rid).token_ids


def test_cancel_frees_pages_and_keeps_processes_in_step(server, engine):
    """A stream closed mid-way is cancelled in both processes: the leader's pool is whole again and
    the next request still equals one device (a follower that kept the request would differ)."""
    before = _metrics(server)
    total = before["dayzero_kv_pages_used"] + before["dayzero_kv_pages_free"]
    stream = _complete(server, "to be cut", max_tokens=60, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    _wait_idle(server, total)
    ids = _complete(server, "after the cut", max_tokens=8, temperature=0).choices[0].model_extra["token_ids"]
    assert ids == engine.generate("after the cut", max_new_tokens=8, ignore_eos=True).token_ids


def test_sigterm_to_process_0_stops_both_with_status_0(server):
    """Last: process 0 drains, tells process 1 to stop, both exit 0 (launch-local's status)."""
    pid = next(int(line.split("pid ")[1]) for line in iter(server.proc.stderr.readline, "")
               if line.startswith("[launch-local] process 0 pid "))
    os.kill(pid, signal.SIGTERM)
    assert server.proc.wait(120) == 0
    err = server.proc.stderr.read()
    assert "[1] dayzero: serve: process 1 ran" in err, err[-3000:]
