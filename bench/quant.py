"""Quantization schemes side by side on the embedded SmolLM2-135M, in one run.

For each scheme: decode and prefill speed (``dayzero bench``'s measurement), checkpoint bytes on
disk and its tensors' bytes uncompressed (the embedded GGUF converted with ``--quantize``/
``--dtype``; the fp32 row is the cached default conversion), bytes of the weights (including the
[D,V] output-head copy the CPU engine makes of a tied embedding) and of a full-context
(8192-token) KV cache on the device, and accuracy against fp32 on a ~500-token English text (``dayzero.tools.quality``:
mean / max per-token KL, teacher-forced greedy agreement over 128 tokens, and the identical
prefix of free-running greedy generation).

    DAYZERO_CACHE=/tmp/dzcache python bench/quant.py [--schemes fp32,bf16,int8,...]
        [--prompt-len 128] [--new-tokens 32] [--repeats 2] [--rounds 4] [--json]

Schemes: fp32, bf16 (weights and cache in bfloat16), int8, fp8, fp8-block, int4, int4-all
(weights; int4 only changes MoE experts, so on dense SmolLM2 it is int8; int4-all quantizes every
projection and the tied head to 4 bits), kv-int8, kv-fp8 (fp32 weights), and
llama.cpp on the same model (``llamacpp-q8_0``, ``llamacpp-q4_0``: the embedded Q4_1 GGUF
requantized with llama.cpp's own quantizer, timed as ``dayzero bench --vs-llamacpp`` times it;
needs ``pip install llama-cpp-python``, else the row is skipped with the reason). Decode speeds
are also given as ratios to fp32 in the same run (``vs_fp32``), and int8 / int4-all against llama.cpp's
q8_0 / q4_0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dayzero.convert import convert_checkpoint
from dayzero.engine import Engine
from dayzero.tools.bench import bench_engine, kv_cache_bytes
from dayzero.engine.default_model import default_gguf_path, default_model_dir
from dayzero.tools.measure import bench_prompt
from dayzero.tools.quality import QUALITY_TEXT, agreement, greedy_tokens, logits_agreement, sequence_logits
from dayzero.model.quant import describe_weights, stored_bytes
from dayzero.tools.peers import LlamaCppPeer, PeerError

SCHEMES = ("fp32", "bf16", "int8", "fp8", "fp8-block", "int4", "int4-all", "kv-int8", "kv-fp8", "llamacpp-q8_0", "llamacpp-q4_0")
# llama.cpp's file types (llama_ftype) of the requantized GGUFs.
LLAMACPP_FTYPES = {"llamacpp-q8_0": 7, "llamacpp-q4_0": 2}
# Our scheme each llama.cpp row is compared with.
LLAMACPP_PAIRS = {"int8": "llamacpp-q8_0", "int4-all": "llamacpp-q4_0"}
FULL_CONTEXT = 8192


def _disk_bytes(path: Path) -> int:
    """Bytes of a converted checkpoint's weights folder on disk (``du``: what the files occupy)."""
    return int(subprocess.run(["du", "-sb", str(path / "weights")], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def _tensor_bytes(path: Path) -> int:
    """Bytes of a checkpoint's tensors as stored, uncompressed (shapes and dtypes of its manifest).

    The disk figure is smaller for float checkpoints: Orbax compresses its chunks, and SmolLM2's
    weights come from a 4-bit GGUF, so each fp32 block holds few distinct values.
    """
    tensors = json.loads((path / "manifest.json").read_text())["tensors"]
    return sum(math.prod(t["shape"]) * np.dtype(getattr(ml_dtypes, t["dtype"], t["dtype"])).itemsize
               for t in tensors.values())


def _checkpoint(scheme: str, tmp: Path) -> Path:
    """The converted checkpoint a scheme loads: the default fp32 one, or a new conversion."""
    if scheme in ("fp32", "kv-int8", "kv-fp8"):
        return default_model_dir()
    dst = tmp / scheme
    if scheme == "bf16":
        convert_checkpoint(default_gguf_path(), dst, dtype="bfloat16", progress=False)
    else:
        convert_checkpoint(default_gguf_path(), dst, quantize=scheme, progress=False)
    return dst


def _engine(scheme: str, checkpoint: Path) -> Engine:
    if scheme == "bf16":
        return Engine.load(checkpoint, dtype=jnp.bfloat16)
    kv = scheme.removeprefix("kv-") if scheme.startswith("kv-") else "none"
    return Engine.load(checkpoint, quantize="auto", kv_cache=kv)


def _llamacpp_gguf(scheme: str, tmp: Path) -> Path:
    """The embedded GGUF requantized by llama.cpp to ``scheme``'s type (q8_0 or q4_0)."""
    try:
        import llama_cpp
    except ImportError:
        raise PeerError("llama.cpp rows need llama-cpp-python: pip install llama-cpp-python") from None
    dst = tmp / f"{scheme}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMACPP_FTYPES[scheme]
    params.allow_requantize = True  # the source is itself Q4_1
    params.nthread = 2
    with _quiet_stderr():  # llama.cpp logs every tensor it converts
        failed = llama_cpp.llama_model_quantize(str(default_gguf_path()).encode(), str(dst).encode(), params)
    if failed:
        raise PeerError(f"llama.cpp could not quantize {default_gguf_path()} to {scheme}")
    return dst


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to /dev/null (C libraries write there directly)."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def measure_llamacpp(scheme: str, reference: Engine, quality: tuple, args, tmp: Path, decoders: dict) -> dict:
    """A llama.cpp row: speed, and its accuracy against dayzero's fp32 logits on the same text
    (an independent implementation of the same model: llama.cpp's own quantization error)."""
    gguf = _llamacpp_gguf(scheme, tmp)
    prompts = bench_prompt(reference.config.vocab_size, args.prompt_len, 1, reference.eos_ids)
    peer = LlamaCppPeer(gguf)
    speed = peer.measure(prompts, args.new_tokens, args.repeats)
    decoders[scheme] = lambda: peer.measure(prompts, args.new_tokens, args.repeats)["decode_tok_s"]
    text, reference_tokens, reference_logits = quality
    accuracy = logits_agreement(reference_logits, peer.sequence_logits(text + reference_tokens), len(text),
                                reference_tokens)
    size = gguf.stat().st_size / 2**20
    return {"scheme": scheme, "weights": scheme.removeprefix("llamacpp-") + " (llama.cpp)", "kv_cache": "f16",
            "decode_tok_s": speed["decode_tok_s"], "prefill_tok_s": speed["prefill_tok_s"], "compile_s": 0.0,
            "disk_mb": size, "tensor_mb": size, "device_weights_mb": size, "kv_cache_mb_8k": math.nan, **accuracy}


def measure(scheme: str, reference: Engine, quality: tuple, args, tmp: Path, decoders: dict) -> dict:
    """One row of the table; ``quality``: the text's ids, fp32's greedy continuation of it, and
    fp32's logits over both. ``decoders`` gets the row's decode measurement, for the rounds."""
    if scheme in LLAMACPP_FTYPES:
        return measure_llamacpp(scheme, reference, quality, args, tmp, decoders)
    text, reference_tokens, _ = quality
    checkpoint = _checkpoint(scheme, tmp)
    engine = reference if scheme == "fp32" else _engine(scheme, checkpoint)
    prompts = bench_prompt(engine.config.vocab_size, args.prompt_len, 1, engine.eos_ids)
    speed = bench_engine(engine, prompts, args.new_tokens, args.repeats)
    decoders[scheme] = lambda: bench_engine(engine, prompts, args.new_tokens, args.repeats)["decode_tok_s"]
    row = {
        "scheme": scheme,
        "weights": describe_weights(engine.weights),
        "kv_cache": engine.kv_cache.value if scheme != "bf16" else "bfloat16",
        "decode_tok_s": speed["decode_tok_s"],
        "prefill_tok_s": speed["prefill_tok_s"],
        "compile_s": speed["compile_s"],
        "disk_mb": _disk_bytes(checkpoint) / 2**20,
        "tensor_mb": _tensor_bytes(checkpoint) / 2**20,
        "device_weights_mb": stored_bytes(engine.weights) / 2**20,
        "kv_cache_mb_8k": kv_cache_bytes(engine.config, 1, FULL_CONTEXT, engine.weights.embed.dtype,
                                         engine.kv_cache) / 2**20,
    }
    if scheme != "fp32":
        row.update(agreement(reference, engine, text, free_running=True, reference_tokens=reference_tokens))
    if checkpoint.parent == tmp:
        shutil.rmtree(checkpoint)
    return row


def interleaved_decode(rows: list[dict], decoders: dict, rounds: int) -> None:
    """Each row's ``decode_tok_s`` replaced by the median of its first measurement and ``rounds``
    more, taken round after round with every scheme once per round (kept as ``decode_samples``).
    A shared host's memory bandwidth drifts by 20-30% within minutes; measured one after another,
    the rows' ratios would carry that drift (one such run put fp32 at 62.8 tok/s where the rounds
    of the same build measured 51.5-56.5)."""
    samples = {r["scheme"]: [r["decode_tok_s"]] for r in rows}
    for _ in range(rounds):
        for r in rows:
            samples[r["scheme"]].append(decoders[r["scheme"]]())
    for r in rows:
        r["decode_samples"] = samples[r["scheme"]]
        r["decode_tok_s"] = float(np.median(samples[r["scheme"]]))


def _ratios(rows: list[dict]) -> None:
    """Each row's decode speed over fp32's, and our int8 / int4-all over llama.cpp's q8_0 / q4_0."""
    speed = {r["scheme"]: r["decode_tok_s"] for r in rows}
    for r in rows:
        r["vs_fp32"] = r["decode_tok_s"] / speed["fp32"]
        peer = LLAMACPP_PAIRS.get(r["scheme"])
        if peer in speed:
            r["vs_" + peer] = r["decode_tok_s"] / speed[peer]


def _print(rows: list[dict]) -> None:
    print(f"SmolLM2-135M on {jax.default_backend()}, {len(QUALITY_TEXT.split())}-word text, 128 greedy tokens")
    print(f"{'scheme':>14}{'decode/s':>10}{'vs fp32':>8}{'prefill/s':>11}{'disk MB':>9}{'tensor MB':>10}{'weights MB':>11}{'kv8k MB':>9}"
          f"{'KL mean':>10}{'KL max':>9}{'agree':>7}{'prefix':>8}  stored as")
    for r in rows:
        acc = (f"{r['kl_mean']:>10.2e}{r['kl_max']:>9.2e}{r['greedy_agreement']:>7.3f}{r.get('greedy_prefix', math.nan):>8.3f}"
               if "kl_mean" in r else f"{'-':>10}{'-':>9}{'-':>7}{'-':>8}")
        print(f"{r['scheme']:>14}{r['decode_tok_s']:>10.1f}{r['vs_fp32']:>8.2f}{r['prefill_tok_s']:>11.1f}{r['disk_mb']:>9.1f}{r['tensor_mb']:>10.1f}"
              f"{r['device_weights_mb']:>11.1f}{r['kv_cache_mb_8k']:>9.1f}{acc}  {r['weights']}, kv {r['kv_cache']}")
    for r in rows:
        for key in [k for k in r if k.startswith("vs_llamacpp")]:
            print(f"{r['scheme']} decode / llama.cpp {key.removeprefix('vs_llamacpp-')}: {r[key]:.2f}x")


def main() -> None:
    """Measure every scheme asked for, in this order, in this one process, then their decode
    speed again in interleaved rounds."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4, help="interleaved decode rounds after the rows (median)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        p.error(f"unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    reference = Engine.load(default_model_dir())
    text = reference.tokenizer.encode(QUALITY_TEXT)
    reference_tokens = greedy_tokens(reference, text, 128)
    quality = (text, reference_tokens, sequence_logits(reference, text + reference_tokens))
    rows, decoders = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in ["fp32"] + [s for s in schemes if s != "fp32"]:
            try:
                rows.append(measure(scheme, reference, quality, args, Path(tmp), decoders))
            except PeerError as e:
                print(f"{scheme}: skipped: {e}", flush=True)
                continue
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
        interleaved_decode(rows, decoders, args.rounds)
    _ratios(rows)
    if args.json:
        print(json.dumps({r["scheme"]: {k: v for k, v in r.items() if k.startswith("vs_")} for r in rows}))
    _print(rows)


if __name__ == "__main__":
    main()
