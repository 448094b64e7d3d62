"""Speculative decoding in the serving engine (``ServingConfig(speculative=SpecConfig(...))``).

Each decode step, every decoding request gets n-gram drafts from its own tokens
(``speculative.ngram_draft``; at most K, and no more than its remaining tokens less one). If any
row has drafts, the step is a verify step instead of a one-token one: each row feeds its last
token and its drafts (T = K+1, padded) through the paged forward with every position's logits,
and ``speculative.accept_drafts`` keeps the argmax prefix (greedy rows) or applies rejection
sampling (sampled rows), so every request's output is distributed as without speculation, and
greedy output is identical. The pages are "rolled back" by bookkeeping: all K+1 positions are
written, but the request's ``computed`` count grows only by what it kept (its last token and its
accepted drafts), so rejected positions are never read and are overwritten by the next step;
only full pages of kept tokens enter the prefix cache.

Pages for the drafts are taken only while the pool keeps its reserve (one page per running
request); a row without room drafts fewer tokens. A batch with a constrained request (masks
are per position) or one asking for top logprobs runs the plain decode step.

With a draft model (``SpecConfig('draft', draft=Engine)``) the drafts come from
``serving_draft.DraftPool`` instead: the draft model on a page pool of its own, addressed by the
same block tables, drawing each draft from its distribution q, which the acceptance takes. With
the MTP drafter (``SpecConfig('mtp')``) from ``serving_mtp.MTPPool``: the model's own MTP module
on a pool of its own, fed the hidden states the target's prefill and verify steps return.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import numpy as np

from dayzero.engine.draft_model import draft_refusal
from dayzero.engine.generate import Engine, GenerationError
from dayzero.engine.paged_steps import _STEPS, RowParams, Sampled, _pinned, sampling_mode
from dayzero.engine.sampling import RowSampling, SamplingMode
from dayzero.engine.speculative import (DraftKind, SpecConfig, accept_drafts, mtp_refusal, ngram_draft,
                                        speculative_refusal)

if TYPE_CHECKING:
    from dayzero.engine.serving import ServingEngine, _Request


def check_serving_speculation(spec, model, run) -> None:
    """Raise :class:`GenerationError` if a serving engine cannot speculate with ``spec``."""
    if not isinstance(spec, SpecConfig):
        raise GenerationError(f"speculative={spec!r} is not a SpecConfig")
    if spec.kind is DraftKind.DRAFT and not isinstance(spec.draft, Engine):
        raise GenerationError(f"the draft model {spec.draft!r} is not an Engine; pass SpecConfig('draft', "
                              "draft=Engine.load(DIR))")
    reason = speculative_refusal(model, run)
    if reason is None and spec.kind is DraftKind.DRAFT:
        # The draft's vocabulary, and its own steps' roll-back: a draft with per-slot states
        # (a hybrid, DeepSeek-V4), on a mesh or on the kernels is refused there.
        reason = draft_refusal(spec.draft, model)
    if reason is None and spec.kind is DraftKind.MTP:  # a model with a kept MTP module
        reason = mtp_refusal(model)
    if reason is not None:
        raise GenerationError(reason)


def draft_pool(server: "ServingEngine"):
    """The drafter's page pool of a ``server`` speculating with a draft model
    (``serving_draft.DraftPool``) or the MTP module (``serving_mtp.MTPPool``), else None."""
    spec = server.config.speculative
    if spec is None or spec.kind is DraftKind.NGRAM:
        return None
    if spec.kind is DraftKind.MTP:
        from dayzero.engine.serving_mtp import MTPPool

        return MTPPool(server)
    from dayzero.engine.serving_draft import DraftPool

    return DraftPool(server)


@functools.partial(jax.jit, static_argnames=("mode", "layout"))
def _accept(logits, drafts, num_drafts, temperature, top_k, top_p, min_p, keys, steps, draft_probs=None, *,
            mode: SamplingMode, layout=None):
    rows = RowSampling(temperature, top_k, top_p, min_p, jax.random.wrap_key_data(keys))
    return _pinned(accept_drafts(logits, drafts, num_drafts, rows, steps, mode, draft_probs), layout)


def _room(server: "ServingEngine", r: "_Request", wanted: int) -> int:
    """How many of ``wanted`` drafts ``r``'s pages can hold after its next token, taking more
    pages while the pool keeps one in reserve for every running request."""
    page = server.config.page_size
    reserve = len(server._running())
    while len(r.pages) * page < r.computed + 1 + wanted and server.pool.available > reserve:
        r.pages.append(server.pool.allocate())
    return max(0, min(wanted, len(r.pages) * page - r.computed - 1))


def drafts_for(server: "ServingEngine", decoding: list["_Request"]) -> tuple | None:
    """Each decoding request's drafts [B,K] and their counts [B] (B the decode batch), then with
    a draft model their distributions q [B,K,V] (None for a greedy batch), or None when this step
    decodes plainly (no drafts, or a row that needs per-token masks or top logprobs)."""
    spec: SpecConfig = server.config.speculative
    if any(r.constraint is not None or r.top_logprobs for r in decoding):
        return None
    K, (min_n, max_n) = spec.num_draft_tokens, spec.ngram
    B = server.config.decode_batch(len(decoding))
    drafts, counts = np.zeros((B, K), np.int32), np.zeros(B, np.int32)
    for row, r in enumerate(decoding):
        wanted = min(K, r.max_new_tokens - r.generated - 1)
        if server.draft is not None:  # the draft model drafts as many as the pages hold
            counts[row] = _room(server, r, wanted) if wanted > 0 else 0
            continue
        d = ngram_draft(np.asarray(r.tokens, np.int32), wanted, min_n, max_n) if wanted > 0 else []
        d = d[: _room(server, r, len(d))] if len(d) else d
        drafts[row, : len(d)], counts[row] = d, len(d)
    if not counts.any():
        return None
    return (drafts, counts) if server.draft is None else server.draft.propose(decoding, counts)


def verify(server: "ServingEngine", decoding: list["_Request"], drafts: np.ndarray, counts: np.ndarray,
           draft_probs: jax.Array | None = None) -> list:
    """One verify step for ``decoding`` with ``drafts`` [B,K] (``counts`` [B] real; drawn from
    ``draft_probs`` [B,K,V], None: point masses): each row emits its accepted drafts and one
    token of the target's own; returns the Events."""
    B, K = drafts.shape
    tokens, num_new, lengths, slots = (np.zeros((B, K + 1), np.int32), np.zeros(B, np.int32),
                                       np.zeros(B, np.int32), np.zeros(B, np.int32))
    for row, r in enumerate(decoding):
        tokens[row, 0], tokens[row, 1:] = r.tokens[-1], drafts[row]
        num_new[row], lengths[row], slots[row] = 1 + counts[row], r.computed, r.slot
    cfg = server.config
    width = cfg.table_width(max(cfg.pages_for(r.computed + 1 + K) for r in decoding))
    steps_, hidden = server.steps, server.draft is not None and server.draft.wants_hidden
    logits = steps_.run_step(tokens, num_new, lengths, server._tables(decoding, B), width, slots, all_logits=True,
                             hidden=hidden)
    logits, states = logits if hidden else (logits, None)  # the MTP pool's entries come from ``states``
    params = [r.params for r in decoding]
    rows = RowParams.of(params, [r.key for r in decoding], B)
    generated = np.zeros(B, np.int32)
    generated[: len(decoding)] = [r.generated for r in decoding]
    mode = sampling_mode(params)
    args = steps_._host((drafts, counts, rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.key_data,
                         generated)) + (() if draft_probs is None else (draft_probs,))
    out = _STEPS.call(_accept, ("accept", server.engine.config, steps_.run, B, K, mode, draft_probs is not None),
                      logits, *args, static=dict(mode=mode, layout=steps_.sample_layout))
    out_tokens, out_logprobs, accepted = (np.asarray(x) for x in out)
    if server.draft is not None:  # before the rows' tokens grow: the draft keeps what it was fed and was accepted
        server.draft.advance(decoding, counts, accepted, states)
    server.stats.decode_steps += 1
    events = []
    for row, r in enumerate(decoding):
        server.stats.spec_drafted += int(counts[row])
        server.stats.spec_accepted += int(accepted[row])
        for j in range(int(accepted[row]) + 1):
            server._written(r, 1)  # the position of the token fed before this one
            server.stats.decode_tokens += 1
            events.append(server._emit(r, Sampled(out_tokens[:, j], out_logprobs[:, j]), row))
            if r.finish_reason is not None:
                break
    return events
