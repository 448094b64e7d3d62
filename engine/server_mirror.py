"""Multi-process ``dayzero serve``: process 0 serves HTTP, every other process runs the same steps.

A model on a mesh that spans processes is one multi-controller JAX program: every process must
issue the same device computations in the same order. Only process 0 (the leader) hears clients,
so the leader's step loop drives a :class:`LeaderServing` instead of the serving engine itself.
It forwards each call to its own engine and records the ones that change the engine's state
(``submit``, ``cancel``, ``completion``); before each ``step`` it broadcasts the record and the
command through JAX's own runtime (``multihost_utils.broadcast_one_to_all``, a collective over
every device), and the other processes (:func:`follow`) replay it on their engines and step too.
Their engines then hold the same requests in the same slots, and sample the same tokens: sampling
depends only on a request's own seed, parameters and logits (the seed of a request without one is
drawn by the leader's HTTP layer, so it is in the record). Images travel in the record as PNG:
lossless, so every process decodes the same pixels (a large image makes its step's record a large
second broadcast).

What travels per step: one broadcast of ``FIRST`` bytes (the payload's length, the command, and
the JSON payload of what changed when it fits), and a second broadcast, padded to a power of two
so that it compiles once per size class, for a payload that does not fit (long prompts). Structured
output travels as the grammar text; each follower compiles its own matcher over the same
tokenizer, so its masks equal the leader's. While no request runs, the leader sends a heartbeat
every ``HEARTBEAT_S`` so the followers do not sit in one collective for long (and records such
as a hand-over reach them). The leader's last message is ``stop``: the followers return and their
processes exit 0. Followers ignore SIGINT and SIGTERM: the leader decides when the run ends (a
follower whose leader died is ended by the runtime's heartbeat timeout, see
``sharding/distributed.py``).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from dayzero.engine.sampling import SamplingParams
from dayzero.engine.serving import ConstraintError

log = logging.getLogger("dayzero.serve")

HEARTBEAT_S = 1.0
FIRST = 1024  # bytes of the first broadcast of a step: a 5-byte header and the start of the payload
_IDLE, _STEP, _STOP = 0, 1, 2
_HEADER = 5  # payload length (uint32, little-endian), command (uint8)


class MirrorError(RuntimeError):
    """A follower's engine no longer matches the leader's (a bug; the run cannot go on)."""


def _broadcast(values: np.ndarray) -> np.ndarray:
    """Process 0's ``values`` in every process (one collective over all devices)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def _padded_size(n: int) -> int:
    """A buffer for ``n`` bytes: a power of two (the broadcast compiles once per size class)."""
    return 1 << max(0, n - 1).bit_length()


def send(command: int, ops: list) -> None:
    """Leader: broadcast one step's record (``ops``) and ``command``: one broadcast of ``FIRST``
    bytes, and a second one only for a payload that does not fit in it."""
    payload = json.dumps(ops, separators=(",", ":")).encode() if ops else b""
    first = np.zeros(FIRST, np.uint8)
    first[:4] = np.frombuffer(np.uint32(len(payload)).tobytes(), np.uint8)
    first[4] = command
    inline = payload[: FIRST - _HEADER]
    first[_HEADER:_HEADER + len(inline)] = np.frombuffer(inline, np.uint8)
    _broadcast(first)
    if len(payload) > len(inline):
        buffer = np.zeros(_padded_size(len(payload)), np.uint8)
        buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
        _broadcast(buffer)


def receive() -> tuple[int, list]:
    """Follower: the leader's next (command, ops), as :func:`send` sent them."""
    first = _broadcast(np.zeros(FIRST, np.uint8))
    size, command = int(first[:4].view(np.uint32)[0]), int(first[4])
    if not size:
        return command, []
    if size <= FIRST - _HEADER:
        payload = bytes(first[_HEADER:_HEADER + size])
    else:
        payload = bytes(_broadcast(np.zeros(_padded_size(size), np.uint8))[:size])
    return command, json.loads(payload)


def _sampling_record(sampling: SamplingParams) -> dict:
    return dataclasses.asdict(sampling)


def _png_base64(image) -> str:
    """An image input (anything ``load_image`` takes; the engine accepted it) as base64 PNG of
    its RGB pixels, which every process decodes to the same array."""
    from dayzero.engine.images import load_image

    out = io.BytesIO()
    load_image(image).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


