"""Speculative decoding, lossless: a drafter proposes K tokens, one step of the target model
checks them all, and the accepted ones (plus one more token of the target's own) are emitted.

- Drafters: n-gram prompt lookup (:func:`ngram_draft`, host-side numpy): the longest suffix of
  the sequence so far (``max_n`` tokens down to ``min_n``) that occurred before in the prompt or
  the generated text proposes the tokens that followed its latest occurrence; a small draft
  model sharing the tokenizer (``dayzero.engine.draft_model``), whose own distribution q each
  draft is drawn from; or the model's own multi-token-prediction module (the
  ``num_nextn_predict_layers`` of DeepSeek-V3, Kimi-K2 or GLM-4.5; ``dayzero.engine.mtp_drafter``),
  fed the target's hidden states (the verify step returns them), its distribution q likewise.
- The verify step (:func:`verify_step`) feeds each row's last emitted token and its K drafts
  through the contiguous-cache forward at once (T = K+1, padded; one compile per cache bucket)
  and gets K+1 rows of logits. :func:`accept_drafts` then applies the acceptance rule: greedy
  rows accept drafts while they equal the argmax and emit the argmax at the first mismatch (the
  bonus token when all match); sampled rows run speculative rejection sampling: accept draft x
  with probability min(1, p(x) / q(x)), on rejection draw from max(0, p - q) renormalised, where
  p is the distribution ``sampling.sample`` draws from (temperature, top-k, top-p, min-p) and q
  the drafter's (a point mass for n-gram drafts: accept with p(x), else draw from p without x),
  so the emitted tokens are distributed exactly as without speculation.
- Rows advance by different amounts: the cache's per-row lengths are set to what each row
  accepted (``append_verified``), so rejected positions are ignored and later overwritten.
- A step in which no row has a draft runs the engine's ordinary one-token decode step.

What cannot run is refused in one place, :func:`speculative_refusal` (see its docstring).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import TYPE_CHECKING, Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.runtime import RunConfig, RunConfigError
from dayzero.engine.sampling import (RowSampling, SamplingMode, SamplingParams, batch_sampling, filter_sorted,
                                     filters_on)
from dayzero.model.cache import KVCache, LatentCache, NewKV, NewLatent, append_to_cache
from dayzero.model.config import ModelConfig, RopeType
from dayzero.model.transformer import forward

if TYPE_CHECKING:  # generate imports this module
    from dayzero.engine.generate import Engine

__all__ = ["DraftKind", "SpecConfig", "SpecStats", "SpeculativeError", "accept_drafts", "ngram_draft",
           "mtp_refusal", "speculative_refusal", "stream_speculative", "verify_step"]


class SpeculativeError(RunConfigError):
    """A speculative-decoding setting, or a run it cannot be combined with."""


class DraftKind(enum.Enum):
    """Where draft tokens come from."""

    NGRAM = "ngram"  # prompt lookup: the continuation of an earlier occurrence of the recent suffix
    DRAFT = "draft"  # a small model sharing the target's tokenizer (``SpecConfig.draft``)
    MTP = "mtp"  # the target's own multi-token-prediction module (DeepSeek-V3, Kimi-K2, GLM-4.5)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings: the drafter ``kind``, ``num_draft_tokens`` (K, the tokens
    proposed and verified per step), for the n-gram drafter the suffix lengths ``ngram`` =
    (min_n, max_n) it looks up, longest first, and for the draft-model drafter the ``draft``
    :class:`~dayzero.engine.generate.Engine` (e.g. ``Engine.load(DIR)`` of a small model of the
    same tokenizer). The MTP drafter (``kind="mtp"``) takes nothing more: the target's own
    multi-token-prediction module drafts (:func:`mtp_refusal` says which models have one)."""

    kind: DraftKind | str = DraftKind.NGRAM
    num_draft_tokens: int = 4
    ngram: tuple[int, int] = (2, 4)
    draft: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", DraftKind(getattr(self.kind, "value", self.kind)))
        except ValueError:
            choices = ", ".join(k.value for k in DraftKind)
            raise SpeculativeError(f"speculative kind {self.kind!r} is unknown; choose one of {choices}") from None
        K = self.num_draft_tokens
        if not isinstance(K, int) or not 1 <= K <= 64:
            raise SpeculativeError(f"num_draft_tokens={K!r} is invalid; it must be an integer in [1, 64]")
        n = tuple(self.ngram)
        if len(n) != 2 or not all(isinstance(x, int) for x in n) or not 1 <= n[0] <= n[1]:
            raise SpeculativeError(f"ngram={self.ngram!r} is invalid; it must be (min_n, max_n) with 1 <= min_n <= max_n")
        object.__setattr__(self, "ngram", n)
        if (self.kind is DraftKind.DRAFT) != (self.draft is not None):
            raise SpeculativeError("the draft drafter needs a draft model and only it takes one: pass "
                                   "SpecConfig(kind='draft', draft=Engine.load(DIR)) (CLI: --speculative draft:DIR)")


