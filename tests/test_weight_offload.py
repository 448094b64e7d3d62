"""Weight offload (``dayzero.model.offload``): decoder layers in host memory, streamed to the device.

On one CPU device and on a faked 2-device mesh (tensor=2, in a subprocess: the device count is
fixed when jax starts): ``forward`` over offloaded layers gives exactly the logits of the same
weights on the device (dense, MoE, int8 MoE), the layer arrays sit in ``pinned_host`` with their
mesh and spec unchanged, and the compiled step's device-resident parameter bytes fit a budget
smaller than the layers' total bytes, a budget the on-device weights do not fit. On XLA:CPU host
and device memory are the same RAM, so these check the program's structure (which parameters the
compiled step reads from host memory space), not a transfer's speed (bench/weight_offload.py).

Run as ``python -m tests.test_weight_offload mesh`` it prints the mesh checks' JSON result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from dayzero.model.config import Family, ModelConfig, MoEConfig, RopeConfig
from dayzero.model.offload import OffloadError, device_resident_bytes, host_memory_kind, offload_layers
from dayzero.model.quant import QuantConfig, WeightQuant, stored_bytes
from dayzero.model.transformer import forward
from dayzero.model.weights import abstract_weights
from tests.mesh_quant_checks import quantized_weights

ROOT = Path(__file__).resolve().parent.parent  # the repository root


def dense_config() -> ModelConfig:
    """A tiny Llama-style decoder of 2 layers (widths divisible by 2: tensor=2 splits them)."""
    return ModelConfig(family=Family.LLAMA, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=128,
                       rope=RopeConfig())


def moe_config() -> ModelConfig:
    """The dense config with 8 experts of width 32 (top-2) in every layer."""
    moe = MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(True,) * 2)
    return dataclasses.replace(dense_config(), moe=moe)


CONFIGS = {"dense": (dense_config, None), "moe": (moe_config, None), "moe-int8": (moe_config, WeightQuant.INT8)}
MESH_CONFIGS = ("dense", "moe-int8")  # on the mesh: the float dense model and the quantized MoE


def model(name: str):
    """(config, weights on the default device, specs) of one of CONFIGS: random N(0, 0.2) weights
    (O(1) logits), quantized as it says."""
    make, scheme = CONFIGS[name]
    config = make()
    quant = None if scheme is None else QuantConfig(scheme)
    return config, jax.device_put(quantized_weights(config, quant, seed=0)), abstract_weights(config, quant)


def tokens(config) -> np.ndarray:
    """Two rows of 12 random token ids."""
    return np.asarray(jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size))


def step(config, parallel=None):
    """The jitted all-position forward pass."""
    return jax.jit(lambda w, t: forward(w, config, t, all_logits=True, parallel=parallel)[0])


def layer_kinds(weights) -> set[str]:
    """The memory kinds of every decoder-layer array."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(weights.layers)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_offloaded_logits_equal_and_fit_budget(name):
    config, weights, _ = model(name)
    offloaded = offload_layers(weights)
    assert layer_kinds(offloaded) == {"pinned_host"}
    assert offloaded.embed.sharding.memory_kind == "device"
    t = tokens(config)
    streamed, resident = (step(config).lower(w, t).compile() for w in (offloaded, weights))
    got, want = np.asarray(streamed(offloaded, t)), np.asarray(resident(weights, t))
    assert np.abs(want).max() > 0.5  # logits that mean something
    np.testing.assert_array_equal(got, want)
    # The compiled step keeps less than the layers alone in device memory; on-device weights do not fit.
    budget = stored_bytes(weights.layers) - 1
    assert device_resident_bytes(streamed) <= budget < device_resident_bytes(resident)
    # What stays on the device is the rest: embedding, final norm and the tokens.
    assert device_resident_bytes(streamed) == stored_bytes(weights) - stored_bytes(weights.layers) + t.nbytes


def test_decode_step_with_offloaded_layers():
    """A cached decode step over offloaded layers gives the on-device step's logits."""
    from dayzero.model.cache import append_to_cache, init_cache

    config, weights, _ = model("dense")
    t = tokens(config)
    run = jax.jit(lambda w, t, c: forward(w, config, t, c)[0])
    prefill = jax.jit(lambda w, t: forward(w, config, t)[1])
    cache = append_to_cache(init_cache(config, 2, 32, weights.embed.dtype), prefill(weights, t[:, :8]))
    want = np.asarray(run(weights, t[:, 8:9], cache))
    np.testing.assert_array_equal(np.asarray(run(offload_layers(weights), t[:, 8:9], cache)), want)


