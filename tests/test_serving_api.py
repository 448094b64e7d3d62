"""The serving engine's API for a server (``dayzero.engine.serving``): top logprobs, token
constraints, cancellation and metrics.

Oracles: the model's full forward pass over prompt + generated tokens (no cache, no paging,
no sampling code) with a numpy log-softmax; hand-written constraints whose allowed tokens are
known; the page pool's counts before a request; counts worked out from the scripted requests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.engine import GenerationError, SamplingParams
from dayzero.engine import paged_steps
from dayzero.engine.sampling import mask_words
from dayzero.engine.serving import ConstraintError, ServingConfig, ServingEngine
from dayzero.model.transformer import forward
from tests.serving_models import prompt

PAGE = 8
# As tests/test_serving.py: 4 slots (decode batches of 1, 2, 4), pages of 8, chunks of 16 or 32.
SERVING = ServingConfig(slots=4, page_size=PAGE, num_pages=48, max_context=128, max_chunk=32, min_chunk=16,
                        min_table_pages=8)
V = 260  # the vocabulary of the session's tiny llama (conftest.py): 9 mask words, the last one partly used
NEW = 15  # new tokens of the requests checked against the full forward (25 tokens with their prompts)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def server(engine):
    return ServingEngine(engine, SERVING)


class AllowOnly:
    """Allows only ``allowed`` token ids, for ever (the request ends by length)."""

    def __init__(self, allowed):
        self.allowed, self.accepted = sorted(allowed), []

    def next_mask(self):
        mask = np.zeros(mask_words(V), np.uint32)
        for t in self.allowed:
            mask[t // 32] |= np.uint32(1 << (t % 32))
        return mask

    def accept(self, token):
        self.accepted.append(token)

    def is_terminated(self):
        return False


class Forced(AllowOnly):
    """Allows exactly ``sequence[i]`` as the i-th token, then is complete."""

    def __init__(self, sequence):
        super().__init__([])
        self.sequence = list(sequence)

    def next_mask(self):
        self.allowed = [self.sequence[len(self.accepted)]]
        return super().next_mask()

    def is_terminated(self):
        return len(self.accepted) == len(self.sequence)


@functools.partial(jax.jit, static_argnames="config")
def _all_logits(weights, tokens, config):
    return forward(weights, config, tokens, all_logits=True)[0]


def _reference_logprobs(engine, tokens: list[int], generated: int) -> np.ndarray:
    """[generated, V] float64 log-softmax of the full forward's logits at each generated position."""
    logits = np.asarray(_all_logits(engine.weights, jnp.asarray([tokens]), engine.config), np.float64)[0]
    logits = logits[len(tokens) - generated - 1 : len(tokens) - 1]
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _events_by_request(events):
    out = {}
    for e in events:
        out.setdefault(e.request_id, []).append(e)
    return out


def test_top_logprobs_are_the_full_forwards_log_softmax(server, engine):
    """A greedy and a sampled request in one batch: each Event's top logprobs are the k largest of
    the reference log-softmax at that position (before temperature), most likely first, and its
    token's logprob is that distribution's; the greedy token is the first of its top logprobs."""
    specs = [(prompt(10, 1), SamplingParams(), 5), (prompt(10, 2), SamplingParams(temperature=0.7, seed=4), 20)]
    ids = [server.submit(p, max_new_tokens=NEW, sampling=s, top_logprobs=k, ignore_eos=True) for p, s, k in specs]
    events = _events_by_request(server.stream())
    for rid, (p, params, k) in zip(ids, specs):
        mine = events[rid]
        reference = _reference_logprobs(engine, p + [e.token for e in mine], NEW)
        for e, lp in zip(mine, reference):
            order = np.argsort(-lp)[:k]
            assert [t for t, _ in e.top_logprobs] == order.tolist()
            np.testing.assert_allclose([v for _, v in e.top_logprobs], lp[order], atol=2e-4)
            np.testing.assert_allclose(e.logprob, lp[e.token], atol=2e-4)
            if params.greedy:
                assert e.top_logprobs[0] == (e.token, e.logprob)
        server.completion(rid)


