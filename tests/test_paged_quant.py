"""The quantized paged KV cache (``Engine(kv_cache="int8"|"fp8")`` served by ``ServingEngine``).

The pages hold the same quantization of the same values as the contiguous cache (one fp32
scale per token and kv head, per token for latent rows and indexer keys), so a request served
over quantized pages must produce exactly the greedy tokens ``Engine.generate`` produces with the
same ``kv_cache`` on the contiguous cache, with log-probabilities equal to fp32 rounding. That
holds when both prefill in the same chunks (a later chunk reads the earlier ones quantized, a
chunk's own tokens exactly), so the contiguous engine's chunk is set to the server's here. A
token read unquantized, or a scale written to the wrong slot, moves a logprob by far more than
the tolerance (int8's step is ~1% of a row's largest value).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dayzero.engine.generate as generate_module
from dayzero.engine import Engine
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.kernels import KernelMode
from dayzero.model.paged_cache import append_to_pages, init_paged_cache
from dayzero.model.quant import KV_FORMATS, KVQuant, QuantizedArray, dequantized, quantize
from dayzero.model.cache import NewKV
from tests.serving_models import FAMILIES, prompt, random_engine

# One slot (the second request then hits the first's cached prefix), chunks of 16, context 64.
CHUNK = 16
SERVING = ServingConfig(slots=1, page_size=8, num_pages=24, max_context=64, max_chunk=CHUNK, min_chunk=CHUNK,
                        min_table_pages=8)
# fp32 rounding: the paged path reads keys token-major, so its sums run in another order. Measured
# largest |difference| (relative) int8 / fp8: dense 1.7e-6 (7.8e-7) / 4.8e-7 (2.0e-7), latent
# 2.4e-6 (1.2e-6) / 1.4e-6 (5.6e-7), sparse 1.9e-6 (9.0e-7) / 1.4e-5 (6.7e-6); unquantized pages
# against the contiguous cache: up to 3.1e-6.
LOGPROB_TOL = dict(rtol=2e-5, atol=5e-6)
NEW_TOKENS = 8

# The families whose caches differ in layout: per-head K/V, latent rows, latent rows + indexer keys.
QUANT_FAMILIES = ("dense", "latent", "sparse")


LONG = prompt(50, 7)  # four chunks of 16
# The second shares LONG's first 32 tokens (4 full pages: a prefix-cache hit), the third is short.
PROMPTS = [LONG, LONG[:32] + prompt(9, 8), prompt(5, 9)]


def _engine(family: str, kv_cache: str) -> Engine:
    return random_engine(FAMILIES[family], kv_cache)


@pytest.mark.parametrize("family, kv_cache", [("dense", "int8"), ("dense", "fp8"),
                                               # sparse pools hold the latent rows too: latent alone is slow
                                               pytest.param("latent", "int8", marks=pytest.mark.slow),
                                               ("sparse", "int8"),
                                               # the fp8 pool code is the dense one's: -m slow
                                               pytest.param("latent", "fp8", marks=pytest.mark.slow),
                                               pytest.param("sparse", "fp8", marks=pytest.mark.slow)])
def test_served_quantized_pages_match_contiguous_cache(family, kv_cache, monkeypatch):
    """Greedy tokens and logprobs of three requests (chunked prefill, a prefix-cache hit, a short
    one) served over quantized pages equal ``Engine.generate``'s over the quantized contiguous cache."""
    engine = _engine(family, kv_cache)
    server = ServingEngine(engine, SERVING)
    assert server.config.kernels is KernelMode.REFERENCE
    assert isinstance(jax.tree.leaves(server.steps.pool, is_leaf=lambda x: isinstance(x, QuantizedArray))[0],
                      QuantizedArray)
    served = server.run(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    assert server.stats.prefill_chunks >= 6 and server.stats.cached_tokens == 32
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", CHUNK)  # the server's chunk boundaries
    alone = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    for ref, out in zip(alone, served):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(out.logprobs, ref.logprobs, **LOGPROB_TOL)


def test_quantized_pages_differ_from_unquantized():
    """The comparison above can fail: the int8 pages change the logprobs by far more than the
    tolerance against unquantized pages (so a path that ignored the scheme would be caught)."""
    plain = ServingEngine(_engine("dense", "none"), SERVING).run(PROMPTS[:1], max_new_tokens=NEW_TOKENS,
                                                                  ignore_eos=True, logprobs=True)
    quant = ServingEngine(_engine("dense", "int8"), SERVING).run(PROMPTS[:1], max_new_tokens=NEW_TOKENS,
                                                                  ignore_eos=True, logprobs=True)
    assert np.max(np.abs(np.subtract(plain[0].logprobs, quant[0].logprobs))) > 100 * LOGPROB_TOL["atol"]


def _pool_bytes(family: str, kv_cache: str) -> int:
    engine = _engine(family, kv_cache)
    return ServingEngine(engine, SERVING).steps.kv_bytes


@pytest.mark.parametrize("kv_cache", ["int8", "fp8"])
def test_pool_bytes(kv_cache):
    """One byte per value plus a 4-byte scale per (kv head, page, slot) (per (page, slot) for
    latent rows and indexer keys), against 4 bytes per value unquantized."""
    P, page, L = SERVING.num_pages, SERVING.page_size, 2
    K, H = 2, 16  # dense: 2 kv heads of 64 / 4
    C, J = 32 + 16, 32  # latent: kv_lora_rank + rope dim; sparse: indexer key width
    expected = {
        "dense": L * 2 * K * P * page * (H + 4),  # keys and values
        "latent": L * P * page * (C + 4),
        "sparse": L * P * page * (C + 4 + J + 4),
    }
    unquantized = {"dense": L * 2 * K * P * page * H * 4, "latent": L * P * page * C * 4,
                   "sparse": L * P * page * (C + J) * 4}
    for family in QUANT_FAMILIES:
        assert _pool_bytes(family, kv_cache) == expected[family], family
        assert _pool_bytes(family, "none") == unquantized[family], family


# windows on fp8 pages: -m slow (windows on the kernels run by default in tests/test_gpt_oss.py)
@pytest.mark.parametrize("family, kv_cache", [("dense", KVQuant.INT8),
                                               pytest.param("window", KVQuant.FP8, marks=pytest.mark.slow),
                                               ("latent", KVQuant.INT8),
                                               # the sparse kernel on unquantized pages runs by default
                                               # (test_serving_kernels): -m slow
                                               pytest.param("sparse", KVQuant.FP8, marks=pytest.mark.slow)])
def test_quantized_pages_on_the_kernels(family, kv_cache):
    """The kernels read int8/fp8 pages with their scale pages in place: served tokens and logprobs
    equal the reference path's over the same quantized pages (every path reads a step's own new
    keys as the pages store them, ``quant.as_stored``), so a misread page or scale, which moves
    logprobs by O(0.1), fails here."""
    engine = _engine(family, kv_cache.value)
    prompts = [prompt(19, 1), prompt(7, 2), prompt(26, 3)]
    outs = {}
    for kernels in ("reference", "pallas_interpret"):
        server = ServingEngine(engine, dataclasses.replace(SERVING, kernels=kernels))
        assert server.config.kernels.value == kernels
        outs[kernels] = server.run(prompts, max_new_tokens=5, ignore_eos=True, logprobs=True)
    for ref, got in zip(outs["reference"], outs["pallas_interpret"]):
        assert got.token_ids == ref.token_ids
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=2e-5)


