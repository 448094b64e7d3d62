"""The native decode attention of CPU decode (``kernels/cpu_attention``) against a float64 softmax
in numpy and against ``attend``'s block loop (``cache.fold_blocks``, the path it replaces), and
where ``attend`` takes it; its in-place form (the step's write and whole attention in one call)
against ``attend`` then ``append_to_cache``, and ``Engine``'s decode through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import cpu_attention, cpu_matvec
from dayzero.model.quant import ValueFormat, quantize
from dayzero.model.cache import InPlaceKVCache, KVCache, LatentCache, NewKV, append_to_cache
from dayzero.model.transformer import attend, attention_masks

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


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


def _in_place_case(B, T, N, K, H, S, starts, num_new, sinks, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H)]
    q, k_new, v_new = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    k_cache = np.asarray(rng.standard_normal((B, K, H, S)), np.float32)
    v_cache = np.asarray(rng.standard_normal((B, K, S, H)), np.float32)
    k_cache[..., max(starts):], v_cache[:, :, max(starts):] = np.nan, np.nan  # never written: must not leak in
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32) if sinks else None
    return (q, k_new, v_new, jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(starts, jnp.int32),
            jnp.asarray(num_new, jnp.int32), sinks)


# One decode token (SmolLM2's heads), a verify step of three with a row whose last token is
# padding, a sliding window across the new keys, sinks with an empty row (nothing cached, no
# real token), head sizes off the vector paths.
@pytest.mark.parametrize("B, T, N, K, H, S, starts, num_new, window, sinks", [
    (1, 1, 9, 3, 64, 256, [129], [1], None, False),
    (2, 3, 8, 2, 128, 1024, [700, 513], [3, 2], None, True),
    (1, 2, 4, 2, 64, 2048, [1500], [2], 300, False),
    (2, 1, 4, 2, 48, 200, [0, 5], [0, 1], None, True),
    (1, 4, 2, 1, 20, 40, [30], [4], 3, True),
])
def test_in_place_equals_attend_then_append(native, B, T, N, K, H, S, starts, num_new, window, sinks):
    """The one-call step (write, then attend over the cache) against ``attend`` over the masks
    ``forward`` builds, then ``append_to_cache``: the same outputs for every real token and the
    same cache, bit for bit."""
    q, k_new, v_new, k_cache, v_cache, starts, num_new, sinks = _in_place_case(B, T, N, K, H, S, starts, num_new,
                                                                               sinks)
    reference = attend(q, k_cache, v_cache, k_new, v_new, attention_masks(starts, num_new, T, S, window), sinks=sinks)
    appended = append_to_cache(KVCache(k=(k_cache,), v=(v_cache,), lengths=starts, rope_len=jnp.int32(0)),
                               NewKV(k=(k_new,), v=(v_new,), num_new=num_new, rope_len=jnp.int32(0)))
    step = jax.jit(cpu_attention.attend_in_place, static_argnames="window")
    out, keys, values = step(q, k_new, v_new, k_cache, v_cache, starts, num_new, window, sinks)
    real = np.arange(T)[None, :] < np.asarray(num_new)[:, None]
    assert not np.isnan(np.asarray(out)[real]).any()
    # Measured: <= 6e-8 (the same fp32 statistics, summed in another order).
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(reference)[real], atol=2e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(appended.k[0]))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(appended.v[0]))


def test_in_place_refuses_bad_shapes(native):
    q, k_new, v_new, k_cache, v_cache, starts, num_new, _ = _in_place_case(1, 1, 9, 3, 64, 128, [10], [1], False)
    with pytest.raises(ValueError, match="attend_in_place takes"):
        cpu_attention.attend_in_place(q, k_new, v_new, k_cache.transpose(0, 1, 3, 2), v_cache, starts, num_new)


def test_engine_decodes_in_place_without_copying_the_cache(native, tiny_model, monkeypatch):
    """``Engine``'s decode writes the cache in the step (one program, the cache donated, no copy
    of it: XLA's temporaries stay under one layer's buffer) and generates what the step followed
    by the separate append generates."""
    from dayzero.engine import Engine
    from dayzero.engine.sampling import SamplingParams, batch_sampling

    engine = Engine.load(tiny_model.dir)
    prompt = [5, 17, 99, 3, 250, 42, 7]
    mode, rows = batch_sampling([SamplingParams(temperature=0.0)])
    tokens, _, cache = engine._prefill_chunks([prompt], np.array([len(prompt)], np.int32), 8, rows, mode)
    assert engine._writes_in_place(cache, 1)
    step = engine._decode_in_place.lower(engine.weights, tokens[:, None], jnp.ones((1,), jnp.int32), rows,
                                         jnp.int32(1), mode=mode, cache=cache).compile()
    assert step.memory_analysis().temp_size_in_bytes < cache.k[0].nbytes
    assert cpu_matvec.TARGET_DECODER_LAYER in step.as_text()  # the tiny llama takes the whole-layer call
    in_place = engine.generate(prompt, max_new_tokens=12, logprobs=True)
    assert any("in place" in key for key in engine._steps.signatures())
    monkeypatch.setattr(Engine, "_writes_in_place", lambda self, cache, T: False)
    appended = Engine.load(tiny_model.dir).generate(prompt, max_new_tokens=12, logprobs=True)
    assert in_place.token_ids == appended.token_ids
    np.testing.assert_allclose(in_place.logprobs, appended.logprobs, atol=1e-5)


def test_in_place_where_it_applies(native):
    """A plain float32 contiguous cache and a few tokens; not a quantized cache, a prefill chunk,
    bfloat16, or a cache that is not a ``KVCache`` (a latent cache's rows)."""
    keys, values = jnp.zeros((1, 3, 64, 128), jnp.float32), jnp.zeros((1, 3, 128, 64), jnp.float32)
    cache = KVCache(k=(keys,), v=(values,), lengths=jnp.zeros((1,), jnp.int32), rope_len=jnp.int32(0))
    assert InPlaceKVCache.applies(cache, 1)
    assert not InPlaceKVCache.applies(cache, cpu_attention.MAX_QUERY_TOKENS + 1)
    assert not InPlaceKVCache.applies(cache.replace(k=(quantize(keys, ValueFormat.INT8, (2,)),)), 1)
    assert not InPlaceKVCache.applies(jax.tree.map(lambda a: a.astype(jnp.bfloat16), cache), 1)
    assert not InPlaceKVCache.applies(LatentCache(latent=(keys[0],), lengths=cache.lengths, rope_len=cache.rope_len), 1)
