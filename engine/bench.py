"""``dayzero bench``: time to first token, prefill and decode throughput, compile time, memory.

With ``--vs-hf`` the HF transformers peer (fp32, CPU torch) runs the same prompt in the same
process right after, and the ratios are printed: these machines are shared and noisy, so only
side-by-side ratios mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import numpy as np


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_prompt(vocab_size: int, length: int, batch: int, avoid: tuple[int, ...]) -> list[list[int]]:
    """Deterministic random prompts (no EOS ids) so every run measures the same work."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(batch):
        ids = rng.integers(0, vocab_size, size=length)
        rows.append([int(i) if i not in avoid else 0 for i in ids])
    return rows


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_engine(engine, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, float]:
    """Measure dayzero on ``prompts`` (best of ``repeats`` after a compiling warm-up)."""
    batch, prompt_len = len(prompts), len(prompts[0])

    def first_token():
        engine.generate(prompts, max_new_tokens=1, ignore_eos=True)

    def full():
        engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)

    first_token()
    full()
    compile_s = engine.compile_s
    ttft = min(_timed(first_token) for _ in range(repeats))
    total = min(_timed(full) for _ in range(repeats))
    decode_s = max(total - ttft, 1e-9)
    return {
        "ttft_s": ttft,
        "prefill_tok_s": batch * prompt_len / ttft,
        "decode_tok_s": batch * (new_tokens - 1) / decode_s,
        "compile_s": compile_s,
        "peak_rss_mb": peak_rss_mb(),
    }


def _load_hf_model(src: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if src.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)


def bench_hf(src: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, float]:
    """Measure HF transformers (fp32, all CPU threads) on the same prompts."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model = _load_hf_model(src).eval()
    ids = torch.tensor(prompts)
    batch, prompt_len = ids.shape

    def first_token():
        with torch.no_grad():
            model(ids, use_cache=True).logits[:, -1].argmax(-1)

    def full():
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    first_token()
    full()
    ttft = min(_timed(first_token) for _ in range(repeats))
    total = min(_timed(full) for _ in range(repeats))
    return {
        "ttft_s": ttft,
        "prefill_tok_s": batch * prompt_len / ttft,
        "decode_tok_s": batch * (new_tokens - 1) / max(total - ttft, 1e-9),
    }


def _hf_source(arg: str, model_dir: str | None) -> Path:
    from dayzero.engine.cli import CommandError
    from dayzero.engine.default_model import default_gguf_path

    if arg != "auto":
        return Path(arg)
    if model_dir is not None:
        raise CommandError("--vs-hf needs SRC (the original checkpoint) when --model is given")
    return default_gguf_path()


def _print_table(ours: dict, peer: dict | None, config: str) -> None:
    print(f"dayzero bench: {config}")
    header = f"{'metric':<16}{'dayzero':>12}"
    if peer:
        header += f"{'hf':>12}{'ratio':>9}"
    print(header)
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "compile_s", "peak_rss_mb"):
        line = f"{key:<16}{ours[key]:>12.3f}"
        if peer and key in peer:
            line += f"{peer[key]:>12.3f}{ours['ratio'][key]:>8.2f}x"
        print(line)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed ``dayzero bench`` arguments."""
    from dayzero.engine.cli import CommandError
    from dayzero.engine.generate import Engine

    for name in ("prompt_len", "new_tokens", "batch", "repeats"):
        if getattr(args, name) < 1:
            raise CommandError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    engine = Engine.load(args.model)
    prompts = bench_prompt(engine.config.vocab_size, args.prompt_len, args.batch, engine.eos_ids)
    result = bench_engine(engine, prompts, args.new_tokens, args.repeats)
    result.update(prompt_len=args.prompt_len, new_tokens=args.new_tokens, batch=args.batch, dtype=str(engine.weights.embed.dtype))
    peer = None
    if args.vs_hf:
        peer = bench_hf(_hf_source(args.vs_hf, args.model), prompts, args.new_tokens, args.repeats)
        result["hf"] = peer
        # Speed ratios: dayzero / HF (higher is better); for time to first token HF / dayzero.
        result["ratio"] = {
            "ttft_s": peer["ttft_s"] / result["ttft_s"],
            "prefill_tok_s": result["prefill_tok_s"] / peer["prefill_tok_s"],
            "decode_tok_s": result["decode_tok_s"] / peer["decode_tok_s"],
        }
    if args.json:
        print(json.dumps(result))
    else:
        config = f"prompt {args.prompt_len} tokens, {args.new_tokens} new, batch {args.batch}, {result['dtype']}"
        _print_table(result, peer, config)
        if peer:
            print("ratio: dayzero speed / HF speed (for ttft_s: HF time / dayzero time); > 1 means dayzero is faster")
    return 0