def test_constraints_are_obeyed_and_leave_unconstrained_rows_unchanged(server, engine):
    """One batch: a greedy and a sampled row limited to 7 tokens, a filtered row (top-k 5) forced
    through 5 given tokens, and an unconstrained filtered row. The limited greedy row takes the
    reference argmax among its 7 tokens at every position; the forced row emits exactly its
    tokens (most outside its top 5: the mask comes before the filters) and stops there; the
    unconstrained row gives the tokens it gives alone (there with the unmasked program)."""
    allowed = list(range(3, V, 37))
    forced = [259, 1, 128, 77, 5]
    filtered = SamplingParams(temperature=0.8, top_k=5, seed=2)
    prompts = [prompt(10, 10 + n) for n in range(4)]
    rows = [(SamplingParams(), AllowOnly(allowed)), (SamplingParams(temperature=1.5, seed=9), AllowOnly(allowed)),
            (filtered, Forced(forced)), (filtered, None)]
    ids = [server.submit(p, max_new_tokens=NEW, sampling=s, constraint=c, ignore_eos=True)
           for p, (s, c) in zip(prompts, rows)]
    events = _events_by_request(server.stream())
    out = [server.completion(i) for i in ids]
    for o, (_, c) in zip(out, rows[:2]):
        assert set(o.token_ids) <= set(allowed) and c.accepted == o.token_ids
        assert o.finish_reason == "length" and len(o.token_ids) == NEW
    assert len(set(out[1].token_ids)) > 1  # it samples among the allowed tokens
    reference = _reference_logprobs(engine, prompts[0] + out[0].token_ids, NEW)
    assert out[0].token_ids == [allowed[i] for i in np.argmax(reference[:, allowed], axis=-1)]
    assert out[2].token_ids == forced and out[2].finish_reason == "stop"
    assert [e.finish_reason for e in events[ids[2]]] == [None] * 4 + ["stop"]
    alone = server.run([prompts[3]], max_new_tokens=NEW, sampling=filtered, ignore_eos=True)[0]
    assert out[3].token_ids == alone.token_ids
    assert not set(out[3].token_ids) <= set(allowed)  # unconstrained, the model leaves the 7 tokens
    assert server.pool.in_use == 0


def test_unconstrained_serving_compiles_no_mask_variant(engine):
    """A greedy request with top logprobs beside a sampled one samples with the unmasked program
    only: no masked sampling variant is run or compiled. A constrained request then runs one."""
    server = ServingEngine(engine, SERVING)
    masked_steps = lambda: [k for k in paged_steps._STEPS.signatures() if k[0] == "sample_masked"]  # noqa: E731
    compiled = masked_steps()
    server.submit(prompt(6, 6), max_new_tokens=4, top_logprobs=2, ignore_eos=True)
    server.submit(prompt(6, 7), max_new_tokens=4, sampling=SamplingParams(temperature=0.5, seed=1), ignore_eos=True)
    list(server.stream())
    assert {masked for _, _, masked, _ in server.steps.samplings_run} == {False}
    assert {top for *_, top in server.steps.samplings_run} == {0, 20}
    assert masked_steps() == compiled
    server.submit(prompt(6, 6), max_new_tokens=4, constraint=AllowOnly([7]), ignore_eos=True)
    assert [e.token for e in server.stream()] == [7] * 4
    assert {masked for _, _, masked, _ in server.steps.samplings_run} == {False, True}


