"""The generation engine: sampling semantics, log-probabilities, request validation, stopping,
streaming and compiled-step reuse.

Most tests share the session's ``tiny_engine`` (a tiny random llama with a byte-level tokenizer,
see conftest.py) so its compiled steps are reused; the reference logits come from the HF model it
was converted from.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from dayzero.engine import Completion, Engine, GenerationError, SamplingError, SamplingParams
from dayzero.engine.sampling import RowSampling, SamplingMode, batch_sampling, sample
from dayzero.engine.tokenizer import Tokenizer

PROMPT = [5, 17, 99, 3, 42, 8, 200, 11, 64, 150]
NEW = 12


def _hf_logits(tiny_model, ids: list[int]) -> np.ndarray:
    """HF fp32 logits [len(ids), V] of one sequence."""
    with torch.no_grad():
        return tiny_model.hf(torch.tensor([ids])).logits[0].float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _continuation_logits(tiny_model, out: Completion) -> np.ndarray:
    """HF logits [len(tokens), V] that predicted each generated token."""
    ids = out.prompt_ids + out.token_ids
    return _hf_logits(tiny_model, ids)[len(out.prompt_ids) - 1 : len(ids) - 1]


# ---- greedy, seeds, degenerate filters -------------------------------------------------------------


def test_greedy_is_argmax_and_logprobs_are_log_softmax(tiny_engine, tiny_model):
    out = tiny_engine.generate(PROMPT, max_new_tokens=NEW, logprobs=True, ignore_eos=True)
    logits = _continuation_logits(tiny_model, out)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = _log_softmax(logits)[np.arange(NEW), out.token_ids]
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)
    assert all(lp <= 0 for lp in out.logprobs)


def test_one_new_token_is_the_argmax_of_the_prompt(tiny_engine, tiny_model):
    out = tiny_engine.generate(PROMPT, max_new_tokens=1, logprobs=True, ignore_eos=True)
    logits = _hf_logits(tiny_model, PROMPT)[-1]
    assert out.token_ids == [int(logits.argmax())] and out.finish_reason == "length"
    assert out.logprobs == pytest.approx([_log_softmax(logits)[out.token_ids[0]]], abs=1e-4)


def test_sampled_logprobs_are_under_the_unmodified_distribution(tiny_engine, tiny_model):
    """With temperature and top-k the logprobs are still those of the raw logits, and every
    token comes from the raw top-k."""
    params = SamplingParams(temperature=0.7, top_k=5, seed=3)
    out = tiny_engine.generate(PROMPT, max_new_tokens=NEW, sampling=params, logprobs=True, ignore_eos=True)
    logits = _continuation_logits(tiny_model, out)
    expected = _log_softmax(logits)[np.arange(NEW), out.token_ids]
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)
    top5 = np.argsort(-logits, axis=-1)[:, :5]
    assert all(t in row for t, row in zip(out.token_ids, top5))
    # At temperature 0.7 over 260 tokens, twelve argmaxes in a row would mean it is not sampling.
    assert out.token_ids != logits.argmax(-1).tolist()


def test_same_seed_same_tokens_different_seed_different_tokens(tiny_engine):
    run = lambda seed: tiny_engine.generate(  # noqa: E731
        PROMPT, max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=seed), ignore_eos=True
    ).token_ids
    first = run(1)
    assert run(1) == first
    # Logits O(1) over 260 tokens: two seeds agreeing on 16 draws has negligible probability.
    assert run(2) != first
    assert run(3) != first


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, seed=5),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=5),
        SamplingParams(temperature=1.0, min_p=1.0, seed=5),
        SamplingParams(temperature=3.0, top_k=0, top_p=1e-3, min_p=0.0, seed=9),
    ],
    ids=["top_k_1", "top_p_tiny", "min_p_1", "hot_top_p_tiny"],
)
def test_degenerate_filters_equal_greedy(tiny_engine, params):
    greedy = tiny_engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids
    assert tiny_engine.generate(PROMPT, max_new_tokens=NEW, sampling=params, ignore_eos=True).token_ids == greedy


def test_batch_rows_keep_their_own_sampling(tiny_engine):
    """A greedy row inside a sampled batch stays greedy; a sampled row draws as it does alone."""
    a, b = PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    sampled = SamplingParams(temperature=1.0, seed=7)
    both = tiny_engine.generate([a, b], max_new_tokens=NEW, sampling=[SamplingParams(), sampled], ignore_eos=True)
    assert both[0].token_ids == tiny_engine.generate(a, max_new_tokens=NEW, ignore_eos=True).token_ids
    alone = tiny_engine.generate(b, max_new_tokens=NEW, sampling=sampled, ignore_eos=True)
    assert both[1].token_ids == alone.token_ids


# ---- filter semantics on a hand-made distribution ---------------------------------------------------

# Distinct probabilities, deliberately not in index order (so "the first k" cannot pass for "the
# k largest").
_PROBS = np.array([0.06, 0.3, 0.01, 0.15, 0.08, 0.2, 0.02, 0.1, 0.03, 0.05])
_LOGITS = np.log(_PROBS).astype(np.float32)
DRAWS = 4000
_sample = jax.jit(sample, static_argnames=("mode",))


def _hf_filtered(params: SamplingParams) -> np.ndarray:
    """HF's warpers, in HF's order, applied to _LOGITS: the filtered, scaled logits."""
    scores = torch.tensor(_LOGITS)[None]
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    for w in warpers:
        scores = w(None, scores)
    return scores[0].numpy()


def _draw(params: SamplingParams, mode: SamplingMode) -> tuple[np.ndarray, np.ndarray]:
    """DRAWS independent draws from _LOGITS (one row per draw, each with its own key)."""
    rows = RowSampling(
        temperature=jnp.full((DRAWS,), params.temperature, jnp.float32),
        top_k=jnp.full((DRAWS,), params.top_k, jnp.int32),
        top_p=jnp.full((DRAWS,), params.top_p, jnp.float32),
        min_p=jnp.full((DRAWS,), params.min_p, jnp.float32),
        keys=jax.random.split(jax.random.key(1234), DRAWS),
    )
    logits = jnp.broadcast_to(jnp.asarray(_LOGITS), (DRAWS, _LOGITS.size))
    tokens, logprobs = _sample(logits, rows, jnp.int32(0), mode=mode)
    return np.asarray(tokens), np.asarray(logprobs)


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(temperature=1.0, top_k=3), {1, 5, 3}),
        # Smallest prefix of the sorted distribution whose mass reaches 0.7: .3+.2+.15+.1.
        (SamplingParams(temperature=1.0, top_p=0.7), {1, 5, 3, 7}),
        # Tokens at least 0.3 x the most likely (0.3): p >= 0.09.
        (SamplingParams(temperature=1.0, min_p=0.3), {1, 5, 3, 7}),
        # All three after a temperature of 0.5 (p ~ p^2): top-6, then the 0.9-mass prefix, then min-p.
        (SamplingParams(temperature=0.5, top_k=6, top_p=0.9, min_p=0.1), None),
        (SamplingParams(temperature=2.0, top_k=8, top_p=0.95), None),
    ],
    ids=["top_k", "top_p", "min_p", "all_three_cold", "hot_k_p"],
)
def test_filtered_sampling_draws_only_allowed_tokens_with_hf_probabilities(params, allowed):
    """Draws fall exactly in the set HF's warpers keep, with the renormalised probabilities."""
    ref = _hf_filtered(params)
    hf_allowed = set(np.flatnonzero(np.isfinite(ref)).tolist())
    if allowed is not None:
        assert hf_allowed == allowed  # the expectation above agrees with HF
    assert params.filtered
    tokens, logprobs = _draw(params, SamplingMode.FILTERED)
    assert set(tokens.tolist()) == hf_allowed
    expected = np.exp(_log_softmax(np.where(np.isfinite(ref), ref, -np.inf)))
    freq = np.bincount(tokens, minlength=_LOGITS.size) / DRAWS
    sigma = np.sqrt(expected * (1 - expected) / DRAWS)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-3), (freq, expected)
    np.testing.assert_allclose(logprobs, np.log(_PROBS)[tokens], atol=1e-5)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_plain_sampling_follows_the_tempered_distribution(temperature):
    params = SamplingParams(temperature=temperature)
    assert not params.filtered
    tokens, logprobs = _draw(params, SamplingMode.PLAIN)
    expected = np.exp(_log_softmax(_LOGITS / temperature))
    freq = np.bincount(tokens, minlength=_LOGITS.size) / DRAWS
    sigma = np.sqrt(expected * (1 - expected) / DRAWS)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-3), (freq, expected)
    np.testing.assert_allclose(logprobs, np.log(_PROBS)[tokens], atol=1e-5)


