"""DeepSeek-V3.2 sparse attention (DSA): the lightning indexer and top-k latent attention, parity with HF.

A tiny random HF DeepseekV32 model (fp32, eager attention, random norms, LayerNorm biases and
selection biases) goes through the real converter, with index_topk = 64 well below the
400-token prompt so the sparse selection really drops tokens: (a) logits match HF's; (b) 32
greedy tokens through ``Engine.generate`` are HF's; (c) prefill + one-token decode steps
reproduce one full forward; (d) each layer's indexer picks the same tokens as HF's
``DeepseekV32Indexer`` called on the same hidden states. Decode reads only the picked latent
rows (the others are NaN in one test and change nothing), and the cache holds the latent row
plus the indexer key per token.

Traps: an indexer with few heads gives exact ties in its ReLU scores, so the model has 16 index
heads and (d) asserts a clear gap between each query's k-th and (k+1)-th score; random routers
can sit near ties too, so the routing gaps are asserted as in test_deepseek.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dayzero.model import dsa
from dayzero.model.config import ConfigError, DSAConfig, Family, ModelConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.mla import LORA_NORM_EPS
from dayzero.model.norm import rms_norm
from dayzero.model.rope import rope_cos_sin
from dayzero.model.transformer import attention_masks, forward
from dayzero.model.cache import LatentCache, append_to_cache, init_cache
from tests.hf_helpers import (
    MIN_ROUTER_GAP, assert_change_is_effective, assert_logits_match, assert_steps_match_full, convert_case, forward_jit,
    greedy_vs_hf, hf_greedy, hf_model, random_ids,
)

LONG, PREFILL, SHORT, NEW = 400, 360, 100, 32
TOPK, INDEX_HEADS, INDEX_DIM = 64, 16, 32
EXPERTS, TOP_K = 8, 2
SEED = 4  # routing gaps >= 1.2e-4 on both prompts (seeds 0-3 and 5 have one under 1e-4)

_append = jax.jit(append_to_cache)

HF_CONFIG = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
    n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=256,
    index_topk=TOPK, index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM,
    max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
    # YaRN 4x over 256 positions: the 400-token prompt runs past the original context, and the
    # indexer's half-split rotation gets the same scaled cos/sin as the main attention.
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                         mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0),
    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)


def build_hf(seed: int):
    """A tiny random HF DeepseekV32 model: fp32, eager, random norm weights/biases and selection biases."""
    model = hf_model(transformers.DeepseekV32Config(**HF_CONFIG), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def _random_ids(n: int, seed: int) -> np.ndarray:
    return random_ids(n, HF_CONFIG["vocab_size"], seed)


def _capture_attention_inputs(model, ids: np.ndarray):
    """HF's logits over ``ids`` and, per layer, the inputs its attention block received."""
    inputs, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs: inputs.append(kwargs), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, inputs


def min_router_gap(model, ids: np.ndarray) -> float:
    """Smallest gap, over tokens and MoE layers, between the TOP_K-th and next biased choice score."""
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    gaps = []
    for logits, layer in zip(out.router_logits, [l for l in model.model.layers if hasattr(l.mlp, "gate")]):
        choice = 1 / (1 + np.exp(-logits.double().numpy())) + layer.mlp.gate.e_score_correction_bias.double().numpy()
        ranked = np.sort(choice, -1)
        gaps.append((ranked[:, -TOP_K] - ranked[:, -TOP_K - 1]).min())
    assert len(gaps) == HF_CONFIG["num_hidden_layers"] - HF_CONFIG["first_k_dense_replace"]
    return float(min(gaps))


@pytest.fixture(scope="module")
def case(hf_factory, tmp_path_factory):
    """The converted tiny DeepSeek-V3.2 model with HF's logits and attention inputs of the long prompt."""
    hf = build_hf(SEED)
    c = convert_case(hf_factory, tmp_path_factory.mktemp("dsa"), "dsa", hf, LONG)
    c.hf_long, c.attn_inputs = _capture_attention_inputs(hf, c.long_ids)
    return c


