"""Checks that need 8 (faked) CPU devices, run in a fresh interpreter by the mesh tests.

``python -m tests.mesh_checks PART [ARGS]`` with XLA_FLAGS=--xla_force_host_platform_device_count=8
prints one JSON object of measurements; the tests (test_mesh_engine.py, test_mesh_checkpoint.py)
assert on it. The device count is fixed when jax first initialises, which the pytest process has
already done with one device, hence the subprocess; one per part, so compiles are shared.
Families with parts of their own keep them in a module beside this one, started by :func:`run_part`
with ``module=`` (tests/linear_mesh_checks.py, glm5_mesh_checks.py, v4_mesh_checks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.generate import Engine
from dayzero.tools.measure import CompileCounter
from dayzero.engine.sampling import SamplingParams
from dayzero.model.config import MoEConfig
from dayzero.model.moe import router_logits
from dayzero.model.parallel import Parallel
from dayzero.model.transformer import forward
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.sharding.placement import placement_for
from tests.test_sharding import _tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]


def run_part(part: str, *args: str, timeout: int = 300, module: str = "tests.mesh_checks",
             fast_compile: bool = False) -> dict:
    """Run one part below (or of ``module``) in a fresh interpreter with 8 CPU devices; return its
    JSON result. ``fast_compile``: XLA's backend optimisations off (compiles ~40% faster; for
    checks that compare two runs in the same process, which the flag affects alike)."""
    return result_of(start_part(part, *args, module=module, fast_compile=fast_compile), timeout)


def start_part(part: str, *args: str, module: str = "tests.mesh_checks", fast_compile: bool = False
               ) -> subprocess.Popen:
    """Start one part as :func:`run_part` runs it, without waiting (start several, then collect
    them with :func:`result_of`: compiling is single-threaded, so two at once use both cores)."""
    flags = "--xla_force_host_platform_device_count=8" + (" --xla_backend_optimization_level=0" * fast_compile)
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", module, part, *map(str, args)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen, timeout: int = 300) -> dict:
    """The JSON result of a part started by :func:`start_part`."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])
NEW = 6


def rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def moe_config():
    """The tiny dense config with 8 experts of width 32 in both layers (top-2, renormalised)."""
    moe = MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(True, True))
    return replace(_tiny_config(), moe=moe)


def generation(engine: Engine) -> dict:
    """Greedy tokens and logprobs of PROMPTS from a fresh engine, and the compilations during
    its decode steps after the first (the warm-up: prefill and one decode step compile)."""
    stream = engine.stream_ids(PROMPTS, NEW, [SamplingParams()] * len(PROMPTS))
    steps = [next(stream), next(stream)]
    with CompileCounter() as counter:
        steps += list(stream)
    tokens = np.stack([t for t, _ in steps], axis=1)
    logprobs = np.stack([lp for _, lp in steps], axis=1)
    return {"tokens": tokens.tolist(), "logprobs": logprobs.tolist(), "decode_compiles": counter.count}


def compare(ref: dict, got: dict) -> dict:
    """Token agreement and the largest logprob difference of two ``generation`` results."""
    diff = max(abs(a - b) for r, g in zip(ref["logprobs"], got["logprobs"]) for a, b in zip(r, g))
    return {"same_tokens": ref["tokens"] == got["tokens"], "logprob_diff": diff,
            "decode_compiles": got["decode_compiles"]}


def sharded_logits(config, weights, tokens, axes, expert_parallel: bool, capacity_factor=None):
    """All-position logits with the weights laid out on a mesh of ``axes``."""
    placement = placement_for(axes)
    par = Parallel(placement, capacity_factor) if expert_parallel else None
    sharded = jax.device_put(weights, placement.shardings(abstract_weights(config)))
    run = jax.jit(lambda w, t: forward(w, config, t, all_logits=True, parallel=par)[0])
    return np.asarray(run(sharded, placement.replicate(np.asarray(tokens))))


