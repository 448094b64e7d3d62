"""The step loop of ``dayzero serve``: one thread owns the (not thread-safe) serving engine.

HTTP handlers never touch the engine. They put submissions and cancellations into a thread-safe
inbox that the loop drains between steps; the loop runs ``ServingEngine.step``, turns each
request's tokens into text (incrementally, holding back any tail that could begin a stop string,
cutting at a stop string and cancelling the request in the engine when one appears) and hands
each update to the request's ``sink`` (which, in the server, forwards it into the handler's
asyncio queue with ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from dayzero.engine.sampling import SamplingParams
from dayzero.engine.server_metrics import ServerMetrics
from dayzero.engine.serving import ConstraintError
from dayzero.engine.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("dayzero.serve")


@dataclasses.dataclass
class Update:
    """What one request produced since its last update. ``tokens``: (id, logprob, top) triples,
    top a tuple of (id, logprob). ``finish_reason``: "stop", "length", or "error" (``error`` says
    why) on the last update. ``accepted`` alone: the engine queued the request."""

    index: int
    text: str = ""
    tokens: list[tuple[int, float, tuple]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    accepted: bool = False


@dataclasses.dataclass
class Submission:
    """One engine request (one choice of an HTTP request); ``sink`` receives its updates in the
    loop's thread."""

    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    sink: Callable[[Update], None]
    stops: list[str] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0
    constraint: Any = None
    images: list | None = None  # the prompt's images (one placeholder each in ``prompt_ids``)
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    request_id: int | None = None  # the engine's, once submitted
    cancelled: bool = False