@dataclasses.dataclass
class SpecStats:
    """One row's speculation: decode steps after its first token (a verify step, or the plain
    decode step when no row of the batch had a draft), draft tokens proposed and accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def to_json(self) -> dict:
        """The ``"speculative"`` object of ``generate --json``."""
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(rate, 4)}


def speculative_refusal(config: ModelConfig, run: RunConfig) -> str | None:
    """Why speculative decoding cannot run with this model and run configuration (None: it can).

    The verify step is the contiguous-cache forward on one device, so refused are: the Pallas
    kernels (generation runs on the paged cache there, which has no verify step yet), a mesh
    (the step's outputs are not pinned to mesh layouts yet), DeepSeek-V4's compressed attention
    (a rejected draft has already advanced its window ring and compressor states), the
    linear-attention hybrids (likewise their recurrent and convolution states), and
    dynamic-NTK RoPE (its frequencies depend on the longest position seen, which the drafts would
    move: not lossless).
    """
    if run.on_kernels:
        return (f"speculative decoding runs on the contiguous cache only, not with --kernels {run.kernels.value}; "
                "use --kernels reference or drop --speculative")
    if run.placement is not None:
        return "speculative decoding runs on one device only, not on a --mesh; drop --mesh or --speculative"
    if config.compressed is not None:
        return ("speculative decoding cannot roll back DeepSeek-V4's window ring and compressor states past a "
                "rejected draft yet; drop --speculative for this model")
    if config.linear is not None:
        return ("speculative decoding cannot roll back the linear-attention layers' recurrent states past a "
                "rejected draft yet; drop --speculative for this model")
    if config.rope.type is RopeType.DYNAMIC:
        return ("speculative decoding is not lossless with dynamic-NTK RoPE (draft positions would change the "
                "frequencies); drop --speculative for this model")
    return None


def mtp_refusal(config: ModelConfig) -> str | None:
    """Why the MTP drafter cannot draft for this model (None: it can): it needs the
    multi-token-prediction modules of DeepSeek-V3, Kimi-K2 or GLM-4.5 (``model.mtp.MTP_FAMILIES``),
    converted from a checkpoint that has them."""
    from dayzero.model.mtp import MTP_FAMILIES

    if config.family not in MTP_FAMILIES:
        return ("--speculative mtp needs a model with multi-token-prediction layers that dayzero runs (DeepSeek-V3, "
                f"Kimi-K2, GLM-4.5/4.6/4.7), not {config.family.value}; use --speculative ngram or draft:DIR")
    if not config.mtp_layers:
        return ("this model has no multi-token-prediction layers (num_nextn_predict_layers is 0); use --speculative "
                "ngram or draft:DIR")
    if not config.mtp_kept:
        return ("this model was converted without its multi-token-prediction layers (the source had no "
                f"model.layers.{config.num_layers}.* tensors); convert a checkpoint that has them, or use "
                "--speculative ngram or draft:DIR")
    return None


def check_speculative(config: ModelConfig, run: RunConfig, spec: SpecConfig | None = None) -> None:
    """Raise :class:`SpeculativeError` if :func:`speculative_refusal` refuses (or, for a draft
    model, ``draft_model.draft_refusal``; for the MTP drafter, :func:`mtp_refusal`)."""
    reason = speculative_refusal(config, run)
    if reason is None and spec is not None and spec.kind is DraftKind.DRAFT:
        from dayzero.engine.draft_model import draft_refusal

        reason = draft_refusal(spec.draft, config)
    if reason is None and spec is not None and spec.kind is DraftKind.MTP:
        reason = mtp_refusal(config)
    if reason is not None:
        raise SpeculativeError(reason)


# ---- the drafter -----------------------------------------------------------------------------


def ngram_draft(seq: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``k`` draft tokens for the sequence ``seq`` [n] (prompt + generated so far).

    Finds the longest suffix of ``seq`` (``max_n`` tokens down to ``min_n``) that also occurs
    earlier, takes its latest earlier occurrence and proposes the (at most ``k``) tokens that
    followed it. Returns an empty array when nothing matches.
    """
    n_tokens = len(seq)
    if k <= 0:
        return seq[:0]
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        # Windows of seq[:-1] start at 0 .. n_tokens-1-n: each has a following token, and the
        # suffix itself (starting at n_tokens-n) is not one of them.
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[n_tokens - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k]
    return seq[:0]


# ---- the verify step ---------------------------------------------------------------------------


def target_logits(logits: jax.Array, rows: RowSampling, mode: SamplingMode) -> jax.Array:
    """The logits [B,T,V] that ``sampling.sample`` draws each row from: divided by the row's
    temperature and, in the filtered mode, with top-k/top-p/min-p's rejects at -inf (in
    vocabulary order). Greedy rows are not drawn from (their temperature is taken as 1)."""
    B, T, V = logits.shape
    temperature = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None, None]
    scaled = logits / temperature
    if mode is not SamplingMode.FILTERED:
        return scaled
    per_position = jax.tree.map(lambda x: jnp.repeat(x, T, axis=0), rows)
    flat = scaled.reshape(B * T, V)
    order = jnp.argsort(-flat, axis=-1)
    kept = filter_sorted(jnp.take_along_axis(flat, order, axis=-1), per_position)
    unsorted = jnp.zeros_like(flat).at[jnp.arange(B * T)[:, None], order].set(kept).reshape(B, T, V)
    return jnp.where(filters_on(rows)[:, None, None], unsorted, scaled)


