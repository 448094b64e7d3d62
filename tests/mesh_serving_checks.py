"""Continuous batching on a mesh of 8 faked CPU devices, run in a fresh interpreter by
tests/test_mesh_serving.py (the device count is fixed when jax starts).

``python -m tests.mesh_serving_checks CASE`` prints one JSON object: for each (mesh, kernels, KV
cache) run of CASE, whether the served tokens equal the single-device serving run with the same
settings, and the largest logprob difference. A CASE is a tiny MoE model with quantized weights:

- ``deepseek_fp8_block``: DeepSeek-V3 (latent attention, shared + 8 routed experts) with fp8
  block weights of block 32 x 32, so tensor=4 cuts every 64-wide expert block in half (the
  block-split case: DeepSeek-V3's 2048-wide experts over tensor=32 at a small scale);
- ``qwen3_int8`` / ``qwen3_int4``: Qwen3-MoE (q/k norms, 4 query heads over 2 kv heads, 8
  experts, top 2) with int8 weights, or int4 routed experts beside int8 projections;
- ``deepseek32_int8``: DeepSeek-V3.2 (sparse attention: the indexer's top 8 tokens) with int8
  weights, on the sparse kernels.

Each run also records every kernel call the forward traced (``_on_devices``) and whether it ran
inside ``shard_map``: a mesh run on the kernels must have made them all there, a reference run
none.
"""

from __future__ import annotations

import json
import sys

import jax

from dayzero.engine import Engine, ServingConfig, ServingEngine
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import QuantConfig, WeightQuant
from dayzero.model.weights import abstract_weights, init_weights, quantize_weights
from dayzero.sharding.placement import placement_for
import dayzero.model.kernel_attention as kernel_attention
from tests.serving_models import BASE, DSA, LATENT, prompt

QWEN3_MOE = dict(BASE, model_type="qwen3_moe", num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[])
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=64)
CASES = {
    "deepseek_fp8_block": (dict(LATENT, **MOE), QuantConfig(WeightQuant.FP8_BLOCK, block=(32, 32))),
    "qwen3_int8": (QWEN3_MOE, QuantConfig(WeightQuant.INT8)),
    "qwen3_int4": (QWEN3_MOE, QuantConfig(WeightQuant.INT4)),
    "deepseek32_int8": (dict(DSA, **MOE), QuantConfig(WeightQuant.INT8)),
}
# (mesh, kernels, KV cache) of each case's two runs: across the cases every mesh meets both
# attention paths and both KV formats (the full product would take too long on two cores).
# (Qwen3's 2 kv heads do not split over tensor=4, so its kernel runs are on tensor=2: two query
# heads per kv head on each device.)
RUNS = {
    "deepseek_fp8_block": (({"tensor": 2, "expert": 4}, "reference", "fp8"),
                           ({"data": 2, "tensor": 4}, "pallas_interpret", "int8")),
    "qwen3_int8": (({"tensor": 2, "expert": 4}, "pallas_interpret", "fp8"),
                   ({"data": 2, "tensor": 4}, "reference", "int8")),
    "qwen3_int4": (({"tensor": 2, "expert": 4}, "pallas_interpret", "int8"),
                   ({"data": 2, "tensor": 4}, "reference", "fp8")),
    "deepseek32_int8": (({"tensor": 2, "expert": 4}, "pallas_interpret", "int8"),),
}
# Three requests on two slots (the third joins when one finishes), the first prefilled in two chunks.
PROMPTS = [prompt(20, 1), prompt(9, 2), prompt(12, 3)]
NEW = 4
SERVING = ServingConfig(slots=2, page_size=8, max_chunk=16, max_context=32)


def quantized_model(case: str):
    """(config, weights quantized once on one device) of ``case``; scale 0.2 gives O(1) logits."""
    hf, quant = CASES[case]
    config = parse_hf_config(hf)
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.2)
    return config, quantize_weights(weights, abstract_weights(config, quant))


KERNEL_CALLS: list[bool] = []  # per kernel call traced: inside shard_map?
_on_devices = kernel_attention._on_devices


def _recording_on_devices(split, kernel, *args):
    KERNEL_CALLS.append(split is not None)
    return _on_devices(split, kernel, *args)


kernel_attention._on_devices = _recording_on_devices


