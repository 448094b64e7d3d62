"""The draft-model drafter of speculative decoding: a small model sharing the target's tokenizer
proposes K tokens per row, one at a time, each drawn from its own distribution q (after the
row's temperature and filters, as the target's p is; greedy rows take q's argmax). The target's
verify step accepts draft x with probability min(1, p(x) / q(x)) and on rejection draws from
max(0, p - q), renormalised (``speculative.accept_drafts``), so the output is distributed as
the target's alone.

The draft model keeps its own contiguous cache. Invariant between steps: the cache holds every
token of the row but its ``pending`` ones (emitted by the target and not yet fed: one, or two
when every draft was accepted). Drafting feeds the pending tokens (the first draft comes from
their logits), then K-1 drafts one by one, so the cache ends holding the sequence and drafts
1..K-1. After the target accepted ``a`` drafts and added its own token t, each row's cache
length is cut to the sequence plus its first min(a, K-1) drafts (positions past it are
overwritten later) and t (with draft K when a = K) becomes pending.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.sampling import RowSampling, SamplingMode
from dayzero.model.config import ModelConfig
from dayzero.model.transformer import forward

if TYPE_CHECKING:
    from dayzero.engine.generate import Engine

DRAFT_KEY_FOLD = 2  # the draft's draws use fold_in(the token's key, 2): independent of the target's (0, 1)


def draft_refusal(draft: "Engine", target: ModelConfig) -> str | None:
    """Why ``draft`` cannot draft for a ``target`` model (None: it can): its vocabulary must fit
    the target's (the tokenizer is shared), and its own steps must be able to roll back."""
    from dayzero.engine.speculative import speculative_refusal

    if draft.config.vocab_size > target.vocab_size:
        return (f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is larger than the target's "
                f"({target.vocab_size}); use a draft model that shares the target's tokenizer")
    reason = speculative_refusal(draft.config, draft.run)
    return None if reason is None else f"the draft model cannot draft: {reason}"


@functools.partial(jax.jit, static_argnames=("config", "mode", "vocab"))
def draft_step(weights, tokens, num_new, cache, rows: RowSampling, steps, *, config: ModelConfig,
               mode: SamplingMode, vocab: int):
    """The draft model over ``tokens`` [B,T] (``num_new`` [B] real) after its cache: each row's
    draft token [B] and the distribution q [B, vocab] it was drawn from (zero past the draft's
    own vocabulary; None for a greedy batch, whose acceptance compares argmaxes), and the new
    keys/values. ``steps`` [B]: the index of the drafted token among the row's generated ones (its
    key, as the target's for that token, folded once more)."""
    logits, new = forward(weights, config, tokens, cache, num_new)
    return (*draw_draft(logits, rows, steps, mode, vocab), new)


def draw_draft(logits: jax.Array, rows: RowSampling, steps: jax.Array, mode: SamplingMode,
               vocab: int) -> tuple[jax.Array, jax.Array | None]:
    """A drafter's token [B] from its ``logits`` [B,V'] and the distribution q [B, vocab] it was
    drawn from (zero past V'; None for a greedy batch): greedy rows take the argmax, sampled
    rows draw after their temperature and filters (as the target's p is taken), with the key of
    token index ``steps`` [B] folded once more (independent of the target's draws)."""
    from dayzero.engine.speculative import target_logits

    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode is SamplingMode.GREEDY:
        return token, None
    scaled = target_logits(logits[:, None], rows, mode)[:, 0]
    q = jax.nn.softmax(scaled, axis=-1)
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.fold_in(k, s), DRAFT_KEY_FOLD))(rows.keys, steps)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    token = jnp.where(rows.temperature > 0, drawn, token)
    return token, jnp.pad(q, ((0, 0), (0, vocab - q.shape[1])))