class LeaderServing:
    """Process 0's serving engine as the step loop sees it: the engine's interface, each state
    change recorded and broadcast before the next step (see the module docstring)."""

    def __init__(self, serving):
        self._serving = serving
        self._ops: list = []
        self._last_sent = time.monotonic()
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        """Everything read-only (``engine``, ``config``, ``replicas``, ``has_work``,
        ``metrics``, ...) is the engine's own."""
        return getattr(self._serving, name)

    def submit(self, prompt, *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               ignore_eos: bool = False, top_logprobs: int = 0, constraint=None, images=None) -> int:
        """``ServingEngine.submit`` (token ids only), recorded once the engine accepted it. A
        constraint must carry its grammar text (other processes rebuild it from that); images
        travel as PNG (lossless: every process decodes the same pixels)."""
        grammar = None if constraint is None else getattr(constraint, "grammar", None)
        if constraint is not None and not isinstance(grammar, str):
            # Checked before the engine queues it: a request only this process held would split the run.
            raise MirrorError(f"constraint {constraint!r} has no grammar text; multi-process serving needs a "
                              "GrammarConstraint (engine/grammar.py)")
        extra = {} if images is None else {"images": images}
        rid = self._serving.submit(prompt, max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=ignore_eos,
                                   top_logprobs=top_logprobs, constraint=constraint, **extra)
        record = ["submit", rid, [int(t) for t in prompt], max_new_tokens, _sampling_record(sampling), ignore_eos,
                  top_logprobs, grammar]
        self._ops.append(record + ([] if images is None else [[_png_base64(image) for image in images]]))
        return rid

    def cancel(self, request_id: int) -> bool:
        """``ServingEngine.cancel``, recorded."""
        self._ops.append(["cancel", request_id])
        return self._serving.cancel(request_id)

    def completion(self, request_id: int):
        """``ServingEngine.completion``, recorded (the followers drop theirs)."""
        self._ops.append(["completion", request_id])
        return self._serving.completion(request_id)

    def step(self) -> list:
        """Send the record and ``step`` to the followers, then step here."""
        self._send(_STEP)
        return self._serving.step()

    def idle(self) -> None:
        """Called while no request runs: a heartbeat every ``HEARTBEAT_S``, sooner if anything
        was recorded."""
        if self._ops or time.monotonic() - self._last_sent >= HEARTBEAT_S:
            self._send(_IDLE)

    def close(self) -> None:
        """Send the last record and ``stop``: the followers return. Idempotent."""
        if not self._closed:
            self._closed = True
            self._send(_STOP)

    def _send(self, command: int) -> None:
        import jax

        ops, self._ops = self._ops, []
        try:
            send(command, ops)
        except jax.errors.JaxRuntimeError as e:  # a follower is gone: the run cannot serve any more
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            print(f"dayzero: error: serve: another process of the run is gone ({first}); stopping", file=sys.stderr,
                  flush=True)
            os._exit(1)
        self._last_sent = time.monotonic()


def ignore_signals() -> None:
    """A follower ignores SIGINT and SIGTERM from the start (loading and compiling included):
    process 0 ends the run (see the module docstring)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def follow(serving, grammars) -> int:
    """A follower's serve loop: replay the leader's records on ``serving`` and step with it until
    the leader says stop; returns the number of steps run. ``grammars``: the
    :class:`~dayzero.engine.grammar.Grammars` that rebuilds constraints (None without a tokenizer)."""
    ignore_signals()
    steps = 0
    while True:
        command, ops = receive()
        for op in ops:
            _replay(serving, grammars, op)
        if command == _STOP:
            return steps
        if command == _STEP:
            steps += 1
            try:
                serving.step()
            except ConstraintError:
                pass  # the leader's engine raised the same and ended the same request
            except Exception:  # noqa: BLE001 - as the leader: a failed step fails its requests, not the run
                log.exception("serving step failed (process 0 reports it to its clients)")


def _replay(serving, grammars, op: list) -> None:
    """Apply one recorded state change to a follower's engine."""
    kind, rid = op[0], op[1]
    if kind == "cancel":
        serving.cancel(rid)
    elif kind == "completion":
        serving.completion(rid)
    elif kind == "submit":
        prompt, max_new_tokens, sampling, ignore_eos, top_logprobs, grammar = op[2:8]
        constraint = None if grammar is None else grammars.from_grammar(grammar)
        # A request with images carries them as base64 PNGs (LeaderServing.submit).
        extra = {"images": [base64.b64decode(image) for image in op[8]]} if len(op) > 8 else {}
        got = serving.submit(prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(**sampling),
                             ignore_eos=ignore_eos, top_logprobs=top_logprobs, constraint=constraint, **extra)
        if got != rid:
            raise MirrorError(f"process 0 submitted request {rid} but this process's engine numbered it {got}; "
                              "the processes' engines have diverged")
    else:
        raise MirrorError(f"unknown record {kind!r} from process 0 (processes of different dayzero versions?)")
