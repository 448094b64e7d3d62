"""Decode steps with micro-batches in flight across steps, for the serving engine on a pipeline
(``stage``) mesh.

A plain serving decode step runs the rows through the stages as M micro-batches and drains the
pipeline at its end, since the host samples and schedules between steps: (S - 1) / (M + S - 1)
of the stage-ticks idle. When every decoding row can take several more tokens without the host
(no per-token mask, no top logprobs, room in its pages), one call runs n steps instead
(``pipeline_inflight.pipeline_decode`` on the page pool, each row sampled on the device with its own
parameters, key and token index): the last stage samples micro-batch m's token and hands it back
to stage 0, which starts m's next step while the other micro-batches are in flight, so the
bubble is (S - 1) / (n M + S - 1). Tokens are those n plain steps give (the same keys and
positions). A row that finishes inside the n steps (its EOS) has its later tokens dropped by the
host; their keys and values went to positions past its end in its own pages, which are never
read (only full pages of kept tokens enter the prefix cache). ``IN_FLIGHT_STEPS`` caps n, so a
waiting request is admitted at most that many steps late.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import numpy as np

from dayzero.engine.paged_steps import _STEPS, RowParams, Sampled, _pinned, sampling_mode
from dayzero.engine.sampling import SamplingMode, in_flight_pick
from dayzero.engine.serving_spec import _room
from dayzero.model.pipeline import micro_batches
from dayzero.model.pipeline_inflight import pipeline_decode

if TYPE_CHECKING:
    from dayzero.engine.serving import ServingEngine, _Request

IN_FLIGHT_STEPS = 8  # most steps one call runs (what a newly admitted request may wait)


@functools.partial(jax.jit, static_argnames=("config", "plan", "parallel", "num_micro", "steps", "mode", "layout"),
                   donate_argnames=("pool",))
def _in_flight(weights, first, active, pool, temperature, top_k, top_p, min_p, keys, counts, *, config, plan,
               parallel, num_micro: int, steps: int, mode: SamplingMode, layout=None):
    tokens, logprobs, pool = pipeline_decode(weights, config, plan, parallel, first, pool, steps, num_micro,
                                             in_flight_pick(mode), (temperature, top_k, top_p, min_p, keys, counts),
                                             active)
    return _pinned((tokens, logprobs), None if layout is None else layout[0]), _pinned(
        pool, None if layout is None else layout[1])


def in_flight_steps(server: "ServingEngine", decoding: list["_Request"]) -> tuple[int, int]:
    """(n, M): how many decode steps the next call runs with M micro-batches in flight, or
    (0, 0) for a plain step (no pipeline, a constrained row or one asking for top logprobs, fewer
    than S micro-batches, a row with one token left; latent attention on a mesh with an expert
    axis, which XLA cannot compile in flight on the page pool yet). Takes the pages the n steps
    write into while the pool keeps one in reserve per running request."""
    steps, config = server.steps, server.config
    if steps.stages is None or any(r.constraint is not None or r.top_logprobs for r in decoding):
        return 0, 0
    if steps.config.mla is not None and steps.run.placement.axes.get("expert", 1) > 1:
        return 0, 0  # XLA 0.10.2 aborts compiling it (NOTES.md, "Decode in flight"): plain steps
    S = steps.stages.num_stages
    M = micro_batches(config.decode_batch(len(decoding)), max(config.micro_batches or S, S))
    n = min([IN_FLIGHT_STEPS] + [r.max_new_tokens - r.generated for r in decoding])
    if M < S or n < 2:
        return 0, 0
    n = 1 + min(_room(server, r, n - 1) for r in decoding)
    n = 1 << (n.bit_length() - 1)  # a power of two: a few call shapes (each compiled on first use)
    return (n, M) if n >= 2 else (0, 0)


def decode_in_flight(server: "ServingEngine", decoding: list["_Request"], n: int, M: int) -> list:
    """``n`` decode steps of ``decoding`` in one call with ``M`` micro-batches in flight; each
    row's tokens emitted in order until it finishes. Returns the Events."""
    steps, config = server.steps, server.config
    B = config.decode_batch(len(decoding))
    first, active, lengths, counts = (np.zeros(B, np.int32) for _ in range(4))
    for row, r in enumerate(decoding):
        first[row], active[row], lengths[row], counts[row] = r.tokens[-1], 1, r.computed, r.generated
    width = config.table_width(max(config.pages_for(r.computed + n) for r in decoding))
    params = [r.params for r in decoding]
    rows = RowParams.of(params, [r.key for r in decoding], B)
    mode = sampling_mode(params)
    pool = steps._with_rows(server._tables(decoding, B)[:, :width], lengths)
    key = (steps.config, steps.run, (config.num_pages, config.page_size, config.slots), B, width, M, n, mode)
    args = (steps.weights, *steps._host((first, active)), pool,
            *steps._host((rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.key_data, counts)))
    layout = None if steps.layout is None else (steps.sample_layout, steps.layout)
    static = dict(config=steps.config, plan=steps.stages, parallel=steps.parallel, num_micro=M, steps=n, mode=mode,
                  layout=layout)
    (tokens, logprobs), steps.pool = _STEPS.call(_in_flight, ("in_flight", key), *args, static=static)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    events = []
    for i in range(n):
        for row, r in enumerate(decoding):
            if r.finish_reason is None:
                server._written(r, 1)
                events.append(server._emit(r, Sampled(tokens[i], logprobs[i]), row))
                server.stats.decode_tokens += 1
    server.stats.decode_steps += n
    server.stats.in_flight_calls += 1
    return events