def test_greedy_mode_takes_argmax_and_modes_are_chosen_per_batch():
    tokens, logprobs = _draw(SamplingParams(), SamplingMode.GREEDY)
    assert set(tokens.tolist()) == {int(np.argmax(_LOGITS))}
    np.testing.assert_allclose(logprobs, math.log(0.3), atol=1e-5)
    assert batch_sampling([SamplingParams(), SamplingParams()])[0] is SamplingMode.GREEDY
    assert batch_sampling([SamplingParams(), SamplingParams(temperature=1)])[0] is SamplingMode.PLAIN
    assert batch_sampling([SamplingParams(temperature=1), SamplingParams(temperature=1, top_k=2)])[0] is SamplingMode.FILTERED


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=float("inf")), "temperature=inf"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_p=-0.1), "top_p=-0.1"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(min_p=-0.2), "min_p=-0.2"),
    ],
)
def test_sampling_params_validation_names_the_value(kwargs, text):
    with pytest.raises(SamplingError) as err:
        SamplingParams(**kwargs)
    assert text in str(err.value)


def test_huge_seed_is_rejected_or_works(tiny_engine):
    """A seed JAX cannot take (>= 2**63 overflows jax.random.key) must be refused up front with a
    SamplingError naming it, or work; never an OverflowError from inside generate."""
    seed = 2**64
    try:
        params = SamplingParams(temperature=1.0, seed=seed)
    except SamplingError as e:
        assert str(seed) in str(e)
        return
    out = tiny_engine.generate(PROMPT, max_new_tokens=2, sampling=params, ignore_eos=True)
    assert len(out.token_ids) == 2


