"""The vision step of the Qwen multimodal models: its time and memory against image size, and
the time to first token of an image prompt against a text prompt of the same token count.

    python bench/vision.py [--tower qwen3-vl|qwen3-vl-small] [--sizes 224,448,672,896]
        [--repeats 3] [--text-layers 4] [--text-width 2048] [--ttft-image 448] [--ttft-text 58]
        [--threads N] [--json OUT.json] [--plot OUT.png]

No checkpoint is needed: the tower is built at a published size with random weights (the
weights' values change neither time nor memory), fp32 on CPU as dayzero computes there:

- ``qwen3-vl``: depth 27, width 1152, 16 heads, MLP 4304, DeepStack after blocks 8/16/24: HF's
  Qwen3VLVisionConfig defaults and the published Qwen3-VL-30B-A3B config (the larger Qwen3-VL
  models' tower; Qwen3.5-35B-A3B / 397B-A17B carry it without DeepStack);
- ``qwen3-vl-small``: depth 24, width 1024, 16 heads, MLP 4096, DeepStack after 5/11/17
  (the Qwen3-VL-2B / 4B tower).

Both: 16-pixel patches over 2 frames, 2 x 2 merge, a 48 x 48 learned position grid. The text
model behind it (part 2 only, its width the tower's output width) is a Qwen3-VL dense text
model of ``--text-layers`` layers at ``--text-width`` (heads of 128, half as many KV heads, MLP
3x the width, vocabulary 32768 with the image tokens at its end, context 4096, tied embeddings).

1. Vision step against image size: a random square image of each ``--sizes`` side goes through
   the real preprocessing (the published pixel bounds: 224 px is upscaled to 256) and
   ``engine.vision_step.encode``, which pads the patches to a bucket (``patch_bucket``; one
   compile each). Reported: patches (real and padded), image tokens, the first call's seconds
   (compile and one run), the median of ``--repeats`` warm calls, XLA's FLOP count of the step
   (of its lowering with attention in one query block: the compiled step's count takes its loop
   over query blocks once) and the achieved rate, XLA's compiled memory (``memory_analysis``: arguments, i.e. mostly the weights,
   + outputs + temporaries) and the process's peak RSS above its level before the call (the
   first call and the warm calls separately: ``/proc/self/clear_refs`` resets the high-water mark).
2. Time to first token (``Engine.generate(..., max_new_tokens=1)``, warm: one untimed call each
   first, then the median of ``--repeats``) of a prompt of ``--ttft-text`` text tokens, the
   vision start/end tokens and one ``--ttft-image`` px square image, against a text-only prompt of
   the same total token count, in the same engine (the two alternate); the image one split into
   preprocess (+ placeholder expansion) and tower (``encode``), each timed alone, and prefill: the
   rest of its TTFT (M-RoPE positions, the prefill step with the image entries, the first token).

Prints both tables; ``--json`` writes everything, ``--plot`` a PNG of part 1 (time and memory
against patches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _bind_threads(argv: list[str]) -> None:
    """``--threads N``: this process on its first N CPUs. Before jax is imported: XLA sizes its
    thread pools by the CPUs the process may use."""
    if "--threads" not in argv[:-1]:
        return
    n = argv[argv.index("--threads") + 1]
    if not n.isdigit() or int(n) < 1:
        raise SystemExit(f"--threads {n!r} must be a positive integer")
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:int(n)])


if __name__ == "__main__":
    _bind_threads(sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dayzero.engine import vision_step  # noqa: E402
from dayzero.engine.generate import Engine  # noqa: E402
from dayzero.model.config import ModelConfig  # noqa: E402
from dayzero.model.hf_config_vision import parse_qwen_vl_config  # noqa: E402
from dayzero.model import vision_qwen  # noqa: E402
from dayzero.model.vision_qwen import _vision_step, vision_forward, vision_layout  # noqa: E402
from dayzero.model.weights import abstract_weights, init_weights  # noqa: E402
from dayzero.tools.measure import bench_prompt, peak_rss_since_reset_mb, reset_peak_rss, rss_mb  # noqa: E402

# Published vision_config sizes (HF Qwen3VLVisionConfig's defaults are the first; the second is
# the Qwen3-VL-2B/4B checkpoints'). Patch 16, temporal 2, merge 2, 2304 positions: both.
TOWERS = {
    "qwen3-vl": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                     deepstack_visual_indexes=[8, 16, 24]),
    "qwen3-vl-small": dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096,
                           deepstack_visual_indexes=[5, 11, 17]),
}
VOCAB = 32768
# The placeholder tokens at the vocabulary's end (HF's defaults, 151652.., are past it).
TOKENS = dict(vision_start_token_id=VOCAB - 4, vision_end_token_id=VOCAB - 3, image_token_id=VOCAB - 2,
              video_token_id=VOCAB - 1)


def bench_config(tower: str, text_layers: int, text_width: int, context: int = 4096, **tower_overrides) -> ModelConfig:
    """A ``qwen3_vl`` composite config: the ``tower`` of :data:`TOWERS` (``tower_overrides``
    replace its sizes, for toy runs) over a dense text model of ``text_layers`` x ``text_width``."""
    if tower not in TOWERS:
        raise ValueError(f"--tower {tower!r} is not one of {', '.join(TOWERS)}")
    if text_width % 128:
        raise ValueError(f"--text-width {text_width} must be a multiple of 128 (heads of 128)")
    heads = text_width // 128
    text = dict(hidden_size=text_width, num_hidden_layers=text_layers, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2), head_dim=128, intermediate_size=3 * text_width,
                vocab_size=VOCAB, max_position_embeddings=context, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})
    vision = {**TOWERS[tower], "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "temporal_patch_size": 2,
              "spatial_merge_size": 2, "num_position_embeddings": 2304, "out_hidden_size": text_width,
              **tower_overrides}
    raw = {"model_type": "qwen3_vl", "tie_word_embeddings": True, "text_config": text, "vision_config": vision,
           **TOKENS}
    return parse_qwen_vl_config(raw)


def random_engine(config: ModelConfig, seed: int = 0) -> Engine:
    """An fp32 engine over random weights of ``config`` (tower included), reference kernels."""
    weights = init_weights(abstract_weights(config), jax.random.key(seed))
    return Engine(config, weights, kernels="reference")


def square_image(side: int, seed: int = 0) -> np.ndarray:
    """A random RGB ``side`` x ``side`` image (uint8 [H, W, 3])."""
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)




def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def _dense_cost(weights, vc, pixels, layout) -> dict:
    """XLA's cost analysis of the tower with its attention in one query block: the compiled
    step's own counts its loop over query blocks once, not once per block. From the lowering
    (not compiled: the dense program's scratch would be P x P); the arithmetic is the same."""
    block, vision_qwen.VISION_QUERY_BLOCK = vision_qwen.VISION_QUERY_BLOCK, pixels.shape[0]
    try:  # a fresh jit: the block size is read at trace time
        cost = jax.jit(lambda w, x, lay: vision_forward(w, vc, x, lay)).lower(weights, pixels, layout).cost_analysis()
    finally:
        vision_qwen.VISION_QUERY_BLOCK = block
    return cost[0] if isinstance(cost, list) else cost  # a list of one dict on older jax


def compiled_stats(engine: Engine, processed) -> dict:
    """XLA's view of the compiled tower step ``encode`` ran for ``processed`` (already compiled:
    lowering the same shapes again hits jax's cache): memory by kind and FLOPs."""
    vc = engine.config.vision
    real = sum(im.pixel_values.shape[0] for im in processed)
    padded = vision_step.patch_bucket(engine.config, real)
    layout = vision_layout(vc, [im.grid_thw for im in processed], padded)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layout)
    pixels = jax.ShapeDtypeStruct((padded, vc.patch_dim), np.float32)
    compiled = _vision_step.lower(engine.weights.vision, vc, pixels, shapes).compile()
    mem, cost = compiled.memory_analysis(), _dense_cost(engine.weights.vision, vc, pixels, shapes)
    mb = lambda n: n / 2**20  # noqa: E731
    out = {"xla_args_mb": mb(mem.argument_size_in_bytes), "xla_out_mb": mb(mem.output_size_in_bytes),
           "xla_temp_mb": mb(mem.temp_size_in_bytes), "gflop": (cost or {}).get("flops", float("nan")) / 1e9}
    out["xla_total_mb"] = out["xla_args_mb"] + out["xla_out_mb"] + out["xla_temp_mb"]
    return out


