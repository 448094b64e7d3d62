"""Loading a checkpoint straight into a pipeline's stacked layout.

A pipeline is needed when the model does not fit one stage's devices, so its weights must never
be whole on them, not even for a moment. :func:`stage_shardings` makes the restore place each
decoder layer on the devices of the stage that runs it (that stage's slice of the mesh, split
over ``tensor`` / ``expert`` as the rules say), and the embedding, final norm and head as the
pipeline keeps them (whole over ``stage``). :func:`assemble` then stacks each stage's layers
into its [1, slots, ...] block on its own devices, one leaf at a time, freeing the per-layer
arrays as it goes, and joins the stages' blocks into the global [S, slots, ...] arrays of
``pipeline.StagedWeights`` without moving a byte between stages
(``jax.make_array_from_single_device_arrays``). Each process reads, quantizes and stacks only
the layers of the stages whose devices it holds (``load_checkpoint`` skips the others), so with
one stage per process a process reads only its own layers. :func:`load_staged` does it all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dayzero.model import pipeline
from dayzero.model.config import ModelConfig
from dayzero.model.quant import QuantConfig
from dayzero.model.weights import Weights, abstract_weights, aligned_weights, is_spec, quantize_weights
from dayzero.sharding.placement import Placement


def stage_placements(placement: Placement) -> list[Placement]:
    """Per stage, its slice of ``placement``'s mesh: the same axes (``stage`` kept, of size 1) and
    rules, so a layer's logical axes split over that stage's devices as they would over the mesh."""
    names = tuple(placement.mesh.axis_names)
    where = names.index("stage")
    grid = placement.mesh.devices
    return [Placement(Mesh(np.take(grid, [s], axis=where), names), placement.rules)
            for s in range(grid.shape[where])]


def stage_of_layers(plan: pipeline.StagePlan) -> list[int]:
    """The stage that runs each decoder layer."""
    return [s for s, (a, b) in enumerate(plan.ranges) for _ in range(a, b)]


def stage_shardings(specs: Weights, plan: pipeline.StagePlan, placement: Placement) -> Weights:
    """A sharding tree for restoring ``specs`` (per-layer, as stored) with each layer on its
    stage's devices and everything else as ``placement`` lays it out."""
    subs = stage_placements(placement)
    layers = tuple(subs[s].shardings(layer) for s, layer in zip(stage_of_layers(plan), specs.layers))
    return placement.shardings(specs.replace(layers=())).replace(layers=layers)


def _local(sub: Placement) -> bool:
    """Whether this process holds devices of ``sub``'s mesh."""
    return any(d.process_index == jax.process_index() for d in sub.mesh.devices.flat)


@functools.lru_cache(maxsize=None)
def _stacker(present: tuple[bool, ...], shape: tuple[int, ...], dtype, sharding: NamedSharding):
    """A jit stacking one stage's slots of a leaf into [1, slots, ...] on that stage's devices:
    the arrays given where ``present``, zeros in the padding slots."""
    def stack(*xs):
        given = iter(xs)
        return jnp.stack([next(given) if p else jnp.zeros(shape, dtype) for p in present])[None]

    return jax.jit(stack, out_shardings=sharding)


def _stacked(layers: tuple, rows: tuple, target: Weights, shardings: Weights, subs: list[Placement]):
    """The per-layer trees ``layers`` stacked as ``rows`` (stage by slot: a layer index or None)
    into global arrays of ``target``'s shapes (``staged_specs``) and ``shardings``, leaf by leaf;
    each per-layer leaf is deleted once stacked."""
    flat = [jax.tree.leaves(layer) for layer in layers]
    like = next(i for row in rows for i in row if i is not None)
    specs, tree = jax.tree.flatten(target, is_leaf=is_spec)
    out = []
    for j, (spec, sharding) in enumerate(zip(specs, jax.tree.leaves(shardings))):
        dtype, pieces = flat[like][j].dtype, []
        for s, row in enumerate(rows):
            if not _local(subs[s]):
                continue
            present = tuple(i is not None for i in row)
            make = _stacker(present, tuple(spec.shape[2:]), dtype, NamedSharding(subs[s].mesh, sharding.spec))
            block = jax.block_until_ready(make(*(flat[i][j] for i in row if i is not None)))
            pieces += [shard.data for shard in block.addressable_shards]
        out.append(jax.make_array_from_single_device_arrays(tuple(spec.shape), sharding, pieces))
        for i in {i for row in rows for i in row if i is not None}:
            if flat[i][j].is_fully_addressable or flat[i][j].addressable_shards:
                flat[i][j].delete()  # stacked: its memory is no longer needed
    return jax.tree.unflatten(tree, out)


def assemble(weights: Weights, specs: Weights, plan: pipeline.StagePlan, placement: Placement
             ) -> pipeline.StagedWeights:
    """``weights`` restored with :func:`stage_shardings` (each layer on its stage's devices) as
    the :class:`~dayzero.model.pipeline.StagedWeights` of ``plan`` on ``placement``. ``specs``:
    the weight tree as the engine holds it (``runtime.weight_specs``). The per-layer arrays are
    consumed (deleted once stacked)."""
    target = pipeline.staged_specs(specs, plan)
    shardings = placement.shardings(target)
    subs = stage_placements(placement)
    layers = _stacked(weights.layers, plan.slot_layers(), target.layers, shardings.layers, subs)
    prefix = None
    if plan.prefix:
        prefix = _stacked(weights.layers, plan.prefix_layers(), target.prefix, shardings.prefix, subs)
    return pipeline.StagedWeights(outer=weights.replace(layers=()), layers=layers, prefix=prefix, plan=plan)


def load_staged(model_dir, config: ModelConfig, run, stored: QuantConfig, specs: Weights
                ) -> tuple[ModelConfig, pipeline.StagedWeights]:
    """Load the checkpoint in ``model_dir`` (stored as ``stored``) straight into the stacked
    layout of ``run``'s pipeline mesh: each layer read onto its stage's devices, quantized as
    ``run`` says and aligned to ``specs`` (the weight tree as the engine holds it), then stacked
    (:func:`assemble`). Layers of stages on other processes are neither read nor computed."""
    from dayzero.convert import load_checkpoint

    placement = run.placement
    plan = pipeline.plan_stages(specs, placement.axes["stage"])
    shardings = stage_shardings(abstract_weights(config, stored), plan, placement)
    config, weights = load_checkpoint(model_dir, dtype=run.dtype, shardings=shardings)
    wanted = abstract_weights(config, run.quant)
    subs, stages = stage_placements(placement), stage_of_layers(plan)

    def ready(tree, quantized, aligned):
        return aligned_weights(quantize_weights(tree, quantized), aligned)

    layers = tuple(ready(layer, q, a) if _local(subs[s]) else layer
                   for layer, q, a, s in zip(weights.layers, wanted.layers, specs.layers, stages))
    outer = ready(weights.replace(layers=()), wanted.replace(layers=()), specs.replace(layers=()))
    return config, assemble(outer.replace(layers=layers), specs, plan, placement)
