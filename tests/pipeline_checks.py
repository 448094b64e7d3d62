"""Pipeline-parallel checks on 8 faked CPU devices, run in a fresh interpreter by test_pipeline.py.

``python -m tests.pipeline_checks PART`` (XLA_FLAGS set by ``tests.mesh_checks.run_part``) prints
one JSON object; the tests assert on it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import jax
import numpy as np

from dayzero.engine.generate import Engine
from dayzero.engine.sampling import SamplingMode, SamplingParams
from dayzero.model.config import MoEConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.parallel import Parallel
from dayzero.model.pipeline import pipeline_forward, plan_stages, stage_weights, staged_specs
from dayzero.model.quant import QuantConfig, WeightQuant
from dayzero.model.transformer import forward
from dayzero.model.weights import (abstract_weights, aligned_weights, axis_sizes, init_weights, mesh_aligned_specs,
                                   quantize_weights)
from dayzero.sharding.placement import placement_for
from tests.mesh_checks import PROMPTS, compare, generation, rel_err
from tests.serving_models import LATENT, prompt
from tests.test_sharding import _tiny_config

# Five layers: stage=2 splits them 3 + 2 and stage=4 2 + 1 + 1 + 1, so padding slots are exercised.
LAYERS = 5


def dense_config():
    """The tiny Llama-style config with five layers."""
    return replace(_tiny_config(), num_layers=LAYERS, sliding_windows=(None,) * LAYERS)


def moe_config():
    """Five Mixtral-style MoE layers, 8 experts of width 32, top-2."""
    moe = MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(True,) * LAYERS)
    return replace(dense_config(), moe=moe)


def pipelined_logits(config, weights, tokens, axes, num_micro, quant=QuantConfig()) -> tuple[np.ndarray, list]:
    """Last-token logits of ``tokens`` through the pipeline on a mesh of ``axes``, and the plan
    (``weights`` quantized as ``quant`` says, block scales aligned to the mesh as an engine's)."""
    placement = placement_for(axes)
    specs = mesh_aligned_specs(abstract_weights(config, quant), axis_sizes(placement))
    plan = plan_stages(specs, axes["stage"])
    staged = stage_weights(aligned_weights(weights, specs), plan)
    staged = jax.device_put(staged, placement.shardings(staged_specs(specs, plan)))
    par = Parallel(placement)
    run = jax.jit(lambda w, t: pipeline_forward(w, config, plan, par, t, num_micro=num_micro)[0])
    return np.asarray(run(staged, placement.replicate(np.asarray(tokens)))), [list(r) for r in plan.ranges]


def dense_first_config():
    """DeepSeek-style: one dense first layer, then four MoE layers (the dense one on stage 0)."""
    config = moe_config()
    return replace(config, moe=replace(config.moe, layers=(False,) + (True,) * (LAYERS - 1)))


def latent_config():
    """DeepSeek-V3-like: multi-head latent attention, one dense first layer then four MoE layers
    (4 routed experts, top-2, sigmoid routing with a selection bias)."""
    return parse_hf_config(dict(LATENT, num_hidden_layers=LAYERS, first_k_dense_replace=1))


CASES = {"dense": (dense_config, {"stage": 2, "tensor": 4}), "moe": (moe_config, {"stage": 4, "expert": 2}),
         "dense_first": (dense_first_config, {"stage": 2, "tensor": 2, "expert": 2}),
         "latent": (latent_config, {"stage": 2, "tensor": 2, "expert": 2})}


def part_forward(case: str) -> dict:
    """Last-token logits pipelined over 1, 2 and 4 micro-batches against one device."""
    make, axes = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    ref = np.asarray(jax.jit(lambda w, t: forward(w, config, t)[0])(weights, tokens))
    out = {}
    for m in (1, 2, 4):
        got, ranges = pipelined_logits(config, weights, tokens, axes, m)
        out[f"m{m}"] = {"err": rel_err(got, ref), "ranges": ranges}
    return out


def part_generate(case: str) -> dict:
    """Greedy generation of two prompts (two micro-batches) by a pipelined engine against one device."""
    make, axes = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    ref = generation(Engine(config, weights))
    engine = Engine(config, weights, placement=placement_for(axes))
    out = compare(ref, generation(engine))
    # In-flight decode in several calls (2 + 2 + 1 steps): each call refills the pipeline from the cache.
    import dayzero.engine.generate as generate_module

    generate_module.IN_FLIGHT_STEPS = 2
    out["in_flight"] = engine._in_flight_micro_batches(SamplingMode.GREEDY, len(PROMPTS))
    out["chunked_same_tokens"] = generation(engine)["tokens"] == ref["tokens"]
    out["k_cache_spec"] = [str(a) for a in engine._cache_shardings(2, 256).buffers[0].spec]
    attn = engine.weights.layers.attn
    out["layer_spec"] = [str(a) for a in (attn.kv_a if config.mla else attn.q).sharding.spec]
    return out


def part_decode(case: str) -> dict:
    """Greedy tokens of four prompts from a pipelined prefill then :func:`pipeline_decode` (2 and
    4 micro-batches in flight) against a one-device engine's."""
    from dayzero.model.cache import empty_from_specs
    from dayzero.model.pipeline import append_staged, staged_cache_specs
    from dayzero.model.pipeline_inflight import pipeline_decode

    make, axes = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5, 5, 1, 2], [100, 3, 7, 2, 9, 4]]
    steps = 6
    ref = np.stack([t for t, _ in Engine(config, weights).stream_ids(prompts, steps + 1, [SamplingParams()] * 4)], 1)
    placement = placement_for(axes)
    specs = abstract_weights(config)
    plan = plan_stages(specs, axes["stage"])
    staged = jax.device_put(stage_weights(weights, plan), placement.shardings(staged_specs(specs, plan)))
    par = Parallel(placement)
    tokens = np.zeros((4, 8), np.int32)
    for b, row in enumerate(prompts):
        tokens[b, :len(row)] = row
    num_new = np.array([len(r) for r in prompts], np.int32)
    out = {}
    for m in sorted({axes["stage"], 4}):  # at least one micro-batch in flight per stage
        shape = (config, plan, 4, 32)
        cache = empty_from_specs(staged_cache_specs, *shape, np.float32,
                                 shardings=placement.shardings(staged_cache_specs(*shape)))
        logits, new = jax.jit(lambda w, t, n: pipeline_forward(w, config, plan, par, t, None, n, num_micro=m))(
            staged, placement.replicate(tokens), placement.replicate(num_new))
        cache = jax.jit(append_staged)(cache, new)
        first = jax.numpy.argmax(logits, -1).astype(np.int32)
        decoded, _, cache = jax.jit(lambda w, f, c: pipeline_decode(w, config, plan, par, f, c, steps, m))(
            staged, first, cache)
        got = np.concatenate([np.asarray(first)[:, None], np.asarray(decoded).T], 1)
        out[f"m{m}"] = {"same_tokens": got.tolist() == ref.tolist(), "got": got.tolist(), "ref": ref.tolist(),
                        "lengths": np.asarray(cache.lengths).tolist()}
    return out


