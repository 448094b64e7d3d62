"""DeepSeek-V4 with quantized weights (``--quantize``) and a quantized KV cache (``--kv-cache``).

Against HF fp32 (slow: 45-60 s per scheme here, each compiles the V4 forward afresh): the tiny random
model of tests/v4_helpers.py (seed 5, as tests/test_v4_model.py), converted, over a 300-token
prompt and HF's 32 greedy tokens (conftest's ``quantized_vs_hf``, gated by
``tests.hf_helpers.MOE_GATES``) for int8, fp8, fp8-block (128 x 128: one block per tiny matrix, one
per group of o_a), int4 experts, and int8 / fp8 caches. By default, device-free or nearly:

- which projections a weight scheme quantizes: q_a, q_b, kv, o_a, o_b and the experts (routed and
  shared); the compressors, indexer, hyper-connections, router, sinks, norms, embedding and head
  stay float. o_a [g, N*H/g, d_g] contracts its middle axis (in_axes (1,)): one scale per (group,
  output channel) per channel, per (group, block) with blocks, the group axis batch-like and split
  with the heads;
- o_a quantized in each layout: its scales are the absmax over the right elements, and every value
  is within its format's rounding bound (full and partial blocks);
- a quantized cache stores window rings, entries and index keys quantized (one scale per row) and
  keeps the compressor states float;
- the KV rows are read as stored on every path: with an int8 cache, the CSA block's outputs do
  not depend on how the tokens are cut into chunks (a row read in float in its own chunk and
  dequantized in later ones would make them depend on it: 5.1e-3 relative when tried).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.model import compressed, compressed_cache
from dayzero.model.cache import init_cache
from dayzero.model.config import CompressKind
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import KVQuant, QuantConfig, QuantizedArray, ValueFormat, WeightQuant, dequantized, quantize
from dayzero.model.rope import rope_cos_sin
from dayzero.model.weights import ParamSpec, abstract_weights, is_spec_node, leaf_path
from tests.hf_helpers import hf_logits, random_ids, within_moe_gates
from tests.v4_helpers import tiny_hf_config, tiny_hf_model

LONG, SHORT, NEW = 300, 20, 32
SEED = 5  # tests/test_v4_model.py's seed: its routers and indexers have no near-ties on the long prompt
# The tiny V4's logits are small (max |logit| 0.76 on the long prompt), so its KLs are ~100x below
# those MOE_GATES was measured on and its KL gates would pass a broken scheme (int8 with each
# channel's scales flipped across the outputs: kl_mean 3.3e-3, caught by greedy agreement 0.375
# alone). Measured kl_mean: int8 4.4e-5, fp8 1.4e-4, fp8-block 1.6e-4, int4 9.3e-5, kv int8 2.4e-5,
# kv fp8 8.8e-5; this bound is 3x the largest and 6.6x below the broken scheme.
V4_KL_MEAN = 5e-4
QUANTIZED = {"q_a", "q_b", "kv", "o_a", "o_b", "gate", "up", "down"}  # leaf names (attn, experts, shared MLP)


pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


@pytest.fixture(scope="module")
def config():
    """The tiny model's config (no weights)."""
    return parse_hf_config(tiny_hf_config().to_dict())


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """What ``quantized_vs_hf`` reads: the converted tiny model (fp32), the long prompt and HF's
    logits of it."""
    from types import SimpleNamespace

    from dayzero.convert import load_checkpoint

    hf = tiny_hf_model(SEED)
    _, dz = hf_factory.save_and_convert(hf, tmp_path_factory.mktemp("v4q"))
    config, weights = load_checkpoint(dz, dtype=jnp.float32)
    long_ids = random_ids(LONG, config.vocab_size, seed=1)
    return SimpleNamespace(name="deepseek_v4", hf=hf, config=config, weights=weights, long_ids=long_ids,
                           hf_long=hf_logits(hf, long_ids))


def _quantized_leaves(specs) -> dict[str, QuantizedArray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec_node)
    return {leaf_path(p): s for p, s in flat if isinstance(s, QuantizedArray)}


