"""The planner's figures against XLA's compiled memory analysis of the sharded decode step.

Used by ``bench/plan_vs_xla.py`` and its test. The decode step is the one the engine runs on
that mesh (``dayzero.engine.generate.engine_step`` with the engine's ``Parallel``: latent
attention over the position-split cache in ``shard_map``, expert-parallel MoE dispatch when the
mesh has ``expert`` > 1), greedy, one token per row over a full cache; XLA's activation figure
is its temporary bytes plus its outputs. Needs as many (faked) devices as the mesh has: run it
in a process started with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``. Nothing is
allocated: weights, cache and host inputs are ``jax.ShapeDtypeStruct`` carrying the shardings
the engine gives them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from dayzero.engine.generate import engine_step
from dayzero.engine.runtime import check_placement
from dayzero.engine.sampling import SamplingMode, SamplingParams, batch_sampling
from dayzero.model.config import ModelConfig
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.parallel import Parallel
from dayzero.model.cache import cache_specs
from dayzero.model.weights import abstract_weights, is_spec, leaf_path, shape_structs
from dayzero.sharding.placement import Placement, placement_for
from dayzero.sharding.planner import KVDtype, WeightDtype, Workload, evaluate

_INT_LEAVES = ("lengths", "rope_len")


def one_layer_per_kind(config: ModelConfig) -> tuple[ModelConfig, list[int]]:
    """``config`` cut to the first decoder layer of each kind (dense MLP, MoE), and those layers'
    indices in the full model."""
    flags = config.moe.layers if config.moe is not None else (False,) * config.num_layers
    chosen = sorted({flags.index(f) for f in set(flags)})
    moe = None if config.moe is None else dataclasses.replace(config.moe, layers=tuple(flags[i] for i in chosen))
    windows = tuple(config.sliding_windows[i] for i in chosen)
    return dataclasses.replace(config, num_layers=len(chosen), moe=moe, sliding_windows=windows), chosen


# Fields of the weight, cache and output trees that hold one entry per decoder layer.
_PER_LAYER = ("layers", "latent", "index_keys", "k", "v")


def _layer_of(name: str) -> int | None:
    """The decoder layer a leaf belongs to (``layers/3/attn/q``, ``latent/3``, ``1/latent/3``)."""
    parts = name.split("/")
    for field, index in zip(parts, parts[1:]):
        if field in _PER_LAYER and index.isdigit():
            return int(index)
    return None


def _per_device(structs: Any, shardings: Any) -> dict[str, int]:
    """``{leaf name: bytes on one device}`` under the compiled executable's shardings."""
    flat, _ = jax.tree_util.tree_flatten_with_path(structs)
    shards = jax.tree.leaves(shardings)
    return {
        leaf_path(path): math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize
        for (path, s), sh in zip(flat, shards)
    }


