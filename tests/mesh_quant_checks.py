"""Quantized weights on meshes of 8 (faked) CPU devices, run in a fresh interpreter by
tests/test_mesh_quant.py.

``python -m tests.mesh_quant_checks PART`` with XLA_FLAGS=--xla_force_host_platform_device_count=8
(``tests.mesh_checks.start_part`` sets it) prints one JSON object of measurements. Each part quantizes its model's weights once on one
device, computes the one-device all-position logits, then for each mesh re-aligns the block scales
(``mesh_aligned_specs`` / ``aligned_weights``), lays the weights out with ``jax.device_put`` and
runs ``forward(..., parallel=Parallel(placement))`` on it. One subprocess per part, since the
device count is fixed when jax starts (see tests/mesh_checks.py).
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from dayzero.model import moe_parallel
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.moe import moe
from dayzero.model.parallel import Parallel
from dayzero.model.quant import QuantConfig, QuantError, QuantizedArray, WeightQuant, describe_weights
from dayzero.model.transformer import forward
from dayzero.model.weights import (
    Init, abstract_weights, aligned_weights, axis_sizes, float_specs, init_weights, leaf_path, map_specs,
    mesh_aligned_specs, named_leaves, quantize_weights,
)
from dayzero.sharding.placement import placement_for
from tests.mesh_checks import logits_and_router_gap, rel_err

# Compiling is nearly all the time here (a dozen forward programs per part), so the tests start the
# parts with ``fast_compile`` (XLA's backend optimisation level 0, ~40% faster compiles); reference
# and mesh logits come from the same process, so both sides of every comparison compile alike.

BASE = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
            rms_norm_eps=1e-5, num_experts_per_tok=2)
# Qwen3-MoE-like: one sparse layer, 8 experts of width 256 over a 128-wide residual, so that
# int4's groups of 128 inputs are real groups (2 per expert's down projection).
QWEN = dict(BASE, model_type="qwen3_moe", num_hidden_layers=1, hidden_size=128, intermediate_size=256,
            moe_intermediate_size=256, num_key_value_heads=2, head_dim=32, num_experts=8, norm_topk_prob=True)
# DeepSeek-V3-like (MLA with a q LoRA, sigmoid router with a score bias, one shared expert):
# layer 0 dense (width 80 = 2.5 blocks of 32), layer 1 8 routed experts of width 64.
LATENT = dict(BASE, model_type="deepseek_v3", hidden_size=64, intermediate_size=80, num_key_value_heads=4,
              kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
              first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=64,
              n_group=1, topk_group=1)
# fp8 blocks of 32 x 32: tensor=4 cuts the experts' width 64 into shards of 16 (half a block), the
# dense width 80 into shards of 20, tensor=8 into 8 and 10.
BLOCK = (32, 32)
MESHES = {"tp2ep4": {"tensor": 2, "expert": 4}, "dp2tp4": {"data": 2, "tensor": 4},
          "tp4ep2": {"tensor": 4, "expert": 2}}
SEEDS = {"qwen": 0, "latent": 0}


def tokens_for(config, seed: int) -> np.ndarray:
    """Two rows of 12 random token ids."""
    return np.asarray(jax.random.randint(jax.random.key(seed + 1), (2, 12), 0, config.vocab_size))


def on_mesh(config, quant, weights, axes, align: bool = True):
    """(weights laid out on a mesh of ``axes``, their specs, the Parallel)."""
    placement = placement_for(axes)
    specs = abstract_weights(config, quant)
    if align:
        specs = mesh_aligned_specs(specs, axis_sizes(placement))
        weights = aligned_weights(weights, specs)
    return jax.device_put(weights, placement.shardings(specs)), specs, Parallel(placement)


def mesh_logits(config, weights, tokens, par) -> np.ndarray:
    """All-position logits of ``forward`` on ``par``'s mesh."""
    run = jax.jit(lambda w, t: forward(w, config, t, all_logits=True, parallel=par)[0])
    return np.asarray(run(weights, par.placement.replicate(tokens)))


def shard_map_args(config, weights, tokens, par) -> list[list[int]]:
    """The shapes one device sees inside the first expert-parallel shard_map: tokens, valid, then
    the MoEWeights leaves (router, gate values, gate scale, up ..., down ..., [score_bias])."""
    jaxpr = jax.make_jaxpr(lambda w, t: forward(w, config, t, all_logits=True, parallel=par)[0])(weights, tokens)
    body = next(e.params["jaxpr"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map")
    return [list(v.aval.shape) for v in body.invars]


def layout(weights, names) -> dict:
    """Global shape and mesh axes of the named quantized leaves' values and scales."""
    leaves = named_leaves(weights)
    return {name: {part: {"shape": list(leaves[f"{name}/{part}"].shape),
                          "spec": [str(a) for a in leaves[f"{name}/{part}"].sharding.spec]}
                   for part in ("values", "scale")} for name in names}


def blocks(weights) -> dict:
    """{leaf name: block} of the block-layout leaves."""
    nodes = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, QuantizedArray))[0]
    return {leaf_path(path): list(x.block)
            for path, x in nodes if isinstance(x, QuantizedArray) and x.block is not None}