def test_cancel_of_a_queued_and_a_running_request_returns_their_pages(server):
    """Five requests on four slots: the fifth waits. Cancelling it and a running one (mid-stream,
    while a decode step's events are handed out, before the running one's) frees the slot and
    pages at once; neither gets another Event, the others finish, and the pool is back where it
    was."""
    server.pool.clear_cache()
    available = server.pool.available
    ids = [server.submit(prompt(n, 50 + n), max_new_tokens=20, ignore_eos=True) for n in (15, 9, 16, 14, 11)]
    running, queued = ids[1], ids[4]
    counts = dict.fromkeys(ids, 0)
    seen = None  # the requests with events after the cancellations
    for event in server.stream():
        counts[event.request_id] += 1
        if seen is not None:
            seen.append(event.request_id)
        elif event.request_id == ids[0] and counts[running] >= 2:
            # ``running`` decodes (it did last step) in this step too, in the row after ids[0]
            # (decode rows come in slot order): its event of this step is dropped.
            before = server.metrics()
            assert before["waiting"] == 1 and before["running"] == 4
            assert server.cancel(running) and server.cancel(queued)
            now = server.metrics()
            assert now["waiting"] == 0 and now["running"] == 3 and now["pages_used"] < before["pages_used"]
            seen = []
    assert running not in seen and queued not in seen and set(seen) == {ids[0], ids[2], ids[3]}
    assert not server.cancel(running) and not server.cancel(ids[0])  # gone; finished
    with pytest.raises(KeyError):
        server.completion(running)
    assert [len(server.completion(i).token_ids) for i in (ids[0], ids[2], ids[3])] == [20] * 3
    assert server.pool.in_use == 0 and server.pool.available == available


def test_metrics_count_a_scripted_run(engine):
    """Four prompts admitted of six (four slots): the queue, the pages of their prompts; then two
    requests sharing five full pages, one after the other: the second finds 40 of its 48 prompt
    tokens cached."""
    server = ServingEngine(engine, SERVING)
    lengths = (20, 9, 30, 14, 11, 5)
    ids = [server.submit(prompt(n, 70 + n), max_new_tokens=3, ignore_eos=True) for n in lengths]
    assert server.metrics()["waiting"] == 6 and server.metrics()["running"] == 0
    server.step()
    m = server.metrics()
    used = sum(-(-n // PAGE) for n in lengths[:4])
    assert (m["waiting"], m["running"], m["pages_used"], m["pages_free"]) == (2, 4, used, 48 - used)
    list(server.stream())
    for i in ids:
        server.completion(i)
    shared = prompt(40, 99)
    first, second = shared + prompt(5, 100), shared + prompt(8, 101)
    server.run([first], max_new_tokens=4, ignore_eos=True)
    server.run([second], max_new_tokens=4, ignore_eos=True)
    prompts = sum(lengths) + len(first) + len(second)
    assert server.metrics() == dict(waiting=0, running=0, pages_used=0, pages_free=48, preemptions=0,
                                    prompt_tokens=prompts, generated_tokens=3 * 6 + 4 * 2,
                                    prefix_cache_hit_rate=40 / prompts)


class _BadMask(AllowOnly):
    def __init__(self, mask):
        super().__init__([])
        self.mask = mask

    def next_mask(self):
        return self.mask


@pytest.mark.parametrize("mask, text", [(np.zeros(3, np.uint32), r"shape \(3,\)"),
                                        (np.zeros(mask_words(V), np.uint32), "allows no token"),
                                        (np.ones(mask_words(V), np.float32), "dtype float32")])
def test_unusable_mask_cancels_its_request_and_serving_goes_on(server, mask, text):
    bad = server.submit(prompt(4, 1), max_new_tokens=3, constraint=_BadMask(mask))
    good = server.submit(prompt(4, 2), max_new_tokens=3, ignore_eos=True)
    with pytest.raises(ConstraintError, match=f"request {bad} gave .*{text}") as error:
        list(server.stream())
    assert error.value.request_id == bad
    assert [e.request_id for e in server.stream()] == [good] * 3
    server.completion(good)
    assert server.pool.in_use == 0


@pytest.mark.parametrize("kwargs, text", [(dict(top_logprobs=21), "top_logprobs=21"),
                                          (dict(top_logprobs=-1), "top_logprobs=-1"),
                                          (dict(constraint=object()), "not a TokenConstraint")])
def test_bad_api_arguments_are_refused_at_submit(server, kwargs, text):
    with pytest.raises(GenerationError, match=text):
        server.submit([1, 2], **kwargs)