def _abstract(value: Any, sharding) -> Any:
    """A tree of arrays as ``jax.ShapeDtypeStruct`` leaves carrying ``sharding``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), value)


def decode_step_inputs(config: ModelConfig, placement: Placement, batch: int, context: int, dtype) -> tuple:
    """Abstract (weights, tokens, num_new, rows, step, cache) of a decode step, laid out as the
    engine lays them out on ``placement``: weights and cache by their logical axes, host inputs
    replicated (``Engine._host``), the tokens as the previous step returned them (replicated)."""
    specs = abstract_weights(config)
    weights = shape_structs(specs, dtype, placement.shardings(specs))
    cspecs = cache_specs(config, batch, context)
    cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), cspecs,
                         placement.shardings(cspecs), is_leaf=is_spec)
    cache = cache.replace(**{n: jax.ShapeDtypeStruct(getattr(cache, n).shape, jnp.int32,
                                                     sharding=getattr(cache, n).sharding) for n in _INT_LEAVES})
    replicated = placement.replicated()
    _, rows = batch_sampling([SamplingParams()] * batch)
    host = (jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch,), jnp.int32), rows, jnp.int32(1))
    tokens, num_new, rows, step = _abstract(host, replicated)
    return weights, tokens, num_new, rows, step, cache


def xla_decode_memory(config: ModelConfig, axes: dict[str, int], batch: int, context: int, dtype) -> dict:
    """Lower and compile the engine's greedy decode step of ``config`` on a mesh of ``axes``
    (``generate.engine_step`` with the engine's ``Parallel``); per-device bytes."""
    placement = placement_for(axes)
    if placement is None:
        raise ValueError(f"mesh {axes} is one device; plan_check compares sharded decode steps")
    check_placement(config, placement)
    weights, tokens, num_new, rows, step, cache = decode_step_inputs(config, placement, batch, context, dtype)
    decode = jax.jit(functools.partial(engine_step, config, Parallel(placement)), static_argnames=("mode",))
    compiled = decode.lower(weights, tokens, num_new, rows, step, mode=SamplingMode.GREEDY, cache=cache).compile()
    memory = compiled.memory_analysis()
    (in_w, *in_host), in_kw = compiled.input_shardings
    in_c = in_kw["cache"]
    host = sum(sum(_per_device(x, sh).values()) for x, sh in zip((tokens, num_new, rows, step), in_host))
    return {
        "weights": _per_device(weights, in_w),
        "cache": _per_device(cache, in_c),
        "host_inputs": host,
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
    }


def _scaled(per_leaf: dict[str, int], layers: list[int], kind_counts: dict[int, int]) -> int:
    """Bytes of the full model from a cut one: each cut layer's leaves times its kind's count."""
    total = 0
    for name, size in per_leaf.items():
        cut = _layer_of(name)
        total += size if cut is None else size * kind_counts[layers[cut]]
    return total


def compare_with_xla(config: ModelConfig, name: str, work: Workload, axes: dict[str, int],
                     check_dtype: str = "float32", whole: bool = True) -> dict:
    """Planner against XLA, per component, for ``config`` on a mesh of ``axes`` (see module doc).

    ``whole``: compile every layer and compare everything as compiled. Otherwise compile one
    layer of each kind: weights and cache are XLA's per-leaf bytes scaled by the layer counts,
    against the planner's full model; activations are compared on the compiled model itself
    (the planner evaluated on that cut config), since part of them grows with depth.
    """
    checked = dataclasses.replace(work, weight_dtype=WeightDtype(check_dtype), kv_dtype=KVDtype(check_dtype))
    lowered, layers = (config, list(range(config.num_layers))) if whole else one_layer_per_kind(config)
    flags = config.moe.layers if config.moe is not None else (False,) * config.num_layers
    # How many layers of the full model each compiled layer stands for.
    kind_counts = {i: (1 if whole else flags.count(flags[i])) for i in layers}
    xla = xla_decode_memory(lowered, axes, work.batch, work.context, jnp.dtype(check_dtype))
    leaves = sum(xla["weights"].values()) + sum(xla["cache"].values()) + xla["host_inputs"]
    if leaves != xla["argument_bytes"]:
        raise AssertionError(f"per-leaf bytes {leaves} differ from XLA's argument size {xla['argument_bytes']}")
    planned = evaluate(DecodeFootprint(config, name), checked, axes)
    compiled_plan = planned if whole else evaluate(DecodeFootprint(lowered, name), checked, axes)
    planner_figures = {"weights": planned.bytes["weights"], "kv_cache": planned.bytes["kv_cache"],
                       "activations": compiled_plan.bytes["activations"]}
    xla_figures = {
        "weights": _scaled(xla["weights"], layers, kind_counts),
        "kv_cache": _scaled(xla["cache"], layers, kind_counts),
        "activations": xla["temp_bytes"] + xla["output_bytes"],  # the step's transients and results
    }
    planner_figures["total"] = sum(planner_figures.values())
    xla_figures["total"] = sum(xla_figures.values())
    return {
        "model": name, "mesh": planned.mesh, "mesh_text": planned.to_json()["mesh_text"],
        "strategy": planned.strategy, "batch": work.batch, "context": work.context,
        "check_dtype": check_dtype, "whole": whole, "layers_compiled": lowered.num_layers,
        "components": {k: {"planner": planner_figures[k], "xla": xla_figures[k],
                           "ratio": planner_figures[k] / xla_figures[k]} for k in planner_figures},
        "compiled": {"argument_bytes": xla["argument_bytes"], "output_bytes": xla["output_bytes"],
                     "temp_bytes": xla["temp_bytes"], "planner_peak_stage": compiled_plan.peak_stage},
    }
