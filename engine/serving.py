"""Continuous batching over a paged KV cache: many requests, one fixed set of decode slots.

    >>> server = ServingEngine(Engine.load(), ServingConfig(slots=8))    # doctest: +SKIP
    >>> a = server.submit("Hello", max_new_tokens=16)                     # doctest: +SKIP
    >>> for event in server.stream(): ...                                  # doctest: +SKIP

Each :meth:`ServingEngine.step`:

1. admits waiting requests (oldest first) while a slot is free and the pool has pages for the
   request's whole prompt (after reusing cached prefix pages) plus one page of growth for every
   running request; the prompt's pages are allocated at admission;
2. gives every decoding request the page its next token needs; when the pool is exhausted it
   preempts the most recently admitted request (its pages are released, it goes back to the
   front of the queue and is recomputed from prompt + generated tokens when readmitted, its
   full pages likely still in the prefix cache);
3. runs one prefill chunk of the oldest request still prefilling (a bounded number of tokens,
   attending to the pages written so far; see ``paged_steps``), sampling its first token when
   the chunk ends its prompt;
4. runs one decode step for every decoding request (packed into a batch of a power of two,
   padding rows masked with no token), samples each row with its own parameters, and emits the
   tokens; finished requests free their slot and pages.

Constrained requests (``submit(constraint=...)``, a ``sampling.TokenConstraint``) are asked for
their mask at the start of every step that samples for them, before any device call (so a bad
mask stops nothing half done), and told each token drawn; the masks are applied inside the
compiled sampling step. A batch with no constrained row samples with the program compiled
without masks. :meth:`ServingEngine.cancel` withdraws a request between steps;
:meth:`ServingEngine.metrics` reports the queue, pool and counters without touching the device.

Models with a fixed-size state per sequence (a linear-attention hybrid's layer states,
DeepSeek-V4's window rings and compressor states) keep it in the request's slot beside its pages.
A slot is reused without a reset: a request admitted to it starts at length 0 and never reads
what an earlier one left there. Their prefix cache needs the states as they were at the end of
the reused prefix: when a prefill chunk ends on a page boundary the slot's states are copied into
a snapshot row (``paging.SnapshotPool``, keyed by the page's hash; a chunk that would run past
the prompt's last page boundary stops there, so that boundary is always copied), and a request
reuses cached pages only up to the last one with a snapshot, which is copied into its slot at
admission.

Host memory is a second tier (``kv_swap.HostSwap``, rows in ``pinned_host`` memory where the
backend has it): a preempted request's pages and slot states are copied there (within
``swap_bytes``) and back at readmission, but for leading pages the device's prefix cache still
holds; and a cached prefix page the pool evicts is copied to a host prefix tier (within
``host_cache_bytes``), where an admission's prefix match continues past the device cache.

A request's tokens do not depend on what else runs: every row computes the same function of its
own inputs, sampling keys come from the request's seed and the index of the token within the
request (never the slot or the step), and recomputation after preemption reproduces the same
cache. Sequences are limited to the model's context, so dynamic-NTK RoPE (whose ``rope_len`` is
shared by a batch) never changes frequencies within a served sequence.
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterator, Sequence

import jax
import numpy as np

from dayzero.engine.generate import Completion, Engine, GenerationError, check_max_new_tokens
from dayzero.engine.paged_steps import PagedSteps, RowParams, Sampled, ServingConfig, key_data, sampling_mode
from dayzero.engine.paging import PagePool, PoolExhausted, SnapshotPool, page_hashes
from dayzero.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenConstraint, allow_all, mask_words
from dayzero.engine import serving_inflight, serving_spec
from dayzero.engine.kv_swap import HostSwap
from dayzero.engine.serving_images import RequestImages
from dayzero.engine.serving_requests import ConstraintError, Event, ServingStats, _Request

__all__ = ["ConstraintError", "Event", "ServingConfig", "ServingEngine", "ServingStats"]


class ServingEngine:
    """Continuous-batching generation over an :class:`Engine`'s model with a paged KV cache.

    On a mesh with a ``data`` axis > 1 (in one process) the engine made is a
    ``dayzero.engine.replicas.ReplicatedServing``: one such engine per data replica, each with its
    own slots and page pool on its own devices, behind this same interface. ``replicas`` lists
    the engines that serve (``[self]`` otherwise).
    """

    def __new__(cls, engine: Engine, config: ServingConfig = ServingConfig()):
        if cls is ServingEngine:
            from dayzero.engine.replicas import ReplicatedServing, serves_replicas  # it imports this module

            if serves_replicas(engine.placement):
                return super().__new__(ReplicatedServing)
        return super().__new__(cls)

    def __init__(self, engine: Engine, config: ServingConfig = ServingConfig()):
        self.engine = engine
        self.replicas = [self]
        # Run as the engine is (its RunConfig: pages stored as its KV cache, its mesh, its
        # kernels unless ``config.kernels`` names others; see ``ServingConfig.run_for``).
        run = config.run_for(engine.config, engine.run)
        self.config = config.resolve(engine.config, run)
        self.steps = PagedSteps(engine.config, engine.weights, self.config, run, host=engine._host)
        self.draft = serving_spec.draft_pool(self)  # the draft model's or MTP module's page pool, or None
        self.pool = PagePool(self.config.num_pages)  # the pages' bookkeeping
        # Which prefixes' slot states are kept (models with per-slot states and a prefix cache).
        self.snapshots = SnapshotPool(self.config.state_snapshots) if self.steps.snapshots is not None else None
        # Host memory for preempted requests' pages and for the prefix pages the device pool
        # evicts (one process only: a process holds its shards).
        self.swap = self._host_memory()
        self.stats = ServingStats()
        self._ids = itertools.count()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._slots: list[_Request | None] = [None] * self.config.slots
        self._finished: dict[int, _Request] = {}
        self._admissions = itertools.count()
        self._cancelled: set[int] = set()  # withdrawn during the step ``stream`` is handing out

    def _host_memory(self) -> HostSwap | None:
        """The host tier of the pool (swap and host prefix cache), or None when neither is on."""
        c, device = self.config, self.steps.kv_bytes
        budget = device if c.swap_bytes is None else c.swap_bytes
        tier = (device if c.host_cache_bytes is None else c.host_cache_bytes) if c.prefix_cache else 0
        if not (budget or tier) or jax.process_count() > 1:
            return None
        swap = HostSwap(self.steps, budget, tier)
        if swap.prefixes is not None:
            self.pool.on_evict = self._spill
        return swap

    # ---- API -----------------------------------------------------------------------------------

    def submit(self, prompt: str | Sequence[int], *, max_new_tokens: int = 64,
               sampling: SamplingParams = SamplingParams(), chat: bool = False, ignore_eos: bool = False,
               logprobs: bool = False, top_logprobs: int = 0, constraint: TokenConstraint | None = None,
               images: Sequence | None = None) -> int:
        """Queue one request (text or token ids); returns its id. Validation as ``Engine.generate``,
        plus the serving limits (``max_context``).

        ``top_logprobs`` (0..20): each of its Events carries that many most likely tokens with
        their logprobs. ``constraint``: restricts every token it generates (see the module
        docstring); the request stops ("stop") once ``constraint.is_terminated()``.
        ``images`` (multimodal models): the prompt's images (anything ``engine.images.load_image``
        takes), one ``config.vision.image_token_id`` placeholder each in the prompt, as in
        ``Engine.generate``; preprocessed here (a bad image raises :class:`GenerationError`),
        encoded at the request's first prefill chunk.
        """
        return self._enqueue(self._request(prompt, max_new_tokens, sampling, chat, ignore_eos, logprobs,
                                           top_logprobs, constraint, images))

    def _enqueue(self, request: _Request) -> int:
        """Queue a validated request; returns the id it is known by here."""
        self._waiting.append(request)
        return request.id

    def _request(self, prompt, max_new_tokens, sampling, chat, ignore_eos, logprobs, top_logprobs=0,
                 constraint=None, images=None) -> _Request:
        """A validated request (raises :class:`GenerationError` naming the bad value)."""
        check_max_new_tokens(max_new_tokens)
        if not isinstance(sampling, SamplingParams):
            raise GenerationError(f"sampling={sampling!r} is not a SamplingParams")
        if not (isinstance(top_logprobs, int) and 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise GenerationError(f"top_logprobs={top_logprobs!r} is invalid; it must be an integer in "
                                  f"[0, {MAX_TOP_LOGPROBS}]")
        if constraint is not None and not isinstance(constraint, TokenConstraint):
            raise GenerationError(f"constraint={constraint!r} is not a TokenConstraint (it needs next_mask, "
                                  "accept and is_terminated)")
        ids = self.engine.prompt_ids(prompt, chat)
        with_images = None
        if images is not None:
            context = min(self.config.max_context, self.engine.config.max_position_embeddings)
            ids, processed = self.engine.image_prompt(ids, images, max_new_tokens, context)
            with_images = RequestImages.of(ids, processed, self.engine.config.vision.image_token_id)
        self.engine.check_length(ids, max_new_tokens)
        if len(ids) + max_new_tokens > self.config.max_context:
            raise GenerationError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}, more than "
                f"this server's max_context of {self.config.max_context}; shorten the request or "
                "raise max_context")
        return _Request(next(self._ids), list(ids), max_new_tokens, sampling, ignore_eos, logprobs, list(ids),
                        key_data(sampling.seed), top_logprobs, constraint, images=with_images)

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting) or any(r is not None for r in self._slots)

    def stream(self) -> Iterator[Event]:
        """Run steps until every submitted request has finished, yielding each token as it comes.

        Requests submitted while iterating join the running batch.
        """
        while self.has_work:
            self._cancelled = set()
            # A request cancelled while this step's events are handed out gets none of the rest.
            yield from (e for e in self.step() if e.request_id not in self._cancelled)

    def completion(self, request_id: int) -> Completion:
        """The finished request ``request_id``, handed over once (the server then forgets it).

        Raises ``KeyError`` if it has not finished or was already taken.
        """
        r = self._finished.pop(request_id)
        tok = self.engine.tokenizer
        generated = r.tokens[len(r.prompt):]
        return Completion(text=tok.decode(generated) if tok else "", prompt_ids=list(r.prompt),
                          token_ids=generated, finish_reason=r.finish_reason,
                          logprobs=list(r.logprobs) if r.want_logprobs else None)

    def run(self, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int | Sequence[int] = 64,
            sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(), chat: bool = False,
            ignore_eos: bool = False, logprobs: bool = False) -> list[Completion]:
        """Submit every prompt (with shared or per-prompt ``max_new_tokens`` and ``sampling``),
        serve them all concurrently, and return their completions in order."""
        n = len(prompts)
        news = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        params = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        if len(news) != n or len(params) != n:
            raise GenerationError(f"{len(news)} max_new_tokens and {len(params)} sampling settings for {n} prompts")
        # All validated before any is queued: a bad one leaves nothing half-submitted.
        requests = [self._request(p, m, s, chat, ignore_eos, logprobs) for p, m, s in zip(prompts, news, params)]
        ids = [self._enqueue(r) for r in requests]
        for _ in self.stream():
            pass
        return [self.completion(i) for i in ids]

    @property
    def kv_bytes(self) -> int:
        """Bytes of the page pool(s) this engine allocated (every replica's; a draft model's too)."""
        return sum(r.steps.kv_bytes + (r.draft.steps.kv_bytes if r.draft else 0) for r in self.replicas)

    def warmup(self, constrained: bool = False, top_logprobs: bool = False) -> int:
        """Compile every step shape up front (after it, serving compiles nothing); returns the
        number of shapes. ``constrained`` / ``top_logprobs``: also the sampling variants with
        token masks / with top logprobs (else compiled when a batch first needs them)."""
        return sum(r.steps.warmup(constrained, top_logprobs) + (r.swap.warmup() if r.swap else 0)
                   + (r.draft.warmup() if r.draft else 0) for r in self.replicas)

    def cancel(self, request_id: int) -> bool:
        """Stop request ``request_id`` now: it produces no further Event (``stream`` drops the
        rest of the step being handed out), its slot and pages go back to the pool (its full
        pages stay in the prefix cache) and it is forgotten (no ``completion``). True if it was
        queued or running, False if unknown or already finished. Call it between steps."""
        if not self._withdraw(request_id):
            return False
        self._cancelled.add(request_id)
        return True

    def _withdraw(self, request_id: int) -> bool:
        """Remove request ``request_id`` from the queue or its slot (freeing its pages)."""
        for r in self._waiting:
            if r.id == request_id:
                self._waiting.remove(r)
                if r.swapped is not None:
                    self.swap.release(r.swapped)
                break
        else:
            r = next((r for r in self._running() if r.id == request_id), None)
            if r is None:
                return False
            self._free(r)
        self.stats.cancelled += 1
        return True

    def metrics(self) -> dict:
        """Gauges and counters for monitoring (host bookkeeping only, no device sync): requests
        ``waiting`` (queued) and ``running``, ``pages_used`` / ``pages_free`` (free or evictable
        cached), ``prefix_cache_hit_rate`` (of the positions prefill had to provide, the share
        found in the prefix cache), and cumulative ``preemptions``, ``prompt_tokens`` and
        ``generated_tokens`` (over every replica)."""
        stats, engines = self.stats, self.replicas
        return dict(
            waiting=sum(len(e._waiting) for e in engines), running=sum(len(e._running()) for e in engines),
            pages_used=sum(e.pool.in_use for e in engines), pages_free=sum(e.pool.available for e in engines),
            prefix_cache_hit_rate=stats.cached_tokens / stats.lookup_tokens if stats.lookup_tokens else 0.0,
            preemptions=stats.preemptions, prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Admit, allocate, run one prefill chunk and one decode step; the tokens produced.

        Raises :class:`ConstraintError` (before any device call) if a constrained request's mask
        is unusable; that request is cancelled and the engine can step on.
        """
        self._admit()
        decoding = self._grow_decoding()
        events = []
        if self.pool is not None:
            self.stats.peak_pages = max(self.stats.peak_pages, self.pool.in_use)
        prefill = min((r for r in self._running() if r.prefilling), key=lambda r: r.admitted, default=None)
        samples_prefill = prefill is not None and prefill.computed + self._chunk(prefill)[2] >= len(prefill.tokens)
        masks = self._masks(([prefill] if samples_prefill else []) + decoding)
        if prefill is not None:
            events += self._prefill_chunk(prefill, masks)
        if decoding:
            events += self._decode(decoding, masks)
        return events

    def _running(self) -> list[_Request]:
        return [r for r in self._slots if r is not None]

    def _admit(self) -> None:
        while self._waiting and None in self._slots:
            r = self._waiting[0]
            if not self._allocate(r):
                return
            self._waiting.popleft()
            if r.swapped is None:
                self.stats.cached_tokens += r.computed
                self.stats.lookup_tokens += r.prefill_target
            if r.admitted < 0:  # first admission (not a readmission after preemption)
                self.stats.prompt_tokens += len(r.prompt)
            r.admitted = next(self._admissions)
            r.slot = self._slots.index(None)
            self._slots[r.slot] = r
            if r.restore is not None:
                self.steps.restore(r.slot, r.restore)
                self.stats.snapshots_restored += 1
                r.restore = None
            if r.swapped is not None:  # its pages and states back from the host, but those still cached
                self.swap.into(r.swapped, r.pages, r.slot, skip=r.registered)
                self.stats.swapped_in += 1
                self.stats.swapped_tokens += r.computed - r.registered * self.config.page_size
                r.swapped = None

    def _allocate(self, r: _Request) -> bool:
        """Give ``r`` the pages of its whole prompt (its cached prefix's first: from the device's
        prefix cache, then copied from the host tier's), if the pool has them with one page of
        growth left for every running request; whether it did."""
        if r.swapped is not None:
            return self._allocate_swapped(r)
        matched, hosted = [], []
        if self.config.prefix_cache:
            r.hashes = page_hashes(self._hashed(r), self.config.page_size, r.hashes)
            # Leave at least one token to compute: its logits give the next token.
            wanted = r.hashes[: (len(r.tokens) - 1) // self.config.page_size]
            matched = self.pool.match_prefix(wanted)
            if self.swap is not None:
                hosted = self.swap.match(wanted[len(matched):])
            matched, hosted = self._restorable(r, matched, hosted)
        needed = self.config.pages_for(len(r.tokens)) - len(matched)
        if self.pool.available < needed + len(self._running()):
            self.pool.release(matched)
            r.restore = None
            return False
        r.pages = matched + self.pool.allocate_many(needed)
        reused = len(matched) + len(hosted)
        if hosted:  # copied into fresh pages, which then hold those prefixes in the device cache too
            self.swap.fill(r.pages[len(matched) : reused], hosted)
            for i in range(len(matched), reused):
                self.pool.register(r.pages[i], r.hashes[i])
            self.stats.host_cached_tokens += len(hosted) * self.config.page_size
        r.registered = reused
        r.computed = reused * self.config.page_size
        return True

    def _allocate_swapped(self, r: _Request) -> bool:
        """``_allocate`` for a request readmitted after a swap: its leading full pages still in
        the device's prefix cache are reused (they hold what its swapped copies hold), fresh pages
        take the rest and are filled from the host at admission (``swap.into``)."""
        matched = []
        if self.config.prefix_cache:
            matched = self.pool.match_prefix(r.hashes[: r.swapped.computed // self.config.page_size])
        needed = self.config.pages_for(len(r.tokens)) - len(matched)
        if self.pool.available < needed + len(self._running()):
            self.pool.release(matched)
            return False
        r.pages = matched + self.pool.allocate_many(needed)
        r.computed, r.registered = r.swapped.computed, len(matched)
        return True

    def _restorable(self, r: _Request, matched: list[int], hosted: list) -> tuple[list[int], list]:
        """The leading ``matched`` pages and then ``hosted`` rows ``r`` can reuse: all of them, or
        with per-slot states up to the last page whose states have a snapshot (set as
        ``r.restore``; the other pages released). Snapshots stay on the device: the host tier
        holds pages only, which a hybrid reuses only up to a boundary with a snapshot."""
        if self.snapshots is None:
            return matched, hosted
        keep = next((k for k in range(len(matched) + len(hosted), 0, -1)
                     if self.snapshots.lookup(r.hashes[k - 1]) is not None), 0)
        self.pool.release(matched[keep:])
        r.restore = self.snapshots.lookup(r.hashes[keep - 1]) if keep else None
        return matched[:keep], hosted[: max(0, keep - len(matched))]

    def _spill(self, evicted: list[tuple[int, bytes]]) -> None:
        """``pool.on_evict``: copy the evicted prefix pages to the host prefix tier."""
        copied = self.swap.spill(evicted)
        self.stats.host_spilled_pages += copied
        self._count_host(copied)

    def _count_host(self, pages: int) -> None:
        self.stats.host_pages += pages
        self.stats.pinned_host_pages += pages * (self.swap.kind == "pinned_host")

    def _grow_decoding(self) -> list[_Request]:
        """Give each decoding request a page for its next token, preempting when the pool is
        out; returns the decoding requests still running."""
        for r in sorted(self._running(), key=lambda r: r.admitted):
            if r.slot is None or r.prefilling:  # preempted meanwhile, or not decoding yet
                continue
            while len(r.pages) * self.config.page_size <= r.computed:
                try:
                    r.pages.append(self.pool.allocate())
                except PoolExhausted:
                    victim = max(self._running(), key=lambda q: q.admitted)
                    self._preempt(victim)
                    if victim is r:
                        break
        return [r for r in self._running() if not r.prefilling]

    def _preempt(self, r: _Request) -> None:
        """Free ``r``'s pages and slot; it goes to the front of the queue, its pages and slot
        states copied to host memory if they fit the swap budget, else to be recomputed (into
        whichever slot it gets next)."""
        if self.swap is not None and r.computed:
            r.swapped = self.swap.out(r.pages[: self.config.pages_for(r.computed)], r.computed, r.slot)
            self.stats.swapped_out += r.swapped is not None
            self._count_host(0 if r.swapped is None else r.swapped.num_pages)
        self._free(r)
        r.computed, r.registered = 0, 0
        self._waiting.appendleft(r)
        self.stats.preemptions += 1

    # ---- device calls --------------------------------------------------------------------------

    def _tables(self, requests: list[_Request], rows: int) -> np.ndarray:
        """Full-width block tables [rows, W] of ``requests`` (then zero rows)."""
        tables = np.zeros((rows, self.config.max_table_pages), np.int32)
        for row, r in enumerate(requests):
            tables[row, : len(r.pages)] = r.pages
        return tables

    def _chunk(self, r: _Request) -> tuple[int, int | None, int]:
        """(T, W, real tokens) of ``r``'s next prefill chunk; with state snapshots, a chunk that
        would pass a page boundary and end mid-page ends at the boundary (a snapshot point)."""
        start, remaining = r.computed, r.prefill_target - r.computed
        T, W = self.config.chunk_shape(start, remaining)
        n = min(T, remaining)
        boundary = (start + n) // self.config.page_size * self.config.page_size
        if self.snapshots is not None and start < boundary < start + n:
            n = boundary - start
            T, W = self.config.chunk_shape(start, n)
        return T, W, n

    def _prefill_chunk(self, r: _Request, masks: dict[int, np.ndarray]) -> list[Event]:
        start = r.computed
        T, W, n = self._chunk(r)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n] = r.tokens[start : start + n]
        images = None if r.images is None else r.images.chunk(self.engine, r.tokens[: r.prefill_target], start, T)
        mtp = self.draft is not None and self.draft.wants_hidden  # the MTP pool reads the chunk's hidden states
        logits = self.steps.run_step(tokens, np.array([n]), np.array([start]), self._tables([r], 1), W,
                                     np.array([r.slot]), images=images, hidden=mtp)
        logits = self.draft.prefilled(r, start, n, T, W, *logits) if mtp else logits
        self._written(r, n)
        self._snapshot(r)
        self.stats.prefill_tokens += n
        self.stats.prefill_chunks += 1
        self.stats.largest_chunk_scores = max(self.stats.largest_chunk_scores, T * (T + self.config.attended(W)))
        if r.computed < len(r.tokens):  # more prompt to go, or a recomputed request decodes next
            return []
        return self._sample([r], logits, 1, masks)

    def _decode(self, decoding: list[_Request], masks: dict[int, np.ndarray]) -> list[Event]:
        """One token for every decoding request: their rows packed into the smallest decode batch
        (padding rows carry no token), so a step costs what its requests need, not all slots.
        With speculation, a verify step when any row has drafts (``serving_spec``); on a pipeline,
        several steps with micro-batches in flight where the rows allow (``serving_inflight``)."""
        if self.config.speculative is not None:
            drafted = serving_spec.drafts_for(self, decoding)
            if drafted is not None:
                return serving_spec.verify(self, decoding, *drafted)
        n, M = serving_inflight.in_flight_steps(self, decoding)  # a pipeline: n steps in one call
        if n:
            return serving_inflight.decode_in_flight(self, decoding, n, M)
        B = self.config.decode_batch(len(decoding))
        tokens, num_new, lengths, steps, slots = (np.zeros(B, np.int32) for _ in range(5))
        for row, r in enumerate(decoding):
            tokens[row], num_new[row], lengths[row], steps[row] = r.tokens[-1], 1, r.computed, r.generated
            slots[row] = r.slot
        width = self.config.table_width(max(self.config.pages_for(r.computed + 1) for r in decoding))
        # Rows after an image prompt are shifted (M-RoPE); a batch with none runs the plain step.
        deltas = np.array([r.images.rope_delta if r.images else 0 for r in decoding] + [0] * (B - len(decoding)),
                          np.int32)
        logits = self.steps.run_step(tokens[:, None], num_new, lengths, self._tables(decoding, B), width, slots,
                                     rope_deltas=deltas if deltas.any() else None)
        for r in decoding:
            self._written(r, 1)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(decoding)
        return self._sample(decoding, logits, B, masks)

    def _sample(self, requests: list[_Request], logits, B: int, masks: dict[int, np.ndarray]) -> list[Event]:
        """Sample the next token of each of ``requests`` (the first rows of ``logits`` [B, V]),
        each with its own parameters, key, token index and mask (from ``masks``, by request id:
        a batch with none runs the unmasked program), and emit them."""
        params = [r.params for r in requests]
        steps = np.zeros(B, np.int32)
        steps[: len(requests)] = [r.generated for r in requests]
        rows = RowParams.of(params, [r.key for r in requests], B)
        packed = None
        if any(r.id in masks for r in requests):
            packed = np.tile(allow_all(self.engine.config.vocab_size), (B, 1))
            for row, r in enumerate(requests):
                if r.id in masks:
                    packed[row] = masks[r.id]
        top = self.steps.top_width(max(r.top_logprobs for r in requests))
        out = self.steps.sample(logits, rows, steps, sampling_mode(params), packed, top)
        return [self._emit(r, out, row) for row, r in enumerate(requests)]

    def _masks(self, requests: list[_Request]) -> dict[int, np.ndarray]:
        """The next-token masks of the constrained ``requests`` (by request id), checked: a
        request whose mask is unusable is cancelled and :class:`ConstraintError` raised."""
        V = self.engine.config.vocab_size
        masks = {}
        for r in requests:
            if r.constraint is None:
                continue
            mask = np.asarray(r.constraint.next_mask())
            problem = None
            if mask.dtype not in (np.uint32, np.int32) or mask.size != mask_words(V):
                problem = (f"a mask of shape {mask.shape} and dtype {mask.dtype}; it must be uint32 or int32 "
                           f"[{mask_words(V)}] (ceil(vocab_size / 32), vocab_size={V})")
            elif not np.unpackbits(mask.reshape(-1).view(np.uint8), bitorder="little")[:V].any():
                problem = "a mask that allows no token"
            if problem is not None:
                self.cancel(r.id)
                raise ConstraintError(r.id, f"the constraint of request {r.id} gave {problem}; the request "
                                            "was cancelled")
            masks[r.id] = mask.reshape(-1).view(np.uint32)
        return masks

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _written(self, r: _Request, n: int) -> None:
        """``n`` more positions of ``r`` are in its pages; enter newly full pages in the prefix cache."""
        r.computed += n
        if not self.config.prefix_cache:
            return
        full = r.computed // self.config.page_size
        if full > r.registered:
            r.hashes = page_hashes(self._hashed(r)[: full * self.config.page_size], self.config.page_size,
                                   r.hashes[:full])
            for i in range(r.registered, full):
                self.pool.register(r.pages[i], r.hashes[i])
            r.registered = full

    @staticmethod
    def _hashed(r: _Request) -> list[int]:
        """What ``r``'s pages are hashed over: its tokens, image placeholders keyed by their images."""
        return r.tokens if r.images is None else r.images.hash_tokens(r.tokens)

    def _snapshot(self, r: _Request) -> None:
        """After a prefill chunk: with state snapshots, copy ``r``'s slot states if the chunk ended
        on a page boundary whose states no snapshot holds yet."""
        full, partial = divmod(r.computed, self.config.page_size)
        if self.snapshots is None or partial or not full:
            return
        row = self.snapshots.claim(r.hashes[full - 1])
        if row is not None:
            self.steps.snapshot(r.slot, row)
            self.stats.snapshots_taken += 1

    def _emit(self, r: _Request, out: Sampled, row: int) -> Event:
        """Append row ``row`` of ``out`` to ``r`` (telling its constraint), finish ``r`` if that
        ends it; its Event."""
        token, logprob = int(out.tokens[row]), float(out.logprobs[row])
        r.tokens.append(token)
        r.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        if r.constraint is not None:
            r.constraint.accept(token)
        if not r.ignore_eos and token in self.engine.eos_ids:
            r.finish_reason = "stop"
        elif r.constraint is not None and r.constraint.is_terminated():
            r.finish_reason = "stop"
        elif r.generated >= r.max_new_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            self._free(r)
            self._finished[r.id] = r
        top = ()
        if r.top_logprobs:
            top = tuple((int(t), float(v)) for t, v in zip(out.top_ids[row, : r.top_logprobs],
                                                           out.top_logprobs[row, : r.top_logprobs]))
        return Event(r.id, token, logprob, r.finish_reason, top)

    def _free(self, r: _Request) -> None:
        """Give ``r``'s pages and slot back (its registered full pages stay in the prefix cache)."""
        self.pool.release(r.pages)
        r.pages = []
        self._slots[r.slot] = None
        r.slot = None
