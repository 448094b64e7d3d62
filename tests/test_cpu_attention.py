"""The native decode attention of CPU decode (``kernels/cpu_attention``) against a float64 softmax
in numpy and against ``attend``'s block loop (``cache.fold_blocks``, the path it replaces), and
where ``attend`` takes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import cpu_attention, cpu_matvec
from dayzero.model.quant import ValueFormat, quantize
from dayzero.model.transformer import attend, attention_masks

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


@pytest.fixture(scope="module")
def native():
    """The kernels' library, built and registered (skipped only without a C++ compiler)."""
    if cpu_matvec._compiler() is None:
        pytest.skip("no C++ compiler (g++ or $CXX): decode attention takes the block loop here")
    assert cpu_matvec.available(), f"the native kernels did not build: {cpu_matvec.unavailable_reason()}"


def _float64_stats(qg, keys, values, mask):
    """(m, l, o / l) in float64 for queries [B,K,M,H] over keys [B,K,H,S], values [B,K,S,H] where
    mask [B,T,S] shows them (row r is token r % T); a row that sees nothing: -inf, 0, 0."""
    qg, keys, values = (np.asarray(a, np.float64) for a in (qg, keys, values))
    B, K, M, _ = qg.shape
    T = mask.shape[1]
    scores = np.einsum("bkmh,bkhs->bkms", qg, keys)
    seen = np.asarray(mask)[:, np.arange(M) % T][:, None]  # [B,1,M,S]
    scores = np.where(seen, scores, -np.inf)
    m = scores.max(-1)
    p = np.where(seen, np.exp(scores - np.where(np.isfinite(m), m, 0)[..., None]), 0.0)
    l = p.sum(-1)
    o = np.einsum("bkms,bksh->bkmh", p, np.where(np.isnan(values), 0.0, values))  # p is 0 wherever NaN sits
    return m, l, o / np.where(l > 0, l, 1)[..., None]


def _case(B, T, G, K, H, S, starts, window=None, seed=0):
    rng = np.random.default_rng(seed)
    qg = jnp.asarray(rng.standard_normal((B, K, G * T, H)) / np.sqrt(H), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, K, H, S)), jnp.float32)
    values = np.asarray(rng.standard_normal((B, K, S, H)), np.float32)
    values[:, :, max(starts):] = np.nan  # never written: whatever sits there must not leak in
    mask, _ = attention_masks(jnp.asarray(starts, jnp.int32), jnp.full((B,), T, jnp.int32), T, S, window)
    return qg, keys, jnp.asarray(values), mask


# SmolLM2's decode (G=3, H=64), rows of different lengths over several 512-position chunks, a
# three-token verify step, a sliding window, head sizes off the vector paths (48, 20) and a
# length no block width divides, a row with nothing cached.
@pytest.mark.parametrize("B, T, G, K, H, S, starts, window", [
    (1, 1, 3, 3, 64, 256, [129], None),
    (2, 1, 3, 3, 64, 4096, [2100, 1337], None),
    (2, 3, 4, 2, 128, 1024, [700, 513], None),
    (1, 2, 2, 2, 64, 2048, [1500], 300),
    (2, 1, 3, 2, 48, 200, [77, 5], None),
    (1, 1, 1, 1, 20, 37, [37], None),
    (2, 1, 2, 2, 64, 512, [0, 100], None),
])
def test_native_equals_float64(native, B, T, G, K, H, S, starts, window):
    qg, keys, values, mask = _case(B, T, G, K, H, S, starts, window)
    m, l, o = jax.jit(cpu_attention.cached_stats)(qg, keys, values, mask)
    m64, l64, out64 = _float64_stats(qg, keys, values, mask)
    np.testing.assert_array_equal(np.isfinite(m), np.isfinite(m64))
    finite = np.isfinite(m64)
    np.testing.assert_allclose(np.asarray(m)[finite], m64[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l), l64, rtol=1e-5)
    out = np.asarray(o) / np.where(np.asarray(l) > 0, np.asarray(l), 1)[..., None]
    assert not np.isnan(out).any()
    # Measured: <= 2e-7 (fp32 sums and a polynomial exp against float64).
    np.testing.assert_allclose(out, out64, atol=2e-6, rtol=0)


def test_attend_takes_it_and_agrees_with_the_block_loop(native, monkeypatch):
    """A decode step's attention through ``attend``: the kernel and the block loop it replaces
    give the same output, and the kernel is what the compiled step calls."""
    B, T, N, K, H, S = 2, 1, 9, 3, 64, 1024
    rng = np.random.default_rng(3)
    q, k_new, v_new = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H)])
    k_cache = jnp.asarray(rng.standard_normal((B, K, H, S)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32)
    masks = attention_masks(jnp.asarray([700, 90], jnp.int32), jnp.ones((B,), jnp.int32), T, S, None)

    def run():
        step = jax.jit(lambda *a: attend(*a, masks))
        return step(q, k_cache, v_cache, k_new, v_new), step.lower(q, k_cache, v_cache, k_new, v_new).as_text()

    out, program = run()
    assert cpu_matvec.TARGET_ATTENTION in program
    monkeypatch.setattr(cpu_attention, "applies", lambda *a: False)
    blocks, program = run()
    assert cpu_matvec.TARGET_ATTENTION not in program
    np.testing.assert_allclose(np.asarray(out), np.asarray(blocks), atol=2e-6, rtol=0)


def test_where_it_applies(native):
    """Only a plain float32 contiguous cache and a few query tokens: a quantized cache, the paged
    view's token-major keys and a prefill chunk take the block loop."""
    q = jnp.zeros((1, 1, 9, 64), jnp.float32)
    keys, values = jnp.zeros((1, 3, 64, 128), jnp.float32), jnp.zeros((1, 3, 128, 64), jnp.float32)
    assert cpu_attention.applies(q, keys, values, False)
    assert not cpu_attention.applies(q, keys, values, True)
    int8 = quantize(keys, ValueFormat.INT8, (2,))
    assert not cpu_attention.applies(q, int8, values, False)
    chunk = jnp.zeros((1, cpu_attention.MAX_QUERY_TOKENS + 1, 9, 64), jnp.float32)
    assert not cpu_attention.applies(chunk, keys, values, False)
    assert not cpu_attention.applies(q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                                     values.astype(jnp.bfloat16), False)


def test_bad_shapes_are_refused(native):
    qg, keys, values, mask = _case(1, 1, 3, 3, 64, 128, [10])
    with pytest.raises(ValueError, match="cached_stats takes"):
        cpu_attention.cached_stats(qg, keys.transpose(0, 1, 3, 2), values, mask)
