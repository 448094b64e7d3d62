"""The pipeline-parallel part of :class:`~dayzero.engine.generate.Engine` (a mesh with a
``stage`` axis > 1, ``dayzero.model.pipeline``), kept apart so the engine's module stays about
the one-device and mesh paths every model takes.

:class:`PipelineMixin` is one of ``Engine``'s bases: its methods read the engine's ``run``,
``config``, ``weights``, ``placement``, ``kv_cache``, ``_stages`` (the ``StagePlan``, None off a
pipeline), ``_parallel``, ``_host`` and ``_cache_shardings``. They stack the weights and the
cache into stages, run a step through the stages (draining the pipeline), and decode with
micro-batches in flight across steps (``pipeline_inflight.pipeline_decode``), which fills and
drains the pipeline once per call.
"""

from __future__ import annotations

from typing import Iterator

import jax
import numpy as np

from dayzero.engine.runtime import weight_specs
from dayzero.engine.sampling import RowSampling, SamplingMode, in_flight_pick, sample
from dayzero.model import pipeline, pipeline_inflight
from dayzero.model.cache import empty_from_specs
from dayzero.model.weights import Weights

__all__ = ["PipelineMixin"]


class PipelineMixin:
    """:class:`~dayzero.engine.generate.Engine`'s methods for a pipeline mesh (``stage`` > 1)."""

    def _check_pipeline_request(self, speculative, images) -> None:
        """Raise ``GenerationError`` for a request a pipelined engine cannot serve yet (speculative
        decoding, images); a no-op off a pipeline."""
        from dayzero.engine.generate import GenerationError  # it imports this module

        if self._stages is not None and (speculative is not None or images is not None):
            raise GenerationError("a pipelined engine (--mesh stage=N) does not take speculative decoding or images "
                                  "yet; drop the stage axis for those requests")

    def _staged(self, weights: Weights, specs) -> pipeline.StagedWeights:
        """The weights stacked into pipeline stages on the placement's ``stage`` axis
        (``dayzero.model.pipeline``); what it cannot pipeline was refused by ``runtime.resolve_run``."""
        run = self.run
        self._stages = pipeline.plan_stages(specs, run.placement.axes["stage"])
        shardings = run.placement.shardings(pipeline.staged_specs(specs, self._stages))
        return jax.jit(pipeline.stage_weights, static_argnums=1, out_shardings=shardings)(weights, self._stages)

    def _replaced(self, weights: pipeline.StagedWeights) -> pipeline.StagedWeights:
        """Weights staged already (a data replica of a pipeline engine) placed on this engine's mesh."""
        specs = weight_specs(self.config, self.run, weights.outer.lm_head is not None)
        return jax.device_put(weights, self.run.placement.shardings(pipeline.staged_specs(specs, self._stages)))

    def _staged_cache_shardings(self, batch: int, max_len: int):
        """The staged cache's shardings (each stage's layers stacked on its devices)."""
        specs = pipeline.staged_cache_specs(self.config, self._stages, batch, max_len, self.kv_cache)
        return self.placement.shardings(specs)

    def _staged_cache(self, batch: int, max_len: int) -> pipeline.StagedKVCache:
        """An empty staged cache for ``batch`` rows of ``max_len`` positions, laid out on the mesh."""
        return empty_from_specs(pipeline.staged_cache_specs, self.config, self._stages, batch, max_len, self.kv_cache,
                                self.weights.outer.embed.dtype, shardings=self._cache_shardings(batch, max_len))

    def _start_pipeline(self) -> None:
        """Set ``micro_batches`` (1 off a pipeline) and, on one, ``_decode_loop``: the jitted
        in-flight decode (``pipeline_inflight.pipeline_decode``) of ``steps`` steps of every row
        from ``first`` [B], each row sampled on the device as a plain step samples it; the cache
        is donated."""
        # Micro-batches per step (at most; a divisor of the batch): more shrink the bubble,
        # (S - 1) / (M + S - 1) of the stage-ticks, but cut the batch into smaller matmuls.
        self.micro_batches = 1 if self._stages is None else self._stages.num_stages
        if self._stages is None:
            return
        config, stages, parallel = self.config, self._stages, self._parallel

        def decode(w, first, cache, rows, counts, steps, num_micro, mode):
            pick_args = (rows.temperature, rows.top_k, rows.top_p, rows.min_p, jax.random.key_data(rows.keys), counts)
            return pipeline_inflight.pipeline_decode(w, config, stages, parallel, first, cache, steps, num_micro,
                                                     in_flight_pick(mode), pick_args)

        self._decode_loop = jax.jit(decode, static_argnames=("steps", "num_micro", "mode"), donate_argnums=(2,))

    def _pipeline_step(self, weights, tokens, num_new, rows: RowSampling, step, mode: SamplingMode, cache,
                       hidden: bool = False) -> tuple:
        """One forward through the stages (``pipeline.pipeline_forward``, the batch cut into
        micro-batches) then sampling: the next tokens [B] and log-probabilities [B], replicated,
        and what ``pipeline.append_staged`` writes. ``hidden`` (the MTP drafter's hidden states)
        is refused: ``Engine.generate`` refuses speculation on a pipeline before it gets here."""
        if hidden:
            raise NotImplementedError("a pipelined step does not return hidden states (MTP speculation); "
                                      "drop the stage axis of the mesh")
        num_micro = pipeline.micro_batches(tokens.shape[0], self.micro_batches)
        logits, new = pipeline.pipeline_forward(weights, self.config, self._stages, self._parallel, tokens, cache,
                                                num_new, num_micro)
        next_tokens, logprobs = sample(logits, rows, step, mode)
        replicated = self._parallel.placement.replicated()
        return (*jax.lax.with_sharding_constraint((next_tokens, logprobs), replicated), new)

    def _in_flight_micro_batches(self, mode: SamplingMode, batch: int) -> int | None:
        """The micro-batch count with which a pipelined engine decodes ``batch`` rows with
        micro-batches in flight (``pipeline_inflight.pipeline_decode``, each row sampled on the device as
        a plain step samples it), or None where it cannot: not a pipeline, or no divisor of the
        batch >= the stage count (then each step runs through the pipeline on its own, draining it)."""
        if self._stages is None:
            return None
        stages = self._stages.num_stages
        m = pipeline.micro_batches(batch, max(self.micro_batches, stages))
        return m if m >= stages else None

    def _stream_in_flight(self, tok, logprob, cache, max_new_tokens: int, rows: RowSampling, mode: SamplingMode,
                          steps_per_call: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield the prefill's ``(tok, logprob)``, then the rest of ``max_new_tokens`` in calls of
        up to ``steps_per_call`` steps each with :meth:`_in_flight_micro_batches` micro-batches
        in flight (the caller checked there are some)."""
        num_micro = self._in_flight_micro_batches(mode, tok.shape[0])
        yield np.asarray(tok), np.asarray(logprob)
        done = 1
        while done < max_new_tokens:
            steps = min(steps_per_call, max_new_tokens - done)
            counts = self._host(np.full(tok.shape[0], done, np.int32))  # the token index each row samples first
            toks, lps, cache = self._decode_loop(self.weights, tok, cache, rows, counts, steps=steps,
                                                 num_micro=num_micro, mode=mode)
            for i in range(steps):
                yield np.asarray(toks[i]), np.asarray(lps[i])
            tok, done = toks[-1], done + steps