def quantized_weights(config, quant, seed: int):
    """Random weights (N(0, 0.2): O(1) logits) quantized once on one device, then held on the host
    (numpy: laying them out on a mesh is then a copy, not a compiled transfer per array)."""
    specs = abstract_weights(config, quant)
    rng = np.random.default_rng(seed)

    def make(s):
        if s.init is Init.NORMAL:
            return (0.2 * rng.standard_normal(s.shape)).astype(np.float32)
        return (np.ones if s.init is Init.ONES else np.zeros)(s.shape, np.float32)
    return jax.tree.map(np.asarray, quantize_weights(map_specs(make, float_specs(specs)), specs))


def compare_meshes(config, quant, seed: int, meshes: dict) -> tuple[dict, dict, np.ndarray]:
    """Each mesh's all-position logits against one device's, from weights quantized once.
    Returns the measurements, the host weights and ``{mesh: (laid-out weights, Parallel)}``."""
    weights = quantized_weights(config, quant, seed)
    tokens = tokens_for(config, seed)
    ref, gap = logits_and_router_gap(config, weights, tokens)
    out = {"router_gap": gap, "stored": describe_weights(weights), "max_logit": float(np.abs(ref).max())}
    laid = {}
    for name, axes in meshes.items():
        sharded, _, par = on_mesh(config, quant, weights, axes)
        laid[name] = sharded, par
        out[name] = {"err": rel_err(mesh_logits(config, sharded, tokens, par), ref),
                     "stored": describe_weights(sharded), "blocks": blocks(sharded)}
    return out, weights, laid


def part_qwen() -> dict:
    config = parse_hf_config(QWEN)
    tokens = tokens_for(config, SEEDS["qwen"])
    out = {}
    for scheme in (WeightQuant.INT8, WeightQuant.INT4):
        res, _, laid = compare_meshes(config, QuantConfig(scheme), SEEDS["qwen"], MESHES)
        # int4 on tensor=4: the down projections' 256 inputs split into 64, groups of 128 become 64.
        sharded, par = laid["tp4ep2"]
        res["tp4ep2"]["local"] = shard_map_args(config, sharded, tokens, par)
        res["tp4ep2"]["layout"] = layout(sharded, ["layers/0/mlp/gate", "layers/0/mlp/down"])
        out[scheme.value] = res
    # int4-all (every projection in groups of 32 inputs) on one mesh: tensor=4 cuts the attention
    # output's 128 inputs and the experts' width into whole groups of 32.
    out["int4-all"] = compare_meshes(config, QuantConfig(WeightQuant.INT4_ALL), SEEDS["qwen"],
                                     {"tp4ep2": MESHES["tp4ep2"]})[0]
    return out


def part_latent() -> dict:
    config = parse_hf_config(LATENT)
    quant = QuantConfig(WeightQuant.FP8_BLOCK, BLOCK)
    tokens = tokens_for(config, SEEDS["latent"])
    out, weights, laid = compare_meshes(config, quant, SEEDS["latent"], {**MESHES, "tp8": {"tensor": 8}})
    names = ["layers/0/mlp/gate", "layers/0/mlp/down", "layers/1/mlp/gate", "layers/1/mlp/down",
             "layers/1/attn/q_b", "layers/1/attn/o", "layers/1/mlp/shared/down"]
    for mesh, (sharded, _) in laid.items():
        out[mesh]["layout"] = layout(sharded, names)
    sharded, par = laid["tp4ep2"]
    out["tp4ep2"]["local"] = shard_map_args(config, sharded, tokens, par)
    out["moe_block"] = moe_block_checks(config, quant, weights, seed=SEEDS["latent"])
    return out


