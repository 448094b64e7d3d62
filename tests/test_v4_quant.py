"""DeepSeek-V4 with quantized weights (``--quantize``) and a quantized KV cache (``--kv-cache``).

The tiny random model of tests/v4_helpers.py (seed 5, as tests/test_v4_model.py), converted, against
HF fp32 over a 300-token prompt and HF's greedy tokens (conftest's ``quantized_vs_hf``, gated by
``tests.hf_helpers.MOE_GATES``). Also checked, device-free or nearly:

- which projections a weight scheme quantizes: q_a, q_b, kv, o_a, o_b and the experts (routed and
  shared); the compressors, indexer, hyper-connections, router, sinks, norms, embedding and head
  stay float. o_a [g, N*H/g, d_g] contracts its middle axis (in_axes (1,)): one scale per (group,
  output) per channel, per (group, block) with blocks, the group axis batch-like;
- the quantized cache stores window rings, entries and index keys quantized (one scale per row)
  and keeps the compressor states float;
- the KV rows are read as stored on every path: with an int8 cache the logits do not depend on
  how the prompt is cut into chunks (a row read in float in its own chunk and quantized in later
  ones would make them depend on it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.convert import load_checkpoint
from dayzero.model.cache import append_to_cache, init_cache
from dayzero.model.compressed_cache import cache_specs
from dayzero.model.quant import KVQuant, QuantConfig, QuantizedArray, ValueFormat, WeightQuant, dequantized, quantize
from dayzero.model.transformer import forward
from dayzero.model.weights import abstract_weights, is_spec_node, leaf_path, quantize_weights
from tests.hf_helpers import hf_logits, random_ids, within_moe_gates
from tests.v4_helpers import tiny_hf_model

LONG, SHORT, NEW = 300, 20, 32
SEED = 5  # tests/test_v4_model.py's seed: its routers and indexers have no near-ties on the long prompt
QUANTIZED = {"q_a", "q_b", "kv", "o_a", "o_b", "gate", "up", "down"}  # leaf names (attn, experts, shared MLP)


@pytest.fixture(autouse=True, scope="module")
def quick_compiles():
    """XLA's optimisation passes off for this module's tiny programs (as test_v4_model.py)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """What ``quantized_vs_hf`` reads: the converted tiny model (fp32), the long prompt and HF's
    logits of it (without our own float logits, which this module does not need)."""
    from types import SimpleNamespace

    hf = tiny_hf_model(SEED)
    _, dz = hf_factory.save_and_convert(hf, tmp_path_factory.mktemp("v4q"))
    config, weights = load_checkpoint(dz, dtype=jnp.float32)
    long_ids = random_ids(LONG, config.vocab_size, seed=1)
    return SimpleNamespace(name="deepseek_v4", hf=hf, config=config, weights=weights, long_ids=long_ids,
                           hf_long=hf_logits(hf, long_ids))


def _quantized_leaves(specs) -> dict[str, QuantizedArray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec_node)
    return {leaf_path(p): s for p, s in flat if isinstance(s, QuantizedArray)}