class TextStream:
    """Incremental detokenization with stop strings: text that could still turn into a stop
    string is held back; a stop string ends the text before it and is never emitted."""

    def __init__(self, tokenizer: Tokenizer | None, stops: list[str]):
        self._decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self._stops = stops
        self._held = ""

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; returns (text now final, whether a stop string was hit)."""
        return self._release(self._decoder.push(token) if self._decoder else "", final=False)

    def finish(self) -> str:
        """The text held back, once the request has ended without a stop string."""
        text, _ = self._release(self._decoder.flush() if self._decoder else "", final=True)
        return text

    def _release(self, delta: str, final: bool) -> tuple[str, bool]:
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        keep = 0 if final else self._possible_start(text)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep], False

    def _possible_start(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


@dataclasses.dataclass
class _Live:
    sub: Submission
    text: TextStream
    tokens: int = 0
    first: float | None = None


class StepLoop:
    """Drives a ``ServingEngine`` from one thread; submissions and cancellations from any thread.

    ``capacity``: most engine requests outstanding at once (running + queued); ``reserve``
    refuses more (the server answers 429). A ``serving`` with ``idle()`` and ``close()`` (the
    multi-process leader, ``server_mirror.LeaderServing``) has them called while no request runs
    and once the loop ends.
    """

    def __init__(self, serving, tokenizer: Tokenizer | None, metrics: ServerMetrics | None, capacity: int):
        self.serving = serving
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._capacity = capacity
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._live: dict[int, _Live] = {}
        self._snapshot: dict[str, Any] = self._engine_metrics()
        self._thread = threading.Thread(target=self._run, name="dayzero-step-loop", daemon=True)

    # ---- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop's thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (requests still running are cancelled) and wait for its thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def reserve(self, n: int) -> bool:
        """Count ``n`` more outstanding requests, unless that passes the capacity."""
        with self._lock:
            if self._outstanding + n > self._capacity:
                return False
            self._outstanding += n
            return True

    def submit(self, sub: Submission) -> None:
        """Queue ``sub`` for the engine (reserved before); its updates go to ``sub.sink``."""
        self._inbox.put(("submit", sub))
        self._wake.set()

    def cancel(self, sub: Submission) -> None:
        """Stop ``sub`` (its client has gone); no further update is sent."""
        sub.cancelled = True
        self._inbox.put(("cancel", sub))
        self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        """The engine's metrics as of the last step (plus ``outstanding``)."""
        return dict(self._snapshot, outstanding=self._outstanding)

    @property
    def alive(self) -> bool:
        """Whether the loop's thread runs."""
        return self._thread.is_alive()

    # ---- the loop's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._iterate()
            except ConstraintError as e:  # one request's grammar failed before the step ran: only it ends
                self._fail(e.request_id, str(e))
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                log.exception("serving step failed")
                for rid in list(self._live):
                    self._fail(rid, f"the engine failed: {type(e).__name__}: {e}")
        for live in list(self._live.values()):
            self._end(live, "cancelled", cancel=True)
        if hasattr(self.serving, "close"):
            self.serving.close()

    def _iterate(self) -> None:
        """Take in what the handlers sent, then run one step (or wait briefly for work)."""
        self._drain()
        if not self.serving.has_work:
            self._snapshot = self._engine_metrics()
            if hasattr(self.serving, "idle"):
                self.serving.idle()
            self._wake.wait(0.05)
            self._wake.clear()
            return
        for event in self.serving.step():
            self._deliver(event)
        self._snapshot = self._engine_metrics()

    def _fail(self, request_id: int, message: str) -> None:
        """End one request with an error its client sees (withdrawn from the engine)."""
        live = self._live.get(request_id)
        if live is not None:
            live.sub.sink(Update(live.sub.index, finish_reason="error", error=message))
            self._end(live, "error", cancel=True)

    def _drain(self) -> None:
        while True:
            try:
                kind, sub = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._admit(sub)
            elif sub.request_id in self._live:
                self._end(self._live[sub.request_id], "cancelled", cancel=True)

    def _admit(self, sub: Submission) -> None:
        if sub.cancelled:
            self._release(1)
            return
        extra = {} if sub.images is None else {"images": sub.images}  # text requests: the plain call
        try:
            sub.request_id = self.serving.submit(sub.prompt_ids, max_new_tokens=sub.max_new_tokens,
                                                 sampling=sub.sampling, ignore_eos=sub.ignore_eos,
                                                 top_logprobs=sub.top_logprobs, constraint=sub.constraint, **extra)
        except Exception as e:  # noqa: BLE001 - GenerationError and friends: the client's 400
            self._release(1)
            self._record("error", sub, None, 0)
            sub.sink(Update(sub.index, finish_reason="error", error=str(e)))
            return
        self._live[sub.request_id] = _Live(sub, TextStream(self._tokenizer, sub.stops))
        sub.sink(Update(sub.index, accepted=True))

    def _deliver(self, event) -> None:
        live = self._live.get(event.request_id)
        if live is None:  # a request already ended here (stop string, cancelled)
            return
        live.tokens += 1
        live.first = live.first or time.monotonic()
        text, stopped = live.text.push(event.token)
        finish = "stop" if stopped else event.finish_reason
        if finish is not None and not stopped:
            text += live.text.finish()
        top = tuple(event.top_logprobs)
        update = Update(live.sub.index, text, [(event.token, event.logprob, top)], finish)
        if not live.sub.cancelled:
            live.sub.sink(update)
        if finish is not None:
            self._end(live, finish, cancel=event.finish_reason is None)

    def _end(self, live: _Live, outcome: str, cancel: bool) -> None:
        """Forget a request that ended (``cancel``: also stop it in the engine)."""
        rid = live.sub.request_id
        del self._live[rid]
        if cancel:
            self.serving.cancel(rid)
        else:
            self.serving.completion(rid)  # the engine keeps finished requests until handed over
        self._release(1)
        self._record(outcome, live.sub, live.first, live.tokens)

    def _release(self, n: int) -> None:
        with self._lock:
            self._outstanding -= n

    def _record(self, outcome: str, sub: Submission, first: float | None, tokens: int) -> None:
        if self._metrics is not None:
            self._metrics.finished(outcome, sub.arrival, first, time.monotonic(), tokens)

    def _engine_metrics(self) -> dict[str, Any]:
        return dict(self.serving.metrics())