def logits_and_router_gap(config, weights, tokens) -> tuple[np.ndarray, float]:
    """One-device all-position logits, and the smallest margin at the routing choice's cut over
    every token and MoE layer (a near-tie would test rounding, not dispatch; see :func:`choice_gap`)."""
    import dayzero.model.transformer as transformer

    def run(w, t):
        inputs = []  # each MoE block's (router, selection bias, hidden states), filled while tracing
        real_moe = transformer.moe
        transformer.moe = lambda mw, c, h, **kw: inputs.append((mw.router, mw.score_bias, h)) or real_moe(mw, c, h, **kw)
        try:
            logits = forward(w, config, t, all_logits=True)[0]
        finally:
            transformer.moe = real_moe
        return logits, [(router_logits(r, h.reshape(-1, h.shape[-1])), b) for r, b, h in inputs]

    logits, routers = jax.jit(run)(weights, tokens)
    return np.asarray(logits), min(choice_gap(np.asarray(r), b, config.moe) for r, b in routers)


def choice_gap(logits: np.ndarray, bias, moe: MoEConfig) -> float:
    """Smallest margin between the C-th and (C+1)-th router logit; with a selection bias (DeepSeek-V3
    routing, one group per token) between the best two groups and, within the best group, between
    the C-th and (C+1)-th biased sigmoid score, which is what that routing ranks."""
    C = moe.experts_per_token
    if bias is None:
        s = np.sort(logits, axis=-1)
        return float((s[:, -C] - s[:, -C - 1]).min())
    if moe.num_groups == 1:  # MiniMax-M2: the C-th against the (C+1)-th biased sigmoid score
        s = np.sort(1 / (1 + np.exp(-logits.astype(np.float64))) + np.asarray(bias), axis=-1)
        return float((s[:, -C] - s[:, -C - 1]).min())
    assert moe.groups_per_token == 1, "only one kept group is handled here"
    grouped = (1 / (1 + np.exp(-logits.astype(np.float64))) + np.asarray(bias)).reshape(len(logits), moe.num_groups, -1)
    group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)
    ranked = np.sort(group_scores, -1)
    best = np.sort(np.take_along_axis(grouped, np.argmax(group_scores, -1)[:, None, None], 1)[:, 0], -1)
    return float(min((ranked[:, -1] - ranked[:, -2]).min(), (best[:, -C] - best[:, -C - 1]).min()))


