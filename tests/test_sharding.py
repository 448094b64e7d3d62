"""Sharding rules: the resolver, mesh construction, and sharded forward == one-device forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from dayzero.sharding import rules as R
from dayzero.sharding.distributed import MeshError


class FakeMesh:
    """Just the ``shape`` mapping spec_for reads, so resolver tests need no real devices."""

    def __init__(self, **sizes):
        self.shape = {"data": 1, "tensor": 1, "expert": 1, **sizes}


def test_every_strategy_resolves_the_weight_axes():
    mesh = FakeMesh(data=2, tensor=4, expert=2)
    assert R.spec_for(("embed", "q_heads", "head_dim"), R.tensor_parallel(), mesh) == P(None, "tensor", None)
    assert R.spec_for(("experts", "embed", "ffw"), R.tensor_expert_parallel(), mesh) == P("expert", None, "tensor")
    assert R.spec_for(("batch", "seq", "vocab"), R.data_tensor(), mesh) == P("data", None, "tensor")
    assert R.spec_for(("vocab", "embed"), R.single_device(), mesh) == P(None, None)
    assert R.spec_for((None, "latent"), R.tensor_parallel(), mesh) == P(None, None)


def test_double_used_mesh_axis_is_rejected():
    # q_heads and kv_heads both go to "tensor": one array cannot be split over it twice.
    with pytest.raises(ValueError, match="'tensor' used twice"):
        R.spec_for(("q_heads", "kv_heads"), R.tensor_parallel(), FakeMesh(tensor=2))
    # Even where the mesh would replicate both, the rules table is still wrong.
    with pytest.raises(ValueError, match="used twice"):
        R.spec_for(("ffw", "vocab"), R.tensor_parallel(), FakeMesh())


def test_indivisible_dimension_is_replicated():
    mesh = FakeMesh(tensor=8)
    assert R.spec_for(("embed", "kv_heads", "head_dim"), R.tensor_parallel(), mesh, (64, 2, 16)) == P(None, None, None)
    assert R.spec_for(("embed", "kv_heads", "head_dim"), R.tensor_parallel(), mesh, (64, 8, 16)) == P(None, "tensor", None)


def test_unknown_logical_axis_and_bad_tables():
    with pytest.raises(ValueError, match="no rule"):
        R.spec_for(("heads",), R.tensor_parallel(), FakeMesh())
    with pytest.raises(ValueError, match="missing logical axes"):
        R.Rules("partial", {"embed": None})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        R.Rules("typo", {**{a: None for a in R.LOGICAL_AXES}, "ffw": "tensr"})


def test_rules_cover_every_axis_the_model_uses():
    from dayzero.model.weights import abstract_weights, is_spec

    names = {a for s in jax.tree.leaves(abstract_weights(_tiny_config()), is_leaf=is_spec) for a in s.axes}
    assert names - {None} <= set(R.LOGICAL_AXES)


def test_expert_parallel_splits_experts_and_their_width():
    from dataclasses import replace

    from dayzero.model.config import MoEConfig
    from dayzero.model.weights import abstract_weights, is_spec

    moe = MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=32, layers=(True, True))
    specs = abstract_weights(replace(_tiny_config(), moe=moe))
    mesh = FakeMesh(tensor=2, expert=4)
    resolved = jax.tree.map(
        lambda s: R.spec_for(s.axes, R.tensor_expert_parallel(), mesh, s.shape), specs, is_leaf=is_spec
    )
    layer = resolved.layers[0].mlp
    assert layer.gate == P("expert", None, "tensor")
    assert layer.down == P("expert", "tensor", None)
    assert layer.router == P(None, None)


def test_cache_specs_resolve_per_strategy():
    from dataclasses import replace

    from dayzero.model.config import AttentionKind, MLAConfig
    from dayzero.model.cache import cache_specs, init_cache
    from dayzero.model.weights import is_spec

    resolve = lambda specs, rules, mesh: jax.tree.map(  # noqa: E731
        lambda s: R.spec_for(s.axes, rules, mesh, s.shape), specs, is_leaf=is_spec
    )
    config = _tiny_config()
    dense = resolve(cache_specs(config, 4, 32), R.data_tensor(), FakeMesh(data=2, tensor=4))
    assert dense.k[0] == P("data", "tensor", None, None)
    assert dense.v[1] == P("data", "tensor", None, None)
    assert dense.lengths == P("data")
    # The latent cache has no head axis: its positions are split over tensor instead.
    mla = replace(config, attention=AttentionKind.MLA,
                  mla=MLAConfig(q_lora_rank=None, kv_lora_rank=32, nope_dim=8, rope_dim=8, v_head_dim=8))
    latent = resolve(cache_specs(mla, 4, 32), R.tensor_parallel(), FakeMesh(tensor=4))
    assert latent.latent[0] == P(None, "tensor", None)
    # init_cache allocates exactly the declared shapes.
    assert jax.tree.map(lambda s: s.shape, cache_specs(mla, 4, 32), is_leaf=is_spec) == jax.tree.map(
        lambda a: a.shape, init_cache(mla, 4, 32)
    )


def test_make_mesh_checks_the_device_count():
    n = len(jax.devices())
    mesh = R.make_mesh({"tensor": n})
    assert dict(mesh.shape) == {"data": 1, "tensor": n, "expert": 1, "stage": 1}
    with pytest.raises(MeshError, match="needs"):
        R.make_mesh({"tensor": n + 1})
    with pytest.raises(MeshError, match="unknown mesh axes"):
        R.make_mesh({"model": 1})


def test_rules_follow_the_mesh_axes():
    from dayzero.sharding.placement import rules_for_mesh

    assert rules_for_mesh({}).name == "single_device"
    assert rules_for_mesh({"tensor": 1, "data": 1}).name == "single_device"
    assert rules_for_mesh({"tensor": 8}).name == "tensor_parallel"
    assert rules_for_mesh({"expert": 8}).name == "tensor_expert_parallel"
    assert rules_for_mesh({"tensor": 2, "expert": 4}).name == "tensor_expert_parallel"
    assert rules_for_mesh({"data": 2}).name == "data_tensor"
    assert rules_for_mesh({"data": 2, "tensor": 4}).name == "data_tensor"
    with pytest.raises(MeshError, match="data=2 x expert=4 is not supported"):
        rules_for_mesh({"data": 2, "expert": 4})
    # ``stage`` composes with every strategy: stacked layers split over it, the rest as before.
    assert rules_for_mesh({"stage": 2, "tensor": 4}).name == "tensor_parallel"
    assert rules_for_mesh({"stage": 4, "expert": 2}).name == "tensor_expert_parallel"
    for rules in (R.single_device(), R.tensor_parallel(), R.tensor_expert_parallel(), R.data_tensor()):
        assert R.spec_for(("stage", "embed", "q_heads"), rules, FakeMesh(stage=2, tensor=4))[0] == "stage"


def test_stage_mesh_axis_parses_and_lays_out_slowest():
    from dayzero.sharding.distributed import parse_mesh

    assert parse_mesh("stage=2,tensor=4") == {"stage": 2, "tensor": 4}
    # Stage slowest-varying: stage 0 holds devices 0..3, so one process per stage holds whole stages.
    grid = R.device_grid({"data": 1, "tensor": 4, "expert": 1, "stage": 2}, list(range(8)))
    assert grid.shape == (1, 4, 1, 2)
    assert sorted(grid[..., 0].reshape(-1)) == [0, 1, 2, 3]
    assert R.grid_devices(grid) == list(range(8))


def test_one_device_mesh_is_the_single_device_path():
    from dayzero.sharding.placement import placement_from_text

    assert placement_from_text(None) is None
    assert placement_from_text("tensor=1,data=1") is None
    with pytest.raises(MeshError, match="tensor=2 needs 2 devices"):
        placement_from_text("tensor=2")


def test_placements_are_hashable_jit_statics():
    from dayzero.sharding.placement import Placement

    mesh = R.make_mesh({"tensor": 1})
    a, b = Placement(mesh, R.tensor_parallel()), Placement(mesh, R.tensor_parallel())
    assert a == b and hash(a) == hash(b)
    assert a != Placement(mesh, R.data_tensor())


def test_expert_parallel_capacity_policy():
    from dayzero.model.moe_parallel import check_expert_parallel
    from dayzero.model.parallel import Parallel

    class EightExperts:  # Parallel reads only the rules and the mesh's axis sizes
        mesh = FakeMesh(expert=8)
        rules = R.tensor_expert_parallel()

    # No factor: room for every pair of a device's tokens at one destination (never drops).
    assert Parallel(EightExperts()).capacity(tokens_per_device=4, experts_per_token=2) == 8
    # A factor scales the average load per destination, never beyond the no-drop size.
    assert Parallel(EightExperts(), 2.0).capacity(32, 2) == 16
    assert Parallel(EightExperts(), 100.0).capacity(32, 2) == 64
    assert Parallel(EightExperts(), 0.01).capacity(32, 2) == 1
    with pytest.raises(ValueError, match="capacity_factor"):
        Parallel(EightExperts(), 0.0)
    with pytest.raises(ValueError, match="6 experts do not split evenly over expert=4"):
        check_expert_parallel(6, 4)


def test_engine_refuses_meshes_the_model_cannot_use():
    from dataclasses import replace

    from dayzero.engine.runtime import RunConfigError, check_placement
    from dayzero.model.config import MoEConfig

    class Axes:
        def __init__(self, **sizes):
            self.axes = {"data": 1, "tensor": 1, "expert": 1, **sizes}

    with pytest.raises(RunConfigError, match="expert=4 needs a Mixture-of-Experts model"):
        check_placement(_tiny_config(), Axes(expert=4))
    moe = MoEConfig(num_experts=6, experts_per_token=2, intermediate_size=32, layers=(True, True))
    with pytest.raises(RunConfigError, match="6 experts do not split evenly"):
        check_placement(replace(_tiny_config(), moe=moe), Axes(expert=4))
    check_placement(_tiny_config(), Axes(tensor=8))  # any dense model runs tensor-parallel


def _tiny_config():
    from dayzero.model.config import Family, ModelConfig, RopeConfig

    # Head counts and widths divisible by 8 so tensor=8 really splits every tensor-parallel dim.
    return ModelConfig(
        family=Family.LLAMA,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=8,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope=RopeConfig(),
    )


# Runs in a fresh interpreter: the device count is fixed when jax first initialises, and the
# pytest process has already done so with one CPU device.
SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.model.transformer import forward
from dayzero.sharding import rules as R
from tests.test_sharding import _tiny_config

config = _tiny_config()
specs = abstract_weights(config)
weights = init_weights(specs, jax.random.key(0), scale=0.1)
tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
run = jax.jit(lambda w, t: forward(w, config, t, cache=None, all_logits=True)[0])
ref = np.asarray(run(weights, tokens))
out = {"devices": len(jax.devices())}
for name, rules, axes in [("tp8", R.tensor_parallel(), {"tensor": 8}),
                          ("dp2tp4", R.data_tensor(), {"data": 2, "tensor": 4})]:
    mesh = R.make_mesh(axes)
    shardings = R.weight_shardings(specs, rules, mesh)
    sharded = jax.device_put(weights, shardings)
    batch = jax.sharding.NamedSharding(mesh, R.spec_for(("batch", "seq"), rules, mesh, tokens.shape))
    logits = run(sharded, jax.device_put(tokens, batch))
    q = sharded.layers[0].attn.q.sharding.spec
    out[name] = {
        "err": float(np.max(np.abs(np.asarray(logits) - ref)) / np.max(np.abs(ref))),
        "q_spec": [a for a in q],
        "q_shard_shape": list(sharded.layers[0].attn.q.addressable_shards[0].data.shape),
        "token_spec": [a for a in batch.spec],
    }
print(json.dumps(out))
"""


def test_sharded_forward_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    for name in ("tp8", "dp2tp4"):
        # Same maths, different summation order across shards: agree to fp32 rounding.
        assert result[name]["err"] < 1e-5, result
    assert result["tp8"]["q_spec"] == [None, "tensor", None]
    assert result["tp8"]["q_shard_shape"] == [64, 1, 8]
    assert result["dp2tp4"]["q_shard_shape"] == [64, 2, 8]
    assert result["dp2tp4"]["token_spec"] == ["data", None]