def test_device_weights_trace_unchanged():
    """On-device weights trace no transfer or barrier (the hook adds nothing); offloaded ones do,
    one move per layer array."""
    config, weights, _ = model("moe-int8")
    fn = lambda w, t: forward(w, config, t, all_logits=True)[0]  # noqa: E731
    t = tokens(config)
    plain = str(jax.make_jaxpr(fn)(weights, t))
    assert "device_put" not in plain and "optimization_barrier" not in plain
    streamed = jax.make_jaxpr(fn)(offload_layers(weights), t)
    moves = sum(e.primitive.name == "device_put" for e in streamed.jaxpr.eqns)
    assert moves == len(jax.tree.leaves(weights.layers))
    barriers = sum(e.primitive.name == "optimization_barrier" for e in streamed.jaxpr.eqns)
    assert barriers == config.num_layers - 1  # each layer after the first waits for its predecessor's input


def test_device_resident_bytes_reads_the_entry_layout():
    text = ("HloModule m, entry_computation_layout={(f32[4,8]{1,0:S(5)}, (s4[10]{0}, bf16[3,2]{1,0}), "
            "pred[], s8[2,2]{1,0:T(8,128)S(5)})->f32[4]{0}}")
    assert device_resident_bytes(text) == 5 + 12 + 1
    with pytest.raises(OffloadError, match="entry_computation_layout"):
        device_resident_bytes("HloModule m")


@pytest.mark.parametrize("kind", ["device", "hbm"])
def test_unknown_memory_kind_is_refused(kind):
    _, weights, _ = model("dense")
    with pytest.raises(OffloadError, match=f"memory_kind='{kind}' is not a host memory kind of the cpu backend"):
        offload_layers(weights, memory_kind=kind)


def test_unpinned_kind_and_backend_without_host_memory():
    _, weights, _ = model("dense")
    assert layer_kinds(offload_layers(weights, memory_kind="unpinned_host")) == {"unpinned_host"}
    memories = lambda *kinds: lambda: [SimpleNamespace(kind=k) for k in kinds]  # noqa: E731
    unpinned = SimpleNamespace(platform="tpu", addressable_memories=memories("device", "unpinned_host"))
    assert host_memory_kind([unpinned]) == "unpinned_host"
    bare = SimpleNamespace(platform="neuron", addressable_memories=memories("device"))
    with pytest.raises(OffloadError, match="the neuron backend has no host memory kind"):
        host_memory_kind([bare])


def test_mesh_weights_must_be_laid_out_first():
    from dayzero.sharding.placement import Placement
    from dayzero.sharding import rules as R

    _, weights, _ = model("dense")
    placement = Placement(R.make_mesh({"tensor": 1}), R.tensor_parallel())
    with pytest.raises(OffloadError, match="lay the weights out with placement.shardings"):
        offload_layers(jax.tree.map(np.asarray, weights), placement)


def test_two_device_mesh():
    # Backend optimisations off: compiles faster, and both programs compared are compiled alike.
    flags = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.test_weight_offload", "mesh"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in MESH_CONFIGS:
        r = result[name]
        assert r["max_abs_diff"] == 0.0, (name, r)
        assert r["kinds"] == ["pinned_host"], (name, r)
        assert r["specs_kept"], (name, r)
        assert r["split"], (name, r)  # tensor=2 really splits some layer array
        assert r["offloaded_bytes"] <= r["budget"] < r["resident_bytes"], (name, r)


def mesh_checks() -> dict:
    """The 2-device (tensor=2) checks, one entry per config: logits against the same weights on
    the mesh's devices, memory kinds, specs kept, per-device resident bytes against a budget of
    one device's share of the layers."""
    from dayzero.model.parallel import Parallel
    from dayzero.sharding.placement import placement_for

    placement = placement_for({"tensor": 2})
    out = {}
    for name in MESH_CONFIGS:
        config, weights, specs = model(name)
        laid = jax.device_put(weights, placement.shardings(specs))
        offloaded = offload_layers(laid, placement)
        run, t = step(config, Parallel(placement)), placement.replicate(tokens(config))
        before, after = (jax.tree.leaves(w.layers) for w in (laid, offloaded))
        per_device = sum(x.addressable_shards[0].data.nbytes for x in before)
        out[name] = {
            "max_abs_diff": float(np.abs(np.asarray(run(offloaded, t)) - np.asarray(run(laid, t))).max()),
            "kinds": sorted({x.sharding.memory_kind for x in after}),
            "specs_kept": all(a.sharding.spec == b.sharding.spec and a.sharding.mesh == b.sharding.mesh
                              for a, b in zip(before, after)),
            "split": any(x.addressable_shards[0].data.shape != x.shape for x in before),
            "budget": per_device - 1,
            "offloaded_bytes": device_resident_bytes(run.lower(offloaded, t).compile()),
            "resident_bytes": device_resident_bytes(run.lower(laid, t).compile()),
        }
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["mesh"]:
        sys.exit("usage: python -m tests.test_weight_offload mesh")
    print(json.dumps(mesh_checks()))
