"""The tiled quantized matvec (``dayzero.model.quant_matmul.linear``) against dequantize + dot, a
quantized decode step against the untiled one, and the quantized tied output head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dayzero.model.quant_matmul as qm
from dayzero.engine.runtime import resolve_run, tied_head
from dayzero.model.cache import append_to_cache, init_cache
from dayzero.model.quant import QuantConfig, QuantizedArray, ValueFormat, WeightQuant, dequantized, quantize
from dayzero.model.transformer import forward
from dayzero.model.weights import abstract_weights, quantize_weights

# (In, Out, format, block): tile-aligned sizes, In with no tile divisor (97: a tail of 1 row after
# 96), a partial last block (100 rows in blocks of 64), int4 groups, fp8 blocks, per channel.
CASES = [
    (576, 200, ValueFormat.INT8, None),
    (97, 31, ValueFormat.INT8, None),
    (200, 70, ValueFormat.INT4, None),
    (100, 30, ValueFormat.INT4, (64, 1)),
    (256, 48, ValueFormat.INT4, (128, 1)),
    (300, 130, ValueFormat.FP8, None),
    (200, 100, ValueFormat.FP8, (64, 48)),
]


@pytest.fixture(autouse=True)
def _scan_only(monkeypatch):
    """These tests check the tiled scan, the pure-jnp path (and the native int8 kernel's reference,
    tests/test_cpu_matvec.py): keep int8 off the native kernel here."""
    monkeypatch.setenv("DAYZERO_NATIVE_CPU", "0")


def _weight(n_in: int, n_out: int, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((n_in, n_out)).astype(np.float32) * np.logspace(-1, 1, n_out))


def _uses_scan(fn, *args) -> bool:
    return "scan" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("n_in, n_out, fmt, block", CASES)
def test_tiled_product_is_dequantize_then_dot(n_in, n_out, fmt, block, rows=2):
    """The scan over row tiles (scales per channel at the end, per block in each tile, a tail of
    rows no tile covers) computes x @ dequantized(w) up to fp32 summation order."""
    q = quantize(_weight(n_in, n_out), fmt, (0,), block)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 1, n_in)).astype(np.float32))
    assert _uses_scan(qm.linear, x, q), "the decode-sized product must take the tiled path"
    got = jax.jit(qm.linear)(x, q)
    want = x @ dequantized(q, jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_tile_rows_divide_the_input_and_stay_inside_a_block():
    """No tail where a divisor near the table's size exists; tiles never straddle a scale block."""
    assert qm.tile_rows(576, 49152) == 64 and qm.tile_rows(1536, 576) == 64
    assert 576 % qm.tile_rows(576, 576) == 0
    assert qm.tile_rows(97, 10) == 64  # prime: 1 tile and a tail
    assert qm.tile_rows(100, 30, 64) == 64  # 64 | 64; the last 36 rows are the tail
    assert 128 % qm.tile_rows(576, 100, 128) == 0
    assert qm.tile_rows(5, 10) == 0  # too few rows for one tile: all tail


def test_several_input_axes_and_many_rows():
    """An [N,H,D] output projection contracts over (N,H); a prefill-sized x takes the plain path."""
    w = _weight(4 * 24, 40).reshape(4, 24, 40)
    q = quantize(w, ValueFormat.INT8, (0, 1))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, 96)).astype(np.float32))
    want = x @ dequantized(q, jnp.float32).reshape(96, 40)
    np.testing.assert_allclose(jax.jit(lambda x, q: qm.linear(x, q, n_in=2))(x, q), want, rtol=1e-5, atol=1e-4)
    many = jnp.tile(x, (1, qm.TILED_MAX_ROWS, 1))
    assert not _uses_scan(lambda x, q: qm.linear(x, q, n_in=2), many, q)


def test_float_weights_and_bad_shapes():
    """A float weight is one dot (no scan); a mismatched activation width is refused by name."""
    w = _weight(64, 16)
    x = jnp.ones((1, 1, 64))
    assert not _uses_scan(qm.linear, x, w)
    np.testing.assert_allclose(qm.linear(x, w), x @ w, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[\.\.\., 63\]"):
        qm.linear(jnp.ones((1, 63)), w)
    with pytest.raises(ValueError, match="in_axes"):
        qm.linear(jnp.ones((1, 64)), quantize(w, ValueFormat.INT8, (1,)))


def test_quantized_decode_step_matches_the_untiled_one(tiny_model, monkeypatch, scheme="int8"):
    """A quantized tiny llama (q/k/v/o, MLP and a quantized tied head) decodes the same logits on
    the tiled path as with every weight dequantized first."""
    config = tiny_model.config
    weights = quantize_weights(tiny_model.weights, abstract_weights(config, QuantConfig(WeightQuant(scheme))))
    # The head a tied model gets (this llama is untied: its embedding stands in for the tie).
    weights = weights.replace(lm_head=tied_head(tiny_model.weights.embed, resolve_run(config, quantize=scheme)))
    assert isinstance(weights.layers[0].attn.q, QuantizedArray) and isinstance(weights.lm_head, QuantizedArray)
    cache = init_cache(config, 1, 32)
    _, new = jax.jit(lambda w, t: forward(w, config, t))(weights, jnp.arange(1, 30, dtype=jnp.int32)[None])
    cache, token = append_to_cache(cache, new), jnp.asarray([[7]], jnp.int32)

    def decode():
        return np.asarray(jax.jit(lambda w, t, c: forward(w, config, t, c)[0])(weights, token, cache))
    assert _uses_scan(lambda w, t, c: forward(w, config, t, c)[0], weights, token, cache)
    tiled = decode()
    monkeypatch.setattr(qm, "TILED_MAX_ROWS", 0)
    plain = decode()
    np.testing.assert_allclose(tiled, plain, rtol=1e-4, atol=1e-4 * np.abs(plain).max())


def test_tied_head_is_an_int8_copy_of_the_embedding_only_where_the_weights_are_int8():
    """int8 and int4 runs hold the [D,V] head as int8 per vocabulary column (error <= half a
    step), fp32 and fp8 runs as a float copy; the embedding itself is untouched."""
    embed = _weight(48, 24).T  # [V=24, D=48]
    config = dataclasses.replace(_tiny_config(), tie_word_embeddings=True)
    for scheme in ("int8", "int4"):
        head = tied_head(embed, resolve_run(config, quantize=scheme))
        assert isinstance(head, QuantizedArray) and head.fmt is ValueFormat.INT8 and head.shape == (48, 24)
        step = np.asarray(head.scale)  # [1, V]
        assert np.all(np.abs(np.asarray(dequantized(head, jnp.float32)) - np.asarray(embed.T)) <= step / 2 + 1e-7)
    for scheme in ("none", "fp8"):
        head = tied_head(embed, resolve_run(config, quantize=scheme))
        assert not isinstance(head, QuantizedArray)
        np.testing.assert_array_equal(head, embed.T)


def _tiny_config():
    from dayzero.model.config import Family, ModelConfig, RopeConfig

    return ModelConfig(family=Family.LLAMA, vocab_size=24, hidden_size=48, intermediate_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=24, rms_norm_eps=1e-5, max_position_embeddings=64,
                       rope=RopeConfig())
