"""Token sampling: greedy, temperature, top-k, top-p and min-p, with per-row parameters.

Filters are applied in the order HF transformers applies its logits warpers (temperature, top-k,
top-p, min-p). Parameters are arrays with one value per batch row, so rows with different
settings share one compiled step; only the *kind* of sampling (greedy, plain, filtered) is static.

Constrained decoding (structured output): a :class:`TokenConstraint` says which tokens may come
next as a packed bitmask (llguidance's layout); :func:`sample` takes a batch of such masks and sets
the logits of disallowed tokens to -inf before anything else. Whether a step takes masks at all
is static: a batch without constraints runs the program compiled without them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class SamplingError(ValueError):
    """Invalid sampling parameters."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature=0`` is greedy (the other filters are unused).

    ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch their filter off. ``seed`` makes sampling
    reproducible: the same seed, prompt and parameters give the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        checks = [
            (self.temperature >= 0 and np.isfinite(self.temperature), "temperature", "a finite number >= 0"),
            (int(self.top_k) == self.top_k and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1] (1 disables it)"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1] (0 disables it)"),
            # jax.random.key takes 32-bit seeds without aliasing (2**32 would equal 0).
            (int(self.seed) == self.seed and 0 <= self.seed < 2**32, "seed", "an integer in [0, 2**32)"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise SamplingError(f"{name}={getattr(self, name)!r} is invalid; it must be {expected}")

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken."""
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """True when a top-k/top-p/min-p filter is active (these need the sorted distribution)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


# Most alternatives a request may ask log-probabilities for (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


@runtime_checkable
class TokenConstraint(Protocol):
    """Which tokens one request may generate next (a grammar's matcher, e.g. llguidance's).

    The serving engine calls ``next_mask()`` before every step that samples the request's next
    token, applies it to the logits inside the compiled sampling step, then ``accept(token)``
    with the token drawn; when ``is_terminated()`` turns true after an ``accept`` the request
    finishes with finish_reason "stop".
    """

    def next_mask(self):
        """The allowed next tokens: a numpy uint32 (or int32) array [ceil(V/32)], bit ``t % 32``
        of word ``t // 32`` set when token t is allowed (``llguidance.numpy.allocate_token_bitmask``'s
        layout); at least one bit must be set."""

    def accept(self, token: int) -> None:
        """Advance past ``token``, which the engine generated (the last mask allowed it)."""

    def is_terminated(self) -> bool:
        """Whether the constrained output is complete (the request then stops)."""


def mask_words(vocab_size: int) -> int:
    """Length of the packed bitmask of a ``vocab_size``-token vocabulary (32 tokens a word)."""
    return -(-vocab_size // 32)


def allow_all(vocab_size: int) -> np.ndarray:
    """The packed bitmask that allows every token (rows without a constraint in a masked batch)."""
    return np.full(mask_words(vocab_size), 0xFFFFFFFF, np.uint32)


def unpack_mask(mask: jax.Array, vocab_size: int) -> jax.Array:
    """Packed bitmasks [B, ceil(V/32)] (uint32) -> allowed [B, V] (bool)."""
    token = jnp.arange(vocab_size)
    words = jnp.take(mask.astype(jnp.uint32), token // 32, axis=-1)
    return (words >> (token % 32).astype(jnp.uint32)) & 1 == 1


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` most likely tokens of each row of ``logits`` [B, V] and their log-probabilities
    under the unmodified distribution (before temperature, filters or masks), most likely first:
    ids [B, k] (int32), log-probabilities [B, k]."""
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return ids.astype(jnp.int32), values


class SamplingMode(enum.Enum):
    """The static part of sampling: which code path the compiled step contains."""

    GREEDY = "greedy"
    PLAIN = "plain"  # temperature only
    FILTERED = "filtered"  # temperature + top-k/top-p/min-p


@struct.dataclass
class RowSampling:
    """Per-row sampling parameters as device arrays [B]."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    keys: jax.Array  # [B] PRNG keys


def in_flight_pick(mode: SamplingMode):
    """``pipeline_inflight.pipeline_decode``'s ``pick`` for rows sampled on the device: its ``pick_args``
    are the rows' temperature, top_k, top_p, min_p, raw key data and token counts [B]; micro-batch
    m's rows at their n-th in-flight step are sampled as a plain step at index count + n samples
    them (:func:`sample`), so in-flight decoding gives the same tokens."""
    def pick(logits, m, n, mb, temperature, top_k, top_p, min_p, key_data, counts):
        mine = [jax.lax.dynamic_slice_in_dim(x, m * mb, mb) for x in (temperature, top_k, top_p, min_p, key_data,
                                                                      counts)]
        return sample(logits, RowSampling(*mine[:4], jax.random.wrap_key_data(mine[4])), mine[5] + n, mode)

    return pick


def batch_sampling(params: list[SamplingParams]) -> tuple[SamplingMode, RowSampling]:
    """Stack per-row parameters and choose the cheapest mode that serves every row."""
    if all(p.greedy for p in params):
        mode = SamplingMode.GREEDY
    elif any(p.filtered for p in params):
        mode = SamplingMode.FILTERED
    else:
        mode = SamplingMode.PLAIN
    rows = RowSampling(
        temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
        top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
        top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
        min_p=jnp.asarray([p.min_p for p in params], jnp.float32),
        keys=jnp.stack([jax.random.key(int(p.seed)) for p in params]),
    )
    return mode, rows


def filters_on(rows: RowSampling) -> jax.Array:
    """[B] bool: which rows ask for any of top-k, top-p, min-p (the others draw unfiltered)."""
    return (rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0)


def filter_sorted(sorted_logits: jax.Array, rows: RowSampling) -> jax.Array:
    """Mask (to -inf) the tail of descending-sorted, temperature-scaled logits [B, V] as each
    row's top-k, top-p and min-p say (used by :func:`sample` and by speculative decoding)."""
    V = sorted_logits.shape[-1]
    rank = jnp.arange(V)[None, :]
    top_k = jnp.where(rows.top_k > 0, rows.top_k, V)[:, None]
    x = jnp.where(rank < top_k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    x = jnp.where((mass_before < rows.top_p[:, None]) | (rank == 0), x, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)
    # min-p: drop tokens less likely than min_p times the most likely one.
    return jnp.where(probs >= rows.min_p[:, None] * probs[:, :1], x, -jnp.inf)


def sample(logits: jax.Array, rows: RowSampling, step: jax.Array, mode: SamplingMode,
           mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row from fp32 ``logits`` [B, V].

    Returns the tokens [B] and their log-probabilities under the unmodified distribution [B]
    (before temperature, filters and mask, as vLLM reports them by default). ``step`` (a scalar,
    or one per row [B]) is folded into each row's key so every position draws fresh randomness.
    ``mask``: packed bitmasks [B, ceil(V/32)] (see :class:`TokenConstraint`); disallowed tokens
    get -inf logits before temperature and filters (an all-ones row leaves its logits as they
    are). A row's token depends only on its own logits, parameters, key, step and mask, never on
    the other rows or on ``mode`` (as long as the mode serves the row): rows without filters
    draw from the unsorted logits in either sampled mode.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    if mask is not None:
        logits = jnp.where(unpack_mask(mask, logits.shape[-1]), logits, -jnp.inf)
    if mode is SamplingMode.GREEDY:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        temperature = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
        scaled = logits / temperature
        steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), rows.temperature.shape)
        keys = jax.vmap(jax.random.fold_in)(rows.keys, steps)
        tokens = jax.vmap(jax.random.categorical)(keys, scaled)
        if mode is SamplingMode.FILTERED:
            order = jnp.argsort(-scaled, axis=-1)
            sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
            choice = jax.vmap(jax.random.categorical)(keys, filter_sorted(sorted_logits, rows))
            tokens = jnp.where(filters_on(rows), jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0], tokens)
        # Rows that asked for greedy inside a sampled batch still get their argmax.
        tokens = jnp.where(rows.temperature > 0, tokens, jnp.argmax(logits, axis=-1))
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
