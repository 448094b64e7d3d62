"""Text generation: load a converted model once, then ``generate`` many times.

Prefill and decode are separate jit-compiled steps. Prompt lengths are padded to power-of-two
buckets and the cache length to a power of two, so new prompt lengths rarely recompile. The cache
is donated to the step that writes it, so XLA updates it in place.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.generate_pipeline import PipelineMixin
from dayzero.engine.sampling import RowSampling, SamplingMode, SamplingParams, batch_sampling, sample
from dayzero.engine.step_cache import StepCache
from dayzero.engine.speculative import SpecConfig, SpecStats, check_speculative, stream_speculative
from dayzero.engine.tokenizer import StreamDecoder, Tokenizer
from dayzero.engine.runtime import (RunConfig, RunConfigError, default_dtype, resolve_run, tied_head, weight_specs,
                                    weights_storage)
from dayzero.kernels import KernelMode
from dayzero.model.config import ModelConfig
from dayzero.model.parallel import Parallel
from dayzero.model.offload import offload_layers
from dayzero.model.quant import KVQuant, WeightQuant
from dayzero.model.mrope import ImageInput, continuation
from dayzero.model.mtp import main_hidden
from dayzero.model.transformer import forward
from dayzero.model.cache import InPlaceKVCache, KVCache, append_to_cache, cache_specs, init_cache
from dayzero.engine import staged_load
from dayzero.model import pipeline
from dayzero.model.weights import Weights, abstract_weights, aligned_weights, quantize_weights
from dayzero.sharding.placement import Placement

__all__ = ["Completion", "Engine", "GenerationError", "default_dtype", "engine_step", "weight_specs"]

MIN_PROMPT_BUCKET = 16
MIN_CACHE_LEN = 256
# Prompts longer than this are prefilled in chunks of this many tokens (see _prefill_chunks):
# each chunk reads the cache's blocks written so far (model/cache.py fold_blocks), so smaller
# chunks re-read the same blocks more often.
PREFILL_CHUNK = 1024
# Greedy decode steps per call of a pipeline with micro-batches in flight (pipeline_decode): the
# pipeline fills and drains once per call, a bubble of (S - 1) / (steps * M + S - 1).
IN_FLIGHT_STEPS = 8

# The sampled tokens [B] as the next step's input [B,1]: compiled once, because indexing a jax
# array op by op (``tokens[:, None]``) took 0.1-0.5 ms of the host's CPU per decode step, measured
# on the 2-core machine, where that CPU is also the device's.
_as_column = jax.jit(lambda tokens: tokens[:, None])


class GenerationError(ValueError):
    """A request the engine cannot serve (bad prompt, too long, bad token ids)."""


@dataclasses.dataclass
class Completion:
    """One finished request. ``finish_reason`` is "stop" (an EOS token) or "length".
    ``speculation``: with speculative decoding, the row's :class:`SpecStats`."""

    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    speculation: SpecStats | None = None

    def to_json(self) -> dict:
        """The ``--json`` object of the CLI contract."""
        out = {
            "text": self.text,
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.speculation is not None:
            out["speculative"] = self.speculation.to_json()
        return out


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << max(n - 1, minimum - 1).bit_length()


def cache_length(longest: int, max_new_tokens: int) -> int:
    """Positions per row of the contiguous cache ``Engine`` allocates for a batch whose longest
    prompt has ``longest`` tokens: room for every padded prefill chunk and for the longest row's
    last generated token, rounded up to a power of two."""
    T = min(bucket(longest, MIN_PROMPT_BUCKET), PREFILL_CHUNK)
    padded = -(-longest // T) * T
    return bucket(max(padded, longest + max_new_tokens), MIN_CACHE_LEN)


def check_max_new_tokens(max_new_tokens) -> None:
    """Raise :class:`GenerationError` unless ``max_new_tokens`` is an integer >= 1."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens={max_new_tokens!r} is invalid; it must be an integer >= 1")


def engine_step(config: ModelConfig, parallel: Parallel | None, weights: Weights, tokens, num_new,
                rows: RowSampling, step, mode: SamplingMode, cache=None, images: ImageInput | None = None,
                hidden: bool = False) -> tuple:
    """One step as :class:`Engine` jits it (prefill without a cache, decode with one).

    The forward pass (on a mesh with ``parallel``'s hand-written blocks: split latent attention,
    expert-parallel MoE) then sampling; returns the next tokens [B], their log-probabilities [B]
    and what ``append_to_cache`` writes. ``dayzero.tools.plan_check`` lowers the same function.
    ``images``: M-RoPE positions and image entries of a step after or with images (Qwen VL).
    ``hidden``: a fourth output, the hidden states [B,T,D] after the final norm, which the MTP
    drafter's module reads (``model.mtp.main_hidden``); without it the program is unchanged.
    """
    layers = [] if hidden else None
    logits, new = forward(weights, config, tokens, cache, num_new, parallel=parallel, images=images,
                          hidden_out=layers)
    next_tokens, logprobs = sample(logits, rows, step, mode)
    if parallel is not None:
        # Replicated: every process reads them back, and the next step gets the same layout
        # whichever step produced them.
        next_tokens, logprobs = jax.lax.with_sharding_constraint(
            (next_tokens, logprobs), parallel.placement.replicated()
        )
    return (next_tokens, logprobs, new) + ((main_hidden(weights, config, layers[-1]),) if hidden else ())


class Engine(PipelineMixin):
    """A loaded model with compiled prefill/decode steps, run as its :class:`RunConfig` says.

    The run configuration (``engine.run``: dtype, weight and KV-cache storage, kernels, mesh, MoE
    dispatch) is resolved once, when the engine is built (``dayzero.engine.runtime``). With a
    placement (a mesh and its rules) the weights and caches are laid out over the mesh by their
    logical axes, host inputs are replicated over it, every step's outputs are pinned to fixed
    shardings (so decode steps never recompile), and MoE blocks dispatch tokens to their experts'
    devices when the mesh has ``expert`` > 1. Without one, everything sits on the default device.
    With a kernel mode, generation runs on the paged cache, whose steps attend on the Pallas
    kernels (``dayzero.engine.serving``); the reference mode uses the contiguous cache. On a
    pipeline mesh (``stage`` > 1) the methods of ``engine.generate_pipeline`` run the stages.

    >>> engine = Engine.load("converted/smollm2")            # doctest: +SKIP
    >>> engine.generate("Hello", max_new_tokens=8).text      # doctest: +SKIP
    """

    def __init__(self, config: ModelConfig, weights: Weights, tokenizer: Tokenizer | None = None,
                 placement: Placement | None = None, kv_cache: KVQuant | str | None = None,
                 kernels: KernelMode | str | None = None, *, run: RunConfig | None = None):
        """An engine over ``weights`` (float or quantized, on one device or anywhere). Without
        ``run``, the run configuration is resolved from ``placement``, ``kv_cache``, ``kernels``
        (None: the platform's choice, as ``load``) and the weights' own dtype and storage; with
        one, those three arguments are ignored."""
        if run is not None and (placement, kv_cache, kernels) != (None, None, None):
            raise RunConfigError("pass either run= or placement/kv_cache/kernels to Engine, not both: a run "
                                 "configuration already holds them")
        if run is None:
            stored = weights_storage(weights)
            run = resolve_run(config, dtype=weights.embed.dtype, quantize=stored.weights, stored=stored,
                              kv_cache=kv_cache, kernels=kernels, placement=placement)
        self.config = config
        self.run = run
        self._stages = getattr(weights, "plan", None)  # the pipeline's StagePlan on a mesh with stage > 1
        if self._stages is not None:  # staged already (a data replica of a pipeline engine): re-placed
            weights = self._replaced(weights)
        elif weights.lm_head is None and jax.default_backend() == "cpu":
            # Tied embeddings: XLA:CPU's matvec against the [V,D] embedding took ~6 ms more per
            # SmolLM2 decode step than against a [D,V] copy (34 vs 40 ms), worth V*D more bytes.
            weights = weights.replace(lm_head=self._transposed(weights.embed))
        if run.placement is not None and self._stages is None:  # no-op for weights loaded into their shardings
            specs = weight_specs(config, run, weights.lm_head is not None)
            weights = jax.device_put(aligned_weights(weights, specs), run.placement.shardings(specs))
            if run.placement.axes.get("stage", 1) > 1:
                weights = self._staged(weights, specs)
        if run.offload_weights:
            weights = offload_layers(weights, run.placement)
        self.weights = weights
        self._parallel = run.parallel
        self._start_pipeline()  # micro_batches (1 without stages) and the in-flight decode step
        self.tokenizer = tokenizer
        self.eos_ids = tuple(tokenizer.eos_token_ids if tokenizer and tokenizer.eos_token_ids else config.eos_token_ids)
        self.compile_s = 0.0  # seconds spent compiling steps so far
        # Image preprocessing of a multimodal model (None: the tower's sizes, the published pixel
        # bounds; set it to the checkpoint's preprocessor_config.json where it differs).
        self.image_config = None
        # Prefill (no cache to read: a first prompt) and decode are separate compiled functions.
        self._prefill = jax.jit(functools.partial(self._step_impl, cache=None), static_argnames=("mode", "hidden"))
        self._decode = jax.jit(self._step_impl, static_argnames=("mode", "hidden"))
        # Decode that writes the cache as it attends (single-device CPU, float32 cache): the cache
        # is donated, so the written cache is the step's own output and no append follows.
        self._decode_in_place = jax.jit(self._step_in_place, static_argnames=("mode", "hidden"),
                                        donate_argnames=("cache",))
        # On a mesh the written cache is pinned to its layout; one device keeps the plain write.
        self._append = jax.jit(append_to_cache if run.placement is None else self._append_on_mesh, donate_argnums=(0,))
        # Warm starts read these steps whole from disk (no trace, no lowering) when --compile-cache is on.
        self._steps = StepCache(scope=repr((config, run)))

    @property
    def placement(self) -> Placement | None:
        """The mesh and rules the engine runs on (None: one device)."""
        return self.run.placement

    @property
    def kv_cache(self) -> KVQuant:
        """How the KV cache is stored."""
        return self.run.kv_cache

    @classmethod
    def load(cls, model_dir: str | Path | None = None, dtype=None, progress: bool = True,
             placement: Placement | None = None, quantize: WeightQuant | str | None = None,
             kv_cache: KVQuant | str | None = None, kernels: KernelMode | str | None = None,
             capacity_factor: float | None = None, grouped_matmul: str | None = None,
             offload_weights: bool = False) -> "Engine":
        """Load a converted model directory (default: the embedded SmolLM2-135M-Instruct).

        Every option is resolved and checked first, together, by
        ``dayzero.engine.runtime.resolve_run`` (None or "auto": the platform's choice), which
        raises :class:`~dayzero.engine.runtime.RunConfigError` for a combination that cannot run.
        With a ``placement`` every weight is restored straight into its sharding on that mesh,
        whatever mesh the checkpoint was converted for (on a pipeline mesh each layer onto its
        stage's devices only: ``engine.staged_load``). ``quantize``: weight quantization
        applied at load to a float checkpoint (none, int8, fp8, fp8-block, int4, int4-all); a checkpoint
        converted with ``--quantize`` is used as stored. ``kv_cache``: none, int8 or fp8.
        ``kernels``: reference, pallas or pallas_interpret. ``capacity_factor`` and
        ``grouped_matmul``: the expert-parallel MoE dispatch (``dayzero.model.parallel``).
        ``offload_weights``: hold the decoder layers in host memory, streamed to the device a
        layer ahead of use (``dayzero.model.offload``). A multimodal checkpoint's
        ``preprocessor_config.json`` becomes ``image_config``.
        """
        from dayzero.convert import load_checkpoint
        from dayzero.convert.checkpoint import read_config, read_manifest, stored_quantization
        from dayzero.convert.tokenizer_export import image_config_in
        from dayzero.engine.default_model import default_model_dir

        model_dir = Path(model_dir) if model_dir is not None else default_model_dir(progress=progress)
        model = read_config(model_dir)
        stored = stored_quantization(read_manifest(model_dir))
        run = resolve_run(model, dtype=dtype, quantize=quantize, stored=stored, kv_cache=kv_cache,
                          kernels=kernels, placement=placement, capacity_factor=capacity_factor,
                          grouped_matmul=grouped_matmul, offload_weights=offload_weights)
        if placement is not None and placement.axes.get("stage", 1) > 1:  # each layer onto its stage only
            config, weights = staged_load.load_staged(model_dir, model, run, stored,
                                                      weight_specs(model, run, untied_head=False))
        else:  # restored as stored (on a mesh, into its shardings), then quantized as the run says
            shardings = None if placement is None else placement.shardings(abstract_weights(model, stored))
            config, weights = load_checkpoint(model_dir, dtype=run.dtype, shardings=shardings)
            if run.quant != stored:
                weights = quantize_weights(weights, abstract_weights(config, run.quant))
        # A model converted without tokenizer files still serves token-id prompts.
        tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
        engine = cls(config, weights, tokenizer, run=run)
        # A multimodal checkpoint's own preprocessor_config.json (copied by convert); None keeps
        # the tower's sizes with the published pixel bounds (vision_step.image_config_of).
        engine.image_config = image_config_in(model_dir, config)
        return engine

    # ---- placement -------------------------------------------------------------------------

    def _transposed(self, embed: jax.Array) -> jax.Array:
        """The [D,V] copy of a tied [V,D] embedding, laid out as an untied head would be."""
        if self.placement is None:  # int8 under int8/int4 weights (runtime.tied_head)
            return tied_head(embed, self.run)
        head = self.placement.sharding(("embed", "vocab"), embed.T.shape)
        return jax.jit(jnp.transpose, out_shardings=head)(embed)

    def _host(self, value):
        """A host value (array, scalar or tree of them) as the steps' input: on the default device,
        or replicated over the mesh (the same value in every process)."""
        if self.placement is None:
            return jax.tree.map(jnp.asarray, value)
        return jax.tree.map(self.placement.replicate, value)

    def _cache_shardings(self, batch: int, max_len: int):
        if self.placement is None:
            return None
        if self._stages is not None:
            return self._staged_cache_shardings(batch, max_len)
        return self.placement.shardings(cache_specs(self.config, batch, max_len, self.kv_cache))

    def _init_cache(self, batch: int, max_len: int):
        """An empty contiguous cache for ``batch`` rows of ``max_len`` positions (stacked by stage
        on a pipeline), laid out on the mesh."""
        if self._stages is not None:
            return self._staged_cache(batch, max_len)
        return init_cache(self.config, batch, max_len, self.weights.embed.dtype, self.kv_cache,
                          self._cache_shardings(batch, max_len))

    # ---- compiled pieces -------------------------------------------------------------------

    def _step_impl(self, weights, tokens, num_new, rows: RowSampling, step, mode: SamplingMode, cache=None,
                   images: ImageInput | None = None, rope_deltas=None, hidden: bool = False):
        if rope_deltas is not None:  # a text step after an image prompt: positions shifted per row
            images = continuation(cache.lengths, tokens.shape[1], rope_deltas)
        if self._stages is not None:
            return self._pipeline_step(weights, tokens, num_new, rows, step, mode, cache, hidden)
        return engine_step(self.config, self._parallel, weights, tokens, num_new, rows, step, mode, cache, images,
                           hidden)

    def _step_in_place(self, weights, tokens, num_new, rows: RowSampling, step, mode: SamplingMode, cache,
                       images: ImageInput | None = None, rope_deltas=None, hidden: bool = False):
        view = InPlaceKVCache(cache, num_new, tuple(self.config.sliding_windows))
        return self._step_impl(weights, tokens, num_new, rows, step, mode, view, images, rope_deltas, hidden)

    def _writes_in_place(self, cache, T: int) -> bool:
        """Whether a decode step of ``T`` tokens per row writes ``cache`` as it attends (one
        program, see :class:`~dayzero.model.cache.InPlaceKVCache`) rather than appending after."""
        return self._stages is None and self.placement is None and InPlaceKVCache.applies(cache, T)

    def _append_on_mesh(self, cache, new):
        cache = pipeline.append_staged(cache, new) if self._stages is not None else append_to_cache(cache, new)
        # The written cache keeps the layout it was made with, so the next step sees the same input.
        return jax.lax.with_sharding_constraint(cache, self._cache_shardings(*cache.lengths.shape, cache.max_len))

    def _run_step(self, tokens, cache: KVCache, num_new, rows, step, mode, fresh: bool = False,
                  images: ImageInput | None = None, rope_deltas=None, hidden: bool = False) -> tuple:
        """One jitted forward + sample, then the cache write (in the same program where
        :meth:`_writes_in_place`). ``fresh``: the cache is empty.
        ``images`` (a prefill chunk of an image prompt) or ``rope_deltas`` [B] (a later step of
        one): another program, told apart in the key by the image entry count. ``hidden``:
        another program that also returns the hidden states (``engine_step``), a fourth output."""
        key = base = (tokens.shape, cache.max_len, mode, fresh, np.ndim(step))  # a per-row step: another program
        extra, static = {}, {"mode": mode}
        if hidden:
            key, static = key + ("hidden",), {"mode": mode, "hidden": True}
        if images is not None:
            n = 0 if images.embeds is None else images.embeds.shape[0]
            key, extra = key + ("images", n, len(images.deepstack)), {"images": self._host(images)}
        elif rope_deltas is not None:
            key, extra = key + ("rope_deltas",), {"rope_deltas": rope_deltas}
        in_place = not fresh and self._writes_in_place(cache, tokens.shape[1])
        key += ("in place",) if in_place else ()
        first = key not in self._steps
        start = time.perf_counter()
        step = self._host(np.int32(step))
        if fresh:
            out = self._steps.call(self._prefill, key, self.weights, tokens, num_new, rows, step, static=static,
                                   **extra)
        elif in_place:
            out = self._steps.call(self._decode_in_place, key, self.weights, tokens, num_new, rows, step, cache=cache,
                                   static=static, **extra)
        else:
            out = self._steps.call(self._decode, key, self.weights, tokens, num_new, rows, step, cache=cache,
                                   static=static, **extra)
        # In place, the step's third output is the written cache; else what to append.
        cache = out[2] if in_place else self._steps.call(self._append, (base, "append"), cache, out[2])
        if first:  # first call of this shape: account its compile (or load) time
            jax.block_until_ready(out[0])
            self.compile_s += time.perf_counter() - start
        return (out[0], out[1], cache, *out[3:])

    # ---- request validation ------------------------------------------------------------------

    def prompt_ids(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
        """A prompt (text, encoded with the chat template if ``chat``, or token ids) as checked
        token ids; raises :class:`GenerationError` naming what is wrong."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise GenerationError("the prompt is empty; pass some text")
            if self.tokenizer is None:
                raise GenerationError("this engine has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
            if chat:
                raise GenerationError("--chat needs a text prompt, not token ids")
        if not ids:
            raise GenerationError("the prompt is empty; pass at least one token")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise GenerationError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size}); "
                "pass ids the model's tokenizer produces"
            )
        return ids

    def check_length(self, ids: list[int], max_new_tokens: int) -> None:
        """Raise :class:`GenerationError` if ``ids`` plus ``max_new_tokens`` exceed the model's context."""
        context = self.config.max_position_embeddings
        if len(ids) + max_new_tokens > context:
            raise GenerationError(
                f"the prompt has {len(ids)} tokens and --max-new-tokens is {max_new_tokens}, "
                f"more than the model's context of {context} tokens; shorten the prompt or "
                "lower --max-new-tokens"
            )

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        *,
        max_new_tokens: int = 64,
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        chat: bool = False,
        logprobs: bool = False,
        ignore_eos: bool = False,
        on_text: Callable[[int, str], None] | None = None,
        speculative: SpecConfig | None = None,
        images: Sequence | None = None,
    ) -> Completion | list[Completion]:
        """Generate a continuation for one prompt or a batch of prompts of any lengths.

        A prompt is text or a list of token ids; a list of those is a batch (one
        :class:`Completion` each, in order). ``sampling`` is shared or one per prompt.
        ``on_text(row, text)`` receives text increments as tokens are produced.
        ``speculative``: decode speculatively (``dayzero.engine.speculative``), with the same
        output distribution (greedy: the same tokens); each completion reports its
        ``speculation`` counts. Refused (``SpeculativeError``) where the verify step cannot run.
        ``images`` (Qwen3-VL / Qwen3.5 models): for one prompt, its images (anything
        ``engine.images.load_image`` takes); for a batch, one such list per prompt. Each image's
        one ``config.vision.image_token_id`` in the prompt (as the chat template writes it) is
        expanded to the image's tokens (``Completion.prompt_ids`` holds the expanded ids).
        """
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise GenerationError("no prompts given")
        check_max_new_tokens(max_new_tokens)
        self._check_pipeline_request(speculative, images)
        if speculative is not None:
            check_speculative(self.config, self.run, speculative)
        params = [sampling] * len(batch) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(batch):
            raise GenerationError(f"{len(params)} sampling settings for {len(batch)} prompts")
        ids = [self.prompt_ids(p, chat) for p in batch]
        vision = None
        if images is not None:
            ids, vision = self._with_images(ids, [images] if single else list(images), max_new_tokens, speculative)
        for row in ids:
            self.check_length(row, max_new_tokens)
        completions = self._generate_ids(ids, max_new_tokens, params, logprobs, ignore_eos, on_text, speculative,
                                         vision)
        return completions[0] if single else completions

    def _with_images(self, ids: list[list[int]], images: list, max_new_tokens: int, speculative) -> tuple:
        """The prompts' ids with their image placeholders expanded, and each prompt's preprocessed
        images (None if no prompt has any); raises :class:`GenerationError` for a request with
        images this engine cannot serve."""
        if speculative is not None:
            raise GenerationError("speculative decoding does not take images yet; drop --speculative for image "
                                  "prompts")
        if len(images) != len(ids):
            raise GenerationError(f"{len(images)} image lists for {len(ids)} prompts; pass one list per prompt")
        processed, expanded = [], []
        for b, (row, sources) in enumerate(zip(ids, images)):
            try:
                row, done = self.image_prompt(row, sources, max_new_tokens, self.config.max_position_embeddings)
            except GenerationError as e:
                raise GenerationError(f"prompt {b + 1}: {e}") from None
            expanded.append(row)
            processed.append(done)
        return expanded, processed if any(processed) else None

    def image_prompt(self, ids: list[int], sources: Sequence, max_new_tokens: int, context: int) -> tuple:
        """One prompt's images (anything ``engine.images.load_image`` takes) preprocessed, and its
        ids with each image's placeholder expanded to the image's tokens: ``(ids, images)``.
        Raises :class:`GenerationError` naming the problem: no vision tower, an unreadable
        image, a placeholder count that is not the image count, more tokens than ``context``."""
        if self.config.vision is None or self.weights.vision is None:
            raise GenerationError("this model has no vision tower; pass images only to a multimodal model "
                                  "(Qwen3-VL, Qwen3.5, Kimi-K2.5)")
        from dayzero.engine import vision_step  # image code loads only for image requests

        if self.image_config is None:
            self.image_config = vision_step.image_config_of(self.config)
        try:
            done = vision_step.preprocess(list(sources), self.image_config)
            expanded = vision_step.expand_placeholders(ids, done, self.config.vision.image_token_id)
        except ValueError as e:  # engine.images.ImageError, a placeholder count
            raise GenerationError(str(e)) from None
        if len(expanded) + max_new_tokens > context:
            raise GenerationError(
                f"the prompt has {len(expanded)} tokens with its images' {sum(im.num_tokens for im in done)} "
                f"image tokens, and max_new_tokens is {max_new_tokens}: more than the context of {context}; "
                "use fewer or smaller images")
        return expanded, done

    def stream_ids(
        self, ids: list[list[int]], max_new_tokens: int, params: list[SamplingParams], vision=None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(tokens [B], logprobs [B])`` for each generated position of a batch.

        No EOS handling and no input checks (``generate`` does both): the caller stops
        consuming when it has what it needs. Rows may have different prompt lengths. With a
        kernel mode the rows are served on the paged cache (``paged_generate.stream_on_pages``).
        ``vision``: each prompt's preprocessed images (``_with_images``), its placeholders already
        expanded in ``ids``; the tower runs once over all of them.
        """
        if self.run.on_kernels:  # the kernels attend over pages: generate as a paged server does
            from dayzero.engine.paged_generate import stream_on_pages  # it imports this module

            yield from stream_on_pages(self, ids, max_new_tokens, params, vision)
            return
        lengths = np.array([len(r) for r in ids], np.int32)
        mode, rows = batch_sampling(params)
        rows = rows if self.placement is None else self._host(rows)
        prefill = deltas = None
        if vision is not None:
            from dayzero.engine import vision_step

            images = [im for row in vision for im in row]
            embeds, deepstack = vision_step.encode(self.weights, self.config, images)
            prefill = vision_step.ImagePrefill.build(self.config, ids, lengths, [im.grid_thw for im in images],
                                                     embeds, deepstack)
            deltas = self._host(prefill.deltas)
        next_tok, logprob, cache = self._prefill_chunks(ids, lengths, max_new_tokens, rows, mode, prefill)
        B = len(ids)
        if self._in_flight_micro_batches(mode, B) is not None:  # a pipeline, micro-batches in flight
            yield from self._stream_in_flight(next_tok, logprob, cache, max_new_tokens, rows, mode, IN_FLIGHT_STEPS)
            return
        ones = self._host(np.ones((B,), np.int32))
        for step in range(1, max_new_tokens + 1):
            produced = (next_tok, logprob)
            if step < max_new_tokens:
                # Dispatch the next step before reading this one back, so the host's
                # bookkeeping overlaps the device's work (one wasted step at an early stop).
                next_tok, logprob, cache = self._run_step(_as_column(next_tok), cache, ones, rows, step, mode,
                                                          rope_deltas=deltas)
            yield np.asarray(produced[0]), np.asarray(produced[1])

    def _prefill_chunks(self, ids, lengths, max_new_tokens, rows, mode, images=None, hidden: bool = False) -> tuple:
        """Prefill the prompts in chunks of at most ``PREFILL_CHUNK`` tokens.

        Each chunk attends to the cache written by the chunks before it, so attention memory is
        bounded by the chunk size times the cache length, not the prompt length squared (an
        8000-token SmolLM2 prompt in one piece peaked at 10.8 GB of RSS). A row whose prompt
        ends in an earlier chunk keeps the token sampled there. With ``images`` (a
        ``vision_step.ImagePrefill``) each chunk gets its M-RoPE positions and image entries.
        Returns the first tokens [B], their log-probabilities [B] and the cache; with ``hidden``
        (the MTP drafter's prompt entries: ``engine.mtp_drafter``) also each chunk's hidden states
        [B,T,D] after the final norm, a list in prompt order, from other compiled steps.
        """
        B, longest = len(ids), int(lengths.max())
        T = min(bucket(longest, MIN_PROMPT_BUCKET), PREFILL_CHUNK)
        padded = -(-longest // T) * T
        max_len = cache_length(longest, max_new_tokens)
        cache = self._init_cache(B, max_len)
        tokens = np.zeros((B, padded), np.int32)
        for b, row in enumerate(ids):
            tokens[b, : len(row)] = row
        first_tok = first_lp = None
        states = []
        for start in range(0, padded, T):
            num_new = np.clip(lengths - start, 0, T).astype(np.int32)
            tok, lp, cache, *state = self._run_step(
                self._host(tokens[:, start : start + T]), cache, self._host(num_new), rows, 0, mode,
                fresh=start == 0, images=None if images is None else images.chunk(start, T), hidden=hidden,
            )
            states += state
            ends_here = self._host((lengths > start) & (lengths <= start + T))
            first_tok = tok if first_tok is None else jnp.where(ends_here, tok, first_tok)
            first_lp = lp if first_lp is None else jnp.where(ends_here, lp, first_lp)
        return (first_tok, first_lp, cache) + ((states,) if hidden else ())

    def _generate_ids(self, ids, max_new_tokens, params, want_logprobs, ignore_eos, on_text, speculative=None,
                      vision=None):
        B = len(ids)
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        stopped = np.zeros(B, bool)
        decoders = [StreamDecoder(self.tokenizer) for _ in range(B)] if on_text and self.tokenizer else None
        stats = [SpecStats() for _ in range(B)] if speculative else None
        if speculative:
            stop_ids = () if ignore_eos else self.eos_ids
            steps = stream_speculative(self, ids, max_new_tokens, params, speculative, stop_ids, stats)
        else:  # one token per row and step
            steps = ((t[:, None], lp[:, None], np.ones(B, int))
                     for t, lp in self.stream_ids(ids, max_new_tokens, params, vision))
        for host_tok, host_lp, counts in steps:
            for b in np.flatnonzero(~done):
                for j in range(counts[b]):
                    out_ids[b].append(int(host_tok[b, j]))
                    out_lp[b].append(float(host_lp[b, j]))
                    if decoders:
                        on_text(int(b), decoders[b].push(host_tok[b, j]))
                    if not ignore_eos and int(host_tok[b, j]) in self.eos_ids:
                        done[b] = stopped[b] = True
                    elif len(out_ids[b]) >= max_new_tokens:
                        done[b] = True
                    if done[b]:
                        break
            if done.all():
                break
        for b, decoder in enumerate(decoders or []):
            tail = decoder.flush()
            if tail:
                on_text(b, tail)
        return [
            Completion(
                text=self.tokenizer.decode(out_ids[b]) if self.tokenizer else "",
                prompt_ids=list(ids[b]),
                token_ids=out_ids[b],
                finish_reason="stop" if stopped[b] else "length",
                logprobs=out_lp[b] if want_logprobs else None,
                speculation=stats[b] if stats else None,
            )
            for b in range(B)
        ]
