"""The serving engine on a pipeline (stage) mesh of 8 faked CPU devices, run in a fresh
interpreter by tests/test_pipeline_serving.py.

``python -m tests.pipeline_serving_checks CASE`` prints one JSON object: for each mesh of CASE,
whether the served tokens equal the single-device serving run with the same settings, the
largest logprob difference, and what the run went through (micro-batches per decode step,
preemptions, swaps, host prefix pages, the pool's partition spec). Five requests share four
slots and a pool of eight pages of eight positions, so the run preempts, swaps a request's pages
to host memory and back, and spills evicted prefix pages to the host tier; two prompts share a
16-token prefix (prefix cache).
"""

from __future__ import annotations

import json
import sys

import jax

from dayzero.engine import Engine, ServingConfig, ServingEngine
from dayzero.model.weights import abstract_weights, init_weights
from dayzero.sharding.placement import placement_for
from tests.pipeline_checks import dense_config, dense_first_config, moe_config
from tests.serving_models import prompt

PROMPTS = [prompt(20, 1), prompt(9, 2), prompt(12, 3), prompt(20, 1)[:17] + [3, 4], prompt(5, 4)]
NEW = 8
# (model, [(mesh axes, micro-batches, warm up first)]).
CASES = {
    "dense": (dense_config, [({"stage": 2, "tensor": 4}, 2, True), ({"data": 2, "stage": 2, "tensor": 2}, None, False)]),
    "moe": (moe_config, [({"stage": 4, "expert": 2}, 4, False)]),
    "dense_first": (dense_first_config, [({"stage": 2, "tensor": 2, "expert": 2}, 1, False)]),
}


def served(engine: Engine, micro_batches: int | None, warm: bool) -> dict:
    """Greedy tokens and logprobs of PROMPTS and what the serving run went through."""
    config = ServingConfig(slots=4, page_size=8, max_chunk=16, max_context=40, num_pages=8,
                           micro_batches=micro_batches)
    server = ServingEngine(engine, config)
    if warm:
        server.warmup()
    outs = server.run(PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    stats = server.stats
    steps = server.replicas[0].steps
    first = jax.tree.leaves(steps.pool)[0]
    return {"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
            "preemptions": stats.preemptions, "swapped_in": stats.swapped_in, "host_pages": stats.host_pages,
            "cached_tokens": stats.cached_tokens, "replicas": len(server.replicas),
            "stages": None if steps.stages is None else [list(r) for r in steps.stages.ranges],
            "decode_micro_batches": None if steps.stages is None else steps._logits_step(4)[1]["num_micro"],
            "pool_shape": list(first.shape), "pool_spec": [str(a) for a in getattr(first.sharding, "spec", ())]}


def run_case(case: str) -> dict:
    """Each mesh of ``CASES[case]`` against single-device serving with the same settings."""
    make, runs = CASES[case]
    config = make()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.1)
    one = served(Engine(config, weights), None, False)
    out = {"one_device": {k: v for k, v in one.items() if k not in ("tokens", "logprobs")}}
    for axes, micro, warm in runs:
        got = served(Engine(config, weights, placement=placement_for(axes)), micro, warm)
        diff = max(abs(a - b) for r, g in zip(one["logprobs"], got["logprobs"]) for a, b in zip(r, g))
        name = "x".join(f"{a}{s}" for a, s in axes.items())
        out[name] = {"same_tokens": one["tokens"] == got["tokens"], "logprob_diff": diff,
                     **{k: v for k, v in got.items() if k not in ("tokens", "logprobs")}}
    return out


if __name__ == "__main__":
    print(json.dumps(run_case(sys.argv[1])))
