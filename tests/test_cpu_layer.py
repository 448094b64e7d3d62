"""The native decoder layer of CPU decode (``kernels/cpu_layer``) against the ops it replaces
(``transformer.decoder_layer``'s norms, products, RoPE, in-place attention and MLP, which run when
``cpu_layer.applies`` is patched off), through ``transformer.forward`` over an in-place cache; where
it applies and where not; and ``Engine``'s decode through it against the per-op step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import cpu_layer, cpu_matvec
from dayzero.model.cache import InPlaceKVCache, InPlaceLayer, KVCache
from dayzero.model.config import Family, ModelConfig, RopeConfig
from dayzero.model.quant import QuantConfig, ValueFormat, WeightQuant, quantize
from dayzero.model.transformer import forward
from dayzero.model.weights import MoEWeights, abstract_weights, map_specs, quantize_weights

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def _config(**changes) -> ModelConfig:
    """Two small Llama layers: 4 query heads over 2 key/value heads of 16, a 48-wide MLP."""
    base = dict(family=Family.LLAMA, vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,
                rope=RopeConfig())
    return ModelConfig(**{**base, **changes})


def _weights(config: ModelConfig, seed: int = 0):
    """Weights drawn by numpy (N(0, 0.3) matrices: activations of order one; norms near 1)."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        if len(spec.shape) == 1:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(spec.shape), jnp.float32)
        return jnp.asarray(0.3 * rng.standard_normal(spec.shape), jnp.float32)

    return map_specs(draw, abstract_weights(config))


def _cache(config: ModelConfig, starts, S: int, seed: int = 1) -> KVCache:
    """A cache of ``S`` positions per row holding random keys/values before each row's start and
    NaN after it (never written: whatever sits there must not leak into an output)."""
    rng = np.random.default_rng(seed)
    B, K, H = len(starts), config.num_kv_heads, config.head_dim
    ks, vs = [], []
    for _ in range(config.num_layers):
        k = rng.standard_normal((B, K, H, S)).astype(np.float32)
        v = rng.standard_normal((B, K, S, H)).astype(np.float32)
        for b, s in enumerate(starts):
            k[b, :, :, s:], v[b, :, s:] = np.nan, np.nan
        ks.append(jnp.asarray(k))
        vs.append(jnp.asarray(v))
    lengths = jnp.asarray(starts, jnp.int32)
    return KVCache(k=tuple(ks), v=tuple(vs), lengths=lengths, rope_len=jnp.max(lengths))


def _step(config, weights, tokens, cache, num_new):
    """``forward`` over the cache written in place -> (all logits [B,T,V], the written cache)."""
    view = InPlaceKVCache(cache, num_new, tuple(config.sliding_windows))
    return forward(weights, config, tokens, view, num_new, all_logits=True)


def _run(config, weights, tokens, cache, num_new):
    """``_step`` compiled afresh (a new function: jit's trace cache must not hand back the other
    path's program) -> (logits, written cache, the program's text)."""
    step = jax.jit(lambda *args: _step(config, *args))
    return (*step(weights, tokens, cache, num_new), step.lower(weights, tokens, cache, num_new).as_text())


def _compare(config, starts, num_new, T, S=64, monkeypatch=None, quant=WeightQuant.NONE):
    weights = _weights(config)
    if quant is not WeightQuant.NONE:
        weights = quantize_weights(weights, abstract_weights(config, QuantConfig(quant)))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (len(starts), T)), jnp.int32)
    num_new = jnp.asarray(num_new, jnp.int32)
    native_logits, native_cache, text = _run(config, weights, tokens, _cache(config, starts, S), num_new)
    assert text.count(cpu_matvec.TARGET_DECODER_LAYER) == config.num_layers
    monkeypatch.setattr(cpu_layer, "applies", lambda *args: False)
    ref_logits, ref_cache, text = _run(config, weights, tokens, _cache(config, starts, S), num_new)
    assert cpu_matvec.TARGET_DECODER_LAYER not in text
    real = np.arange(T)[None, :] < np.asarray(num_new)[:, None]
    assert not np.isnan(np.asarray(native_logits)[real]).any()
    # Measured: <= 4.8e-6 on logits up to 8 (the same fp32 sums; RoPE and exp in another order).
    np.testing.assert_allclose(np.asarray(native_logits)[real], np.asarray(ref_logits)[real], atol=2e-5, rtol=2e-6)
    for got, want in zip(native_cache.k + native_cache.v, ref_cache.k + ref_cache.v):
        # NaN wherever nothing was written, in both; the new keys within fp32 rounding (measured:
        # <= 4.6e-6 in the second layer, whose input differs by the first's rounding).
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(native_cache.lengths), np.asarray(ref_cache.lengths))