def local_expert_shapes(config, weights, tokens, axes) -> dict:
    """What one device sees inside the expert-parallel shard_map: its weight shapes, collectives."""
    placement = placement_for(axes)
    par = Parallel(placement)
    jaxpr = jax.make_jaxpr(lambda w, t: forward(w, config, t, all_logits=True, parallel=par)[0])(
        weights, tokens)
    bodies = [e.params["jaxpr"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"]
    body = bodies[0]
    names = {e.primitive.name for e in body.eqns}
    # Arguments: tokens, valid, then the MoEWeights leaves (router, gate, up, down).
    shapes = [list(v.aval.shape) for v in body.invars]
    return {"shard_maps": len(bodies), "arg_shapes": shapes, "all_to_all": "all_to_all" in names}


def part_dense() -> dict:
    config = _tiny_config()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    ref = generation(Engine(config, weights))
    out = {"devices": len(jax.devices())}
    for name, axes in (("tp8", {"tensor": 8}), ("dp2tp4", {"data": 2, "tensor": 4})):
        engine = Engine(config, weights, placement=placement_for(axes))
        out[name] = compare(ref, generation(engine))
        out[name]["k_cache_spec"] = [str(a) for a in engine._cache_shardings(2, 256).k[0].spec]
    out["mla_tp8"] = part_mla()
    return out


def mla_config():
    """The tiny config with multi-head latent attention (no q LoRA, latent 32 + rope 8)."""
    from dayzero.model.config import AttentionKind, MLAConfig

    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=32, nope_dim=8, rope_dim=8, v_head_dim=8)
    return replace(_tiny_config(), attention=AttentionKind.MLA, mla=mla)


def gathered_shapes(engine: Engine, batch: int, max_len: int) -> list[str]:
    """The result shapes of every all-gather in the compiled decode step."""
    import re

    from dayzero.engine.sampling import batch_sampling

    from dayzero.model.cache import init_cache

    cache = init_cache(engine.config, batch, max_len, jnp.float32, shardings=engine._cache_shardings(batch, max_len))
    mode, rows = batch_sampling([SamplingParams()] * batch)
    host = engine._host
    text = engine._decode.lower(engine.weights, host(np.zeros((batch, 1), np.int32)), host(np.ones(batch, np.int32)),
                                host(rows), host(np.int32(1)), mode=mode, cache=cache).compile().as_text()
    return re.findall(r"= (\S+) all-gather(?:-start)?\(", text)


def part_mla() -> dict:
    config = mla_config()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    ref = generation(Engine(config, weights))
    engine = Engine(config, weights, placement=placement_for({"tensor": 8}))
    out = compare(ref, generation(engine))
    out["latent_spec"] = [str(a) for a in engine._cache_shardings(2, 256).latent[0].spec]
    out["decode_all_gathers"] = gathered_shapes(engine, 2, 256)
    return out


def part_moe() -> dict:
    config = moe_config()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    ref, gap = logits_and_router_gap(config, weights, tokens)
    out = {"router_gap": gap}
    for name, axes in (("ep8", {"expert": 8}), ("tp2ep4", {"tensor": 2, "expert": 4})):
        out[name] = {"err": rel_err(sharded_logits(config, weights, tokens, axes, True), ref)}
    # Capacity: a small factor drops pairs, and the logits move.
    out["ep8"]["tight_err"] = rel_err(sharded_logits(config, weights, tokens, {"expert": 8}, True, 0.25), ref)
    out["local"] = local_expert_shapes(config, weights, tokens, {"tensor": 2, "expert": 4})
    gen_ref = generation(Engine(config, weights))
    out["ep8"]["generate"] = compare(gen_ref, generation(Engine(config, weights, placement=placement_for({"expert": 8}))))
    return out


def glm_config():
    """The tiny config as GLM-4.5 builds it: q/k/v biases, q/k norms, half of each 16-wide head
    rotated, a dense first layer, then DeepSeek-V3 routing (sigmoid, selection bias, 2 groups of
    4 experts, scaling 2.5, one shared expert)."""
    from dayzero.model.config import Family, RouterScore

    moe = MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(False, True),
                    score=RouterScore.SIGMOID, score_bias=True, num_groups=2, routed_scaling=2.5, shared_experts=1)
    base = _tiny_config()
    return replace(base, family=Family.GLM4_MOE, head_dim=16, qkv_bias=True, qk_norm=True, moe=moe,
                   rope=replace(base.rope, partial_rotary_factor=0.5))


def part_glm() -> dict:
    """GLM-4.5's blocks on tensor=2 x expert=4: all-position logits and generation as on one device."""
    config = glm_config()
    keys = iter(jax.random.split(jax.random.key(3), 64))
    weights = init_weights(abstract_weights(config), next(keys), scale=0.1)
    # Random norms, biases and selection bias: the constant init would hide a misplaced one.
    weights = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(next(keys), w.shape, w.dtype), weights)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    axes = {"tensor": 2, "expert": 4}
    ref, gap = logits_and_router_gap(config, weights, tokens)
    out = {"router_gap": gap, "tp2ep4": {"err": rel_err(sharded_logits(config, weights, tokens, axes, True), ref)}}
    out["tp2ep4"]["generate"] = compare(generation(Engine(config, weights)),
                                        generation(Engine(config, weights, placement=placement_for(axes))))
    return out


def minimax_config():
    """The tiny config as MiniMax-M2 builds it: one q (k) RMSNorm over all 8 heads of a token, half
    of each 8-wide head rotated, sigmoid routing with a selection bias in every layer (top-2 of 8,
    renormalised, no groups or shared experts)."""
    from dayzero.model.config import Family, RouterScore

    moe = MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(True, True),
                    score=RouterScore.SIGMOID, score_bias=True)
    base = _tiny_config()
    return replace(base, family=Family.MINIMAX_M2, qk_norm=True, qk_norm_all_heads=True, moe=moe,
                   rope=replace(base.rope, partial_rotary_factor=0.5))


