"""The MTP drafter of speculative decoding: the model's own multi-token-prediction module
(``num_nextn_predict_layers`` of DeepSeek-V3, Kimi-K2, GLM-4.5; ``dayzero.model.mtp``) proposes K tokens per row.

Entry j of the module's one-layer cache pairs token s[j+1] with the main model's hidden state
h[j] (after its final norm), at position j: its output predicts s[j+2]. Invariant between steps:
the MTP cache holds exactly the entries of the positions the main model's cache holds (0 ..
len - 2 of a row of len tokens; the last emitted token is not fed yet), and ``logits`` / ``out``
hold the module's output at the last of them, which predicts the token after the last emitted
one: draft 1. Drafts 2..K chain the module on its own outputs (the previous draft, and the
module's output in place of h), inside one jitted step on a copy of the cache: their entries
are never kept, so nothing needs rolling back after a rejection. The verify step returns the
main model's hidden states of its K+1 inputs; the ``accepted + 1`` emitted tokens and the hidden
states before each become the rows' new entries (:meth:`MTPDrafter.advance`): the entries of
accepted drafts are recomputed from the main model's states, as the drafts' own were not.

Each draft is drawn from the module's distribution q (after the row's temperature and filters,
as the target's p: ``draft_model.draw_draft``), so ``accept_drafts(..., draft_probs)`` keeps the
output distributed as the target's alone; greedy rows take q's argmax.

Prompt: the module's entries for the prompt need the main model's hidden state at every prompt
position. The engine's prefill returns them when asked (``Engine._prefill_chunks(hidden=True)``,
one list entry per prompt chunk), so the main model runs over the prompt once; the drafter writes
the entries chunk by chunk as the prefill did.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.draft_model import draw_draft
from dayzero.engine.sampling import RowSampling, SamplingMode
from dayzero.model.cache import append_to_cache, init_cache
from dayzero.model.config import ModelConfig
from dayzero.model.mtp import nextn_block_config, nextn_forward, nextn_logits

if TYPE_CHECKING:
    from dayzero.engine.generate import Engine


@functools.partial(jax.jit, static_argnames=("config",))
def mtp_entries(weights, tokens, hidden, num_new, cache, *, config: ModelConfig):
    """The MTP module over new entries (``tokens`` [B,T] s[j+1], ``hidden`` [B,T,D] h[j],
    ``num_new`` [B] real): the logits [B,V] and output [B,D] of each row's last real entry, and
    what the cache write takes."""
    w = weights.mtp[0]
    out, new = nextn_forward(w, weights, config, tokens, hidden, cache, num_new)
    last = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
    out = jnp.take_along_axis(out, last[:, None, None], axis=1)
    return nextn_logits(w, weights, config, out)[:, 0], out[:, 0], new


@functools.partial(jax.jit, static_argnames=("config", "mode", "K"))
def mtp_chain(weights, logits, out, cache, active, rows: RowSampling, steps, *, config: ModelConfig,
              mode: SamplingMode, K: int):
    """K drafts [B,K] and their q [B,K,V] (None for a greedy batch): draft 1 drawn from
    ``logits`` [B,V], each next from the module over the previous draft and ``out`` [B,D], the
    module's previous output. The chain's entries go to a copy of ``cache`` that is dropped.
    ``steps`` [B]: draft 1's index among the row's generated tokens."""
    w, V = weights.mtp[0], config.vocab_size

    def link(carry, i):
        logits, out, cache = carry
        token, q = draw_draft(logits, rows, steps + i, mode, V)
        x, new = nextn_forward(w, weights, config, token[:, None], out[:, None], cache, active)
        carry = nextn_logits(w, weights, config, x)[:, 0], x[:, 0], append_to_cache(cache, new)
        return carry, (token, token if q is None else q)

    (logits, _, _), (tokens, qs) = jax.lax.scan(link, (logits, out, cache), jnp.arange(K - 1, dtype=jnp.int32))
    token, q = draw_draft(logits, rows, steps + K - 1, mode, V)
    drafts = jnp.concatenate([tokens.T, token[:, None]], axis=1)
    if q is None:
        return drafts, None
    return drafts, jnp.concatenate([jnp.moveaxis(qs, 0, 1), q[:, None]], axis=1)


class MTPDrafter:
    """One generation's MTP state: the module's cache and each row's output at its last entry."""

    wants_hidden = True  # the verify step returns the main model's hidden states for advance()

    def __init__(self, engine: "Engine", ids: list[list[int]], first: np.ndarray, hidden: list[jax.Array],
                 max_new_tokens: int, K: int, rows: RowSampling, mode: SamplingMode):
        """The module's entries for the prompts ``ids`` from ``hidden``, the main model's hidden
        states of each prefill chunk [B,T,D] (``Engine._prefill_chunks(..., hidden=True)``); the
        last entry pairs the target's first token ``first`` [B] with the last prompt position's."""
        from dayzero.engine.generate import cache_length

        self.engine, self.rows, self.mode = engine, rows, mode
        lengths = np.array([len(r) for r in ids], np.int32)
        B, T = len(ids), hidden[0].shape[1]
        padded = T * len(hidden)
        if hidden[0].shape[0] != B or padded < lengths.max():
            raise ValueError(f"hidden states of {len(hidden)} chunks of shape {hidden[0].shape} do not cover {B} "
                             f"prompts of up to {lengths.max()} tokens; pass the prefill's own (hidden=True)")
        # Room as the target's cache has: the rows' tokens and the chain's entries past them.
        max_len = cache_length(int(lengths.max()), max_new_tokens + K)
        self.cache = init_cache(nextn_block_config(engine.config), B, max_len, engine.weights.embed.dtype,
                                engine.kv_cache)
        shifted = np.zeros((B, padded), np.int32)
        for b, row in enumerate(ids):
            shifted[b, : len(row)] = list(row[1:]) + [int(first[b])]
        self.stale = np.zeros(B, bool)
        for start, states in zip(range(0, padded, T), hidden):
            num_new = jnp.asarray(np.clip(lengths - start, 0, T).astype(np.int32))
            logits, out = self._entries(jnp.asarray(shifted[:, start: start + T]), states, num_new)
            ends_here = jnp.asarray((lengths > start) & (lengths <= start + T))[:, None]
            self.logits = logits if start == 0 else jnp.where(ends_here, logits, self.logits)
            self.out = out if start == 0 else jnp.where(ends_here, out, self.out)

    def _entries(self, tokens: jax.Array, hidden: jax.Array, num_new: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Write the module's entries for ``tokens`` / ``hidden``; the last entry's logits and output."""
        e = self.engine
        key = ("mtp_entries", tokens.shape, self.cache.max_len)
        logits, out, new = e._steps.call(mtp_entries, key, e.weights, tokens, hidden, num_new, self.cache,
                                         static={"config": e.config})
        self.cache = e._steps.call(e._append, ("mtp_append", tokens.shape, self.cache.max_len), self.cache, new)
        return logits, out

    def propose(self, active: np.ndarray, produced: np.ndarray, K: int) -> tuple[np.ndarray, jax.Array | None]:
        """K drafts [B,K] for every ``active`` row and their distributions q [B,K,V] (None for a
        greedy batch); ``produced`` [B]: tokens each row has emitted (the first draft's index)."""
        if (self.stale & active).any():
            raise AssertionError("the MTP drafter missed a target step's hidden states")
        e = self.engine
        key = ("mtp_chain", self.out.shape, self.cache.max_len, self.mode, K)
        drafts, q = e._steps.call(mtp_chain, key, e.weights, self.logits, self.out, self.cache,
                                  jnp.asarray(active.astype(np.int32)), self.rows, jnp.asarray(produced, jnp.int32),
                                  static={"config": e.config, "mode": self.mode, "K": K})
        return np.asarray(drafts), q

    def advance(self, active: np.ndarray, drafts: np.ndarray, tokens: np.ndarray, accepted: np.ndarray,
                hidden: jax.Array) -> None:
        """After a verify step: each ``active`` row emitted ``tokens[b, :accepted[b] + 1]``, the
        token after each of the step's inputs, whose hidden states are ``hidden`` [B,K+1,D]:
        those pairs are the row's new entries."""
        num_new = jnp.asarray(np.where(active, accepted + 1, 0).astype(np.int32))
        self.logits, self.out = self._entries(jnp.asarray(tokens, jnp.int32), hidden, num_new)

    def plain(self, active: np.ndarray, emitted: np.ndarray) -> None:
        """After an ordinary decode step of the target (no row had a draft: every row's last
        token), which returns no hidden state: the rows cannot draft again."""
        self.stale |= active