def test_quantized_projections(config):
    """int8 quantizes exactly V4's projections; o_a's scales are [g, 1, d_g] per channel and
    [g, ceil(In/bi), ceil(d_g/bo)] with blocks, split with the groups (q_heads) in both layouts;
    int4 takes the routed experts (hash-routed layers' too), int8 the rest."""
    leaves = _quantized_leaves(abstract_weights(config, QuantConfig(WeightQuant.INT8)))
    assert {p.rsplit("/", 1)[-1] for p in leaves} == QUANTIZED
    assert not any(part in p for p in leaves for part in ("compressor", "indexer", "_hc", "hc_head", "router"))
    routed = {f"layers/{i}/mlp/{n}" for i in range(config.num_layers) for n in ("gate", "up", "down")}
    assert routed <= leaves.keys()
    g, dg, N, H = config.compressed.o_groups, config.compressed.o_lora_rank, config.num_heads, config.head_dim
    o_a = leaves["layers/0/attn/o_a"]
    assert o_a.values.shape == (g, N * H // g, dg) and o_a.in_axes == (1,)
    assert o_a.scale.shape == (g, 1, dg) and o_a.scale.axes == ("q_heads", None, None)
    block = abstract_weights(config, QuantConfig(WeightQuant.FP8_BLOCK, (48, 12))).layers[0].attn.o_a
    assert block.scale.shape == (g, math.ceil(N * H // g / 48), math.ceil(dg / 12))
    assert block.scale.axes == ("q_heads", None, None)
    int4 = _quantized_leaves(abstract_weights(config, QuantConfig(WeightQuant.INT4)))
    assert {p for p, s in int4.items() if s.fmt is ValueFormat.INT4} == routed
    # The published formats (mxfp4+fp8-block): routed experts MXFP4 in blocks of 32 inputs, every
    # other projection FP8 in the checkpoint's blocks.
    both = _quantized_leaves(abstract_weights(config, QuantConfig(WeightQuant.MXFP4_FP8_BLOCK, (128, 128))))
    assert both.keys() == leaves.keys()
    assert {p for p, s in both.items() if (s.fmt, s.block) == (ValueFormat.MXFP4, (32, 1))} == routed
    assert all((s.fmt, s.block) == (ValueFormat.FP8, (128, 128)) for p, s in both.items() if p not in routed)


def _block_absmax(w: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    """Per element, the absmax of its scale's elements: o_a's inputs (axis 1) per (group, output)
    channel, or its [bi, bo] block of each group's [In, Out] matrix."""
    a = np.abs(w)
    if block is None:
        return np.broadcast_to(a.max(axis=1, keepdims=True), a.shape)
    g, n_in, n_out = a.shape
    out = np.empty_like(a)
    for i in range(0, n_in, block[0]):
        for o in range(0, n_out, block[1]):
            tile = a[:, i:i + block[0], o:o + block[1]]
            out[:, i:i + block[0], o:o + block[1]] = tile.max(axis=(1, 2), keepdims=True)
    return out


@pytest.mark.parametrize("fmt, block", [(ValueFormat.INT8, None), (ValueFormat.FP8, None),
                                        (ValueFormat.FP8, (48, 12)), (ValueFormat.FP8, (128, 128))])
def test_o_a_quantization(config, fmt, block):
    """o_a quantized over its inputs (axis 1) as the model declares it: each element's scale is the
    absmax of its channel / block over qmax (48 x 12 over 128 x 16: partial blocks on both axes;
    128 x 128: one block per group), and every element is within the format's rounding bound
    (int8: half a step; fp8: 2^-4 relative, or 2^-10 of the scale below e4m3's normals). The
    weights' magnitudes vary by input row and output column, so a scale over the wrong axis fails."""
    g, dg, N, H = config.compressed.o_groups, config.compressed.o_lora_rank, config.num_heads, config.head_dim
    rng = np.random.default_rng(0)
    w = rng.standard_normal((g, N * H // g, dg)) * np.exp(rng.uniform(-2, 2, (g, N * H // g, 1)))
    w = (w * np.exp(rng.uniform(-2, 2, (g, 1, dg)))).astype(np.float32)
    spec = abstract_weights(config).layers[0].attn.o_a
    assert spec.shape == w.shape
    q = quantize(w, fmt, spec.in_axes, block)
    scale = np.asarray(q.scale, np.float32)
    if block is not None:
        scale = np.repeat(np.repeat(scale, block[0], axis=1), block[1], axis=2)[:, :w.shape[1], :w.shape[2]]
    scale = np.broadcast_to(scale, w.shape)
    np.testing.assert_allclose(scale, _block_absmax(w, block) / fmt.qmax, rtol=1e-6)
    err = np.abs(np.asarray(dequantized(q, jnp.float32)) - w)
    bound = scale / 2 if fmt is ValueFormat.INT8 else np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10)
    assert np.all(err <= bound * (1 + 1e-6))


@pytest.mark.parametrize("kv, fmt", [(KVQuant.INT8, ValueFormat.INT8), (KVQuant.FP8, ValueFormat.FP8)])
def test_kv_cache_quantizes_rows_and_keeps_states_float(config, kv, fmt):
    """Window rings, entries and index keys are stored quantized with one scale per row; the
    compressor states (the inputs of the entries' softmax-weighted sums) stay float."""
    specs = compressed_cache.cache_specs(config, 2, 64, kv)
    for layer, kind in zip(specs.layers, config.compressed.kinds):
        rows = [r for r in (layer.window, layer.entries, layer.index_keys) if r is not None]
        assert len(rows) == {CompressKind.SLIDING: 1, CompressKind.HCA: 2, CompressKind.CSA: 3}[kind]
        for r in rows:
            assert isinstance(r, QuantizedArray) and r.fmt is fmt and r.scale.shape == (*r.values.shape[:2], 1)
        for state in (s for s in (layer.state, layer.index_state) if s is not None):
            assert all(isinstance(s, ParamSpec) and s.dtype is None for s in (state.kv, state.gate)), kind


def _chunked_csa(config, sizes: list[int], kv: KVQuant, T: int = 16) -> np.ndarray:
    """The CSA block's outputs [n, D] for 100 random hidden states fed through an empty ``kv``
    cache in chunks of ``sizes`` (one compiled step of T tokens, the rest padding), with
    numpy-drawn weights (randomised sinks and position biases)."""
    i = config.compressed.kinds.index(CompressKind.CSA)
    rng = np.random.default_rng(0)
    w = jax.tree.map(lambda p: (0.3 * rng.standard_normal(p.shape) + (p.init.value == "ones")).astype(np.float32),
                     abstract_weights(config).layers[i].attn, is_leaf=lambda p: isinstance(p, ParamSpec))
    x = rng.standard_normal((1, sum(sizes), config.hidden_size)).astype(np.float32)
    full = init_cache(config, 1, 128, jnp.float32, kv)
    cache = full.replace(layers=(full.layers[i],))
    out, done = [], 0
    for n in sizes:
        chunk = np.zeros((1, T, config.hidden_size), np.float32)
        chunk[:, :n] = x[:, done:done + n]
        y, cache = _csa_step(w, config, jnp.asarray(chunk), cache, jnp.asarray([n], jnp.int32))
        out.append(np.asarray(y[0, :n]))
        done += n
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnums=(1,))
def _csa_step(w, config, x, cache, num_new):
    """One chunk through the CSA block and its cache write."""
    starts = cache.lengths
    rope_len = jnp.max(starts + num_new)
    positions = starts[:, None] + jnp.arange(x.shape[1])[None, :]
    cos_sin = rope_cos_sin(config.compressed.compress_rope, config.head_dim, config.max_position_embeddings,
                           positions, rope_len)
    y, new = compressed.compressed_block(w, config, CompressKind.CSA, x, cos_sin, cache.layers[0], starts, num_new)
    return y, compressed_cache.append(cache, compressed_cache.NewCompressed((new,), num_new, rope_len))


# fp8 -m slow: the same path with another stored format, at one more compile (~5 s).
@pytest.mark.parametrize("kv", [KVQuant.INT8, pytest.param(KVQuant.FP8, marks=pytest.mark.slow)])
def test_kv_rows_are_read_as_stored(config, kv):
    """With a quantized cache, the CSA block over 100 tokens in chunks of 16 and in ragged
    chunks (1 to 16 tokens: windows of 4 and the 16-token ring wrapping mid-chunk) gives the same
    outputs to fp32 rounding: every new window row, entry and index key is read as it will be
    stored, so what a token sees does not depend on whether its keys came in its own chunk."""
    even = _chunked_csa(config, [16] * 6 + [4], kv)
    ragged = _chunked_csa(config, [5, 1, 16, 3, 1, 16, 9, 16, 13, 16, 4], kv)
    assert np.abs(even - ragged).max() <= 1e-5 * np.abs(even).max()


@pytest.mark.slow  # 45-60 s per scheme (a V4 forward compile each, HF's greedy tokens)
@pytest.mark.parametrize("scheme, kv", [("int8", "none"), ("fp8", "none"), ("fp8-block", "none"),
                                        ("int4", "none"), ("none", "int8"), ("none", "fp8")])
def test_quantized_model_against_hf(case, scheme, kv, quantized_vs_hf):
    """Quantized weights or cache against HF fp32: KL over the 300-token prompt and greedy
    agreement over HF's 32 tokens, within tests.hf_helpers.MOE_GATES (bounds justified there) and
    within V4_KL_MEAN."""
    result = quantized_vs_hf(case, scheme, kv, SHORT, NEW)
    assert within_moe_gates(result, scheme, kv) and result["kl_mean"] <= V4_KL_MEAN, result