def minimax_weights(config):
    """Random weights, norms and selection biases, the q and k heads scaled unevenly (x1/4 to x4):
    an RMS over each tensor=4 shard's two heads then differs from the one over all eight by far
    more than rounding."""
    keys = iter(jax.random.split(jax.random.key(5), 64))
    weights = init_weights(abstract_weights(config), next(keys), scale=0.1)
    weights = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(next(keys), w.shape, w.dtype), weights)
    scale = jnp.asarray([4.0, 2.0, 1.0, 0.5, 0.25, 1.0, 2.0, 4.0])[None, :, None]
    layers = tuple(replace(layer, attn=replace(layer.attn, q=layer.attn.q * scale, k=layer.attn.k * scale[:, ::-1]))
                   for layer in weights.layers)
    return replace(weights, layers=layers)


def per_shard_norm(shards: int):
    """A stand-in for ``transformer.rms_norm`` that takes the all-heads q/k norm over each of
    ``shards`` slices of the heads, as a tensor-parallel port that forgot to sum the squares across
    devices would; other norms unchanged."""
    import dayzero.model.transformer as transformer

    real_norm = transformer.rms_norm

    def norm(x, w, eps, axes=-1, offset=0.0):
        if axes == -1:
            return real_norm(x, w, eps, offset=offset)
        *lead, n, h = x.shape
        return real_norm(x.reshape(*lead, shards, n // shards * h), w.reshape(shards, -1), eps,
                         offset=offset).reshape(x.shape)

    return norm


def part_minimax_norm() -> dict:
    """MiniMax-M2's attention block (all-heads q/k norm, partial RoPE) with its heads split over
    tensor=4 (x data=2) against one device, and how far a per-shard norm would move it (the check's
    power). One block with numpy-drawn weights, so the check costs little more than jax's start."""
    import dayzero.model.transformer as transformer
    from dayzero.model.rope import rope_cos_sin
    from dayzero.model.weights import ParamSpec

    config = minimax_config()
    rng = np.random.default_rng(0)
    spec = abstract_weights(config).layers[0].attn
    attn = jax.tree.map(lambda p: (0.3 * rng.standard_normal(p.shape) + (p.init.value == "ones")).astype(np.float32),
                        spec, is_leaf=lambda p: isinstance(p, ParamSpec))
    scale = np.asarray([4.0, 2.0, 1.0, 0.5, 0.25, 1.0, 2.0, 4.0], np.float32)[None, :, None]
    attn = replace(attn, q=attn.q * scale, k=attn.k * scale[:, ::-1])
    x = rng.standard_normal((2, 12, config.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
    cos_sin = rope_cos_sin(config.rope, config.head_dim, config.max_position_embeddings, positions, 12)
    masks = transformer.attention_masks(np.zeros(2, np.int32), np.full(2, 12, np.int32), 12, None, None)
    block = lambda a, h: transformer.attention_block(a, config, h, cos_sin, None, masks)[0]  # noqa: E731
    ref = np.asarray(jax.jit(block)(attn, x))
    placement = placement_for({"data": 2, "tensor": 4})
    on_mesh = jax.device_put(attn, placement.shardings(abstract_weights(config)).layers[0].attn)
    out = {"dp2tp4_err": rel_err(jax.jit(block)(on_mesh, placement.replicate(x)), ref),
           "q_norm_spec": [str(a) for a in on_mesh.q_norm.sharding.spec],
           "k_norm_spec": [str(a) for a in on_mesh.k_norm.sharding.spec]}
    real_norm, transformer.rms_norm = transformer.rms_norm, per_shard_norm(4)
    try:
        # A new function, so jit traces it again (the cache is keyed on the function).
        out["per_shard_err"] = rel_err(jax.jit(lambda a, h: block(a, h))(attn, x), ref)
    finally:
        transformer.rms_norm = real_norm
    return out


def part_minimax() -> dict:
    """MiniMax-M2's blocks on data=2 x tensor=4 and tensor=2 x expert=4: all-position logits as on
    one device, and generation on data=2 x tensor=4 as on one device."""
    config = minimax_config()
    weights = minimax_weights(config)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    ref, gap = logits_and_router_gap(config, weights, tokens)
    out = {"router_gap": gap}
    for name, axes in (("dp2tp4", {"data": 2, "tensor": 4}), ("tp2ep4", {"tensor": 2, "expert": 4})):
        out[name] = {"err": rel_err(sharded_logits(config, weights, tokens, axes, True), ref)}
    dp2tp4 = placement_for({"data": 2, "tensor": 4})
    out["dp2tp4"]["generate"] = compare(generation(Engine(config, weights)),
                                        generation(Engine(config, weights, placement=dp2tp4)))
    return out


def part_checkpoint(hf_dir: str, one_device_dir: str, mesh_dir: str) -> dict:
    """``one_device_dir`` (converted without a mesh) loaded into tensor=8; ``hf_dir`` converted here
    for data=2 x tensor=4 into ``mesh_dir`` and loaded on one device."""
    from pathlib import Path

    from dayzero.convert import convert_checkpoint, load_checkpoint, verify_checkpoint
    from dayzero.model.weights import named_leaves

    config, one = load_checkpoint(one_device_dir)
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 24), 0, config.vocab_size))
    run = jax.jit(lambda w, t: forward(w, config, t, all_logits=True)[0])
    ref = np.asarray(run(one, tokens))
    tp8 = placement_for({"tensor": 8})
    _, on_tp8 = load_checkpoint(one_device_dir, shardings=tp8.shardings(abstract_weights(config)))
    out = {
        "tp8_err": rel_err(run(on_tp8, tp8.replicate(tokens)), ref),
        "tp8_q_spec": [str(a) for a in on_tp8.layers[0].attn.q.sharding.spec],
        "tp8_same_values": all(np.array_equal(np.asarray(a), np.asarray(b))
                               for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(on_tp8))),
    }
    convert_checkpoint(hf_dir, mesh_dir, progress=False, placement=placement_for({"data": 2, "tensor": 4}))
    manifest = json.loads((Path(mesh_dir) / "manifest.json").read_text())
    zarray = json.loads((Path(mesh_dir) / "weights" / "layer_000" / "mlp.gate" / ".zarray").read_text())
    _, back = load_checkpoint(mesh_dir)  # one device
    leaves_one, leaves_back = named_leaves(one), named_leaves(back)
    out.update({
        "mesh": manifest["mesh"], "rules": manifest["rules"],
        "gate_spec": manifest["tensors"]["layers/0/mlp/gate"]["spec"], "gate_chunks": zarray["chunks"],
        "one_device_devices": sorted({str(d) for x in jax.tree.leaves(back) for d in x.devices()}),
        "same_values": all(np.array_equal(np.asarray(leaves_one[k]), np.asarray(leaves_back[k])) for k in leaves_one),
        "same_logits": bool(np.array_equal(np.asarray(run(back, tokens)), ref)),
        "verified_leaves": verify_checkpoint(mesh_dir),
    })
    out["cli"] = cli_on_mesh(hf_dir, one_device_dir, mesh_dir)
    return out