def vision_row(engine: Engine, side: int, repeats: int) -> dict:
    """Part 1 for one square image of ``side`` px (module docstring)."""
    preprocess_s, processed = _timed(lambda: vision_step.preprocess([square_image(side)], engine.image_config))
    patches = processed[0].pixel_values.shape[0]
    encode = lambda: vision_step.encode(engine.weights, engine.config, processed)  # noqa: E731
    before = reset_peak_rss()
    compile_s, _ = _timed(encode)
    compile_peak = peak_rss_since_reset_mb() - before
    before = reset_peak_rss()
    times = [_timed(encode)[0] for _ in range(repeats)]
    warm_peak = peak_rss_since_reset_mb() - before
    row = {"side_px": side, "grid": list(map(int, processed[0].grid_thw)), "patches": patches,
           "padded_patches": vision_step.patch_bucket(engine.config, patches), "image_tokens": processed[0].num_tokens,
           "preprocess_ms": 1e3 * preprocess_s, "compile_call_s": compile_s,
           "encode_ms": 1e3 * statistics.median(times), "encode_best_ms": 1e3 * min(times),
           "peak_rss_compile_mb": compile_peak, "peak_rss_warm_mb": warm_peak,
           **compiled_stats(engine, processed)}
    row["gflop_s"] = row["gflop"] / (row["encode_ms"] / 1e3)
    return row


