"""The serving engine on a pipeline (stage) mesh of 8 faked CPU devices, run in a fresh
interpreter by tests/test_pipeline_serving.py.

``python -m tests.pipeline_serving_checks CASE`` prints one JSON object: for each mesh of CASE,
whether the served tokens equal the single-device serving run with the same settings, the
largest logprob difference, and what the run went through (micro-batches per decode step,
preemptions, swaps, host prefix pages, the pool's partition spec). Five requests share four
slots and a pool of eight pages of eight positions, so the run preempts, swaps a request's pages
to host memory and back, and spills evicted prefix pages to the host tier; two prompts share a
16-token prefix (prefix cache). Each case runs with its own KV cache format (int8, fp8 or float)
on every mesh and on the one device it is compared with.
"""

from __future__ import annotations

import json
import sys

import jax

from dayzero.engine import Engine, ServingConfig, ServingEngine
from dayzero.engine.sampling import SamplingParams
from dayzero.model.pipeline import plan_stages
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.sharding.placement import placement_for
from tests.pipeline_checks import dense_config, dense_first_config, latent_config, moe_config
from tests.serving_models import prompt

PROMPTS = [prompt(20, 1), prompt(9, 2), prompt(12, 3), prompt(20, 1)[:17] + [3, 4], prompt(5, 4)]
NEW = 8
# Greedy and seeded sampled requests (a pipeline samples in-flight steps on the device).
SAMPLING = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(),
            SamplingParams(temperature=0.8, top_k=20, seed=5), SamplingParams(temperature=1.0, top_p=0.9, seed=7)]
# (model, KV cache, [(mesh axes, micro-batches, warm up first)]).
CASES = {
    "dense": (dense_config, "int8", [({"stage": 2, "tensor": 4}, 2, True),
                                     ({"data": 2, "stage": 2, "tensor": 2}, None, False)]),
    "moe": (moe_config, "none", [({"stage": 4, "expert": 2}, 4, False)]),
    "dense_first": (dense_first_config, "fp8", [({"stage": 2, "tensor": 2, "expert": 2}, 1, False)]),
    "latent": (latent_config, "int8", [({"stage": 2, "tensor": 2, "expert": 2}, 2, False)]),
    "gpt_oss": (lambda: gpt_oss_config(), "none", [({"stage": 2, "tensor": 2, "expert": 2}, 2, False)]),
}


def gpt_oss_config():
    """The tiny gpt-oss of tests/test_gpt_oss.py: a sliding-window layer (24) then a full one,
    attention sinks, 8 experts; on two stages each stage's slot has another window."""
    import transformers

    from dayzero.model.hf_config import parse_hf_config
    from tests.test_gpt_oss import COMMON

    return parse_hf_config(transformers.GptOssConfig(**COMMON).to_dict())


def served(engine: Engine, micro_batches: int | None, warm: bool) -> dict:
    """Greedy tokens and logprobs of PROMPTS and what the serving run went through."""
    config = ServingConfig(slots=4, page_size=8, max_chunk=16, max_context=40, num_pages=8,
                           micro_batches=micro_batches)
    server = ServingEngine(engine, config)
    if warm:
        server.warmup()
    outs = server.run(PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=True, sampling=SAMPLING)
    stats = server.stats
    steps = server.replicas[0].steps
    first = jax.tree.leaves(steps.pool)[0]
    return {"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
            "preemptions": stats.preemptions, "in_flight_calls": stats.in_flight_calls, "swapped_in": stats.swapped_in, "host_pages": stats.host_pages,
            "cached_tokens": stats.cached_tokens, "replicas": len(server.replicas),
            "stages": None if steps.stages is None else [list(r) for r in steps.stages.ranges],
            "decode_micro_batches": None if steps.stages is None else steps._logits_step(4)[1]["num_micro"],
            "pool_shape": list(first.shape), "pool_spec": [str(a) for a in getattr(first.sharding, "spec", ())]}


def generated(engine: Engine) -> list:
    """Engine.generate's tokens for four prompts with greedy and seeded sampled rows (on a
    pipeline: decoded with micro-batches in flight, each row sampled on the device)."""
    prompts = [p[:7] for p in PROMPTS[:4]]
    return [t.tolist() for t, _ in engine.stream_ids(prompts, NEW + 4, SAMPLING[:4])]


def run_case(case: str) -> dict:
    """Each mesh of ``CASES[case]`` against single-device serving with the same settings (the
    first mesh also against single-device generation)."""
    make, kv, runs = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    one = served(Engine(config, weights, kv_cache=kv), None, False)
    out = {"case": case, "one_device": {k: v for k, v in one.items() if k not in ("tokens", "logprobs")}}
    staged = Engine(config, weights, placement=placement_for(runs[0][0]), kv_cache=kv)
    out["generate_in_flight"] = staged._in_flight_micro_batches(None, 4)
    out["generate_same_tokens"] = generated(staged) == generated(Engine(config, weights, kv_cache=kv))
    for axes, micro, warm in runs:
        got = served(Engine(config, weights, placement=placement_for(axes), kv_cache=kv), micro, warm)
        diff = max(abs(a - b) for r, g in zip(one["logprobs"], got["logprobs"]) for a, b in zip(r, g))
        name = "x".join(f"{a}{s}" for a, s in axes.items())
        out[name] = {"same_tokens": one["tokens"] == got["tokens"], "logprob_diff": diff,
                     **{k: v for k, v in got.items() if k not in ("tokens", "logprobs")}}
    return out


def run_load(model_dir: str) -> dict:
    """A converted checkpoint loaded for ``stage=2,tensor=4``: where each layer was read (the
    devices of its stage only) and the stacked weights against ``stage_weights`` of the
    checkpoint loaded on one device."""
    import numpy as np

    from dayzero.convert import load_checkpoint
    from dayzero.convert.checkpoint import read_config, read_manifest, stored_quantization
    from dayzero.engine import staged_load
    from dayzero.engine.generate import weight_specs
    from dayzero.engine.runtime import resolve_run
    from dayzero.model.pipeline import stage_weights

    placement = placement_for({"stage": 2, "tensor": 4})
    config, stored = read_config(model_dir), stored_quantization(read_manifest(model_dir))
    run = resolve_run(config, placement=placement)
    specs = weight_specs(config, run, untied_head=False)
    plan = plan_stages(specs, 2)
    _, per_layer = load_checkpoint(model_dir, shardings=staged_load.stage_shardings(specs, plan, placement))
    read_on = [sorted({d.id for leaf in jax.tree.leaves(layer) for d in leaf.sharding.device_set})
               for layer in per_layer.layers]
    _, staged = staged_load.load_staged(model_dir, config, run, stored, specs)
    _, whole = load_checkpoint(model_dir)
    want = stage_weights(whole, plan)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(staged), jax.tree.leaves(want)))
    stage_devices = [sorted(d.id for d in sub.mesh.devices.flat) for sub in staged_load.stage_placements(placement)]
    q = staged.layers.attn.q
    return {"read_on": read_on, "stage_devices": stage_devices, "ranges": [list(r) for r in plan.ranges],
            "max_abs_diff": err, "q_spec": [str(a) for a in q.sharding.spec],
            "q_shard_shape": list(q.addressable_shards[0].data.shape), "q_shape": list(q.shape)}


if __name__ == "__main__":
    print(json.dumps(run_load(sys.argv[2]) if sys.argv[1] == "load" else run_case(sys.argv[1])))
