"""The MTP drafter of speculative decoding: the model's own multi-token-prediction module
(DeepSeek-V3's ``num_nextn_predict_layers``, ``dayzero.model.mtp``) proposes K tokens per row.

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
position, which the engine's prefill does not return; the drafter runs the main model over the
prompt once more for them (chunked as the prefill is), a second prefill's cost.
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
from dayzero.model.mtp import main_hidden, nextn_block_config, nextn_forward, nextn_logits
from dayzero.model.transformer import forward

if TYPE_CHECKING:
    from dayzero.engine.generate import Engine


@functools.partial(jax.jit, static_argnames=("config",))
def prompt_hidden(weights, tokens, num_new, cache, *, config: ModelConfig):
    """The main model's hidden states [B,T,D] over ``tokens`` (after its final norm, as the MTP
    module reads them) and the keys/values a next chunk of the prompt attends to."""
    layers = []
    _, new = forward(weights, config, tokens, cache, num_new, hidden_out=layers)
    return main_hidden(weights, config, layers[-1]), new


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

    def __init__(self, engine: "Engine", ids: list[list[int]], first: np.ndarray, max_new_tokens: int, K: int,
                 rows: RowSampling, mode: SamplingMode):
        """The module's entries for the prompts ``ids`` (the last one pairs the target's first
        token ``first`` [B] with the last prompt position's hidden state)."""
        from dayzero.engine.generate import MIN_PROMPT_BUCKET, PREFILL_CHUNK, bucket, cache_length

        self.engine, self.rows, self.mode = engine, rows, mode
        config = engine.config
        lengths = np.array([len(r) for r in ids], np.int32)
        B, longest = len(ids), int(lengths.max())
        T = min(bucket(longest, MIN_PROMPT_BUCKET), PREFILL_CHUNK)
        padded = -(-longest // T) * T
        # Room as the target's cache has: the rows' tokens and the chain's entries past them.
        max_len = cache_length(longest, max_new_tokens + K)
        dtype = engine.weights.embed.dtype
        self.cache = init_cache(nextn_block_config(config), B, max_len, dtype, engine.kv_cache)
        main = init_cache(config, B, max_len, dtype, engine.kv_cache) if padded > T else None
        tokens, shifted = np.zeros((B, padded), np.int32), np.zeros((B, padded), np.int32)
        for b, row in enumerate(ids):
            tokens[b, : len(row)] = row
            shifted[b, : len(row)] = list(row[1:]) + [int(first[b])]
        self.stale = np.zeros(B, bool)
        for start in range(0, padded, T):
            num_new = jnp.asarray(np.clip(lengths - start, 0, T).astype(np.int32))
            chunk = jnp.asarray(tokens[:, start: start + T])
            hidden, new = engine._steps.call(prompt_hidden, ("mtp_prompt", chunk.shape, max_len, start == 0),
                                             engine.weights, chunk, num_new, None if start == 0 else main,
                                             static={"config": config})
            if main is not None:
                main = engine._steps.call(engine._append, ("mtp_prompt_append", chunk.shape, max_len), main, new)
            logits, out = self._entries(jnp.asarray(shifted[:, start: start + T]), hidden, num_new)
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