def image_prompt(text_tokens: int) -> list[int]:
    """Text ids, then an image as the chat template writes it (start, one placeholder, end), split
    around it half and half: ``text_tokens`` + 3 ids."""
    text = bench_prompt(TOKENS["vision_start_token_id"], text_tokens, 1)[0] if text_tokens else []
    image = [TOKENS["vision_start_token_id"], TOKENS["image_token_id"], TOKENS["vision_end_token_id"]]
    half = text_tokens // 2
    return text[:half] + image + text[half:]


def ttft_rows(engine: Engine, side: int, text_tokens: int, repeats: int) -> dict:
    """Part 2 (module docstring): TTFT of the image prompt and of a text prompt as long (medians of
    ``repeats`` warm runs, the two alternating), and the image prompt's preprocess and tower
    medians measured alone; its prefill is the rest of its TTFT."""
    image, prompt = square_image(side), image_prompt(text_tokens)
    runs = {"image": lambda: engine.generate(prompt, images=[image], max_new_tokens=1, ignore_eos=True)}
    total = len(runs["image"]().prompt_ids)  # compiles the image steps; the ids come back expanded
    text = bench_prompt(TOKENS["vision_start_token_id"], total, 1)[0]
    runs["text"] = lambda: engine.generate(text, max_new_tokens=1, ignore_eos=True)
    runs["text"]()  # compiles
    ttft = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            ttft[name].append(_timed(run)[0])
    pre = [_timed(lambda: _expanded(engine, prompt, image)) for _ in range(repeats)]
    done = pre[0][1][1]
    tower = [_timed(lambda: vision_step.encode(engine.weights, engine.config, done))[0] for _ in range(repeats)]
    median = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    out = {"side_px": side, "prompt_tokens": total, "image_tokens": done[0].num_tokens,
           "text_tokens": total - done[0].num_tokens, "ttft_image_ms": median(ttft["image"]),
           "ttft_text_ms": median(ttft["text"]), "preprocess_ms": median([t for t, _ in pre]),
           "tower_ms": median(tower)}
    out["ratio"] = out["ttft_image_ms"] / out["ttft_text_ms"]
    out["prefill_ms"] = out["ttft_image_ms"] - out["preprocess_ms"] - out["tower_ms"]
    return out


def _expanded(engine: Engine, prompt: list[int], image) -> tuple[list[int], list]:
    """The host work ``Engine.generate`` does for one image prompt before the tower: the image
    preprocessed, its placeholder expanded."""
    done = vision_step.preprocess([image], engine.image_config)
    return vision_step.expand_placeholders(prompt, done, engine.config.vision.image_token_id), done


def print_tables(result: dict) -> None:
    """Part 1 and part 2 as text tables."""
    s = result["settings"]
    print(f"vision step, tower {s['tower']} ({result['tower_params_m']:.0f}M params), fp32, "
          f"{result['backend']}, {result['threads']} threads; warm median of {s['repeats']}; load average "
          f"{result['load_average_before']:.1f} before, {result['load_average_after']:.1f} after")
    print(f"{'px':>5} {'patches':>8} {'padded':>7} {'tokens':>7} {'compile s':>10} {'encode ms':>10} "
          f"{'GFLOP/s':>8} {'XLA temp MB':>12} {'XLA total MB':>13} {'RSS+ compile':>13} {'RSS+ warm':>10}")
    for r in result["vision"]:
        print(f"{r['side_px']:>5} {r['patches']:>8} {r['padded_patches']:>7} {r['image_tokens']:>7} "
              f"{r['compile_call_s']:>10.1f} {r['encode_ms']:>10.0f} {r['gflop_s']:>8.0f} {r['xla_temp_mb']:>12.0f} "
              f"{r['xla_total_mb']:>13.0f} {r['peak_rss_compile_mb']:>13.0f} {r['peak_rss_warm_mb']:>10.0f}")
    t = result.get("ttft")
    if t:
        print(f"\nTTFT, text model {s['text_layers']} layers x {s['text_width']} + the tower; prompt of "
              f"{t['prompt_tokens']} tokens ({t['image_tokens']} from a {t['side_px']} px image)")
        print(f"{'image TTFT ms':>14} {'text TTFT ms':>13} {'ratio':>6} {'preprocess ms':>14} {'tower ms':>9} "
              f"{'prefill ms':>11}")
        print(f"{t['ttft_image_ms']:>14.0f} {t['ttft_text_ms']:>13.0f} {t['ratio']:>6.2f} {t['preprocess_ms']:>14.1f} "
              f"{t['tower_ms']:>9.0f} {t['prefill_ms']:>11.0f}")