def part_quantized(case: str, formats: str = "int8,fp8-block") -> dict:
    """Last-token logits (two micro-batches) of the model quantized in each of ``formats``, pipelined,
    against the same quantized model on one device (and, to show quantization happened, that
    model's distance from the float one)."""
    make, axes = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    one_device = jax.jit(lambda w, t: forward(w, config, t)[0])
    plain = np.asarray(one_device(weights, tokens))
    out = {}
    for name in formats.split(","):
        quant = QuantConfig(WeightQuant(name))
        quantized = quantize_weights(weights, abstract_weights(config, quant))
        ref = np.asarray(one_device(quantized, tokens))
        got, ranges = pipelined_logits(config, quantized, tokens, axes, 2, quant)
        out[name] = {"err": rel_err(got, ref), "vs_float": rel_err(ref, plain), "ranges": ranges}
    return out


def part_quantized_generate(case: str, fmt: str) -> dict:
    """Greedy generation by a pipelined engine over weights quantized as ``fmt`` against the same
    quantized weights on one device (the engine's own path: runtime checks, aligned specs, staging)."""
    make, axes = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    weights = quantize_weights(weights, abstract_weights(config, QuantConfig(WeightQuant(fmt))))
    engine = Engine(config, weights, placement=placement_for(axes))
    out = compare(generation(Engine(config, weights)), generation(engine))
    out["quantize"] = engine.run.describe()["quantize"]
    out["staged_experts"] = type(engine.weights.layers.mlp.gate).__name__  # still quantized once staged
    return out


SERVE_PROMPTS = [prompt(20, 1), prompt(9, 2), prompt(12, 3), prompt(5, 4)]


def part_serve(case: str) -> dict:
    """Tokens and logprobs served by a ServingEngine over a pipelined engine (staged page pools
    read through block tables) against the one-device serving run."""
    from dayzero.engine import ServingConfig, ServingEngine

    make, axes = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    serving = ServingConfig(slots=4, page_size=8, max_chunk=16, max_context=40)

    def served(engine):
        outs = ServingEngine(engine, serving).run(SERVE_PROMPTS, max_new_tokens=6, ignore_eos=True, logprobs=True)
        return [o.token_ids for o in outs], [o.logprobs for o in outs]

    one, got = served(Engine(config, weights)), served(Engine(config, weights, placement=placement_for(axes)))
    diff = max(abs(a - b) for r, g in zip(one[1], got[1]) for a, b in zip(r, g))
    return {"same_tokens": one[0] == got[0], "logprob_diff": diff, "tokens": got[0]}


if __name__ == "__main__":
    print(json.dumps(globals()[f"part_{sys.argv[1]}"](*sys.argv[2:])))
