"""The draft-model drafter of serving speculation: ``ServingConfig(speculative=SpecConfig('draft',
draft=Engine.load(DIR)))``, lossless as ``Engine.generate``'s (``engine/draft_model.py``).

The draft model gets a page pool of its own (:class:`DraftPool`): a second ``PagedSteps`` over the
draft's config and weights with the target's resolved ``ServingConfig``, so the same page size and
number of pages. A request's block table (page ids) then addresses both pools: the draft's keys
and values of a position lie in the same page, at the same offset, as the target's, and the pages
the target takes for a request (at admission, for growth, for drafts) are the draft's too.

Per request the pool tracks ``draft_computed``: how many of the request's leading positions its
pages hold the draft's keys/values for. It is tagged with the request's admission: a request
readmitted after a preemption (recomputed, or swapped in from host memory, which holds the
target's pages only) starts again at 0 and the draft recomputes its tokens. Simple and correct;
a swapped request pays one draft prefill of its tokens.

Drafting, for the decoding rows that get ``n`` > 0 drafts (``serving_spec``: at most K, within
their remaining tokens and the pages the pool can spare):

1. catch-up: a row whose draft lags by more than two tokens (new, readmitted, or after plain
   decode steps) runs draft prefill chunks (``ServingConfig.chunk_shape``, the serving chunk
   policy) over all its tokens but the last;
2. one batched draft step feeds each row's pending tokens (one, or two after a verify step that
   accepted every draft: T = 1 or 2) and draws draft 1 from its logits; then n-1 steps of one token
   feed drafts 1..n-1 and draw drafts 2..n. Each draft is drawn as ``draft_model.draw_draft`` draws
   it (greedy rows: the argmax; sampled rows: from q, the draft's distribution after the row's
   temperature and filters, with the key of the token's index folded once more), and the q of
   every step goes to the verify step's acceptance (``speculative.accept_drafts``).

After the verify step accepted ``a`` of a row's ``n`` drafts, the draft pool holds the row's
tokens before the step (L of them) and drafts 1..min(a, n-1): ``draft_computed = L + min(a, n-1)``
(positions past it, rejected drafts, are never read and are overwritten later), the same
invariant as ``draft_model``'s, so one or two tokens are pending at the next drafting.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.draft_model import draw_draft
from dayzero.engine.generate import GenerationError
from dayzero.engine.paged_steps import _STEPS, PagedSteps, RowParams, sampling_mode
from dayzero.engine.sampling import RowSampling, SamplingMode

if TYPE_CHECKING:
    from dayzero.engine.serving import ServingEngine, _Request


@functools.partial(jax.jit, static_argnames=("mode", "vocab"))
def _draw(logits, temperature, top_k, top_p, min_p, keys, steps, *, mode: SamplingMode, vocab: int):
    rows = RowSampling(temperature, top_k, top_p, min_p, jax.random.wrap_key_data(keys))
    return draw_draft(logits, rows, steps, mode, vocab)


class SidePool:
    """A drafter's page pool beside a serving engine's (``steps``: its ``PagedSteps``, made with
    the target's resolved ``ServingConfig``, so the block tables address it), and what it holds
    of each running request, tagged with the request's admission (a readmission starts afresh).
    Shared by :class:`DraftPool` and ``serving_mtp.MTPPool``."""

    wants_hidden = False  # whether the target's steps hand it their hidden states (the MTP pool)

    def __init__(self, server: "ServingEngine", steps: PagedSteps):
        """The pool ``steps`` beside ``server`` (its config resolved), holding nothing yet."""
        self.server, self.steps, self.K = server, steps, server.config.speculative.num_draft_tokens
        self._held: dict[int, tuple] = {}  # request id -> (its admission, what the pool holds of it)

    def _get(self, r: "_Request", default):
        """What the pool holds of ``r`` in its current admission (``default`` if nothing)."""
        admitted, value = self._held.get(r.id, (None, default))
        return value if admitted == r.admitted else default

    def _put(self, r: "_Request", value) -> None:
        self._held[r.id] = (r.admitted, value)

    def _chunks(self, r: "_Request", start: int, end: int):
        """``r``'s tokens [start, end) as one-row prefill chunks of the serving chunk policy:
        (tokens [1, T], real tokens n, chunk start, table width W) each."""
        cfg = self.server.config
        while start < end:
            T, W = cfg.chunk_shape(start, end - start)
            n = min(T, end - start)
            tokens = np.zeros((1, T), np.int32)
            tokens[0, :n] = r.tokens[start : start + n]
            yield tokens, n, start, W
            start += n

    def _batch(self, decoding: list["_Request"], B: int) -> tuple:
        """(tables [B, full width], table width, RowParams, SamplingMode, each row's first draft's
        index among its generated tokens [B]) of a drafting step; finished requests are forgotten."""
        running = {r.id for r in self.server._running()}
        self._held = {i: v for i, v in self._held.items() if i in running}  # finished, cancelled: forgotten
        cfg = self.server.config
        width = cfg.table_width(max(cfg.pages_for(r.computed + 1 + self.K) for r in decoding))
        params = [r.params for r in decoding]
        steps = np.zeros(B, np.int32)
        steps[: len(decoding)] = [r.generated for r in decoding]
        return (self.server._tables(decoding, B), width, RowParams.of(params, [r.key for r in decoding], B),
                sampling_mode(params), steps)


class DraftPool(SidePool):
    """The draft model's page pool beside a serving engine's, and each request's ``draft_computed``."""

    def __init__(self, server: "ServingEngine"):
        """The pool for ``server`` (its config resolved, speculating with a draft model)."""
        cfg, draft = server.config, server.config.speculative.draft
        if draft.config.max_position_embeddings < cfg.max_context:
            raise GenerationError(
                f"the draft model's context ({draft.config.max_position_embeddings} tokens) is shorter than "
                f"this server's max_context of {cfg.max_context}; lower max_context or use a draft model with a "
                "longer context")
        # Same page size, page count and slots as the target's: the block tables address both pools.
        super().__init__(server, PagedSteps(draft.config, draft.weights, cfg, draft.run, host=draft._host))
        self.draft = draft
        self.caught_up_tokens = 0  # tokens the draft ran through catch-up prefill chunks
        self.draft_steps = 0  # batched drafting steps (one per draft position)

    def held(self, r: "_Request") -> int:
        """``draft_computed`` of ``r``: its leading positions whose draft keys/values are in the
        draft pool (0 after every admission: a readmitted request's draft recomputes)."""
        return self._get(r, 0)

    def _set(self, r: "_Request", held: int) -> None:
        self._put(r, held)

    def propose(self, decoding: list["_Request"], counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, jax.Array | None]:
        """Drafts [B,K] for the ``decoding`` rows, ``counts`` [B] of them each (B the decode
        batch), with their distributions q [B,K,V] (None for a greedy batch); the counts as given."""
        B, K = len(counts), self.K
        tables, width, rows, mode, steps = self._batch(decoding, B)
        tokens, num_new, lengths = self._pending(decoding, counts)
        drafts, probs = np.zeros((B, K), np.int32), []
        for i in range(int(counts.max())):
            logits = self.steps.run_step(tokens, num_new, lengths, tables, width)
            token, q = self._draw(logits, rows, steps + i, mode)
            drafts[:, i] = np.where(counts > i, np.asarray(token), 0)
            probs.append(q)
            # Draft i+1 is fed only where the row wants draft i+2 (the last draft is never fed).
            lengths, num_new, tokens = lengths + num_new, (counts > i + 1).astype(np.int32), drafts[:, i : i + 1]
            self.draft_steps += 1
        for row, r in enumerate(decoding):
            if counts[row]:
                self._set(r, len(r.tokens) + int(counts[row]) - 1)
        if probs[0] is None:
            return drafts, counts, None
        q = jnp.stack(probs, axis=1)
        return drafts, counts, jnp.pad(q, ((0, 0), (0, K - q.shape[1]), (0, 0)))

    def _pending(self, decoding: list["_Request"], counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first drafting step's inputs, after the catch-up of the rows that draft: each row's
        pending tokens [B,T] (T = 1 or 2), their count [B] (0: no draft) and the draft's lengths [B]."""
        B = len(counts)
        lengths, num_new = np.zeros(B, np.int32), np.zeros(B, np.int32)
        for row, r in enumerate(decoding):
            if counts[row]:
                self._catch_up(r)
                lengths[row] = self.held(r)
                num_new[row] = len(r.tokens) - lengths[row]
        tokens = np.zeros((B, int(num_new.max())), np.int32)
        for row, r in enumerate(decoding):
            tokens[row, : num_new[row]] = r.tokens[len(r.tokens) - num_new[row]:]
        return tokens, num_new, lengths

    def _catch_up(self, r: "_Request") -> None:
        """Draft prefill chunks over ``r``'s tokens from ``draft_computed`` to all but its last,
        when more than two are pending (fewer are fed by the first drafting step itself)."""
        start, end = self.held(r), len(r.tokens) - 1
        if end + 1 - start <= 2:
            return
        # A page shared through the prefix cache may be written here again: its positions hold the
        # same tokens at the same positions in every request that shares it, so the draft writes
        # the values already there (to rounding). Nor would other values break losslessness: the
        # acceptance only needs each draft's q to be the distribution it was drawn from.
        table = self.server._tables([r], 1)
        for tokens, n, at, W in self._chunks(r, start, end):
            self.steps.run_step(tokens, np.array([n]), np.array([at]), table, W)
            self.caught_up_tokens += n
        self._set(r, end)

    def _draw(self, logits: jax.Array, rows: RowParams, steps: np.ndarray, mode: SamplingMode) -> tuple:
        """Each row's draft token [B] (on the device) and q [B,V] (None in greedy mode) from the
        draft's ``logits`` [B,V']; ``steps`` [B]: each draft's index among the row's generated tokens."""
        vocab = self.server.engine.config.vocab_size
        args = self.steps._host((rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.key_data,
                                 np.asarray(steps, np.int32)))
        signature = ("draft_draw", self.draft.config, len(steps), mode, vocab)
        return _STEPS.call(_draw, signature, logits, *args, static=dict(mode=mode, vocab=vocab))

    def advance(self, decoding: list["_Request"], counts: np.ndarray, accepted: np.ndarray, hidden=None) -> None:
        """After a verify step in which each row accepted ``accepted`` [B] of its ``counts`` [B]
        drafts (called before the rows' tokens are appended): the draft pool keeps the tokens
        before the step and the accepted drafts it was fed, at most ``counts - 1``. (``hidden``:
        the step's hidden states, which only the MTP pool reads.)"""
        for row, r in enumerate(decoding):
            if counts[row]:
                self._set(r, len(r.tokens) + min(int(accepted[row]), int(counts[row]) - 1))

    def warmup(self) -> int:
        """Compile the draft's steps up front: its ``PagedSteps`` prefill and decode shapes (as
        the target's), the first drafting step's two-token shapes, and the draws; returns the
        number of calls made. Each writes nothing (no real token)."""
        cfg = self.server.config
        n = self.steps.warmup()
        tables = {B: np.zeros((B, cfg.max_table_pages), np.int32) for B in cfg.decode_batches()}
        for B, W in itertools.product(cfg.decode_batches(), cfg.table_widths()):
            self.steps.run_step(np.zeros((B, 2)), np.zeros(B), np.zeros(B), tables[B], W)
        for B, mode in itertools.product(cfg.decode_batches(), SamplingMode):
            self._draw(jnp.zeros((B, self.draft.config.vocab_size), jnp.float32), RowParams.of([], [], B),
                       np.zeros(B), mode)
        return n + len(cfg.decode_batches()) * (len(cfg.table_widths()) + len(SamplingMode))
