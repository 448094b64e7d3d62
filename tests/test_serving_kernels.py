"""Serving decode steps on the paged kernels (``ServingConfig(kernels=...)``, ``--kernels``).

With ``pallas_interpret`` a decode step reads the pages in place through ``paged_attention`` /
``paged_latent_attention`` (the new token written into its page first, see
``dayzero.model.paged_decode``); with ``reference`` it gathers them. Served concurrently, in
decode batches of 1, 2 and 4 rows with padding, every request must produce the same greedy
tokens either way, with log-probabilities equal to fp32 rounding: both compute the same fp32
softmax, only the order of the sums differs (the kernel's online softmax over 16-key tiles),
which moves a logprob by ~1e-6; a wrong mask or a missing new token moves it by O(0.1).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from dayzero.engine import Engine, GenerationError
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.kernels import KernelError, KernelMode
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.weights import abstract_weights, init_weights

# Context 64 (tables 8 pages of 8: one width, fewer compilations), chunks of 16 or 32 tokens, 4 decode slots.
SERVING = ServingConfig(slots=4, page_size=8, num_pages=40, max_context=64, max_chunk=32, min_chunk=16,
                        min_table_pages=8)
LOGPROB_TOL = dict(rtol=1e-4, atol=2e-5)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 200, n).tolist()


# Five requests over four slots: one waits, then joins as another leaves. Lengths cross pages.
PROMPTS = [_prompt(n, 50 + n) for n in (5, 30, 17, 1, 9)]
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


def _random_engine(hf_config: dict) -> Engine:
    config = parse_hf_config(hf_config)
    # Weights of scale 0.2 give O(1) logits, so agreement means something.
    return Engine(config, init_weights(abstract_weights(config), jax.random.key(0), scale=0.2))


BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
            max_position_embeddings=128, rms_norm_eps=1e-5)


def test_dense_kernel_decode_matches_reference(tiny_engine):
    """The tiny llama (4 query heads over 2 kv heads)."""
    _assert_same(tiny_engine)


def test_sliding_window_kernel_decode_matches_reference():
    """A window of 8 positions, shorter than most of the sequences: the kernel's window mask."""
    _assert_same(_random_engine(dict(BASE, model_type="mistral", num_key_value_heads=2, sliding_window=8)),
                 requests=3, slots=2)


def test_latent_kernel_decode_matches_reference():
    """Multi-head latent attention (DeepSeek-V3 layout): the latent pages, absorbed queries."""
    _assert_same(_random_engine(dict(
        BASE, model_type="deepseek_v3", num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)), requests=3, slots=2)


def test_kernel_decode_writes_the_same_pages(tiny_engine):
    """The in-place decode writes each new token's keys/values where the reference append does,
    and nowhere else (padding rows write nothing)."""
    pools = []
    for kernels in ("reference", "pallas_interpret"):
        server = ServingEngine(tiny_engine, dataclasses.replace(SERVING, kernels=kernels))
        server.run(PROMPTS[:3], max_new_tokens=NEW[:3], ignore_eos=True)
        pools.append(server.steps.pool)
    for ref, out in zip(jax.tree.leaves(pools[0]), jax.tree.leaves(pools[1])):
        if ref.ndim >= 3:  # the pages (tables and lengths are per call)
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_auto_resolves_to_reference_on_cpu(tiny_engine):
    if jax.default_backend() != "cpu":
        pytest.skip("auto means pallas off CPU")
    assert ServingEngine(tiny_engine, SERVING).config.kernels is KernelMode.REFERENCE


def test_pallas_on_cpu_is_refused(tiny_engine):
    if jax.default_backend() != "cpu":
        pytest.skip("pallas runs on GPU")
    with pytest.raises(KernelError, match="pallas_interpret"):
        ServingEngine(tiny_engine, dataclasses.replace(SERVING, kernels="pallas"))


DSA = dict(
    BASE, model_type="deepseek_v32", num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1, index_topk=8,
    index_n_heads=16, index_head_dim=32)


def test_sparse_attention_with_kernels_is_refused():
    engine = _random_engine(DSA)
    with pytest.raises(GenerationError, match="sparse attention"):
        ServingEngine(engine, dataclasses.replace(SERVING, kernels="pallas_interpret"))


def test_auto_on_gpu_serves_sparse_attention_with_the_reference(tiny_engine, monkeypatch):
    """Where auto means pallas, a sparse-attention model still gets a path that can serve it."""
    from dayzero.engine.paged_steps import serving_kernels
    from dayzero.kernels import mode

    monkeypatch.setattr(mode, "current_platform", lambda: "gpu")
    dsa = parse_hf_config(DSA)
    assert serving_kernels(tiny_engine.config, "auto") is KernelMode.PALLAS
    assert serving_kernels(dsa, "auto") is KernelMode.REFERENCE
    with pytest.raises(GenerationError, match="sparse attention"):
        serving_kernels(dsa, "pallas")
