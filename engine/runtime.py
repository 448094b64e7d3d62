"""The run configuration: every runtime option of an engine, resolved and checked in one place.

An engine runs a model with a compute dtype, a weight storage (float or quantized), a KV-cache
storage, an attention implementation (``--kernels``), a placement on a device mesh and the
options of the expert-parallel MoE dispatch. Each of those is decided here, once, when the
engine is built (:func:`resolve_run`, called by ``Engine.load`` and ``Engine(...)``); the CLI, the
Python API and the serving engine all go through it, and the forward pass and the caches only
read what it decided.

A combination that cannot run is refused here with one :class:`RunConfigError` sentence naming
the option and what to do. What runs (every combination not listed below):

- quantized weights (int8, fp8, fp8-block, int4 experts or int4 everywhere) on one device and on every mesh;
- a quantized KV cache (int8, fp8) on the reference path and on the kernels, which read the
  scale pages themselves;
- the kernels on a mesh: each kernel call runs inside ``shard_map`` over the heads' ``tensor``
  split (and the rows' ``data`` split), so the pages never move.

What is refused (:func:`resolve_run` raises):

- ``--kernels pallas`` off a GPU (``pallas_interpret`` runs the same kernels anywhere);
- the kernels asked for by name on a mesh whose ``tensor`` size does not divide the query heads,
  or (GQA) the kv heads: each device's kernel must see whole kv heads with all their query heads
  (``auto`` resolves to the reference path there: the platform's best that runs);
- a weight scheme that differs from the one a checkpoint is stored in;
- ``--mesh expert=N`` on a model without experts, or with an expert count N does not divide
  (``data`` x ``expert`` meshes, which have no rules table, are refused earlier, when ``--mesh``
  is turned into a placement: ``sharding.placement``'s ``MeshError``);
- the MoE dispatch options (``capacity_factor``, ``grouped_matmul``) without an ``expert`` axis:
  they set the expert-parallel dispatch only;
- the kernels (``pallas``, and ``pallas_interpret``, which runs the same kernels and so keeps the
  same limit) over an int8/fp8 page pool of 2^31 to 2^32 elements per device
  (:func:`check_page_pool`, when a serving engine sizes its pool);
- DeepSeek-V4 (compressed attention): the kernels asked for by name (it has no kernel path yet;
  ``auto`` resolves to the reference path);
- on a pipeline mesh (``stage`` > 1), what ``model.pipeline.pipeline_refusal`` names (the
  kernels asked for by name among them: ``auto`` resolves to the reference path there), and
  ``--offload-weights``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from dayzero.kernels import KernelError, KernelMode, describe
from dayzero.kernels.mode import resolve_mode
from dayzero.model.config import ModelConfig
from dayzero.model.moe import GroupedMatmul
from dayzero.model.mesh_check import kernel_split_refusal, mesh_refusal
from dayzero.model.parallel import Parallel
from dayzero.model.quant import (KVQuant, QuantConfig, QuantError, QuantizedArray, ValueFormat,
                                 WeightQuant, parse_kv_quant, parse_weight_quant, quantize)
from dayzero.model.weights import abstract_weights, axis_sizes, mesh_aligned_specs
from dayzero.sharding.placement import Placement


class RunConfigError(ValueError):
    """A runtime option, or a combination of them, that this engine cannot run; the message
    names the option and what to use instead."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every runtime option of an engine, resolved (no ``auto`` left) and checked together.

    ``dtype``: the compute (and float weight) dtype. ``weights``: how the weights are stored
    (``stored`` in the checkpoint, or quantized at load); ``quant``: that scheme with its block.
    ``kv_cache``: how the KV cache (contiguous or paged) is stored. ``kernels``: how attention
    runs (reference, pallas, pallas_interpret). ``placement``: the mesh and its rules (None: one
    device). ``capacity_factor`` / ``grouped_matmul``: the MoE dispatch (see ``model.parallel``).
    ``requested``: the options as they were asked for (``auto`` included), for reports.
    ``offload_weights``: the decoder layers' weights live in host memory and are streamed to the
    device a layer ahead inside each step (``dayzero.model.offload``).
    """

    dtype: Any
    quant: QuantConfig
    kv_cache: KVQuant
    kernels: KernelMode
    placement: Placement | None = None
    capacity_factor: float | None = None
    grouped_matmul: GroupedMatmul | None = None
    requested: tuple[tuple[str, str], ...] = ()
    offload_weights: bool = False

    @property
    def weights(self) -> WeightQuant:
        """The weight storage scheme."""
        return self.quant.weights

    @property
    def parallel(self) -> Parallel | None:
        """The mesh options the hand-written parallel blocks take (None on one device)."""
        if self.placement is None:
            return None
        return Parallel(self.placement, self.capacity_factor, self.grouped_matmul)

    @property
    def on_kernels(self) -> bool:
        """Whether attention runs on the Pallas kernels (pallas or pallas_interpret)."""
        return self.kernels is not KernelMode.REFERENCE

    def describe(self) -> dict[str, Any]:
        """The resolved configuration as JSON (``generate --json``'s ``"run"`` object)."""
        mesh = None if self.placement is None else {a: s for a, s in self.placement.axes.items() if s > 1}
        return {
            "dtype": jnp.dtype(self.dtype).name,
            "quantize": self.weights.value,
            "weight_block": list(self.quant.block) if self.weights is WeightQuant.FP8_BLOCK else None,
            "kv_cache": self.kv_cache.value,
            "kernels": self.kernels.value,
            "mesh": mesh,
            "rules": None if self.placement is None else self.placement.rules.name,
            "moe_capacity_factor": self.capacity_factor,
            "grouped_matmul": None if self.grouped_matmul is None else self.grouped_matmul.value,
            "requested": dict(self.requested),
            "offload_weights": self.offload_weights,
        }


def default_dtype() -> jnp.dtype:
    """fp32 on CPU (XLA:CPU bf16 matvecs are ~20x slower), bf16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def resolve_run(model: ModelConfig, *, dtype: Any = None, quantize: WeightQuant | str | None = None,
                stored: QuantConfig = QuantConfig(), kv_cache: KVQuant | str | None = None,
                kernels: KernelMode | str | None = None, placement: Placement | None = None,
                capacity_factor: float | None = None,
                grouped_matmul: GroupedMatmul | str | None = None, offload_weights: bool = False) -> RunConfig:
    """The :class:`RunConfig` for ``model`` with these options (None / "auto": the platform's
    choice); ``stored``: how the checkpoint's weights are stored. Raises :class:`RunConfigError`
    for an unknown value or a combination that cannot run (see the module docstring)."""
    requested = dict(dtype="auto" if dtype is None else jnp.dtype(dtype).name,
                     quantize=_spelled(quantize), kv_cache=_spelled(kv_cache), kernels=_spelled(kernels))
    try:
        quant = _weight_storage(quantize, stored)
        kv = parse_kv_quant(kv_cache)
        mode = _model_kernels(model, resolve_mode(KernelMode.AUTO if kernels is None else kernels), kernels)
    except (QuantError, KernelError) as e:
        raise RunConfigError(str(e)) from None
    matmul = _grouped_matmul(grouped_matmul)
    if capacity_factor is not None and not capacity_factor > 0:
        raise RunConfigError(f"capacity_factor {capacity_factor} must be > 0 (or None for no dropped tokens)")
    expert_parallel = placement is not None and placement.axes["expert"] > 1
    if (capacity_factor is not None or matmul is not None) and not expert_parallel:
        raise RunConfigError(
            "capacity_factor and grouped_matmul set the expert-parallel dispatch, which runs on a mesh with "
            "expert > 1 only; add --mesh expert=N or leave them unset (one device uses the platform's matmul)")
    if placement is not None:
        check_placement(model, placement)
        staged = placement.axes.get("stage", 1) > 1  # a pipeline attends on the reference path (pipeline_refusal)
        fits = not staged and _kernels_fit(model, placement)
        if mode is not KernelMode.REFERENCE and _spelled(kernels) == "auto" and not fits:
            mode = KernelMode.REFERENCE  # auto: the platform's best that runs on this mesh
        if mode is not KernelMode.REFERENCE:
            _check_kernels_on_mesh(model, placement, mode)
        _check_pipeline(model, placement, quant, kv, mode, offload_weights)
    return RunConfig(jnp.dtype(dtype or default_dtype()), quant, kv, mode, placement, capacity_factor, matmul,
                     tuple(requested.items()), offload_weights)


def _check_pipeline(model: ModelConfig, placement: Placement, quant: QuantConfig, kv: KVQuant, mode: KernelMode,
                    offload_weights: bool) -> None:
    """Refuse what a mesh with ``stage`` > 1 cannot run yet (``dayzero.model.pipeline``)."""
    if placement.axes.get("stage", 1) == 1:
        return
    from dayzero.model.pipeline import pipeline_refusal

    reason = pipeline_refusal(model, placement.axes, kernels=mode, quantized=quant.weights is not WeightQuant.NONE,
                              kv_quantized=kv is not KVQuant.NONE)
    if reason is None and offload_weights:
        reason = ("--offload-weights streams the per-layer weights, and a stage mesh stacks them by stage: "
                  "drop one of --offload-weights and --mesh stage=N")
    if reason is not None:
        raise RunConfigError(reason)


def _model_kernels(model: ModelConfig, mode: KernelMode, requested: KernelMode | str | None) -> KernelMode:
    """``mode`` for this model: DeepSeek-V4's compressed attention has no kernel path yet, and a
    hybrid's linear layers run the delta-rule kernels only at the sizes they tile, so for those
    ``auto`` means the reference path and a kernel asked for by name is refused."""
    if mode is KernelMode.REFERENCE:
        return mode
    reason = None
    if model.compressed is not None:
        reason = "DeepSeek-V4's compressed attention has no kernel path yet (its reference path runs)"
    elif model.linear is not None:
        from dayzero.kernels.delta_rule import pallas_size_refusal

        lc = model.linear
        if pallas_size_refusal(lc.k_head_dim, lc.v_head_dim, lc.chunk, mode is KernelMode.PALLAS_INTERPRET):
            reason = (f"the delta-rule kernels cannot tile this model's linear layers (dk={lc.k_head_dim}, "
                      f"dv={lc.v_head_dim}, chunk={lc.chunk}: each must be a power of two >= 16)")
    if reason is None:
        return mode
    if _spelled(requested) == "auto":
        return KernelMode.REFERENCE
    raise RunConfigError(f"--kernels {_spelled(requested)}: {reason}; use --kernels reference or auto")


def _grouped_matmul(name) -> GroupedMatmul | None:
    if name is None:
        return None
    try:
        return GroupedMatmul(name)
    except ValueError:
        choices = ", ".join(g.value for g in GroupedMatmul)
        raise RunConfigError(f"grouped_matmul {name!r} is unknown; choose one of {choices}") from None


def _spelled(option: Any) -> str:
    if option is None:
        return "auto"
    return option.value if hasattr(option, "value") else str(option)


def _weight_storage(quantize, stored: QuantConfig) -> QuantConfig:
    """The weights' storage: a checkpoint stored quantized is used as stored (asking for another
    scheme is an error); a float one is quantized at load as ``quantize`` says."""
    scheme = parse_weight_quant(quantize)
    if stored.weights is WeightQuant.NONE:
        return QuantConfig(scheme)
    asked_explicitly = quantize not in (None, "auto")
    if asked_explicitly and scheme is not stored.weights:
        raise QuantError(
            f"the checkpoint is stored quantized as {stored.weights.value}; load it without --quantize "
            f"(or with {stored.weights.value}), or convert the source again with --quantize {scheme.value}")
    return stored


# How the CPU engine stores its [D,V] output-head copy of a tied embedding (21% of SmolLM2-135M's
# parameters, read every decode step) under each weight scheme: int8, one scale per vocabulary
# column, where the projections are int8 or int4 (int8, int4, int4-all: llama.cpp's q4_0 keeps a
# tied head at q8_0 too; on SmolLM2 an int4 head in groups of 32 raised int4-all's mean KL from
# 0.38 to 0.52 and cut greedy agreement from 0.94 to 0.86); float otherwise. Quantized, the head
# runs on the native decode matvec (``dayzero.model.quant_matmul``); fp8 is left float because
# XLA:CPU converts fp8 to fp32 ~10x slower than int8 and there is no native fp8 kernel, so an fp8
# head would cost time (measured: the [576 x 49152] matvec 150-230 ms fp8, 6-8 ms int8, 11-23 ms
# fp32 on a loaded 2-core host).
TIED_HEAD_FORMAT = {WeightQuant.INT8: ValueFormat.INT8, WeightQuant.INT4: ValueFormat.INT8,
                    WeightQuant.INT4_ALL: ValueFormat.INT8}


def tied_head(embed: jax.Array, run: RunConfig) -> jax.Array | QuantizedArray:
    """The single-device [D,V] output head made from a tied [V,D] ``embed``: quantized per
    vocabulary column as :data:`TIED_HEAD_FORMAT` says for ``run``'s weights, else a float copy.
    The embedding itself stays float (its gathered rows are the model's input)."""
    head = jnp.asarray(embed.T)
    fmt = TIED_HEAD_FORMAT.get(run.weights)
    if fmt is None or run.placement is not None:
        return head
    return _quantized_head(head, fmt)


@functools.partial(jax.jit, static_argnums=(1,))
def _quantized_head(head: jax.Array, fmt: ValueFormat) -> QuantizedArray:
    return quantize(head, fmt, (0,))


def check_placement(model: ModelConfig, placement: Placement) -> None:
    """Raise :class:`RunConfigError` unless ``placement``'s mesh can run this model at all (the
    device-free decision ``model.mesh_check.mesh_refusal``, which the planner also asks)."""
    reason = mesh_refusal(model, placement.axes)
    if reason is not None:
        raise RunConfigError(reason)


def _kernels_fit(model: ModelConfig, placement: Placement) -> bool:
    """Whether every head count the kernels split divides ``placement``'s ``tensor`` size."""
    return kernel_split_refusal(model, placement.axes["tensor"], KernelMode.PALLAS) is None


def _check_kernels_on_mesh(model: ModelConfig, placement: Placement, mode: KernelMode) -> None:
    """The kernels run per device inside ``shard_map`` over the head split: each device needs
    whole kv heads and all the query heads that read them (``mesh_check.kernel_split_refusal``)."""
    reason = kernel_split_refusal(model, placement.axes["tensor"], mode)
    if reason is not None:
        raise RunConfigError(reason)


def with_kernels(run: RunConfig, model: ModelConfig, kernels: KernelMode | str | None) -> RunConfig:
    """``run`` with its kernel mode replaced by ``kernels`` (None: unchanged), checked against the
    rest of ``run`` as :func:`resolve_run` checks it (e.g. a serving engine's own choice)."""
    if kernels is None:
        return run
    try:
        mode = _model_kernels(model, resolve_mode(kernels), kernels)
    except KernelError as e:
        raise RunConfigError(str(e)) from None
    if run.placement is not None and mode is not KernelMode.REFERENCE:
        _check_kernels_on_mesh(model, run.placement, mode)
    requested = {**dict(run.requested), "kernels": _spelled(kernels)}
    return dataclasses.replace(run, kernels=mode, requested=tuple(requested.items()))


def check_page_pool(run: RunConfig, model: ModelConfig, num_pages: int, page_size: int) -> None:
    """Refuse a page pool the kernels cannot address: Pallas Triton computes 32-bit element
    offsets for arrays under 2^32 bytes, so a 1-byte (int8/fp8) pool of 2^31 to 2^32 elements on
    one device would overflow them (``kernels.tiles.pallas_offsets_fit``). Checked on each
    device's share of the pool, when the pages are made, before anything is allocated."""
    if not run.on_kernels or run.kv_cache is KVQuant.NONE:
        return
    from dayzero.kernels.tiles import pallas_offsets_fit
    from dayzero.model.paged_cache import paged_cache_specs

    pool = jax.tree.leaves(paged_cache_specs(model, num_pages, page_size, kv_quant=run.kv_cache),
                           is_leaf=lambda x: hasattr(x, "axes"))[0]
    shape = list(pool.shape)
    tp = 1 if run.placement is None else run.placement.axes["tensor"]
    if pool.axes[0] == "kv_heads" and shape[0] % tp == 0:
        shape[0] //= tp
    if not pallas_offsets_fit(tuple(shape), pool.dtype):
        raise RunConfigError(
            f"num_pages={num_pages} makes each device's {run.kv_cache.value} page pool {shape} more than 2^31 "
            f"one-byte elements but under 4 GiB, which the Pallas kernels address with 32-bit offsets; use fewer "
            f"pages (or a larger tensor split), --kv-cache none, or --kernels reference")


def weights_storage(weights: Any) -> QuantConfig:
    """How a weight tree in memory is stored (the scheme that would have produced its quantized
    leaves: int4 experts beside int8, MXFP4 experts (beside fp8 blocks), fp8 blocks with their
    block, or per-channel int8 / fp8)."""
    nodes = [x for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedArray))
             if isinstance(x, QuantizedArray)]
    formats = {x.fmt for x in nodes}
    if not nodes:
        return QuantConfig()
    if ValueFormat.INT4 in formats:  # beside int8 projections (int4), or everywhere (int4-all)
        return QuantConfig(WeightQuant.INT4 if ValueFormat.INT8 in formats else WeightQuant.INT4_ALL)
    blocked = [x.block for x in nodes if x.block is not None and x.fmt is ValueFormat.FP8]
    # Weights aligned for a mesh hold finer blocks that divide the stored one; their lcm is the
    # coarsest block every leaf can be re-blocked from (the stored one when any leaf kept it).
    block = tuple(math.lcm(*(b[i] for b in blocked)) for i in range(2)) if blocked else None
    if ValueFormat.MXFP4 in formats:  # MXFP4 experts, beside FP8-block projections (DeepSeek-V4) or not
        return QuantConfig(WeightQuant.MXFP4_FP8_BLOCK, block) if blocked else QuantConfig(WeightQuant.MXFP4)
    if blocked:
        return QuantConfig(WeightQuant.FP8_BLOCK, block)
    return QuantConfig(WeightQuant.FP8 if ValueFormat.FP8 in formats else WeightQuant.INT8)


