"""Decode speed with the decoder layers' weights offloaded to host memory, against on the device,
side by side in one run.

    python bench/weight_offload.py [--model DIR] [--prompt-len 64] [--new-tokens 32] [--repeats 3]
        [--rounds 4] [--json bench/weight_offload.json]

One ``Engine.load`` (default: the embedded SmolLM2-135M-Instruct); a second engine is built over
the same weights with ``offload_layers`` (``dayzero.model.offload``: every decoder layer in the
``pinned_host`` memory kind, streamed to the device one layer ahead inside the jitted step). Both
generate the same greedy tokens from the same prompt; each is measured ``--rounds`` times,
in alternating order, best of ``--repeats`` after a warm-up each time (``dayzero.tools.bench.bench_engine``),
so drift of a shared machine hits both alike. Also reported: the device-resident parameter bytes
of each engine's compiled decode step (read from its entry layout: host-space parameters are not
counted) against the layers' bytes, and the machine's read bandwidth measured in the same run.
On XLA:CPU host and device memory are the same RAM and XLA reads host-space parameters in place,
so the two speeds should agree there; on a GPU the ratio shows what the streaming costs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import numpy as np

from dayzero.engine import Engine
from dayzero.engine.sampling import SamplingParams
from dayzero.model.cache import init_cache
from dayzero.model.offload import device_resident_bytes, offload_layers
from dayzero.model.quant import stored_bytes
from dayzero.model.transformer import forward
from dayzero.tools.bench import bench_engine
from dayzero.tools.measure import bench_prompt
from dayzero.tools.roofline import read_bandwidth

MODES = ("device", "offloaded")


def decode_step_bytes(engine: Engine, max_len: int) -> int:
    """Device-resident parameter bytes of a batch-1 decode step over ``engine``'s weights (the
    forward pass as the engine runs it, compiled here so its entry layout can be read)."""
    config = engine.config
    cache = init_cache(config, 1, max_len, engine.weights.embed.dtype, engine.kv_cache)
    step = jax.jit(lambda w, t, c: forward(w, config, t, c)[0])
    return device_resident_bytes(step.lower(engine.weights, np.zeros((1, 1), np.int32), cache).compile())


def greedy_tokens(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The greedy continuation of each prompt."""
    steps = [t for t, _ in engine.stream_ids(prompts, new_tokens, [SamplingParams()] * len(prompts))]
    return np.stack(steps, axis=1).tolist()


def measure(engines: dict, prompts: list[list[int]], args) -> dict:
    """Best decode/prefill figures of each engine over ``args.rounds`` rounds, the order of the
    engines reversed every other round."""
    best: dict = {}
    for n in range(args.rounds):
        order = list(engines.items())
        for mode, engine in order if n % 2 == 0 else order[::-1]:  # neither always runs first
            r = bench_engine(engine, prompts, args.new_tokens, args.repeats)
            if mode not in best or r["decode_tok_s"] > best[mode]["decode_tok_s"]:
                best[mode] = r
    return best


def main() -> None:
    """Measure both modes in this one process; print a table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=str(Path(__file__).with_name("weight_offload.json")))
    args = ap.parse_args()
    device = Engine.load(args.model, progress=False)
    offloaded = Engine(device.config, offload_layers(device.weights, device.placement), device.tokenizer,
                       run=device.run)
    engines = dict(zip(MODES, (device, offloaded)))
    prompts = bench_prompt(device.config.vocab_size, args.prompt_len, 1, device.eos_ids)
    tokens = {mode: greedy_tokens(e, prompts, args.new_tokens) for mode, e in engines.items()}
    compile_s = {mode: e.compile_s for mode, e in engines.items()}  # their steps compiled in that first run
    bandwidth = read_bandwidth()["bytes_s"]
    load_before = os.getloadavg()[0]  # a loaded shared machine makes single figures noisy
    best = measure(engines, prompts, args)
    max_len = args.prompt_len + args.new_tokens
    result = {
        "backend": jax.default_backend(),
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": 1,
        "layers_mb": stored_bytes(device.weights.layers) / 2**20,
        "weights_mb": stored_bytes(device.weights) / 2**20,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "load_average_1m": [load_before, os.getloadavg()[0]],  # before and after the timed rounds
        "cpu_count": os.cpu_count(),
        "same_tokens": tokens["device"] == tokens["offloaded"],
        "rows": {mode: {
            "layer_memory_kind": jax.tree.leaves(e.weights.layers)[0].sharding.memory_kind,
            "decode_step_device_mb": decode_step_bytes(e, max_len) / 2**20,
            "compile_s": compile_s[mode],
            **{k: best[mode][k] for k in ("decode_tok_s", "prefill_tok_s", "ttft_s")},
        } for mode, e in engines.items()},
    }
    result["offloaded_over_device_decode"] = (result["rows"]["offloaded"]["decode_tok_s"]
                                              / result["rows"]["device"]["decode_tok_s"])
    _print(result)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def _print(r: dict) -> None:
    print(f"{r['model']} on {r['backend']}: layers {r['layers_mb']:.1f} MB of {r['weights_mb']:.1f} MB, "
          f"prompt {r['prompt_len']}, {r['new_tokens']} new tokens, "
          f"read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s, "
          f"load average {r['load_average_1m'][0]:.1f}-{r['load_average_1m'][1]:.1f} on {r['cpu_count']} CPUs")
    print(f"{'layers':>10}{'kind':>13}{'decode/s':>10}{'prefill/s':>11}{'compile s':>11}{'step device MB':>16}")
    for mode, row in r["rows"].items():
        print(f"{mode:>10}{row['layer_memory_kind']:>13}{row['decode_tok_s']:>10.1f}{row['prefill_tok_s']:>11.1f}"
              f"{row['compile_s']:>11.2f}{row['decode_step_device_mb']:>16.1f}")
    print(f"offloaded / device decode: {r['offloaded_over_device_decode']:.3f}; same greedy tokens: {r['same_tokens']}")


if __name__ == "__main__":
    main()