# One decode token per row (rows at different lengths), a three-token verify step with a padded
# token and a row with none (an empty row: nothing real), a sliding window across the new keys,
# partial rotary (8 of 16 dimensions), a norm scale of 1 + weight (Gemma, Qwen3-Next).
@pytest.mark.parametrize("changes, starts, num_new, T", [
    ({}, [5, 30], [1, 1], 1),
    ({}, [12, 40], [3, 2], 3),
    ({}, [0, 9], [0, 1], 1),
    ({"sliding_windows": (None, 6)}, [20, 33], [2, 2], 2),
    ({"rope": RopeConfig(partial_rotary_factor=0.5)}, [7, 3], [1, 1], 1),
    ({"norm_weight_offset": 1.0}, [17, 2], [2, 1], 2),
])
def test_native_layer_equals_the_per_op_layer(native, monkeypatch, changes, starts, num_new, T):
    _compare(_config(**changes), starts, num_new, T, monkeypatch=monkeypatch)


def test_where_it_applies(native):
    """A plain Llama layer over an in-place cache, float32 or with int8 / int4 projections; not fp8
    or bfloat16 weights, one with biases, q/k norms or sinks, an MoE layer, bfloat16 activations,
    or a step that appends its keys afterwards."""
    config = _config()
    w = _weights(config).layers[0]
    x = jnp.zeros((1, 1, config.hidden_size), jnp.float32)
    cos = jnp.zeros((1, 1, config.head_dim), jnp.float32)
    cache = _cache(config, [3], 16)
    layer = InPlaceLayer(cache.k[0], cache.v[0], cache.lengths, jnp.ones((1,), jnp.int32))
    assert cpu_layer.applies(w, x, layer, cos)
    assert not cpu_layer.applies(w, x, (cache.k[0], cache.v[0]), cos)  # the step appends afterwards
    assert not cpu_layer.applies(w, x.astype(jnp.bfloat16), layer, cos)
    assert not cpu_layer.applies(w, x, layer, jnp.zeros((1, 1, config.head_dim + 2), jnp.float32))  # R > H
    a = w.attn
    assert cpu_layer.applies(w.replace(attn=a.replace(q=quantize(a.q, ValueFormat.INT8, (0,)))), x, layer, cos)
    assert not cpu_layer.applies(w.replace(attn=a.replace(q=quantize(a.q, ValueFormat.FP8, (0,)))), x, layer, cos)
    assert not cpu_layer.applies(w.replace(attn=a.replace(q=a.q.astype(jnp.bfloat16))), x, layer, cos)
    # int4 in groups of 16 rows: 64 outputs are taken, v's 32 too; groups that do not divide the
    # 32 rows are not
    assert cpu_layer.applies(w.replace(attn=a.replace(q=quantize(a.q, ValueFormat.INT4, (0,), (16, 1)))), x, layer,
                             cos)
    assert not cpu_layer.applies(w.replace(attn=a.replace(q=quantize(a.q, ValueFormat.INT4, (0,), (24, 1)))), x,
                                 layer, cos)
    assert not cpu_layer.applies(w.replace(attn=a.replace(q_bias=jnp.zeros(a.q.shape[1:]))), x, layer, cos)
    assert not cpu_layer.applies(w.replace(attn=a.replace(k_norm=jnp.ones((config.head_dim,)))), x, layer, cos)
    assert not cpu_layer.applies(w.replace(attn=a.replace(sinks=jnp.zeros((config.num_heads,)))), x, layer, cos)
    m = w.mlp
    moe = MoEWeights(router=jnp.zeros((config.hidden_size, 2)), gate=m.gate[None], up=m.up[None], down=m.down[None])
    assert not cpu_layer.applies(w.replace(mlp=moe), x, layer, cos)


# The quantized products as the per-op layer runs them (kernels/cpu_matvec's int8 and int4
# kernels, the same row passes): sizes that int4-all's groups of 32 divide.
@pytest.mark.parametrize("quant", [WeightQuant.INT8, WeightQuant.INT4_ALL])
@pytest.mark.parametrize("starts, num_new, T", [([5, 30], [1, 1], 1), ([12, 40], [3, 2], 3)])
def test_quantized_native_layer_equals_the_per_op_layer(native, monkeypatch, quant, starts, num_new, T):
    _compare(_config(hidden_size=64, intermediate_size=96), starts, num_new, T, monkeypatch=monkeypatch, quant=quant)


def test_engine_decodes_through_the_native_layer(native, tiny_model, monkeypatch):
    """``Engine``'s greedy decode with the native layer generates the per-op step's tokens, with
    log-probabilities within fp32 rounding."""
    from dayzero.engine import Engine

    prompt = [5, 17, 99, 3, 250, 42, 7]
    native_out = Engine.load(tiny_model.dir).generate(prompt, max_new_tokens=12, logprobs=True)
    monkeypatch.setattr(cpu_layer, "applies", lambda *args: False)
    per_op = Engine.load(tiny_model.dir).generate(prompt, max_new_tokens=12, logprobs=True)
    assert native_out.token_ids == per_op.token_ids
    np.testing.assert_allclose(native_out.logprobs, per_op.logprobs, atol=1e-5)
