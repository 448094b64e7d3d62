"""The native int8 and int4 matrix-vector kernels of CPU decode (``kernels/cpu_matvec``) against
their pure-jnp reference, ``quant_matmul``'s tiled scan, and a float64 product of the dequantized
weight; how ``linear`` picks it; what happens where it cannot build; and a stored step that calls
it loaded by a fresh process (the FFI target must be registered before the executable loads)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import cpu_matvec
from dayzero.model import quant_matmul
from dayzero.model.quant import ValueFormat, dequantized, quantize

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def _weight(shape, n_in, seed=0):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
    return quantize(w, ValueFormat.INT8, tuple(range(n_in)))


def _float64_product(x, q, n_in):
    matrix = np.asarray(dequantized(q, jnp.float32), np.float64).reshape(math.prod(q.shape[:n_in]), -1)
    return np.asarray(x, np.float64) @ matrix


# Shapes of SmolLM2's projections (q as [D,N,H], o as [N,H,D] over two input axes), the tied head,
# and sizes no unroll or vector width divides (K=37 leaves a tail of rows, N=13 of columns).
@pytest.mark.parametrize("shape, n_in", [((576, 9, 64), 1), ((9, 64, 576), 2), ((1536, 576), 1),
                                         ((576, 4099), 1), ((37, 13), 1), ((300, 333), 1)])
@pytest.mark.parametrize("rows", [1, 8])
def test_native_equals_the_reference(native, shape, n_in, rows):
    q = _weight(shape, n_in)
    n_rows = math.prod(shape[:n_in])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, n_rows)), jnp.float32)
    out = jax.jit(lambda x, q: quant_matmul.linear(x, q, n_in))(x, q).reshape(rows, -1)
    expected = _float64_product(x, q, n_in)
    scale = np.abs(expected).max()
    # Measured: <= 3e-7 x the largest output (fp32 sums in another order than the float64 one).
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6 * scale, rtol=0)
    reference = quant_matmul._tiled(x, q, n_rows, math.prod(shape[n_in:]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=2e-6 * scale, rtol=0)


def _int4_weight(shape, group, seed=0):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
    return quantize(w, ValueFormat.INT4, (0,), (group, 1))


# SmolLM2's shapes in groups of 32 (q, o, down, the head), the expert groups of 128, a group of
# 16, and sizes whose columns leave a tail after the 32-column vector steps (N=34, 98; N=48: one
# 16-column block alone with AVX2) or whose last group is partial (K=72 in groups of 32).
@pytest.mark.parametrize("shape, group", [((576, 576), 32), ((1536, 576), 32), ((576, 4100), 32),
                                          ((576, 192), 128), ((64, 98), 16), ((72, 34), 32), ((64, 48), 32)])
@pytest.mark.parametrize("rows", [1, 8])
def test_native_int4_equals_the_reference(native, shape, group, rows):
    q = _int4_weight(shape, group)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, shape[0])), jnp.float32)
    fn = jax.jit(lambda x, q: quant_matmul.linear(x, q))
    assert cpu_matvec.TARGET_INT4 in fn.lower(x, q).as_text()
    out = np.asarray(fn(x, q))
    expected = _float64_product(x, q, 1)
    scale = np.abs(expected).max()
    # Measured: <= 2.3e-7 x the largest output.
    np.testing.assert_allclose(out, expected, atol=2e-6 * scale, rtol=0)
    reference = quant_matmul._tiled(x, q, *shape)
    np.testing.assert_allclose(out, np.asarray(reference), atol=2e-6 * scale, rtol=0)


def test_int4_nibble_order_and_signs(native):
    """Every int4 value in every position of a byte: XLA packs two per byte, the even-indexed
    value in the low nibble; a swapped or unsigned nibble moves these exact products."""
    values = np.tile(np.arange(-8, 8, dtype=np.int8), (8, 4))  # [8, 64]: -8..7 at even and odd columns
    values[1::2] = np.roll(values[1::2], 1, axis=1)
    q = quantize(jnp.asarray(values, jnp.float32), ValueFormat.INT4, (0,), (8, 1))
    q = type(q)(jnp.asarray(values).astype(jnp.int4), jnp.ones_like(q.scale), q.fmt, q.in_axes, q.block)
    x = jnp.asarray(2.0 ** np.arange(8), jnp.float32)[None]  # each row's weight readable in the sum
    out = jax.jit(lambda x, q: quant_matmul.linear(x, q))(x, q)
    np.testing.assert_array_equal(np.asarray(out)[0], (2.0 ** np.arange(8)) @ values.astype(np.float64))


def test_int4_that_the_kernel_cannot_take_uses_the_scan(native):
    x = jnp.ones((1, 60), jnp.float32)  # 60 rows: not whole eight-row passes
    q = _int4_weight((60, 32), 20)
    text = _lowered(lambda x, w: quant_matmul.linear(x, w), x, q)
    assert cpu_matvec.TARGET_INT4 not in text and cpu_matvec.TARGET not in text
    expected = _float64_product(x, q, 1)
    out = jax.jit(lambda x, q: quant_matmul.linear(x, q))(x, q)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6 * np.abs(expected).max(), rtol=0)


# SmolLM2's q as [D,N,H] and o as [N,H,D] (two input axes), the head, and column tails (N=13, 4099).
@pytest.mark.parametrize("shape, n_in", [((576, 9, 64), 1), ((9, 64, 576), 2), ((576, 4099), 1), ((40, 13), 1)])
@pytest.mark.parametrize("rows", [1, quant_matmul.FLOAT32_NATIVE_MAX_ROWS])
def test_native_float32_equals_the_dot(native, shape, n_in, rows):
    w = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    n_rows = math.prod(shape[:n_in])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, n_rows)), jnp.float32)
    fn = jax.jit(lambda x, w: quant_matmul.linear(x, w, n_in))
    assert cpu_matvec.TARGET_FLOAT32 in fn.lower(x, w).as_text()
    out = np.asarray(fn(x, w)).reshape(rows, -1)
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64).reshape(n_rows, -1)
    # Measured: <= 4e-7 x the largest output (XLA's fp32 dot: the same).
    np.testing.assert_allclose(out, expected, atol=2e-6 * np.abs(expected).max(), rtol=0)


def test_float32_takes_the_kernel_only_for_few_float32_rows(native):
    w = jnp.ones((256, 64), jnp.float32)
    rows = quant_matmul.FLOAT32_NATIVE_MAX_ROWS
    assert cpu_matvec.TARGET_FLOAT32 in _lowered(quant_matmul.linear, jnp.ones((rows, 256)), w)
    # more rows (a batch, a prefill): XLA's dot reads the weights once for all of them
    assert cpu_matvec.TARGET_FLOAT32 not in _lowered(quant_matmul.linear, jnp.ones((rows + 1, 256)), w)
    assert cpu_matvec.TARGET_FLOAT32 not in _lowered(quant_matmul.linear, jnp.ones((1, 256), jnp.bfloat16),
                                                     w.astype(jnp.bfloat16))
    assert cpu_matvec.TARGET_FLOAT32 not in _lowered(quant_matmul.linear, jnp.ones((1, 60)), w[:60])  # 60 rows


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def test_linear_takes_the_kernel_for_channel_scaled_int8_only(native):
    x = jnp.ones((1, 256), jnp.float32)
    int8 = _weight((256, 128), 1)
    assert cpu_matvec.TARGET in _lowered(lambda x, w: quant_matmul.linear(x, w), x, int8)
    blocked = quantize(jnp.ones((256, 128)), ValueFormat.FP8, (0,), block=(128, 128))  # block scales: the scan
    assert cpu_matvec.TARGET not in _lowered(lambda x, w: quant_matmul.linear(x, w), x, blocked)
    many = jnp.ones((quant_matmul.TILED_MAX_ROWS + 1, 256), jnp.float32)  # a prefill: one dequantized dot
    assert cpu_matvec.TARGET not in _lowered(lambda x, w: quant_matmul.linear(x, w), many, int8)


def test_switched_off_falls_back_to_the_scan(native, monkeypatch):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 256)), jnp.float32)
    q = _weight((256, 96), 1)
    on = jax.jit(lambda x, q: quant_matmul.linear(x, q))(x, q)
    monkeypatch.setenv("DAYZERO_NATIVE_CPU", "0")
    assert not cpu_matvec.available() and cpu_matvec.fingerprint() == "off"
    off_text = _lowered(lambda x, q: quant_matmul.linear(x, q), x, q)
    assert cpu_matvec.TARGET not in off_text
    off = jax.jit(lambda x, q: quant_matmul.linear(x, q) + 0.0)(x, q)
    np.testing.assert_allclose(np.asarray(on), np.asarray(off), atol=1e-5 * float(jnp.abs(off).max()), rtol=0)


def test_many_independent_products_in_one_step(native):
    """XLA runs independent thunks on the pool the kernel splits its work over: 40 products in
    one program must neither deadlock nor mix their outputs (the first version of the hand-off,
    which waited for its scheduled parts, hung here)."""
    qs = [_weight((576, 384), 1, seed) for seed in range(40)]
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 576)), jnp.float32)
    outs = jax.jit(lambda x, qs: [quant_matmul.linear(x, q) for q in qs])(x, qs)
    for out, q in zip(outs, qs):
        expected = _float64_product(x, q, 1)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6 * np.abs(expected).max(), rtol=0)


def test_under_vmap(native):
    """A caller may vmap the product (a stack of layers or experts): each is its own call."""
    qs = [_weight((128, 96), 1, seed) for seed in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *qs)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 1, 128)), jnp.float32)
    out = jax.jit(jax.vmap(lambda x, q: quant_matmul.linear(x, q)))(x, stacked)
    for i, q in enumerate(qs):
        expected = _float64_product(x[i], q, 1)
        np.testing.assert_allclose(np.asarray(out[i]), expected, atol=2e-6 * np.abs(expected).max(), rtol=0)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"int8 values \[K,N\].*\(2, 5\)"):
        cpu_matvec.matvec_int8(jnp.ones((1, 4)), jnp.ones((2, 5), jnp.int8), jnp.ones(5))
    with pytest.raises(ValueError, match=r"int4 values \[K,N\].*\(16, 5\).*group 8"):
        cpu_matvec.matvec_int4(jnp.ones((1, 16)), jnp.ones((16, 5), jnp.int4), jnp.ones((2, 5)), 8)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_a_failed_build_leaves_the_scan_and_says_why(tmp_path):
    """No usable compiler: available() is False with the compiler's complaint, linear still runs."""
    done = _run("""
        import jax, jax.numpy as jnp
        from dayzero.kernels import cpu_matvec
        from dayzero.model import quant_matmul
        from dayzero.model.quant import ValueFormat, quantize
        q = quantize(jnp.ones((64, 32)), ValueFormat.INT8, (0,))
        print(float(jax.jit(quant_matmul.linear)(jnp.ones((1, 64)), q).sum()))
        print("available", cpu_matvec.available(), "|", cpu_matvec.unavailable_reason())
    """, {"CXX": "false", "DAYZERO_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    total, status = done.stdout.strip().splitlines()
    assert float(total) == pytest.approx(64 * 32, rel=1e-2)
    assert status.startswith("available False | ") and "failed" in status
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.partial"))  # nothing half-written


def test_a_stored_step_with_the_kernel_loads_in_a_fresh_process(native, tmp_path):
    """The step cache stores an executable that calls the kernel; a new process must register
    the target before loading it, or running it fails."""
    code = """
        import jax, jax.numpy as jnp, numpy as np
        from dayzero.engine.step_cache import StepCache
        from dayzero.model import quant_matmul
        from dayzero.model.quant import ValueFormat, quantize
        q = quantize(jnp.asarray(np.random.default_rng(0).standard_normal((256, 64)), jnp.float32),
                     ValueFormat.INT8, (0,))
        steps = StepCache(scope="test", directory=__import__("pathlib").Path(%r))
        fn = jax.jit(lambda x, q: quant_matmul.linear(x, q))
        out = steps.call(fn, ("matvec",), jnp.ones((1, 256)), q)
        print(steps.built, steps.loaded, float(out.sum()))
    """ % str(tmp_path / "steps")
    # The default cache, where the module's fixture built the kernel: the fresh processes load it.
    from dayzero.engine.default_model import cache_root

    env = {"DAYZERO_CACHE": str(cache_root())}
    first, second = _run(code, env), _run(code, env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    built_1, loaded_1, sum_1 = first.stdout.split()
    built_2, loaded_2, sum_2 = second.stdout.split()
    assert (built_1, loaded_1, built_2, loaded_2) == ("1", "0", "0", "1")
    assert sum_1 == sum_2