def cli_on_mesh(hf_dir: str, one_device_dir: str, mesh_dir: str) -> dict:
    """``generate`` and ``verify`` with ``--mesh``, against the one-device engine."""
    import contextlib
    import io

    from dayzero.engine.cli import main

    def run(*argv) -> tuple[int, dict]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main([str(a) for a in argv])
        return rc, json.loads(out.getvalue().strip().splitlines()[-1])

    ids = [5, 3, 2, 7, 1, 9]
    one = Engine.load(one_device_dir).generate(ids, max_new_tokens=NEW, logprobs=True, ignore_eos=True)
    rc, gen = run("generate", "--model", mesh_dir, "--prompt-ids", ",".join(map(str, ids)),
                  "--max-new-tokens", NEW, "--json", "--logprobs", "--mesh", "data=2,tensor=4")
    vrc, report = run("verify", "--model", one_device_dir, "--reference", hf_dir, "--json",
                      "--prompt-ids", ",".join(map(str, ids * 4)), "--mesh", "tensor=8")
    return {"generate_rc": rc, "same_tokens": gen["token_ids"] == one.token_ids,
            "logprob_diff": max(abs(a - b) for a, b in zip(gen["logprobs"], one.logprobs)),
            "verify_rc": vrc, "verify_passed": report["passed"]}