class DraftModel:
    """One generation's draft-model state: the draft engine's cache and each row's pending tokens."""

    def __init__(self, draft: "Engine", ids: list[list[int]], first: np.ndarray, max_new_tokens: int, K: int,
                 rows: RowSampling, mode: SamplingMode, vocab: int):
        """Prefill the draft model over the prompts ``ids``; ``first`` [B]: the target's first
        tokens (pending). ``vocab``: the target's vocabulary size (q's width)."""
        self.draft, self.rows, self.mode, self.vocab = draft, rows, mode, vocab
        lengths = np.array([len(r) for r in ids], np.int32)
        # Room for the target's tokens plus the drafts past them (as the target's cache).
        _, _, self.cache = draft._prefill_chunks(ids, lengths, max_new_tokens + K, rows, mode)
        self.lengths = lengths.copy()
        self.pending = [[int(t)] for t in first]

    def propose(self, active: np.ndarray, produced: np.ndarray, K: int) -> tuple[np.ndarray, jax.Array | None]:
        """K drafts [B,K] for every ``active`` row and their distributions q [B,K,V] (None for a
        greedy batch); ``produced`` [B]: tokens each row has emitted (the first draft's index).
        The drafts stay on the device until all K are drawn (one host sync per proposal)."""
        B = len(self.pending)
        drafts, probs = [], []
        T = max(len(p) for p in self.pending)
        tokens = np.zeros((B, T), np.int32)
        num_new = np.zeros(B, np.int32)
        for b in np.flatnonzero(active):
            tokens[b, : len(self.pending[b])] = self.pending[b]
            num_new[b] = len(self.pending[b])
        for i in range(K):
            token, q = self._step(tokens, num_new, produced + i)
            drafts.append(token)
            probs.append(q)
            tokens, num_new = token[:, None], active.astype(np.int32)
        self.lengths = self.lengths + np.where(active, [len(p) for p in self.pending], 0) + active * (K - 1)
        return np.asarray(jnp.stack(drafts, axis=1)), None if probs[0] is None else jnp.stack(probs, axis=1)

    def _step(self, tokens: np.ndarray, num_new: np.ndarray, steps: np.ndarray) -> tuple:
        """One draft step and its cache write (the last draft's keys/values are not needed)."""
        d = self.draft
        key = ("draft", tokens.shape, self.cache.max_len, self.mode, self.vocab)
        token, q, new = d._steps.call(draft_step, key, d.weights, jnp.asarray(tokens), jnp.asarray(num_new),
                                      self.cache, self.rows, jnp.asarray(steps, jnp.int32),
                                      static={"config": d.config, "mode": self.mode, "vocab": self.vocab})
        self.cache = d._steps.call(d._append, ("draft_append", tokens.shape, self.cache.max_len), self.cache, new)
        return token, q

    def advance(self, active: np.ndarray, drafts: np.ndarray, tokens: np.ndarray, accepted: np.ndarray,
                hidden=None) -> None:
        """After a verify step: rows ``active`` accepted ``accepted`` [B] of ``drafts`` and
        emitted ``tokens`` [B,K+1] (the accepted drafts, then the target's own token); cut the
        cache to what stays valid. (``hidden``: the target's hidden states, which only the MTP
        drafter reads.)"""
        K = drafts.shape[1]
        for b in np.flatnonzero(active):
            a = int(accepted[b])
            self.lengths[b] -= (K - 1) - min(a, K - 1)
            self.pending[b] = ([int(drafts[b, K - 1])] if a == K else []) + [int(tokens[b, a])]
        self._set_lengths()

    def plain(self, active: np.ndarray, emitted: np.ndarray) -> None:
        """After an ordinary decode step of the target (no drafts): ``emitted`` [B] is pending too."""
        for b in np.flatnonzero(active):
            self.pending[b].append(int(emitted[b]))

    def _set_lengths(self) -> None:
        lengths = jnp.asarray(self.lengths, jnp.int32)
        self.cache = self.cache.replace(lengths=lengths, rope_len=jnp.maximum(self.cache.rope_len, jnp.max(lengths)))