def on_placement(run: RunConfig, model: ModelConfig, placement: Placement | None) -> RunConfig:
    """``run`` on another ``placement`` (e.g. one data replica's devices), checked as
    :func:`resolve_run` checks a placement."""
    if placement is not None:
        check_placement(model, placement)
        if run.on_kernels:
            _check_kernels_on_mesh(model, placement, run.kernels)
    return dataclasses.replace(run, placement=placement)


def options_from_args(args: Any) -> dict[str, Any]:
    """The run options of a parsed ``generate`` / ``bench`` command line as ``Engine.load``
    takes them (``--quantize``, ``--kv-cache``, ``--kernels``); resolved by :func:`resolve_run`."""
    return dict(quantize=args.quantize, kv_cache=args.kv_cache, kernels=args.kernels,
                offload_weights=getattr(args, "offload_weights", False))


def kernels_record(run: RunConfig) -> dict[str, str]:
    """``describe``'s record of the resolved kernel mode (``generate --json``'s ``"kernels"``)."""
    return {**describe(run.kernels), "requested": dict(run.requested).get("kernels", "auto")}


def weight_specs(config: ModelConfig, run: RunConfig, untied_head: bool):
    """The abstract weight tree as an engine with ``run`` holds it: quantized as ``run`` says,
    with each block scale aligned to its shards on ``run``'s mesh, and with the [D,V] head copy
    if ``untied_head``."""
    if untied_head and config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    specs = abstract_weights(config, run.quant)
    if run.placement is not None:
        specs = mesh_aligned_specs(specs, axis_sizes(run.placement))
    return specs