def plot(result: dict, path: Path) -> None:
    """Time and memory of the vision step against the (padded) patch count."""
    from dayzero.tools.plot import _pyplot

    plt = _pyplot()
    rows = result["vision"]
    x = [r["padded_patches"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    ax_t.plot(x, [r["encode_ms"] for r in rows], "o-", label="encode (warm median)")
    ax_t.plot(x, [1e3 * r["compile_call_s"] for r in rows], "s--", label="first call (compile + run)")
    for r in rows:
        ax_t.annotate(f"{r['side_px']} px", (r["padded_patches"], r["encode_ms"]), fontsize=7,
                      textcoords="offset points", xytext=(4, -10))
    ax_m.plot(x, [r["xla_total_mb"] for r in rows], "o-", label="XLA args + outputs + temp")
    ax_m.plot(x, [r["xla_temp_mb"] for r in rows], "s--", label="XLA temp")
    ax_m.plot(x, [r["peak_rss_compile_mb"] for r in rows], "^:", label="peak RSS above baseline, first call")
    # Under 1 MiB the warm calls reused what the first call's allocations left (off a log axis).
    warm = [(xi, r["peak_rss_warm_mb"]) for xi, r in zip(x, rows) if r["peak_rss_warm_mb"] >= 1]
    ax_m.plot([w[0] for w in warm], [w[1] for w in warm], "v:", label="peak RSS above baseline, warm (>= 1 MiB)")
    for ax, ylabel in ((ax_t, "milliseconds"), (ax_m, "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("patches per call (power-of-two bucket)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_title("time")
    ax_m.set_title("memory")
    fig.suptitle(f"dayzero vision step: {result['settings']['tower']} tower, fp32, {result['backend']}, "
                 f"{result['threads']} threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 16:
        raise SystemExit(f"--sizes {text!r}: give comma-separated image sides in pixels, each >= 16")
    return sizes


def main(argv: list[str] | None = None) -> dict:
    """Run both parts as the flags say; print, and write the JSON and the plot when asked."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tower", default="qwen3-vl", choices=sorted(TOWERS))
    p.add_argument("--sizes", default="224,448,672,896", help="square image sides in pixels (part 1)")
    p.add_argument("--repeats", type=int, default=3, help="warm calls per measurement (median)")
    p.add_argument("--text-layers", type=int, default=4)
    p.add_argument("--text-width", type=int, default=2048)
    p.add_argument("--ttft-image", type=int, default=448, help="image side in pixels for part 2 (0: skip part 2)")
    p.add_argument("--ttft-text", type=int, default=58,
                   help="text tokens around the image in part 2 (58: a 256-token prompt with a 448 px image)")
    p.add_argument("--threads", type=int, help="use only this many CPUs (read before jax starts)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG of part 1")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats} must be at least 1")
    sizes = _sizes(args.sizes)
    engine = random_engine(bench_config(args.tower, args.text_layers, args.text_width))
    engine.image_config = vision_step.image_config_of(engine.config)
    tower_params = sum(x.size for x in jax.tree.leaves(engine.weights.vision))
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
              "backend": jax.default_backend(), "threads": len(os.sched_getaffinity(0)),
              "load_average_before": os.getloadavg()[0],  # a shared machine: other work slows every figure
              "tower_params_m": tower_params / 1e6, "rss_after_load_mb": rss_mb(),
              "vision": [vision_row(engine, side, args.repeats) for side in sizes]}
    if args.ttft_image:
        result["ttft"] = ttft_rows(engine, args.ttft_image, args.ttft_text, args.repeats)
    result["load_average_after"] = os.getloadavg()[0]
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    return result


if __name__ == "__main__":
    main()
