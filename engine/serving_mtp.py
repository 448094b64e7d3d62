"""The MTP drafter of serving speculation: ``ServingConfig(speculative=SpecConfig('mtp'))``, the
model's own multi-token-prediction module (``model/mtp.py``) drafting for every decoding request,
lossless as ``Engine.generate``'s (``engine/mtp_drafter.py``, whose functions it runs).

The module gets a page pool of its own (:class:`MTPPool`, a ``serving_draft.SidePool``): one
attention layer (``nextn_block_config``) on pages of the target's size and count, so a request's
block table addresses it. Entry j of a request pairs token j+1 with h_j, the target's
post-final-norm hidden state at position j, and lies at position j of the MTP pool.

Per request the pool keeps, tagged with its admission, ``held`` (entries 0..held-1 are in its
pages) and the pending hidden states of positions held.. whose entries are not written yet (the
next token of the last one may not exist yet, and the drafting step needs the last entry's
output anyway). The target's steps hand it their hidden states (``PagedSteps.run_step(hidden=
True)``):

- a prefill chunk (``prefilled``): the pending state and the chunk's hidden states but the last
  become entries at once (their next tokens are in the prompt), the last stays pending. So a
  readmitted request's recompute prefill rebuilds its entries with no extra work;
- a verify step (``advance``): each drafting row's step positions L..L+a (its last token and its
  ``a`` accepted drafts) become pending; their next tokens are the ones the step emits.

Positions whose hidden states no step handed over are recomputed when the request next drafts
(catch-up): the target's forward over them, chunked as prefill, without writing its pages. That
covers positions taken from the prefix cache or copied back from a swap at admission (their
pages may hold another request's entries, or none: all are recomputed, a second prefill of the
cached part), plain decode steps (a batch with a constrained or top-logprobs row, or no room for
drafts) and verify steps in which the row had no draft.

Drafting: one batched step writes each drafting row's pending entries (T = K+1, padded) and
returns the module's output at the last, entry L-1 of a row of L computed positions; then
``mtp_drafter.mtp_chain`` draws the K drafts (each from q, the module's distribution after the
row's temperature and filters: greedy rows take its argmax) on a contiguous copy of the rows'
pages (gathered as the reference attention gathers them; a per-head module's keys, GLM-4.5's,
turned to the contiguous cache's dim-major layout), which is dropped: the chain's entries
are never kept and nothing rolls back. Accepted positions get their entries from the verify
step's hidden states.

A page shared through the prefix cache is written again by every request that recomputes it: the
same entries (to rounding) but for its last slot, which pairs the sharer's own next token. A
draft read from another request's entry is still drawn from the q it reports, so the output stays
lossless; only acceptance can suffer.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.mtp_drafter import mtp_chain, mtp_entries
from dayzero.engine.paged_steps import _STEPS, PagedSteps, RowParams, _append
from dayzero.engine.sampling import RowSampling, SamplingMode
from dayzero.engine.serving_draft import SidePool
from dayzero.model.cache import KVCache, LatentCache
from dayzero.model.config import ModelConfig
from dayzero.model.kernel_attention import gathered
from dayzero.model.mtp import nextn_block_config
from dayzero.model.paged_cache import PagedKVCache
from dayzero.model.quant import QuantizedArray

if TYPE_CHECKING:
    from dayzero.engine.serving import ServingEngine, _Request


@functools.partial(jax.jit, static_argnames=("config",))
def _entries(weights, tokens, first, carried, hidden, num_new, cache, *, config: ModelConfig):
    """``mtp_entries`` over ``tokens`` [B,T] paired with hidden states [B,T,D]: ``hidden``, or where
    ``carried`` [B] is set, ``first`` [B,D] (the pending state of the position before a chunk)
    followed by ``hidden`` but its last position."""
    shifted = jnp.concatenate([first[:, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
    h = jnp.where(carried[:, None, None] > 0, shifted, hidden)
    return mtp_entries(weights, tokens, h, num_new, cache, config=config)


@functools.partial(jax.jit, static_argnames=("size",))
def _window(hidden, row, start, *, size: int):
    """Rows ``start .. start+size-1`` of ``hidden[row]`` [T,D] (zeros past its end): [size,D]."""
    padded = jnp.pad(hidden[row], ((0, size), (0, 0)))
    return jax.lax.dynamic_slice_in_dim(padded, start, size, axis=0)


@functools.partial(jax.jit, static_argnames=("config", "mode", "K"))
def _chain(weights, logits, out, view, active, temperature, top_k, top_p, min_p, keys, steps, *, config: ModelConfig,
           mode: SamplingMode, K: int):
    """``mtp_chain`` on a contiguous copy of the rows' pages of the module's pool ``view``."""
    rows = RowSampling(temperature, top_k, top_p, min_p, jax.random.wrap_key_data(keys))
    tables = view.block_tables
    if isinstance(view, PagedKVCache):  # a per-head module (GLM-4.5): keys as the contiguous cache holds them
        cache = KVCache(k=tuple(_dim_major(gathered(p, tables)) for p in view.k_pages),
                        v=tuple(gathered(p, tables) for p in view.v_pages), lengths=view.lengths,
                        rope_len=view.rope_len)
    else:
        keys_ = None if view.index_key_pages is None else tuple(gathered(p, tables) for p in view.index_key_pages)
        cache = LatentCache(latent=tuple(gathered(p, tables) for p in view.latent_pages), lengths=view.lengths,
                            rope_len=view.rope_len, index_keys=keys_)
    return mtp_chain(weights, logits, out, cache, active, rows, steps, config=config, mode=mode, K=K)


def _dim_major(keys):
    """Gathered token-major keys [B,K,S,H] (plain or quantized per token and head) as the
    contiguous cache's [B,K,H,S]: the chain appends its drafts' entries to a ``KVCache``."""
    if isinstance(keys, QuantizedArray):
        return keys.replace(values=keys.values.swapaxes(2, 3), scale=keys.scale.swapaxes(2, 3), in_axes=(2,))
    return keys.swapaxes(2, 3)


class MTPPool(SidePool):
    """The MTP module's page pool beside a serving engine's, and each request's entries in it."""

    wants_hidden = True

    def __init__(self, server: "ServingEngine"):
        """The pool for ``server`` (its config resolved, speculating with ``SpecConfig('mtp')``)."""
        e = server.engine
        # Only the pool and its host/view helpers of these PagedSteps are used: the module's own
        # steps are the jits above.
        super().__init__(server, PagedSteps(nextn_block_config(e.config), e.weights, server.config, server.steps.run,
                                            host=e._host))
        self.P = self.K + 1  # hidden states a verify step hands over per row; the drafting step's T
        self.caught_up_tokens = 0  # positions whose hidden states catch-up recomputed
        self.draft_steps = 0  # batched drafting calls (each: entries, then the chain of K drafts)

    def _state(self, r: "_Request") -> tuple[int, jax.Array | None, int]:
        """(held, pending hidden states [P,D] or None, how many of them are real) of ``r``."""
        return self._get(r, (0, None, 0))

    # ---- hidden states from the target's steps --------------------------------------------------

    def prefilled(self, r: "_Request", start: int, n: int, T: int, W: int | None, logits: jax.Array,
                  hidden: jax.Array) -> jax.Array:
        """After a prefill chunk of ``r`` over positions ``start .. start+n-1`` (shape T, table
        width W) with hidden states ``hidden`` [1,T,D]: write their entries (but the last);
        returns the chunk's ``logits``."""
        held, _, count = self._state(r)
        if held + count != start:  # a fresh admission after cached or swapped-in positions
            self._catch_up(r, start)
        self._absorb(r, start, n, T, W, hidden)
        return logits

    def advance(self, decoding: list["_Request"], counts: np.ndarray, accepted: np.ndarray, hidden=None) -> None:
        """After a verify step whose hidden states are ``hidden`` [B,K+1,D] (called before the
        rows' tokens grow): each drafting row's positions L .. L+accepted (its last token and
        its accepted drafts) are pending. A row without drafts falls behind (caught up later)."""
        for row, r in enumerate(decoding):
            if counts[row]:
                block = self._call(_window, self._window_key(hidden), hidden, *self._ints(row, 0),
                                   static=dict(size=self.P))
                self._put(r, (r.computed, block, int(accepted[row]) + 1))

    def _absorb(self, r: "_Request", start: int, n: int, T: int, W: int | None, hidden: jax.Array) -> None:
        """The hidden states [1,T,D] of ``r``'s positions ``start .. start+n-1`` are known (its
        pending states end at ``start``, at most one): write the entries of all but the last."""
        held, pending, count = self._state(r)
        m = count + n - 1  # entries held .. held+m-1, the carried state first
        if m:
            tokens = np.zeros((1, T), np.int32)
            tokens[0, :m] = r.tokens[held + 1 : held + 1 + m]
            first = jnp.zeros((1, hidden.shape[-1]), hidden.dtype) if pending is None else pending[None, 0]
            self._write(tokens, first, np.array([count]), hidden, np.array([m]), np.array([held]),
                        self.server._tables([r], 1), W)
        block = self._call(_window, self._window_key(hidden), hidden, *self._ints(0, n - 1),
                           static=dict(size=self.P))
        self._put(r, (held + m, block, 1))

    def _catch_up(self, r: "_Request", end: int) -> None:
        """Recompute the target's hidden states of ``r``'s positions from its last entry to
        ``end`` (its pages hold them: the forward writes nothing) and absorb them."""
        start, steps = self._state(r)[0], self.server.steps
        self._put(r, (start, None, 0))
        table = self.server._tables([r], 1)
        for tokens, n, at, W in self._chunks(r, start, end):
            fn, signature, args, static = steps._forward_call(tokens, np.array([n]), np.array([at]), table, W)
            (_, hidden), _ = _STEPS.call(fn, signature + ("hidden",), *args, static=dict(static, hidden=True))
            self._absorb(r, at, n, tokens.shape[1], W, hidden)
            self.caught_up_tokens += n

    # ---- drafting -------------------------------------------------------------------------------

    def propose(self, decoding: list["_Request"], counts: np.ndarray) -> tuple:
        """Drafts [B,K] for the ``decoding`` rows, ``counts`` [B] of them each (B the decode
        batch), with their distributions q [B,K,V] (None for a greedy batch); the counts as given."""
        B, K, P = len(counts), self.K, self.P
        tables, width, rows, mode, steps = self._batch(decoding, B)
        D = self.server.engine.config.hidden_size
        tokens, num_new, lengths = np.zeros((B, P), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        blocks = [None] * B
        for row, r in enumerate(decoding):
            if not counts[row]:
                continue
            held, _, count = self._state(r)
            if held + count != r.computed:
                self._catch_up(r, r.computed)
            held, blocks[row], count = self._state(r)
            tokens[row, :count] = r.tokens[held + 1 : held + 1 + count]
            num_new[row], lengths[row] = count, held
            self._put(r, (r.computed, None, 0))
        dtype = next(b for b in blocks if b is not None).dtype
        hidden = jnp.stack([jnp.zeros((P, D), dtype) if b is None else b for b in blocks])
        logits, out = self._write(tokens, jnp.zeros((B, D), dtype), np.zeros(B, np.int32), hidden, num_new, lengths,
                                  tables, width)
        drafts, q = self._chain(logits, out, lengths + num_new, counts, tables, width, rows, mode, steps)
        self.draft_steps += 1
        drafts = np.where(np.arange(K) < counts[:, None], np.asarray(drafts), 0).astype(np.int32)
        return drafts, counts, q

    def _write(self, tokens, first, carried, hidden, num_new, lengths, tables, width) -> tuple[jax.Array, jax.Array]:
        """Write entries (``_entries``' arguments; rows at ``lengths``, ``num_new`` real) into
        the pool; the module's logits [B,V] and output [B,D] at each row's last one."""
        s, e = self.steps, self.server.engine
        toks, nums, read = s.forward_args(tokens, num_new, lengths, tables, width)
        signature = ("mtp_entries", e.config, s.run, self._pool_key(), tokens.shape, width)
        logits, out, new = self._call(_entries, signature, e.weights, toks, first, *s._host((np.asarray(carried),)),
                                      hidden, nums, read, static=dict(config=e.config))
        s.pool = _STEPS.call(_append, ("mtp_append", signature[1:]), s._with_rows(tables, lengths), new,
                             static=dict(layout=s.layout))
        return logits, out

    def _chain(self, logits, out, lengths, counts, tables, width, rows: RowParams, mode: SamplingMode, steps):
        """``_chain`` over the pool as the rows' tables address it: drafts [B,K] (on the
        device) and q [B,K,V] (None in greedy mode)."""
        s, e = self.steps, self.server.engine
        view = s.forward_args(np.zeros((len(counts), 1)), counts, lengths, tables, width)[2]
        signature = ("mtp_chain", e.config, s.run, self._pool_key(), len(counts), width, mode, self.K)
        args = s._host(((counts > 0).astype(np.int32), rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                        rows.key_data, np.asarray(steps, np.int32)))
        return self._call(_chain, signature, e.weights, logits, out, view, *args,
                          static=dict(config=e.config, mode=mode, K=self.K))

    def _window_key(self, hidden: jax.Array) -> tuple:
        return ("mtp_window", self.server.engine.config, hidden.shape, str(hidden.dtype))

    def _pool_key(self) -> tuple:
        c = self.server.config
        return (c.num_pages, c.page_size, c.slots)

    def _ints(self, *values: int) -> tuple:
        return self.steps._host(tuple(np.int32(v) for v in values))

    def _call(self, fn, signature, *args, static):
        """``_STEPS.call``, its first call's compile counted in the pool's ``compile_s``."""
        with self.steps._compiling(signature) as done:
            result = _STEPS.call(fn, signature, *args, static=static)
            done(result)
        return result

    # ---- warm-up --------------------------------------------------------------------------------

    def warmup(self) -> int:
        """Compile what MTP serving runs up front (each call writes nothing): the target's
        prefill and verify steps with hidden states, the module's entry steps of those shapes
        and of the drafting step, the state windows and the chains; returns the number of calls."""
        cfg, target, K, P = self.server.config, self.server.steps, self.K, self.P
        D = self.server.engine.config.hidden_size
        full = {B: np.zeros((B, cfg.max_table_pages), np.int32) for B in (1, *cfg.decode_batches())}
        calls = 0
        for T, W in cfg.prefill_shapes():
            _, hidden = target.run_step(np.zeros((1, T)), np.zeros(1), np.zeros(1), full[1], W, hidden=True)
            self._write(np.zeros((1, T), np.int32), jnp.zeros((1, D), hidden.dtype), np.zeros(1, np.int32), hidden,
                        np.zeros(1), np.zeros(1), full[1], W)
            self._call(_window, self._window_key(hidden), hidden, *self._ints(0, 0), static=dict(size=P))
            calls += 3
        for B, W in itertools.product(cfg.decode_batches(), cfg.table_widths()):
            zeros = np.zeros(B)
            _, hidden = target.run_step(np.zeros((B, K + 1)), zeros, zeros, full[B], W, all_logits=True, hidden=True)
            logits, out = self._write(np.zeros((B, P), np.int32), jnp.zeros((B, D), hidden.dtype),
                                      np.zeros(B, np.int32), hidden, zeros, zeros, full[B], W)
            self._call(_window, self._window_key(hidden), hidden, *self._ints(0, 0), static=dict(size=P))
            for mode in SamplingMode:
                self._chain(logits, out, zeros, np.zeros(B, np.int32), full[B], W, RowParams.of([], [], B), mode,
                            zeros)
            calls += 3 + len(SamplingMode)
        return calls