def test_sampling_params_boundaries_are_accepted():
    off = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=2**32 - 1)
    assert off.greedy and not off.filtered
    edge = SamplingParams(temperature=5.0, top_k=1, top_p=1e-9, min_p=1.0)
    assert not edge.greedy and edge.filtered


@pytest.mark.parametrize(
    "prompt, kwargs, text",
    [
        ("", {}, "empty"),
        ("   \n", {}, "empty"),
        ([], {}, "no prompts"),
        ([[]], {}, "empty"),
        ([1, 2, 260], {}, "260"),
        ([1, -1, 2], {}, "-1"),
        ([[1, 2], [3, 999]], {}, "999"),
        (list(range(250)), dict(max_new_tokens=7), "256"),
        ([1, 2, 3], dict(max_new_tokens=300), "300"),
        ([1, 2, 3], dict(max_new_tokens=0), "0"),
        ([1, 2, 3], dict(max_new_tokens=-2), "-2"),
        ([1, 2, 3], dict(chat=True), "chat"),
        ([[1, 2], [3, 4]], dict(sampling=[SamplingParams()]), "1 sampling settings for 2 prompts"),
    ],
    ids=["empty_text", "blank_text", "no_prompts", "empty_ids", "id_eq_vocab", "negative_id", "oov_in_batch",
         "past_context", "max_new_past_context", "max_new_zero", "max_new_negative", "chat_with_ids",
         "sampling_count"],
)
def test_bad_requests_raise_generation_error(tiny_engine, prompt, kwargs, text):
    with pytest.raises(GenerationError) as err:
        tiny_engine.generate(prompt, **kwargs)
    assert text in str(err.value)


def test_text_prompt_without_tokenizer_is_an_error(tiny_model):
    engine = Engine(tiny_model.config, tiny_model.weights)
    with pytest.raises(GenerationError, match="tokenizer"):
        engine.generate("hello", max_new_tokens=2)


def test_prompt_filling_the_context_exactly_is_served(tiny_engine):
    """250 prompt tokens + 6 new = the 256-token context: allowed (one more is refused above)."""
    out = tiny_engine.generate([i % 250 for i in range(250)], max_new_tokens=6, ignore_eos=True)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


# ---- stopping ------------------------------------------------------------------------------------


def test_eos_from_the_tokenizer_files(tiny_engine):
    assert tiny_engine.eos_ids == (257,)  # generation_config.json of the converted directory


def test_finish_reason_stop_at_eos_and_length_otherwise(tiny_engine, tiny_model):
    greedy = tiny_engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
    assert greedy.finish_reason == "length"
    toks = greedy.token_ids
    # EOS := a token first produced at step >= 2, so that stopping is visibly early and a
    # shorter max_new_tokens can end just before it.
    first = next(i for i, t in enumerate(toks) if i >= 2 and toks.index(t) == i)
    eos = toks[first]
    engine = Engine(dataclasses.replace(tiny_model.config, eos_token_ids=(eos,)), tiny_model.weights)
    assert engine.eos_ids == (eos,)

    out = engine.generate(PROMPT, max_new_tokens=NEW)
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: first + 1]  # EOS included, nothing after it

    ignored = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
    assert ignored.finish_reason == "length" and ignored.token_ids == greedy.token_ids

    short = engine.generate(PROMPT, max_new_tokens=first)  # stops by length just before the EOS
    assert short.finish_reason == "length" and short.token_ids == greedy.token_ids[:first]

    # In a batch, the row that meets EOS stops; the other runs to its length, as it does alone.
    other = [200, 100, 50, 25, 12, 6, 3]
    other_alone = engine.generate(other, max_new_tokens=NEW)
    rows = engine.generate([PROMPT, other], max_new_tokens=NEW)
    assert rows[0].token_ids == out.token_ids and rows[0].finish_reason == "stop"
    assert rows[1].token_ids == other_alone.token_ids
    assert rows[1].finish_reason == other_alone.finish_reason