def served(engine: Engine, warm: bool = False) -> dict:
    """Greedy tokens and logprobs of PROMPTS served concurrently (2 slots, chunked prefill), run
    as the engine's run configuration says, and the kernel calls its steps traced. ``warm``:
    after ``warmup`` (as ``serve`` does), whose sampling steps then take the forward's logits."""
    KERNEL_CALLS.clear()
    server = ServingEngine(engine, SERVING)
    if warm:
        server.warmup()
    outs = server.run(PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    pools = [jax.tree.leaves(r.steps.pool)[0] for r in server.replicas]
    return {"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
            "kv_spec": _pool_spec(server), "kernels": server.config.kernels.value,
            "replica_devices": [sorted(d.id for d in p.devices()) for p in pools],
            "replica_requests": [r.stats.prefill_chunks > 0 for r in server.replicas],
            "kernel_calls": len(KERNEL_CALLS), "kernels_in_shard_map": all(KERNEL_CALLS)}


def _pool_spec(server: ServingEngine) -> list[str] | None:
    """The partition spec of the first layer's pool (None on one device)."""
    first = jax.tree.leaves(server.steps.pool)[0]
    spec = getattr(first.sharding, "spec", None)
    return None if spec is None else [str(a) for a in spec]


def run_case(case: str) -> dict:
    """Each run of ``RUNS[case]`` against single-device serving with the same settings."""
    config, weights = quantized_model(case)
    out = {"devices": jax.device_count()}
    for axes, kernels, kv in RUNS[case]:
        one = served(Engine(config, weights, kv_cache=kv, kernels=kernels))
        mesh = Engine(config, weights, placement=placement_for(axes), kv_cache=kv, kernels=kernels)
        # The reference data x tensor runs serve after warmup (vocabulary-split logits meet the
        # steps warmup compiled); the others compile on first use.
        got = served(mesh, warm=kernels == "reference" and "data" in axes)
        diff = max(abs(a - b) for r, g in zip(one["logprobs"], got["logprobs"]) for a, b in zip(r, g))
        name = "x".join(f"{a}{s}" for a, s in axes.items()) + f"-{kernels}-{kv}"
        out[name] = {"same_tokens": one["tokens"] == got["tokens"], "logprob_diff": diff,
                     "pool_spec": got["kv_spec"], "run": mesh.run.describe(), "served_on": got["kernels"],
                     "replica_devices": got["replica_devices"], "replica_requests": got["replica_requests"],
                     "kernel_calls": got["kernel_calls"], "kernels_in_shard_map": got["kernels_in_shard_map"]}
    return out


def run_cli(hf_dir: str, root: str) -> dict:
    """The CLI with everything at once: ``generate --mesh tensor=2,expert=4 --quantize fp8-block
    --kv-cache int8 --kernels pallas_interpret`` on a float checkpoint (quantized at load), and a
    checkpoint converted with ``--quantize fp8-block --mesh tensor=2,expert=4`` loaded on
    ``data=2,tensor=4``; each against the same settings on one device."""
    args = ["--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(NEW), "--json", "--logprobs",
            "--kv-cache", "int8", "--kernels", "pallas_interpret"]
    float_dir, fp8_dir = f"{root}/float", f"{root}/fp8_block"
    out = {"convert_float": _cli(["convert", hf_dir, float_dir, "--no-progress"])[0],
           "convert_fp8": _cli(["convert", hf_dir, fp8_dir, "--no-progress", "--quantize", "fp8-block",
                                "--mesh", "tensor=2,expert=4"])[0]}
    for name, model, extra, mesh in (("at_load", float_dir, ["--quantize", "fp8-block"], "tensor=2,expert=4"),
                                     ("converted", fp8_dir, [], "data=2,tensor=4")):
        rc_one, one = _cli(["generate", "--model", model, *args, *extra])
        rc_mesh, got = _cli(["generate", "--model", model, *args, *extra, "--mesh", mesh])
        out[name] = {"rc": [rc_one, rc_mesh], "one": one.get("run"), "mesh": got.get("run"),
                     "same_tokens": one.get("token_ids") == got.get("token_ids") and len(one["token_ids"]) == NEW,
                     "logprob_diff": max(abs(a - b) for a, b in zip(one["logprobs"], got["logprobs"]))}
    return out


def _cli(argv: list[str]) -> tuple[int, dict]:
    """``dayzero ARGV`` in this process: (exit code, the JSON object it printed, or {})."""
    import contextlib
    import io

    from dayzero.engine.cli import main

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(argv)
    text = stdout.getvalue().strip()
    return rc, json.loads(text.splitlines()[-1]) if text.startswith("{") else {}


if __name__ == "__main__":
    result = run_cli(*sys.argv[2:]) if sys.argv[1] == "cli" else run_case(sys.argv[1])
    print(json.dumps(result))