def test_converted_config(case):
    c = case.config
    assert c.family is Family.DEEPSEEK_V32 and c.mla.rope_interleave and c.mla.q_lora_rank == 32
    assert c.dsa == DSAConfig(topk=TOPK, heads=INDEX_HEADS, head_dim=INDEX_DIM)
    assert c.moe.layers == (False, True, True) and c.sliding_windows == (None,) * 3
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_router_margins_are_not_ties(case):
    """Clear expert choices on the long prompt and on the short prompt with its greedy tokens."""
    assert min_router_gap(case.hf, case.long_ids) > MIN_ROUTER_GAP
    prompt = _random_ids(SHORT, seed=2)
    generated = np.asarray(hf_greedy(case.hf, prompt, NEW), np.int32)[None]
    assert min_router_gap(case.hf, np.concatenate([prompt, generated], axis=1)) > MIN_ROUTER_GAP


def _scores_float64(w, c, x: np.ndarray, q_latent: np.ndarray, cos_sin) -> np.ndarray:
    """The indexer's scores [T,T] in float64 from the same weights (the formula of dsa.py's
    docstring, written out in numpy): how far our fp32 scores are from exact ones."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    cos, sin = f(cos_sin[0][0]), f(cos_sin[1][0])  # [T,R]
    R, I, J = c.mla.rope_dim, c.dsa.heads, c.dsa.head_dim

    def rope(v):  # [T,...,J]: half-split rotation of the first R dims
        rot, rest = v[..., :R], v[..., R:]
        half = np.concatenate([-rot[..., R // 2 :], rot[..., : R // 2]], -1)
        shape = (len(cos),) + (1,) * (v.ndim - 2) + (R,)
        return np.concatenate([rot * cos.reshape(shape) + half * sin.reshape(shape), rest], -1)

    k = f(x) @ f(w.k)
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + dsa.K_NORM_EPS)
    k = rope(k * f(w.k_norm) + f(w.k_norm_bias))
    q = rope(np.einsum("tq,qij->tij", f(q_latent), f(w.q_b)))
    per_head = np.maximum(np.einsum("tij,sj->tis", q, k) * J**-0.5, 0)
    return np.einsum("ti,tis->ts", f(x) @ f(w.head_weights) * I**-0.5, per_head)


def test_indexer_topk_matches_hf(case):
    """(d) Per layer and query, our indexer picks the same visible tokens as HF's indexer module
    called on the same hidden states, and its k-th / (k+1)-th scores are not a tie: their gap is
    over 10x the distance of our fp32 scores from float64 ones (HF's fp32 scores err alike)."""
    c, T = case.config, LONG
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    cos_sin = rope_cos_sin(c.rope, c.head_dim, c.max_position_embeddings, positions, jnp.int32(T))
    masks = attention_masks(jnp.zeros((1,), jnp.int32), jnp.full((1,), T, jnp.int32), T, None, None)
    causal = np.tril(np.ones((T, T), bool))
    for i, (layer, kwargs) in enumerate(zip(case.hf.model.layers, case.attn_inputs)):
        h = kwargs["hidden_states"]
        attn = layer.self_attn
        with torch.no_grad():
            q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
            theirs = attn.indexer(h, q_resid, kwargs["position_embeddings"], kwargs["attention_mask"][:, 0],
                                  None).numpy()[0]
        w = case.weights.layers[i].attn
        x = jnp.asarray(h.numpy())
        q_latent = rms_norm(x @ w.q_a, w.q_a_norm, LORA_NORM_EPS)
        keys = dsa.index_keys(w.indexer, c, x, cos_sin)
        ours, visible = dsa.select(w.indexer, c, x, q_latent, cos_sin, None, keys, masks)
        ours, visible = np.asarray(ours[0]), np.asarray(visible[0])
        scores = np.asarray(dsa.index_scores(w.indexer, c, x, q_latent, cos_sin, keys)[0])
        assert ours.shape == theirs.shape == (T, TOPK)
        for t in range(T):
            mine = set(ours[t][visible[t]].tolist())
            hf_set = {j for j in theirs[t].tolist() if j <= t}  # HF's picks past t are masked ones
            assert mine == hf_set, f"layer {i}, query {t}: {sorted(mine ^ hf_set)} differ"
            assert len(mine) == min(TOPK, t + 1)
        exact = _scores_float64(w.indexer, c, x[0], q_latent[0], cos_sin)
        rounding = np.where(causal, np.abs(scores - exact), 0)[TOPK:].max(-1)
        ranked = -np.sort(-np.where(causal, exact, -np.inf)[TOPK:], axis=-1)  # queries with > k visible tokens
        gap = ranked[:, TOPK - 1] - ranked[:, TOPK]
        worst = np.argmin(gap / rounding)
        assert gap[worst] > 10 * rounding[worst], (
            f"layer {i}, query {TOPK + worst}: index scores tie (gap {gap[worst]:.3g}, rounding {rounding[worst]:.3g})")


def test_logits_match_hf(case):
    """(a) fp32 logits of a 400-token prompt (index_topk 64): max |ours - HF| <= 1e-4 * max |HF|."""
    assert_logits_match(case.ours_long, case.hf_long, case.name)


def test_sparsity_is_effective(case):
    """Attending to every token (index_topk >= the prompt) moves the logits far from HF's, so (a)
    really tests the selection."""
    dense = dataclasses.replace(case.config, dsa=dataclasses.replace(case.config.dsa, topk=LONG))
    assert_change_is_effective(case, dense)


def test_greedy_generation_matches_hf(case):
    """(b) 32 greedy tokens after a 100-token prompt (past index_topk, so decode gathers) are HF's."""
    out, ref = greedy_vs_hf(case, _random_ids(SHORT, seed=2), NEW)
    assert out.token_ids == ref


def test_batched_rows_of_different_lengths(case):
    """Two rows with different prompt lengths (both past index_topk) decode as each would alone:
    per-row cache lengths, masks and gathers."""
    prompts = [_random_ids(n, seed=s)[0].tolist() for n, s in ((90, 5), (71, 6))]
    together = case.engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
    alone = [case.engine.generate(p, max_new_tokens=6, ignore_eos=True) for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def _prefill_and_decode(case, prefill: int, poison: bool = False) -> np.ndarray:
    """Logits of prefilling ``prefill`` tokens then decoding the rest one at a time. ``poison``:
    each step reads a copy of the cache whose latent rows its indexer does not pick are NaN."""
    config, weights, ids = case.config, case.weights, case.long_ids
    cache = init_cache(config, 1, LONG)
    logits, new = forward_jit(weights, config, jnp.asarray(ids[:, :prefill]), cache)
    cache = _append(cache, new)
    steps = [np.asarray(logits[0])]
    for t in range(prefill, LONG):
        token = jnp.asarray(ids[:, t : t + 1])
        read = _poison_unpicked(case, cache, token, t) if poison else cache
        logits, new = forward_jit(weights, config, token, read)
        cache = _append(cache, new)
        steps.append(np.asarray(logits[0]))
    return np.stack(steps)


def _poison_unpicked(case, cache: LatentCache, token: jax.Array, t: int) -> LatentCache:
    """NaN in each layer's cached latent rows that decoding ``token`` at position t will not pick."""
    c, weights = case.config, case.weights
    hidden: list = []
    forward(weights, c, token, cache, hidden_out=hidden)  # layer inputs: embed, then each layer's output
    layer_inputs = [jnp.take(weights.embed, token, axis=0)] + hidden[:-1]
    positions = jnp.full((1, 1), t, jnp.int32)
    cos_sin = rope_cos_sin(c.rope, c.head_dim, c.max_position_embeddings, positions, jnp.int32(t + 1))
    masks = attention_masks(cache.lengths, jnp.ones((1,), jnp.int32), 1, cache.max_len, None)
    latent = []
    for i, layer in enumerate(weights.layers):
        w = layer.attn
        x = rms_norm(layer_inputs[i], layer.attn_norm, c.rms_norm_eps)
        q_latent = rms_norm(x @ w.q_a, w.q_a_norm, LORA_NORM_EPS)
        new_keys = dsa.index_keys(w.indexer, c, x, cos_sin)
        picked, visible = dsa.select(w.indexer, c, x, q_latent, cos_sin, cache.index_keys[i], new_keys, masks)
        keep = np.zeros(cache.max_len + 1, bool)  # + the new token's own index
        keep[np.asarray(picked[0, 0])[np.asarray(visible[0, 0])]] = True
        keep = keep[: cache.max_len]
        latent.append(jnp.where(jnp.asarray(keep)[None, :, None], cache.latent[i], jnp.nan))
    return cache.replace(latent=tuple(latent))


def test_prefill_then_decode_matches_full_forward(case):
    """(c) prefill 360 tokens, decode 40 one at a time: the logits of one 400-token pass."""
    assert_steps_match_full(_prefill_and_decode(case, PREFILL), case.ours_long[0, PREFILL - 1 :], case.name)


def test_decode_reads_only_the_picked_rows(case):
    """Decode steps whose unpicked cached latent rows are NaN give the same logits: the main
    attention gathers the index_topk picked rows and never touches the rest of the cache."""
    prefill = LONG - 3  # the poisoning runs the model eagerly: a few steps suffice
    full = case.ours_long[0, prefill - 1 :]
    poisoned = _prefill_and_decode(case, prefill, poison=True)
    assert np.isfinite(poisoned).all()
    assert_steps_match_full(poisoned, full, "poisoned")


def test_cache_holds_latent_and_index_keys(case):
    """Bytes per token = num_layers * (kv_lora_rank + qk_rope_head_dim + index_head_dim) * itemsize."""
    c, batch, slots = case.config, 3, 64
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = init_cache(c, batch, slots, dtype)
        assert isinstance(cache, LatentCache) and len(cache.index_keys) == c.num_layers
        arrays = [x for x in jax.tree.leaves(cache) if x.ndim > 1]
        per_token = sum(math.prod(x.shape) * x.dtype.itemsize for x in arrays) / (batch * slots)
        width = c.mla.kv_lora_rank + c.mla.rope_dim + c.dsa.head_dim
        assert per_token == c.num_layers * width * jnp.dtype(dtype).itemsize


# ---- config parsing ---------------------------------------------------------------------------------


def _saved_config(case) -> dict:
    return json.loads((case.root / "hf" / "config.json").read_text())


@pytest.mark.parametrize("change, match", [
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"index_head_dim": 8}, "index_head_dim"),
    ({"index_topk": 0}, "index_topk"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"layer_types": ["indexed_attention", "linear_attention", "indexed_attention"]}, "linear_attention"),
    ({"index_block_size": 64}, "index_block_size"),  # an unknown indexer key is not ignored
])
def test_bad_deepseek_v32_config_is_refused(case, change, match):
    raw = {k: v for k, v in {**_saved_config(case), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(raw)


def test_mlp_layer_types_win_over_first_k_dense_replace(case):
    """HF builds each layer's MLP from mlp_layer_types when the config has it."""
    raw = {**_saved_config(case), "mlp_layer_types": ["sparse", "dense", "sparse"]}
    assert parse_hf_config(raw).moe.layers == (True, False, True)
    raw = {k: v for k, v in _saved_config(case).items() if k not in ("mlp_layer_types", "layer_types")}
    assert parse_hf_config(raw).moe.layers == (False, True, True)