@pytest.mark.parametrize("kv_cache", [KVQuant.INT8, KVQuant.FP8])
def test_page_writes_quantize_each_row(kv_cache):
    """Two rows' keys/values appended through their tables read back (gathered, dequantized) as
    each row quantized alone with one scale per (token, kv head); padding writes nothing."""
    config = _engine("dense", "none").config
    K, H = config.num_kv_heads, config.head_dim
    cache = init_paged_cache(config, 6, 4, batch=2, table_width=2, kv_quant=kv_cache)
    cache = cache.replace(block_tables=jnp.array([[3, 1], [0, 5]], jnp.int32))
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=(2, 6, K, H)) * rng.uniform(0.1, 3, (2, 6, K, 1)), jnp.float32)
            for _ in range(2))
    num_new = jnp.array([6, 3], jnp.int32)  # row 1's last 3 tokens are padding
    new = NewKV(k=(k,) * config.num_layers, v=(v,) * config.num_layers, num_new=num_new, rope_len=jnp.int32(6))
    cache = append_to_pages(cache, new)
    keys, values = cache.layer(0)
    assert isinstance(keys, QuantizedArray) and keys.fmt is KV_FORMATS[kv_cache]
    for got, rows in ((keys, k), (values, v)):
        got = np.asarray(dequantized(got, jnp.float32)).transpose(0, 2, 1, 3)  # [B,S,K,H]
        expected = np.asarray(dequantized(quantize(rows, KV_FORMATS[kv_cache], (3,)), jnp.float32))
        np.testing.assert_array_equal(got[0, :6], expected[0])
        np.testing.assert_array_equal(got[1, :3], expected[1, :3])
        np.testing.assert_array_equal(got[1, 3:], 0)  # never written: zero values, scale 1
    np.testing.assert_array_equal(np.asarray(cache.k_pages[0].values[:, 2]), 0)  # a page no table lists