# ---- text, chat, streaming ---------------------------------------------------------------------


def test_chat_prompt_uses_the_template(tiny_engine, tiny_model):
    out = tiny_engine.generate("hi", chat=True, max_new_tokens=3, ignore_eos=True)
    expected = [256, *b"user\nhi", 257, *b"\n", 256, *b"assistant\n"]
    assert out.prompt_ids == expected
    assert out.prompt_ids == Tokenizer(tiny_model.dir).encode_chat("hi")


def test_text_is_the_decoded_tokens(tiny_engine):
    out = tiny_engine.generate("hello", max_new_tokens=NEW, ignore_eos=True)
    assert out.prompt_ids == list(b"hello")
    assert out.text == tiny_engine.tokenizer.decode(out.token_ids)
    assert out.text  # bytes decode to something


def _streamed(engine, prompts, **kwargs):
    pieces: dict[int, list[str]] = {}
    out = engine.generate(prompts, on_text=lambda row, text: pieces.setdefault(row, []).append(text), **kwargs)
    return out, {row: "".join(p) for row, p in pieces.items()}


def test_streaming_concatenates_to_the_final_text(tiny_engine):
    out, streamed = _streamed(tiny_engine, ["hello", "The quick brown fox"], max_new_tokens=24, ignore_eos=True)
    assert set(streamed) == {0, 1}
    for row, completion in enumerate(out):
        assert streamed[row] == completion.text, f"row {row}"


def test_streaming_flushes_an_incomplete_utf8_tail(tiny_engine):
    """When the last token leaves an incomplete UTF-8 sequence, the final text ends in U+FFFD;
    the stream must still deliver it (nothing else will come to complete it)."""
    full = tiny_engine.generate("hello", max_new_tokens=40, ignore_eos=True).token_ids
    cut = next((n for n in range(1, 41) if tiny_engine.tokenizer.decode(full[:n]).endswith("\ufffd")), None)
    assert cut is not None, "premise: the tiny model emits some non-ASCII byte"
    out, streamed = _streamed(tiny_engine, "hello", max_new_tokens=cut, ignore_eos=True)
    assert out.text.endswith("\ufffd")
    assert streamed.get(0, "") == out.text


# ---- compiled-step reuse ------------------------------------------------------------------------


def test_no_recompilation_within_a_bucket(tiny_model):
    from dayzero.tools.measure import CompileCounter

    engine = Engine(tiny_model.config, tiny_model.weights)
    sizes = lambda: (engine._steps.signatures(), engine._steps.built)  # noqa: E731

    engine.generate([1, 2, 3, 4, 5], max_new_tokens=8)
    after_first, compile_s = sizes(), engine.compile_s
    assert compile_s > 0
    # Another length in the same prompt bucket (16) and cache bucket (256), another max_new_tokens.
    with CompileCounter() as counter:
        engine.generate(list(range(10, 23)), max_new_tokens=20)
        engine.generate([7], max_new_tokens=3)
    assert counter.count == 0
    assert sizes() == after_first
    assert engine.compile_s == compile_s
    # A longer prompt (bucket 32) compiles a new prefill and the write of its 32 new positions,
    # but no new decode step: the counters do see compilations.
    with CompileCounter() as counter:
        engine.generate(list(range(20)), max_new_tokens=4)
    assert counter.count >= 1
    signatures, built = sizes()
    new = [k for k in signatures if k not in after_first[0]]
    assert built == after_first[1] + 2 and len(new) == 2
    steps = {k[0] if k[-1] == "append" else k for k in new}  # a step's cache write is (its key, "append")
    assert {(k[0], k[3]) for k in steps} == {((1, 32), True)}  # a fresh prefill 32 wide, and its write
    assert engine.compile_s > compile_s


# ---- chunked prefill ------------------------------------------------------------------------------


def test_chunked_prefill_gives_the_same_tokens_as_one_piece(tiny_model, monkeypatch):
    """Long prompts are prefilled in chunks; tokens and logprobs must not change with the chunk."""
    import dayzero.engine.generate as generate

    prompts = [list(np.random.default_rng(s).integers(0, 256, size=n)) for s, n in ((0, 150), (1, 37), (2, 90))]
    whole = Engine(tiny_model.config, tiny_model.weights).generate(
        prompts, max_new_tokens=12, ignore_eos=True, logprobs=True
    )
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 32)  # 150 tokens -> 5 chunks, rows ending in chunks 1, 2, 4
    chunked = Engine(tiny_model.config, tiny_model.weights).generate(
        prompts, max_new_tokens=12, ignore_eos=True, logprobs=True
    )
    for a, b in zip(whole, chunked):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