def gpt_oss_config():
    """The tiny config as gpt-oss builds it: attention sinks, q/k/v/o biases, a 6-token window in
    the first layer and full attention in the second, softmax routing with a router bias (top-2
    of 8), expert biases and the clamped SwiGLU (limit 0.5, so it bites on these activations)."""
    from dayzero.model.config import Family

    moe = MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(True, True),
                    router_bias=True, expert_bias=True, swiglu_limit=0.5, swiglu_alpha=1.702, swiglu_up_shift=1.0)
    return replace(_tiny_config(), family=Family.GPT_OSS, qkv_bias=True, o_bias=True, attention_sinks=True,
                   sliding_windows=(6, None), moe=moe)


def gpt_oss_logits_and_gap(config, weights, tokens) -> tuple[np.ndarray, float]:
    """As :func:`logits_and_router_gap`, the margin taken on the biased router logits gpt-oss ranks."""
    import dayzero.model.transformer as transformer

    def run(w, t):
        inputs = []  # each MoE block's (router, router bias, hidden states), filled while tracing
        real_moe = transformer.moe
        transformer.moe = lambda mw, c, h, **kw: inputs.append((mw.router, mw.router_bias, h)) or real_moe(mw, c, h, **kw)
        try:
            logits = forward(w, config, t, all_logits=True)[0]
        finally:
            transformer.moe = real_moe
        return logits, [router_logits(r, h.reshape(-1, h.shape[-1])) + b for r, b, h in inputs]

    logits, routers = jax.jit(run)(weights, tokens)
    return np.asarray(logits), min(choice_gap(np.asarray(r), None, config.moe) for r in routers)


def part_gpt_oss() -> dict:
    """gpt-oss's blocks on data=2 x tensor=4 (sinks split with the heads; also with the flash kernel
    interpreted per device inside shard_map) and tensor=2 x expert=4 (expert biases split with the
    experts and their width): all-position logits as on one device, and generation on
    tensor=2 x expert=4 as on one device."""
    from dayzero.kernels import KernelMode

    config = gpt_oss_config()
    keys = iter(jax.random.split(jax.random.key(7), 64))
    weights = init_weights(abstract_weights(config), next(keys), scale=0.1)
    # Random norms, biases and router bias; sinks N(0, 1), a sizeable share of each softmax.
    weights = jax.tree.map(lambda w: w + 0.1 * jax.random.normal(next(keys), w.shape, w.dtype), weights)
    weights = replace(weights, layers=tuple(
        replace(layer, attn=replace(layer.attn, sinks=jax.random.normal(next(keys), layer.attn.sinks.shape)))
        for layer in weights.layers))
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    ref, gap = gpt_oss_logits_and_gap(config, weights, tokens)
    out = {"router_gap": gap}
    for name, axes in (("dp2tp4", {"data": 2, "tensor": 4}), ("tp2ep4", {"tensor": 2, "expert": 4})):
        out[name] = {"err": rel_err(sharded_logits(config, weights, tokens, axes, True), ref)}
    placement = placement_for({"data": 2, "tensor": 4})
    sharded = jax.device_put(weights, placement.shardings(abstract_weights(config)))
    out["sinks_spec"] = [str(a) for a in sharded.layers[0].attn.sinks.sharding.spec]
    par = Parallel(placement)
    run = jax.jit(lambda w, t: forward(w, config, t, all_logits=True, parallel=par,
                                       kernels=KernelMode.PALLAS_INTERPRET)[0])
    out["dp2tp4_kernels"] = {"err": rel_err(run(sharded, placement.replicate(np.asarray(tokens))), ref)}
    tp2ep4 = placement_for({"tensor": 2, "expert": 4})
    out["tp2ep4"]["generate"] = compare(generation(Engine(config, weights)),
                                        generation(Engine(config, weights, placement=tp2ep4)))
    return out


PARTS = {"dense": part_dense, "moe": part_moe, "glm": part_glm, "checkpoint": part_checkpoint,
         "minimax": part_minimax, "minimax_norm": part_minimax_norm, "gpt_oss": part_gpt_oss}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
