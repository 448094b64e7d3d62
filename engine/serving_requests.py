"""What the serving engine (``dayzero.engine.serving``) hands out and keeps per request: the
:class:`Event` of each generated token, the cumulative :class:`ServingStats`, the
:class:`ConstraintError` a bad token mask raises, and the per-request bookkeeping
(:class:`_Request`: its tokens, pages, slot, images and swapped-out KV)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dayzero.engine.generate import GenerationError
from dayzero.engine.kv_swap import Swapped
from dayzero.engine.sampling import SamplingParams, TokenConstraint
from dayzero.engine.serving_images import RequestImages


class ConstraintError(GenerationError):
    """A request's :class:`TokenConstraint` gave an unusable mask; the request (``request_id``)
    was cancelled and nothing else of the step ran (step again to go on)."""

    def __init__(self, request_id: int, message: str):
        super().__init__(message)
        self.request_id = request_id


@dataclasses.dataclass(frozen=True)
class Event:
    """One generated token of request ``request_id``; ``finish_reason`` ("stop" or "length")
    is set on the request's last token, None before."""

    request_id: int
    token: int
    logprob: float
    finish_reason: str | None = None
    # The request's top_logprobs most likely (token, logprob) at this position, most likely
    # first (logprobs under the unmodified distribution, as ``logprob``).
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class ServingStats:
    """Counters of a serving engine (cumulative)."""

    prefill_tokens: int = 0  # tokens run through prefill chunks (padding excluded)
    cached_tokens: int = 0  # tokens whose pages came from the prefix cache instead
    prefill_chunks: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    in_flight_calls: int = 0  # calls that ran several decode steps in flight through a pipeline
    preemptions: int = 0
    peak_pages: int = 0  # most pages referenced at once
    largest_chunk_scores: int = 0  # max over prefill chunks of T x attended positions
    prompt_tokens: int = 0  # of the requests admitted (each counted once)
    generated_tokens: int = 0  # tokens emitted
    # Positions prefill had to provide at each admission (the prompt; after a preemption also the
    # tokens generated before it), cached_tokens of them from the prefix cache.
    lookup_tokens: int = 0
    cancelled: int = 0  # requests withdrawn by ``cancel``
    snapshots_taken: int = 0  # slot states copied at page boundaries (models with per-slot states)
    snapshots_restored: int = 0  # ... and copied back into a slot to reuse a cached prefix
    spec_drafted: int = 0  # draft tokens verified (n-gram or draft model) (``ServingConfig.speculative``)
    spec_accepted: int = 0  # ... and accepted
    swapped_out: int = 0  # preempted requests whose pages went to host memory (``kv_swap``)
    swapped_in: int = 0  # ... and came back at readmission
    swapped_tokens: int = 0  # positions copied back from a swap (the rest of its pages: device prefix cache)
    host_spilled_pages: int = 0  # cached prefix pages the device pool evicted, copied to the host prefix tier
    host_cached_tokens: int = 0  # positions copied back from the host prefix tier (part of cached_tokens)
    host_pages: int = 0  # pages copied to host memory (swaps and the host prefix tier) ...
    pinned_host_pages: int = 0  # ... of them held in the pinned_host memory kind (the rest: numpy)


@dataclasses.dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    ignore_eos: bool
    want_logprobs: bool
    tokens: list[int]  # prompt then generated tokens
    key: np.ndarray  # the sampling PRNG key's words, from the seed
    top_logprobs: int = 0  # most likely alternatives reported per token
    constraint: TokenConstraint | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)  # the block table
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of the full pages of tokens
    registered: int = 0  # leading pages entered in the prefix cache
    computed: int = 0  # positions whose keys/values are in the pages
    slot: int | None = None
    restore: int | None = None  # the snapshot row its slot's states come from at admission
    images: RequestImages | None = None  # an image prompt's images (``serving_images``)
    swapped: Swapped | None = None  # its pages on the host while preempted (``kv_swap``)
    admitted: int = -1  # admission order (preemption takes the latest)
    finish_reason: str | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def prefill_target(self) -> int:
        """Positions prefill computes: the whole prompt (its last logits give the first token);
        after a preemption, every token but the last generated one, which decode then feeds."""
        return len(self.tokens) - (1 if self.generated else 0)

    @property
    def prefilling(self) -> bool:
        """Prefill chunks are still to run (else the request decodes)."""
        return self.computed < self.prefill_target
