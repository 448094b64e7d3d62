"""Serving on the kernels (``ServingConfig(kernels=...)``, ``--kernels``).

With ``pallas_interpret`` a first prefill chunk runs on ``flash_attention`` (``sparse_attention``
for DeepSeek-V3.2), and every later step, prefill chunk or decode, reads the pages in place
through ``paged_attention`` / ``paged_latent_attention`` / ``sparse_attention`` (the new tokens
written into their pages first, see ``dayzero.model.kernel_attention``); with ``reference`` it
gathers them. Served concurrently, in
decode batches of 1, 2 and 4 rows with padding, every request must produce the same greedy
tokens either way, with log-probabilities equal to fp32 rounding: both compute the same fp32
softmax, only the order of the sums differs (the kernel's online softmax over 16-key tiles),
which moves a logprob by ~1e-6; a wrong mask or a missing new token moves it by O(0.1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.engine import Engine
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.engine.runtime import RunConfigError
from dayzero.kernels import KernelMode
from dayzero.model.transformer import forward
from tests.serving_models import DSA, FAMILIES, LATENT, prompt, random_engine

# Context 64 (tables 8 pages of 8: one width, fewer compilations), chunks of 16 or 32 tokens, 4 decode slots.
SERVING = ServingConfig(slots=4, page_size=8, num_pages=40, max_context=64, max_chunk=32, min_chunk=16,
                        min_table_pages=8)
LOGPROB_TOL = dict(rtol=1e-4, atol=2e-5)


# Five requests over four slots: one waits, then joins as another leaves. Lengths cross pages.
PROMPTS = [prompt(n, 50 + n) for n in (5, 30, 17, 1, 9)]
NEW = [6, 4, 9, 7, 3]


def _served(engine: Engine, kernels: str, requests: int, slots: int) -> list:
    server = ServingEngine(engine, dataclasses.replace(SERVING, kernels=kernels, slots=slots))
    out = server.run(PROMPTS[:requests], max_new_tokens=NEW[:requests], ignore_eos=True, logprobs=True)
    return out, server


def _assert_same(engine: Engine, requests: int = len(PROMPTS), slots: int = 4) -> None:
    """``requests`` of PROMPTS over ``slots`` decode slots (fewer compile fewer decode batches:
    interpret-mode kernels are slow to compile)."""
    reference, _ = _served(engine, "reference", requests, slots)
    kernel, server = _served(engine, "pallas_interpret", requests, slots)
    assert server.config.kernels is KernelMode.PALLAS_INTERPRET
    assert server.stats.decode_steps > 0
    for ref, out in zip(reference, kernel):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(out.logprobs, ref.logprobs, **LOGPROB_TOL)


def test_dense_kernel_decode_matches_reference(tiny_engine):
    """The tiny llama (4 query heads over 2 kv heads); three requests on two slots, the third
    joining when one finishes (all of PROMPTS on four slots is the same path with more decode
    batches to compile in interpret mode)."""
    _assert_same(tiny_engine, requests=3, slots=2)


@pytest.mark.slow  # windows on the kernels through a served model: tests/test_gpt_oss.py (default suite)
def test_sliding_window_kernel_decode_matches_reference():
    """A window of 8 positions, shorter than most of the sequences: the kernel's window mask."""
    _assert_same(random_engine(FAMILIES["window"]),
                 requests=3, slots=2)


@pytest.mark.slow  # the latent kernel serves by default on a mesh in tests/test_mesh_serving.py
def test_latent_kernel_decode_matches_reference():
    """Multi-head latent attention (DeepSeek-V3 layout): the latent pages, absorbed queries."""
    _assert_same(random_engine(LATENT), requests=3, slots=2)


def test_kernel_decode_writes_the_same_pages(tiny_engine):
    """The in-place steps (later prefill chunks, decode) write each new token's keys/values where
    the reference append does, and nowhere else (padding rows and tokens write nothing)."""
    pools = []
    for kernels in ("reference", "pallas_interpret"):
        server = ServingEngine(tiny_engine, dataclasses.replace(SERVING, kernels=kernels))
        server.run(PROMPTS[:3], max_new_tokens=NEW[:3], ignore_eos=True)
        pools.append(server.steps.pool)
    for ref, out in zip(jax.tree.leaves(pools[0]), jax.tree.leaves(pools[1])):
        if ref.ndim >= 3:  # the pages (tables and lengths are per call)
            # Layer 2's keys carry layer 1's attention output, whose summation order differs
            # (measured 1.1e-6 at most); a write in the wrong slot would differ by O(1).
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_auto_resolves_to_reference_on_cpu(tiny_engine):
    if jax.default_backend() != "cpu":
        pytest.skip("auto means pallas off CPU")
    assert ServingEngine(tiny_engine, SERVING).config.kernels is KernelMode.REFERENCE


def test_pallas_on_cpu_is_refused(tiny_engine):
    if jax.default_backend() != "cpu":
        pytest.skip("pallas runs on GPU")
    with pytest.raises(RunConfigError, match="pallas_interpret"):
        ServingEngine(tiny_engine, dataclasses.replace(SERVING, kernels="pallas"))




def test_sparse_kernel_serving_matches_reference():
    """DeepSeek-V3.2 sparse attention (top-8 of up to 36 tokens): the indexer's picks read from
    the pages by ``sparse_attention``, prefill and decode."""
    _assert_same(random_engine(DSA), requests=3, slots=2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_first_prefill_on_kernels_matches_reference(family):
    """``forward`` with nothing cached and a kernel mode (flash, or sparse over the indexer's
    picks): the logits of every real token and the keys/values to cache match the reference,
    in a batch of ragged rows (24 and 13 real tokens of 24)."""
    engine = random_engine(FAMILIES[family])
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 200, (2, 24)), jnp.int32)
    num_new = jnp.array([24, 13], jnp.int32)
    runs = [forward(engine.weights, engine.config, tokens, None, num_new, all_logits=True, kernels=mode)
            for mode in (KernelMode.REFERENCE, KernelMode.PALLAS_INTERPRET)]
    (ref_logits, ref_new), (logits, new) = runs
    real = np.arange(24)[None, :] < np.asarray(num_new)[:, None]
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real], rtol=1e-4, atol=2e-5)
    for ref, out in zip(jax.tree.leaves(ref_new), jax.tree.leaves(new)):
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("family", ["dense", "sparse"])
def test_chunked_prefill_and_prefix_hit_on_kernels(family):
    """A 50-token prompt prefilled in chunks of 16 (the first on the flash or sparse kernel, the
    later ones reading the pages in place), then a second request whose first 32 tokens hit the
    prefix cache: the same tokens and logprobs as the reference path."""
    engine = random_engine(FAMILIES[family])
    long = prompt(50, 7)
    prompts, new = [long, long[:32] + prompt(9, 8)], [8, 6]
    config = dataclasses.replace(SERVING, max_chunk=16, slots=1)
    outs = {}
    for kernels in ("reference", "pallas_interpret"):
        server = ServingEngine(engine, dataclasses.replace(config, kernels=kernels))
        outs[kernels] = server.run(prompts, max_new_tokens=new, ignore_eos=True, logprobs=True)
        assert server.stats.prefill_chunks >= 5 and server.stats.cached_tokens == 32
    for ref, out in zip(outs["reference"], outs["pallas_interpret"]):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(out.logprobs, ref.logprobs, **LOGPROB_TOL)
