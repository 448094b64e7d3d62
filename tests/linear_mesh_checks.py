"""Linear-attention hybrids on a mesh of 8 faked CPU devices, run in a fresh interpreter by
tests/test_linear_mesh.py (the device count is fixed when jax starts; ``tests.mesh_checks.run_part``
with ``module="tests.linear_mesh_checks"``).

``python -m tests.linear_mesh_checks PART CONFIG_JSON`` prints one JSON object. CONFIG_JSON is a
tiny model's ``ModelConfig.to_json`` (the test parses tests/linear_helpers.py's HF configs, so that
this process need not import torch); the weights are drawn here (:func:`random_weights`).

- ``specs``: the partition specs of the linear layers' states, device-free: in generate's
  contiguous cache (4 rows) and in the serving pool (2 slots) on each mesh of ``SPEC_MESHES``;
- ``run``: ``Engine.generate`` (greedy) and serving (2 slots, 4 requests) on one device and on each
  mesh of ``RUN_MESHES``, with the specs of the state pools the servers held (one per replica).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine import Engine, SamplingParams
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.model.cache import cache_specs
from dayzero.model.config import ModelConfig
from dayzero.model.paged_cache import paged_cache_specs
from dayzero.model.weights import Init, ParamSpec, abstract_weights, map_specs
from dayzero.sharding.placement import placement_for

RUN_MESHES = {"tp2ep4": {"tensor": 2, "expert": 4}, "dp4tp2": {"data": 4, "tensor": 2}}
# dp2tp4: tensor=4 splits 4 value heads but not 2 key heads (Qwen3-Next) nor 2 heads (Kimi).
SPEC_MESHES = {**RUN_MESHES, "dp2tp4": {"data": 2, "tensor": 4}}
LENGTHS = (37, 5, 21, 50)  # 4 rows: generate's batch splits over data=4
NEW = 6
# 2 slots, prefill chunks of 32 (a 37- and a 50-token prompt take two), one table width.
SERVING = ServingConfig(slots=2, page_size=16, max_context=64, max_chunk=32, min_chunk=32, min_table_pages=4)


def random_weights(config: ModelConfig, seed: int = 0):
    """Weights as ``init_weights`` draws them (N(0, 0.2) matrices: O(1) logits; ones, zeros),
    drawn by numpy: ``init_weights`` compiles a sampler per leaf shape (seconds per model here)."""
    rng = np.random.default_rng(seed)

    def draw(spec: ParamSpec):
        value = {Init.ONES: np.ones, Init.ZEROS: np.zeros}.get(spec.init)
        value = 0.2 * rng.standard_normal(spec.shape) if value is None else value(spec.shape)
        return jnp.asarray(value, spec.dtype or jnp.float32)

    return map_specs(draw, abstract_weights(config))


def prompts(config: ModelConfig) -> list[list[int]]:
    """The requests: random ids of ``LENGTHS`` below the vocabulary size."""
    return [np.random.default_rng(s).integers(0, config.vocab_size, n).tolist() for s, n in enumerate(LENGTHS)]


def _spec(leaf) -> list[str] | None:
    """A sharding's (or an array's) partition spec, one entry per dimension; None on one device."""
    spec = getattr(leaf.sharding if isinstance(leaf, jax.Array) else leaf, "spec", None)
    if spec is None:
        return None
    spec = [str(a) for a in spec]
    if isinstance(leaf, jax.Array):  # an array's spec drops its trailing Nones
        spec += ["None"] * (leaf.ndim - len(spec))
    return spec


def state_specs_of(tree) -> dict[str, list[str]]:
    """The first linear layer's state leaves' partition specs in a cache (or shardings) tree."""
    state = tree.states[0]
    return {name: _spec(getattr(state, name)) for name in ("conv_q", "conv_k", "conv_v", "recurrent")}


def part_specs(config_json: str) -> dict:
    """Device-free: the states' specs on each mesh of ``SPEC_MESHES``, in generate's contiguous
    cache of 4 rows and in a (not replicated) serving pool of 2 slots."""
    config = ModelConfig.from_json(json.loads(config_json))
    out = {}
    for name, axes in SPEC_MESHES.items():
        placement = placement_for(axes)
        out[name] = {"contiguous": state_specs_of(placement.shardings(cache_specs(config, 4, 64))),
                     "pool": state_specs_of(placement.shardings(paged_cache_specs(config, 8, 16, state_slots=2)))}
    return out


def _served(engine: Engine, ids: list[list[int]]) -> tuple[list, dict]:
    """Greedy completions of ``ids`` served concurrently, and the per-replica pools' state specs."""
    server = ServingEngine(engine, SERVING)
    done = server.run(ids, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    pools = [state_specs_of(r.steps.pool) for r in server.replicas]
    return done, {"replicas": len(server.replicas), "pool": pools[0], "same_pools": all(p == pools[0] for p in pools)}


def compare(ref: list, got: list) -> dict:
    """Token agreement and the largest logprob difference of two lists of completions."""
    return {"same_tokens": [a.token_ids for a in ref] == [b.token_ids for b in got],
            "logprob_diff": max(float(np.max(np.abs(np.subtract(a.logprobs, b.logprobs)))) for a, b in zip(ref, got))}


def part_run(config_json: str) -> dict:
    """Greedy generate and serving on one device, then on each mesh of ``RUN_MESHES``: each
    compared with one device, and the specs of the states the mesh runs held."""
    jax.config.update("jax_disable_most_optimizations", True)  # tiny programs: compile time dominates
    config = ModelConfig.from_json(json.loads(config_json))
    weights, ids = random_weights(config), prompts(config)
    params = [SamplingParams()] * len(ids)
    one = Engine(config, weights).generate(ids, max_new_tokens=NEW, sampling=params, ignore_eos=True, logprobs=True)
    served_one, _ = _served(Engine(config, weights), ids)
    out = {"devices": jax.device_count(), "served_vs_generate": compare(one, served_one),
           "distinct_tokens": len({t for c in one for t in c.token_ids})}
    for name, axes in RUN_MESHES.items():
        engine = Engine(config, weights, placement=placement_for(axes))
        got = engine.generate(ids, max_new_tokens=NEW, sampling=params, ignore_eos=True, logprobs=True)
        served, pool = _served(engine, ids)
        out[name] = {"generate": compare(one, got), "served": compare(served_one, served), **pool}
    return out


PARTS = {"specs": part_specs, "run": part_run}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