def moe_block_checks(config, quant, weights, seed: int) -> dict:
    """The MoE block of layer 1 alone on tensor=4 x expert=2 (where the experts' width shards cut
    their blocks), against the one-device block:

    - ``unaligned``: weights laid out without re-aligning (block scales whole): the expert-parallel
      block re-blocks its experts itself;
    - negative controls on the re-aligned weights, their experts' block scales handed to
      shard_map whole along the width while their values are split: ``guard``, the QuantError
      that refuses it; ``wrong_err``, with the guard off (every tensor device reads its slice
      with the first slice's scales).
    """
    h = np.asarray(jax.random.normal(jax.random.key(seed + 2), (2, 12, config.hidden_size)), np.float32)
    ref = np.asarray(jax.jit(lambda w, x: moe(w, config.moe, x))(weights.layers[1].mlp, h))
    raw, _, par = on_mesh(config, quant, weights, MESHES["tp4ep2"], align=False)
    out = {"unaligned": rel_err(block_on(config, par)(raw.layers[1].mlp, par.placement.replicate(h)), ref)}
    experts = on_mesh(config, quant, weights, MESHES["tp4ep2"])[0].layers[1].mlp
    real_axes, real_check = moe_parallel._scale_axes, moe_parallel._check_scale_follows

    def whole_width(x, axes, p):
        scale_axes = real_axes(x, axes, p)
        return scale_axes[:-2] + (None, None) if x.block is not None else scale_axes

    moe_parallel._scale_axes = whole_width
    try:
        try:
            block_on(config, par)(experts, par.placement.replicate(h))
            out["guard"] = None
        except QuantError as e:
            out["guard"] = str(e)
        moe_parallel._check_scale_follows = lambda *a: None
        out["wrong_err"] = rel_err(block_on(config, par)(experts, par.placement.replicate(h)), ref)
    finally:
        moe_parallel._scale_axes, moe_parallel._check_scale_follows = real_axes, real_check
    return out


def block_on(config, par):
    """A freshly jitted expert-parallel MoE block (traced anew: the controls above patch it)."""
    return jax.jit(lambda w, x: moe_parallel.moe_expert_parallel(w, config.moe, x, par))


GREEDY_NEW = 6  # tokens generated after each 8-token prompt


def greedy(config, weights, prompts: np.ndarray, par=None) -> tuple[list, np.ndarray]:
    """Greedy continuation of ``prompts`` [B, P] by ``forward`` without a cache (one compiled
    program: a fixed [B, P + GREEDY_NEW] buffer, read causally at each step's last position),
    on ``par``'s mesh or one device; returns the new tokens and the first step's logits [B, P, V]."""
    B, P = prompts.shape
    buf = np.zeros((B, P + GREEDY_NEW), np.int32)
    buf[:, :P] = prompts
    put = (lambda x: x) if par is None else par.placement.replicate
    run = jax.jit(lambda w, t: forward(w, config, t, all_logits=True, parallel=par)[0])
    first = None
    for pos in range(P, P + GREEDY_NEW):
        logits = np.asarray(run(weights, put(buf)))
        first = logits[:, :P] if first is None else first
        buf[:, pos] = logits[:, pos - 1].argmax(-1)
    return buf[:, P:].tolist(), first


def part_gpt_oss_mxfp4() -> dict:
    """gpt-oss (tests/mesh_checks.py's tiny config: sinks, biases, clamped SwiGLU, 8 experts of
    width 32) with its routed experts MXFP4 (e2m1 values, one e8m0 scale per 32 inputs) on
    tensor=2 x expert=4, laid out as the engine lays them (``on_mesh``), against one device:
    greedy tokens, the first step's logits, and where the MXFP4 leaves lie. ``engine``:
    ``Engine.generate`` on that mesh against one device's, or the one-line error it raises."""
    from dayzero.engine.generate import Engine
    from tests.mesh_checks import compare, generation, gpt_oss_config, gpt_oss_logits_and_gap

    config = gpt_oss_config()
    quant = QuantConfig(WeightQuant.MXFP4)
    keys = iter(jax.random.split(jax.random.key(7), 64))
    weights = init_weights(abstract_weights(config), next(keys), scale=0.1)
    # Random norms, biases and sinks (constants would hide a bias or sink split the wrong way).
    weights = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(next(keys), w.shape, w.dtype), weights)
    weights = jax.tree.map(np.asarray, quantize_weights(weights, abstract_weights(config, quant)))
    prompts = np.asarray(jax.random.randint(jax.random.key(1), (2, 8), 0, config.vocab_size))
    tokens, ref = greedy(config, weights, prompts)
    _, gap = gpt_oss_logits_and_gap(config, weights, prompts)
    sharded, _, par = on_mesh(config, quant, weights, MESHES["tp2ep4"])
    mesh_tokens, logits = greedy(config, sharded, prompts, par)
    out = {"stored": describe_weights(weights), "router_gap": gap, "max_logit": float(np.abs(ref).max()),
           "tokens": tokens, "mesh_tokens": mesh_tokens, "err": rel_err(logits, ref), "blocks": blocks(sharded),
           "layout": layout(sharded, ["layers/0/mlp/gate", "layers/0/mlp/down"]),
           "dtypes": [str(x.dtype) for x in (sharded.layers[0].mlp.down.values, sharded.layers[0].mlp.down.scale)]}
    try:
        out["engine"] = compare(generation(Engine(config, weights)),
                                generation(Engine(config, weights, placement=par.placement)))
    except ValueError as e:  # see test_mesh_quant.test_mxfp4_engine_on_a_mesh
        out["engine"] = {"error": str(e).splitlines()[0]}
    return out


PARTS = {"qwen": part_qwen, "latent": part_latent, "gpt_oss_mxfp4": part_gpt_oss_mxfp4}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