def accept_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, rows: RowSampling,
                  steps: jax.Array, mode: SamplingMode, draft_probs: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The acceptance rule over one verify step's logits [B,K+1,V] (row t: the distribution of
    the token after input t) for drafts [B,K] of which the first ``num_drafts`` [B] are real.

    Returns (tokens [B,K+1], their log-probabilities under the unmodified distribution [B,K+1],
    accepted [B]): each row emits ``accepted + 1`` tokens, its accepted drafts then one token of
    the target's own (the argmax, a residual draw at the first rejection, or the bonus draw).
    ``steps`` [B]: each row's index of the token after its last emitted one; the token at index
    s is drawn with the row's key folded with s, as ``sample`` draws it, and its acceptance test
    with a key derived from that one. ``draft_probs`` [B,K,V]: the distributions q the drafts
    were drawn from (None: point masses, as n-gram drafts are).
    """
    B, T, V = logits.shape
    K = T - 1
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B,T]
    has_draft = jnp.arange(K)[None, :] < num_drafts[:, None]
    accept = (drafts == argmax[:, :K]) & has_draft
    final = argmax
    if mode is not SamplingMode.GREEDY:
        target = target_logits(logits, rows, mode)
        positions = steps[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        keys = jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)))(rows.keys, positions)  # [B,T]
        probs = jax.nn.softmax(target, axis=-1)
        p_draft = jnp.take_along_axis(probs[:, :K], drafts[..., None], axis=-1)[..., 0]
        uniform = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1))))(keys[:, :K])
        if draft_probs is None:
            # Point-mass drafter: accept draft x with probability p(x) ...
            passes = uniform < p_draft
            # ... on rejection draw from normalize(max(0, p - q)): p without x, renormalised.
            draft_at = jnp.concatenate([jnp.where(has_draft, drafts, -1), jnp.full((B, 1), -1, drafts.dtype)], 1)
            residual = jnp.where(jnp.arange(V)[None, None, :] == draft_at[..., None], -jnp.inf, target)
        else:
            passes, residual = _against_draft_probs(probs, target, drafts, has_draft, draft_probs, uniform, p_draft)
        drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys, residual).astype(jnp.int32)
        sampled = (rows.temperature > 0)[:, None]
        accept = jnp.where(sampled, passes & has_draft, accept)
        final = jnp.where(sampled, drawn, argmax)
    accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # leading accepts [B]
    t = jnp.arange(T)[None, :]
    last = jnp.take_along_axis(final, accepted[:, None], axis=1)
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(t < accepted[:, None], padded, last).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0], accepted.astype(jnp.int32)


def _against_draft_probs(probs, target, drafts, has_draft, draft_probs, uniform, p_draft) -> tuple:
    """(whether each draft passes [B,K], the residual logits [B,K+1,V]) of drafts drawn from
    ``draft_probs`` q [B,K,V]: pass when u < p(x) / q(x); the residual is log max(0, p - q),
    q taken as 0 past the real drafts (the bonus position draws from p)."""
    B, T, V = probs.shape
    q = jnp.where(has_draft[..., None], draft_probs.astype(probs.dtype), 0.0)
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    passes = uniform * q_draft < p_draft
    excess = jnp.maximum(probs - jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1), 0.0)
    residual = jnp.where(excess > 0, jnp.log(jnp.where(excess > 0, excess, 1.0)), -jnp.inf)
    # Where p <= q everywhere no draft can be rejected: the residual is never drawn from then.
    return passes, jnp.where(jnp.any(excess > 0, axis=-1, keepdims=True), residual, target)


@functools.partial(jax.jit, static_argnames=("config", "mode", "hidden"))
def verify_step(weights, tokens, num_new, rows: RowSampling, steps, mode: SamplingMode,
                cache: KVCache | LatentCache, config: ModelConfig, draft_probs=None, hidden: bool = False):
    """The forward over each row's last token and drafts ``tokens`` [B,K+1] (``num_new`` [B] of
    them real: 0 for a finished row), then :func:`accept_drafts` (``draft_probs``: the drafts'
    q, None for point masses); returns its three outputs and what ``append_verified`` writes,
    then with ``hidden`` the hidden states [B,K+1,D] after the final norm (the MTP drafter's)."""
    layers = [] if hidden else None
    logits, new = forward(weights, config, tokens, cache, num_new, all_logits=True, hidden_out=layers)
    out = accept_drafts(logits, tokens[:, 1:], jnp.maximum(num_new - 1, 0), rows, steps, mode, draft_probs)
    if not hidden:
        return (*out, new)
    from dayzero.model.mtp import main_hidden

    return (*out, new, main_hidden(weights, config, layers[-1]))


@functools.partial(jax.jit, donate_argnums=(0,))
def append_verified(cache: KVCache | LatentCache, new: NewKV | NewLatent, accepted: jax.Array):
    """Write a verify step's keys/values, then keep of each row only its last token and its
    ``accepted`` [B] drafts: the rejected positions lie past the row's length, unread, and the
    next step overwrites them. ``rope_len`` likewise counts kept positions only."""
    keep = jnp.minimum(new.num_new, accepted + 1)
    lengths = cache.lengths + keep
    written = append_to_cache(cache, new)
    return written.replace(lengths=lengths, rope_len=jnp.maximum(cache.rope_len, jnp.max(lengths)))


# ---- the generation loop -----------------------------------------------------------------------


def _verify(engine: "Engine", tokens, num_new, rows, steps, mode, cache, draft_probs=None,
            hidden: bool = False) -> tuple:
    """One verify step and its cache write, its first compile counted in ``engine.compile_s``;
    with ``hidden``, also the step's hidden states (else None)."""
    key = ("verify", tokens.shape, cache.max_len, mode) + (() if draft_probs is None else ("q",)) + \
        (("hidden",) if hidden else ())
    first = (key, "append") not in engine._steps
    start = time.perf_counter()
    extra = {} if draft_probs is None else {"draft_probs": draft_probs}
    tok, lp, accepted, new, *states = engine._steps.call(
        verify_step, key, engine.weights, jnp.asarray(tokens), jnp.asarray(num_new), rows, jnp.asarray(steps),
        cache=cache, static={"mode": mode, "config": engine.config, "hidden": hidden}, **extra)
    cache = engine._steps.call(append_verified, (key, "append"), cache, new, accepted)
    if first:
        jax.block_until_ready(tok)
        engine.compile_s += time.perf_counter() - start
    return tok, lp, accepted, cache, states[0] if states else None


def _drafter(engine: "Engine", spec: SpecConfig, ids: list[list[int]], first: np.ndarray, max_new_tokens: int,
             rows: RowSampling, mode: SamplingMode, hidden: list | None = None):
    """The drafter object of a draft-model or MTP run (None for n-gram drafts, drawn on the host);
    ``hidden``: the prefill's hidden states, which the MTP drafter reads."""
    K = spec.num_draft_tokens
    if spec.kind is DraftKind.DRAFT:
        from dayzero.engine.draft_model import DraftModel

        return DraftModel(spec.draft, ids, first, max_new_tokens, K, rows, mode, engine.config.vocab_size)
    if spec.kind is DraftKind.MTP:
        from dayzero.engine.mtp_drafter import MTPDrafter

        return MTPDrafter(engine, ids, first, hidden, max_new_tokens, K, rows, mode)
    return None


def stream_speculative(engine: "Engine", ids: list[list[int]], max_new_tokens: int, params: list[SamplingParams],
                       spec: SpecConfig, stop_ids: tuple[int, ...],
                       stats: list[SpecStats]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(tokens [B,W], logprobs [B,W], counts [B])`` per step: row b's next ``counts[b]``
    tokens. A row stops after a token in ``stop_ids`` (tokens after it are dropped) or at
    ``max_new_tokens``; ``stats`` (one per row) is updated as the steps run."""
    B, K = len(ids), spec.num_draft_tokens
    min_n, max_n = spec.ngram
    mode, rows = batch_sampling(params)
    lengths = np.array([len(r) for r in ids], np.int32)
    # Room for the drafts past the last kept token: a verify step writes K+1 positions.
    # The MTP drafter reads the prompt's hidden states: the prefill returns them (one forward).
    tok, lp, cache, *prompt_states = engine._prefill_chunks(ids, lengths, max_new_tokens + K, rows, mode,
                                                             hidden=spec.kind is DraftKind.MTP)
    drafter = _drafter(engine, spec, ids, np.asarray(tok), max_new_tokens, rows, mode, *prompt_states)
    hidden = getattr(drafter, "wants_hidden", False)
    seqs = [np.array(r, np.int32) for r in ids]
    produced = np.zeros(B, np.int64)
    done = np.zeros(B, bool)
    tok, lp, counts = np.asarray(tok)[:, None], np.asarray(lp)[:, None], np.ones(B, np.int64)
    while True:
        for b in np.flatnonzero(~done):
            kept = tok[b, : counts[b]]
            stop = np.flatnonzero(np.isin(kept, stop_ids))
            n = min(len(kept), max_new_tokens - produced[b], stop[0] + 1 if stop.size else len(kept))
            counts[b] = n
            seqs[b] = np.concatenate([seqs[b], kept[:n]])
            produced[b] += n
            done[b] = produced[b] >= max_new_tokens or (stop.size > 0 and stop[0] < n)
        yield tok, lp, counts
        if done.all():
            return
        # At most the tokens still wanted, less the one the target adds itself.
        budget = np.where(done, 0, np.minimum(K, max_new_tokens - produced - 1)).astype(np.int32)
        probs = None
        if drafter is None:
            drafts = np.zeros((B, K), np.int32)
            for b in np.flatnonzero(~done):
                d = ngram_draft(seqs[b], int(budget[b]), min_n, max_n)
                drafts[b, : len(d)], budget[b] = d, len(d)
        elif budget.any():
            drafts, probs = drafter.propose(~done, produced.astype(np.int32), K)
        num_drafts = budget
        for b in np.flatnonzero(~done):
            stats[b].steps += 1
            stats[b].drafted += int(num_drafts[b])
        last = np.array([s[-1] for s in seqs], np.int32)[:, None]
        active = (~done).astype(np.int32)
        if not num_drafts.any():  # nothing to verify: the ordinary one-token decode step
            t, l, cache = engine._run_step(engine._host(last), cache, engine._host(active), rows,
                                           produced.astype(np.int32), mode)
            tok, lp, counts = np.asarray(t)[:, None], np.asarray(l)[:, None], active.astype(np.int64)
            if drafter is not None:
                drafter.plain(~done, tok[:, 0])
            continue
        tokens = np.concatenate([last, drafts], axis=1)
        t, l, accepted, cache, states = _verify(engine, tokens, active * (1 + num_drafts), rows,
                                                produced.astype(np.int32), mode, cache, probs, hidden)
        tok, lp, accepted = np.asarray(t), np.asarray(l), np.asarray(accepted)
        if drafter is not None:
            drafter.advance(~done, drafts, tok, accepted, states)
        for b in np.flatnonzero(~done):
            stats[b].accepted += int(accepted[b])
        counts = np.where(done, 0, accepted + 1)
