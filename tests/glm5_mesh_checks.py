"""GLM-5 on 8 faked CPU devices, run in a fresh interpreter by tests/test_glm5.py.

``python -m tests.glm5_mesh_checks mesh`` (XLA_FLAGS as tests/mesh_checks.py sets them) prints
one JSON object: the all-position logits of a tiny random GLM-5 (full and shared indexer layers,
index_topk 8 of 40 tokens, a dense first layer, then MoE with a shared expert) on tensor=2 x
expert=4 and data=2 x tensor=4 against one device, the routing margin, and greedy generation
on tensor=2 x expert=4 against one device.
"""

from __future__ import annotations

import json
import sys

import jax

from dayzero.engine.generate import Engine
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.sharding.placement import placement_for
from tests.mesh_checks import compare, generation, logits_and_router_gap, rel_err, sharded_logits
from tests.serving_models import DSA

GLM5 = dict(DSA, model_type="glm_moe_dsa", num_hidden_layers=4, first_k_dense_replace=1,
            indexer_types=["full", "shared", "full", "shared"], n_routed_experts=8, n_shared_experts=1,
            routed_scaling_factor=2.5)


def part_mesh() -> dict:
    """GLM-5's blocks on two meshes: logits and generation as on one device."""
    config = parse_hf_config(GLM5)
    keys = iter(jax.random.split(jax.random.key(5), 128))
    weights = init_weights(abstract_weights(config), next(keys), scale=0.2)
    # Random norms, LayerNorm biases and selection biases: the constant init would hide a misplaced one.
    weights = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(next(keys), w.shape, w.dtype), weights)
    tokens = jax.random.randint(jax.random.key(1), (4, 40), 0, config.vocab_size)
    ref, gap = logits_and_router_gap(config, weights, tokens)
    out = {"router_gap": gap}
    for name, axes in (("tp2ep4", {"tensor": 2, "expert": 4}), ("dp2tp4", {"data": 2, "tensor": 4})):
        out[name] = {"err": rel_err(sharded_logits(config, weights, tokens, axes, True), ref)}
    out["tp2ep4"]["generate"] = compare(generation(Engine(config, weights)),
                                        generation(Engine(config, weights, placement=placement_for(
                                            {"tensor": 2, "expert": 4}))))
    return out


PARTS = {"mesh": part_mesh}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
