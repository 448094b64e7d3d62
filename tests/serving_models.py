"""Tiny random-weight models of each attention family, and prompts, shared by the serving tests
(imported as ``tests.serving_models``)."""

from __future__ import annotations

import jax
import numpy as np

from dayzero.engine import Engine
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.weights import abstract_weights, init_weights

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
            max_position_embeddings=128, rms_norm_eps=1e-5)
LATENT = dict(
    BASE, model_type="deepseek_v3", num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)
# DeepSeek-V3.2's sparse attention: each query attends to its indexer's top 8 tokens.
DSA = dict(LATENT, model_type="deepseek_v32", index_topk=8, index_n_heads=16, index_head_dim=32)
FAMILIES = {
    "dense": dict(BASE, model_type="llama", num_key_value_heads=2),  # 4 query heads over 2 kv heads
    "window": dict(BASE, model_type="mistral", num_key_value_heads=2, sliding_window=8),
    "latent": LATENT,
    "sparse": DSA,
}


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids below 200, from ``seed``."""
    return np.random.default_rng(seed).integers(0, 200, n).tolist()


def random_engine(hf_config: dict, kv_cache: str = "none") -> Engine:
    """An engine over random weights of ``hf_config``; scale 0.2 gives O(1) logits, so that
    agreement between two paths means something."""
    config = parse_hf_config(hf_config)
    return Engine(config, init_weights(abstract_weights(config), jax.random.key(0), scale=0.2), kv_cache=kv_cache)