def test_quantized_projections(case):
    """int8 quantizes exactly V4's projections; o_a's scales: [g, 1, d_g] per channel, [g, ceil(In/bi),
    ceil(d_g/bo)] with blocks, split with the groups (axis q_heads) in both layouts."""
    config = case.config
    leaves = _quantized_leaves(abstract_weights(config, QuantConfig(WeightQuant.INT8)))
    assert {p.rsplit("/", 1)[-1] for p in leaves} == QUANTIZED
    assert not any(part in p for p in leaves for part in ("compressor", "indexer", "_hc", "hc_head", "router"))
    routed = {f"layers/{i}/mlp/{n}" for i in range(config.num_layers) for n in ("gate", "up", "down")}
    assert routed <= leaves.keys()
    cc, N, H = config.compressed, config.num_heads, config.head_dim
    g, dg = cc.o_groups, cc.o_lora_rank
    o_a = leaves["layers/0/attn/o_a"]
    assert o_a.values.shape == (g, N * H // g, dg) and o_a.in_axes == (1,)
    assert o_a.scale.shape == (g, 1, dg) and o_a.scale.axes == ("q_heads", None, None)
    block = abstract_weights(config, QuantConfig(WeightQuant.FP8_BLOCK, (48, 12))).layers[0].attn.o_a
    assert block.scale.shape == (g, math.ceil(N * H // g / 48), math.ceil(dg / 12))
    assert block.scale.axes == ("q_heads", None, None)
    int4 = _quantized_leaves(abstract_weights(config, QuantConfig(WeightQuant.INT4)))
    assert {p for p, s in int4.items() if s.fmt is ValueFormat.INT4} == routed


@pytest.mark.parametrize("fmt, block", [(ValueFormat.INT8, None), (ValueFormat.FP8, None),
                                        (ValueFormat.FP8, (48, 12)), (ValueFormat.FP8, (128, 128))])
def test_o_a_quantization_bound(case, fmt, block):
    """The converted o_a, quantized over its middle (input) axis: every element within the
    format's rounding bound of its own scale (int8: half a step; fp8: 2^-4 relative, 2^-10 of the
    scale below e4m3's normals), for channels and for full and partial blocks (48 x 12 over
    128 x 16: partial last blocks on both axes). A scale taken over the wrong axis breaks it."""
    w = np.asarray(case.weights.layers[1].attn.o_a, np.float32)
    q = quantize(w, fmt, (1,), block)
    back = np.asarray(dequantized(q, jnp.float32))
    scale = np.asarray(q.scale, np.float32)
    if block is not None:  # one scale per element
        scale = np.repeat(np.repeat(scale, block[0], axis=1), block[1], axis=2)[:, :w.shape[1], :w.shape[2]]
    scale = np.broadcast_to(scale, w.shape)
    err = np.abs(back - w)
    if fmt is ValueFormat.INT8:
        assert np.all(err <= scale / 2 * (1 + 1e-6))
    else:
        assert np.all(err <= np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6))
    assert np.abs(w).max() / scale.min() <= fmt.qmax * (1 + 1e-6) or block is not None


def test_kv_cache_quantizes_rows_and_keeps_states_float(case):
    """int8 / fp8 cache: window rings, entries and index keys quantized with one scale per row;
    the compressor states (running inputs of the softmax-weighted sums) stay float."""
    for kv, fmt in ((KVQuant.INT8, ValueFormat.INT8), (KVQuant.FP8, ValueFormat.FP8)):
        specs = cache_specs(case.config, 2, 64, kv)
        for layer, kind in zip(specs.layers, case.config.compressed.kinds):
            rows = [layer.window, layer.entries, layer.index_keys]
            for r in (r for r in rows if r is not None):
                assert isinstance(r, QuantizedArray) and r.fmt is fmt and r.scale.shape == (*r.values.shape[:2], 1)
            for state in (layer.state, layer.index_state):
                if state is not None:
                    assert all(s.dtype is None for s in (state.kv, state.gate)), kind


def _chunked_logits(config, weights, ids: np.ndarray, sizes: list[int], kv: KVQuant, T: int = 16) -> np.ndarray:
    """Logits of every position of ``ids`` [n] fed through an empty ``kv`` cache in chunks of
    ``sizes`` (one compiled step of T tokens, the rest padding)."""
    step = jax.jit(forward, static_argnums=(1,), static_argnames=("all_logits",))
    append = jax.jit(append_to_cache)
    cache = init_cache(config, 1, 128, jnp.float32, kv)
    out, done = [], 0
    for n in sizes:
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n] = ids[done:done + n]
        logits, new = step(weights, config, jnp.asarray(tokens), cache, jnp.asarray([n], jnp.int32), all_logits=True)
        cache = append(cache, new)
        out.append(np.asarray(logits[0, :n]))
        done += n
    return np.concatenate(out)


@pytest.mark.parametrize("kv", [KVQuant.INT8])
def test_kv_rows_are_read_as_stored(case, kv):
    """With an int8 cache, 100 tokens in chunks of 16 and in ragged chunks (1 to 16, windows of 4
    and 16 closing mid-chunk) give the same logits to fp32 rounding: every new window row, entry
    and index key is read as it will be stored. (Reading the new rows in float moves them by
    ~1e-2 relative: the check has power, see the report.)"""
    ids = random_ids(100, case.config.vocab_size, seed=4)[0]
    even = _chunked_logits(case.config, case.weights, ids, [16] * 6 + [4], kv)
    ragged = _chunked_logits(case.config, case.weights, ids, [5, 1, 16, 3, 1, 16, 9, 16, 13, 16, 4], kv)
    assert np.abs(even - ragged).max() <= 1e-5 * np.abs(even).max()


@pytest.mark.parametrize("scheme, kv", [
    ("none", "int8"),
    *(pytest.param(s, k, marks=pytest.mark.slow)
      for s, k in (("fp8-block", "none"), ("int8", "none"), ("fp8", "none"), ("int4", "none"), ("none", "fp8"))),
])
def test_quantized_model_against_hf(case, scheme, kv, quantized_vs_hf):
    """Quantized weights or cache against HF fp32: KL over the 300-token prompt and greedy
    agreement over HF's 32 tokens, within tests.hf_helpers.MOE_GATES."""
    result = quantized_vs_hf(case, scheme, kv, SHORT, NEW)
    print(scheme, kv, result)
    assert within_moe_gates(result, scheme, kv), result
