"""Peak memory of ``dayzero.convert.convert_checkpoint`` on a synthetic multi-GB checkpoint.

Writes a random HF llama checkpoint (sharded safetensors, one shard per layer, so this writer
holds at most one layer), converts it in a fresh subprocess and reports that process's peak RSS
above its baseline after imports. Conversion streams one group (globals or one layer) at a time,
so the peak must stay well below the checkpoint size; the script fails if it is not below half.

    python bench/convert_memory.py [--layers 16] [--hidden 2048] [--keep DIR]

Prints one JSON line: checkpoint_bytes, baseline_rss_mb, peak_rss_mb, peak_above_baseline_mb,
ratio (peak above baseline / checkpoint size), largest_group_mb, convert_s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# Runs in the child: imports first, then the baseline, then the conversion. ru_maxrss (KiB on
# Linux) is the process's high-water mark, which counts every page it ever had resident.
CHILD = r"""
import json, resource, sys, time
import psutil, jax, orbax.checkpoint, tensorstore, safetensors, gguf, tqdm
import dayzero.convert
baseline = psutil.Process().memory_info().rss
start = time.perf_counter()
dayzero.convert.convert_checkpoint(sys.argv[1], sys.argv[2], progress=False)
elapsed = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"baseline": baseline, "peak": peak, "convert_s": elapsed}))
"""


def layer_shapes(hidden: int, ffw: int) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of one llama decoder layer (multi-head attention, no GQA)."""
    return {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (ffw, hidden),
        "mlp.up_proj.weight": (ffw, hidden),
        "mlp.down_proj.weight": (hidden, ffw),
    }


def _random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def write_checkpoint(path: Path, layers: int, hidden: int, ffw: int, vocab: int) -> tuple[int, int]:
    """Write the synthetic checkpoint shard by shard; return (total bytes, largest shard bytes)."""
    path.mkdir(parents=True)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": ffw, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
        "num_key_value_heads": hidden // 128, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    weight_map, sizes = {}, []
    shards = [("globals", {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                           "lm_head.weight": (vocab, hidden)})]
    shards += [(f"layer{i}", {f"model.layers.{i}.{k}": s for k, s in layer_shapes(hidden, ffw).items()})
               for i in range(layers)]
    for n, (_, shapes) in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: _random(rng, s) for k, s in shapes.items()}  # one shard in memory at a time
        save_file(tensors, path / name)
        sizes.append(sum(t.nbytes for t in tensors.values()))
        weight_map.update({k: name for k in tensors})
        del tensors
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(sizes), max(sizes)


def measure(src: Path, dst: Path) -> dict:
    """Convert in a fresh interpreter and return its baseline, peak RSS and time."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    """Build the checkpoint, measure the conversion, print one JSON line; non-zero on failure."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--keep", type=Path, help="work in this (new) directory and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="convert-memory-") as scratch:
        work = args.keep or Path(scratch)
        total, largest = write_checkpoint(work / "hf", args.layers, args.hidden, args.intermediate, args.vocab)
        result = measure(work / "hf", work / "converted")
    mb = 2**20
    above = result["peak"] - result["baseline"]
    report = {
        "checkpoint_bytes": total,
        "baseline_rss_mb": round(result["baseline"] / mb, 1),
        "peak_rss_mb": round(result["peak"] / mb, 1),
        "peak_above_baseline_mb": round(above / mb, 1),
        "ratio": round(above / total, 3),
        "largest_group_mb": round(largest / mb, 1),
        "convert_s": round(result["convert_s"], 1),
    }
    print(json.dumps(report))
    if total < 2e9:
        print(f"checkpoint is only {total} bytes; the benchmark wants >= 2 GB", file=sys.stderr)
        return 1
    if above >= total / 2:
        print(f"peak RSS above baseline {above / mb:.0f} MB is not below half the checkpoint", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
