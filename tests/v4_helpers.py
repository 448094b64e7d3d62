"""Shared tiny DeepSeek-V4 oracle for the V4 tests: an HF ``DeepseekV4Config`` small enough for
CPU torch in fp32, and a randomly initialised HF model whose parameters HF would leave at a
trivial value (zero sinks, zero position biases, hc base 0 / scale 1, zero score bias, and a
``tid2eid`` of zeros that sends every hash-routed token to expert 0) are randomised, so a wrong
use of any of them moves the logits.

Layer kinds [sliding, CSA, HCA, CSA] with CSA ratio 4 and HCA ratio 16 (a prompt of a few
hundred tokens closes many HCA windows); MLP kinds [hash, hash, moe, moe].
"""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2,
    n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5, max_position_embeddings=4096,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=16, o_groups=2,
    o_lora_rank=16, index_n_heads=16, index_head_dim=32, index_topk=8, num_nextn_predict_layers=0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)


def tiny_hf_config(**overrides):
    """The tiny ``DeepseekV4Config`` (``TINY`` with ``overrides``), eager attention."""
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    return config


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give the parameters and buffers HF initialises to trivial values random ones (see the
    module docstring); ``tid2eid`` rows get C distinct experts each."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                V, C = p.shape
                E = model.config.n_routed_experts
                p.copy_(torch.stack([torch.randperm(E, generator=g)[:C] for _ in range(V)]))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias")) or ".base" in name \
                    or name.endswith(("hc_base",)):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("scale", "hc_scale")) and ("_hc." in name or "hc_head" in name):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
            elif "norm" in name and p.dim() == 1:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
    return model


def tiny_hf_model(seed: int = 0, **overrides):
    """A randomly initialised tiny ``DeepseekV4ForCausalLM`` in fp32, eval mode (see ``randomize``)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_hf_config(**overrides)).float().eval()
    return randomize(model, seed)


def random_attn_weights(config, kind, seed: int = 0):
    """Numpy-drawn float32 weights of the first ``kind`` layer's attention block of ``config``
    (a dayzero ``ModelConfig``): 0.3 * N(0, 1), plus 1 where the spec initialises ones (norms),
    so sinks and position biases are random too. For block-level tests that need no HF model."""
    import jax
    import numpy as np

    from dayzero.model.weights import ParamSpec, abstract_weights

    rng = np.random.default_rng(seed)
    spec = abstract_weights(config).layers[config.compressed.kinds.index(kind)].attn
    return jax.tree.map(lambda p: (0.3 * rng.standard_normal(p.shape) + (p.init.value == "ones")).astype(np.float32),
                        spec, is_leaf=lambda p: isinstance(p, ParamSpec))


def one_layer_cache(config, kind, batch: int, max_len: int, kv_quant):
    """An empty fp32 ``CompressedCache`` holding only the first ``kind`` layer (``kv_quant`` a
    ``KVQuant``), for :func:`block_step`."""
    import jax.numpy as jnp

    from dayzero.model.cache import init_cache

    full = init_cache(config, batch, max_len, jnp.float32, kv_quant)
    return full.replace(layers=(full.layers[config.compressed.kinds.index(kind)],))


def block_step(w, config, kind, x, cache, num_new, gather=None):
    """One call of the V4 attention block of ``kind`` over ``x`` [B,T,D] at the one-layer
    ``cache``'s lengths (``num_new`` [B] real tokens; ``gather`` as ``compressed_block``'s), and
    the cache with the call appended -> (output [B,T,D], cache). Not jitted: wrap it."""
    import jax.numpy as jnp

    from dayzero.model import compressed, compressed_cache
    from dayzero.model.config import CompressKind
    from dayzero.model.rope import rope_cos_sin

    starts = cache.lengths
    rope_len = jnp.max(starts + num_new)
    positions = starts[:, None] + jnp.arange(x.shape[1])[None, :]
    rope = config.rope if kind is CompressKind.SLIDING else config.compressed.compress_rope
    cos_sin = rope_cos_sin(rope, config.head_dim, config.max_position_embeddings, positions, rope_len)
    y, new = compressed.compressed_block(w, config, kind, x, cos_sin, cache.layers[0], starts, num_new, gather)
    return y, compressed_cache.append(cache, compressed_cache.NewCompressed((new,), num_new, rope_len))
