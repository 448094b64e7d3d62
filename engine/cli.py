"""The ``dayzero`` command line: convert, generate, bench, verify, check (contract in DESIGN.md).

A user's mistake ends with one sentence on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from dayzero.model.presets import PRESETS
from dayzero.sharding.distributed import MeshError, ProcessGroup, initialize, parse_mesh

KERNEL_CHOICES = ("auto", "reference", "pallas", "pallas_interpret")
# Names as dayzero.model.quant's enums spell them, for --help (which should not import jax). The
# values are checked by dayzero.model.quant, whose error names the bad value and lists these.
CONVERT_QUANT = "none|int8|fp8|fp8-block|int4|int4-all|mxfp4"
KV_CACHE = "auto|none|int8|fp8"


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input, not a bug (imported lazily: jax is slow to import)."""
    from dayzero.convert import ConvertError
    from dayzero.engine.compile_cache import CompileCacheError
    from dayzero.tools.bench import BenchError
    from dayzero.convert.check import CheckError
    from dayzero.engine.default_model import DefaultModelError
    from dayzero.engine.generate import GenerationError
    from dayzero.engine.images import ImageError
    from dayzero.engine.launch import LaunchError
    from dayzero.tools.peers import PeerError
    from dayzero.tools.plot import PlotError
    from dayzero.engine.runtime import RunConfigError
    from dayzero.engine.sampling import SamplingError
    from dayzero.engine.server_run import ServeError
    from dayzero.tools.soak import SoakError
    from dayzero.engine.tokenizer import TokenizerError
    from dayzero.tools.verify import VerifyError
    from dayzero.model.config import ConfigError
    from dayzero.model.quant import QuantError
    from dayzero.sharding.planner import PlanError

    return (
        ConvertError, DefaultModelError, GenerationError, ImageError, SamplingError, TokenizerError, ConfigError,
        MeshError, QuantError, RunConfigError, ServeError, CompileCacheError,
        BenchError, PeerError, PlotError, SoakError,
        VerifyError, CheckError, LaunchError, PlanError,
    )


class CommandError(ValueError):
    """A bad combination of command-line options."""


def _add_process_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-host")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 in a multi-host run")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the run")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index in [0, N)")


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    """The run options ``generate`` and ``bench`` share: weight and KV storage, kernels."""
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                   help="attention: reference (XLA), pallas (GPU), pallas_interpret (same kernels, any platform); "
                        "auto: the platform's choice")
    p.add_argument("--quantize", metavar="auto|" + CONVERT_QUANT, default="auto",
                   help="quantize a float model's weights at load (auto: the platform's fastest, fp32 on CPU)")
    p.add_argument("--kv-cache", metavar=KV_CACHE, default="auto",
                   help="KV-cache storage (auto: the platform's fastest, fp32 on CPU)")
    p.add_argument("--offload-weights", action="store_true",
                   help="hold the decoder layers' weights in host memory (pinned_host) and stream them to the "
                        "device one layer ahead of use")


def _add_compile_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-cache", metavar="DIR|off",
                   help="persistent compilation cache (default: $DAYZERO_COMPILE_CACHE, else under the dayzero "
                        "cache directory; off: compile every time)")


def _add_mesh_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", metavar="AXIS=N,...",
                   help="device mesh over all devices of all processes, axes data/tensor/expert/stage (e.g. tensor=4): "
                        "tensor splits heads/MLP/vocabulary, expert adds expert parallelism, data splits batch rows, "
                        "stage splits the layers into pipeline stages")


def _placement(text: str | None):
    """The mesh and rules ``--mesh`` asks for (None: one device); see dayzero.sharding.placement."""
    from dayzero.sharding.placement import placement_from_text

    return placement_from_text(text)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CommandError(f"--prompt-ids {text!r} is not a comma-separated list of integers, e.g. 1,2,3") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every sub-command."""
    parser = argparse.ArgumentParser(prog="dayzero", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert an HF directory, PyTorch state dict or GGUF file")
    c.add_argument("src", help="HF model directory, .bin/.pt/.pth state dict, or .gguf file")
    c.add_argument("dst", help="new directory to create")
    c.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="storage dtype (default: the source's)")
    c.add_argument("--quantize", metavar=CONVERT_QUANT,
                   help="store projection weights quantized (fp8-block keeps a block-FP8 source's values; default: "
                        "none, except an MXFP4 source's experts, kept as stored, with its FP8 blocks too when every "
                        "other projection is block-FP8: DeepSeek-V4)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--resume", action="store_true",
                   help="continue the interrupted conversion staged in DST.partial (same options)")
    c.add_argument("--threads", type=int, metavar="N",
                   help="source tensors read, transformed and hashed at once (default: cores, at most 8)")
    c.add_argument("--max-memory", metavar="SIZE",
                   help="most memory the tensors being converted may hold at once, e.g. 16GiB; a stack of experts "
                        "that needs more is converted a slice of experts at a time (default: about twice the "
                        "largest tensor)")
    # --mesh: write the arrays laid out (chunked) for that mesh; any mesh can load them.
    _add_mesh_arg(c)
    _add_process_args(c)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", help="converted model directory (default: embedded SmolLM2-135M-Instruct)")
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--image", action="append", metavar="PATH",
                   help="an image file (PNG, JPEG, WebP, GIF, BMP) for a multimodal model (Qwen3-VL, Qwen3.5); "
                        "repeat for several. With --prompt it implies --chat: the chat template places the images "
                        "before the text; with --prompt-ids, put one image placeholder id per image")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--logprobs", action="store_true", help="with --json, add each token's log-probability")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_speculative_args(g)
    _add_quant_args(g)
    _add_mesh_arg(g)
    _add_compile_cache_arg(g)
    _add_process_args(g)

    b = sub.add_parser("bench", help="measure time to first token, prefill and decode speed, memory")
    b.add_argument("--model", help="converted model directory (default: embedded SmolLM2-135M-Instruct)")
    b.add_argument("--prompt-len", default="512", metavar="N[,N...]", help="prompt length(s) to sweep")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--batch", default="1", metavar="B[,B...]", help="batch size(s): concurrent sequences")
    b.add_argument("--repeats", type=int, default=3, help="timed repetitions (the best is reported)")
    b.add_argument("--vs-hf", nargs="?", const="auto", metavar="SRC",
                   help="also run HF transformers (fp32, CPU) on SRC (default: the embedded GGUF)")
    b.add_argument("--vs-llamacpp", metavar="GGUF", help="also run llama.cpp (llama-cpp-python) on GGUF")
    b.add_argument("--soak", action="store_true", help="also decode to the maximum context and report stability")
    b.add_argument("--soak-len", type=int, metavar="N", help="soak up to N tokens (default: the model's context)")
    b.add_argument("--plot", metavar="PNG", help="write latency and memory against prompt length to PNG")
    b.add_argument("--json", action="store_true")
    add_speculative_args(b)  # also decode speculatively and report acceptance and speed-up (tools/bench_spec.py)
    _add_quant_args(b)
    _add_mesh_arg(b)
    _add_compile_cache_arg(b)
    _add_process_args(b)

    v = sub.add_parser("verify", help="compare a conversion with HF transformers on the original, layer by layer")
    v.add_argument("--model", required=True, metavar="DST", help="converted model directory")
    v.add_argument("--reference", required=True, metavar="SRC", help="the original: HF directory, .bin/.pt/.pth or .gguf")
    vprompt = v.add_mutually_exclusive_group()
    vprompt.add_argument("--prompt", help="prompt text, encoded with DST's tokenizer (default: a ~200-token paragraph)")
    vprompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    v.add_argument("--rtol", type=float, default=1e-3, help="per-layer error bound relative to max|reference|")
    v.add_argument("--atol", type=float, default=0.0, help="absolute per-layer error allowance added to rtol's")
    v.add_argument("--max-kl", type=float, default=1e-4, help="largest allowed per-token KL(reference || ours)")
    v.add_argument("--min-top1", type=float, default=1.0, help="smallest allowed top-1 agreement fraction")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    _add_mesh_arg(v)
    _add_compile_cache_arg(v)
    _add_process_args(v)

    k = sub.add_parser("check", help="validate a checkpoint's files, tensors and values before converting")
    k.add_argument("src", help="HF model directory, .bin/.pt/.pth state dict, .gguf file, or converted directory")
    k.add_argument("--sha256-file", metavar="FILE",
                   help="sha256sum-style list '<hex>  <name>', or a converted directory whose manifest lists them")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    _add_mesh_arg(k)
    _add_process_args(k)

    ll = sub.add_parser("launch-local", help="run a command as N local processes of one multi-host run (testing)")
    ll.add_argument("--processes", type=int, required=True, metavar="N", help="number of processes")
    ll.add_argument("--devices-per-process", type=int, required=True, metavar="D", help="CPU devices per process")
    ll.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the dayzero command to run")

    _add_serve_parser(sub)

    pl = sub.add_parser("plan", help="per-device memory on N devices: weights, KV cache, activations, mesh, fits?")
    model = pl.add_mutually_exclusive_group(required=True)
    model.add_argument("--config", metavar="PATH", help="HF config.json (or the directory holding it)")
    model.add_argument("--preset", metavar="NAME",
                       help="a named model: " + ", ".join(sorted(PRESETS)))
    pl.add_argument("--devices", type=int, required=True, metavar="N", help="number of devices")
    pl.add_argument("--device-memory", required=True, metavar="SIZE", help="memory per device, e.g. 80GiB or 141GB")
    pl.add_argument("--quantize", metavar=CONVERT_QUANT, default="none",
                    help="weight storage, as generate --quantize (auto is the platform's run-time choice: name one)")
    pl.add_argument("--state-snapshots", type=int, metavar="N",
                    help="prefix-cache copies of per-sequence states (hybrids, DeepSeek-V4), as serve's (default 4 per "
                         "sequence)")
    pl.add_argument("--kv-cache", metavar="none|int8|fp8", default="none", help="KV-cache storage, as generate --kv-cache")
    pl.add_argument("--dtype", default="bfloat16", metavar="bfloat16|float32", help="compute and float-weight dtype")
    pl.add_argument("--kernels", default="auto", metavar="auto|reference|pallas",
                    help="attention as generate --kernels (pallas refuses meshes that split heads unevenly)")
    pl.add_argument("--context", type=int, default=4096, metavar="N", help="cache positions per row")
    pl.add_argument("--batch", type=int, default=1, metavar="B", help="rows decoded together")
    pl.add_argument("--prefill-chunk", type=int, default=512, metavar="T",
                    help="tokens of one prefill chunk (one row, as serving prefills; its peak is planned too)")
    pl.add_argument("--devices-per-host", type=int, default=8, metavar="N",
                    help="devices per host: collectives over groups spanning hosts are counted as inter-host")
    pl.add_argument("--reserve", type=float, default=0.1, metavar="F", help="fraction of each device kept free")
    pl.add_argument("--host-memory", metavar="SIZE",
                    help="host memory per host for the host tier: offloaded weights streamed per step, KV swap space")
    pl.add_argument("--host-bandwidth", metavar="SIZE", default="55GB",
                    help="bytes per second a device's host link moves (default 55GB: PCIe Gen5 x16, measured-typical)")
    pl.add_argument("--micro-batches", type=int, metavar="M",
                    help="micro-batches of a pipeline (stage) mesh's decode step (default: one per stage)")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    _add_mesh_arg(pl)
    _add_process_args(pl)
    return parser


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    s.add_argument("--model", help="converted model directory (default: embedded SmolLM2-135M-Instruct)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one; the URL is printed)")
    s.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: --model's value)")
    s.add_argument("--slots", type=int, help="requests decoded at once (default 8)")
    s.add_argument("--page-size", type=int,
                   help="positions per KV page (default 16; DeepSeek-V4: 128, a multiple of its compression ratios)")
    s.add_argument("--num-pages", type=int, help="pages in the KV pool (default: 1024 positions per slot)")
    s.add_argument("--max-context", type=int, help="longest prompt + completion served (default: the model's)")
    s.add_argument("--max-chunk", type=int, help="most prompt tokens per prefill step, a power of two (default 512)")
    s.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the pages of shared prompt prefixes")
    s.add_argument("--state-snapshots", type=int, metavar="N",
                   help="models with per-sequence states (linear-attention hybrids, DeepSeek-V4): copies of a "
                        "slot's states the prefix cache keeps at page boundaries (default 4 per slot; 0: no prefix cache)")
    s.add_argument("--swap-space", metavar="SIZE",
                   help="host memory for the KV pages of preempted requests, copied back instead of recomputed, "
                        "e.g. 4GiB (default: the device pool's size; 0: recompute)")
    s.add_argument("--host-cache", metavar="SIZE",
                   help="host memory for a second prefix-cache tier: cached prefix pages the device pool evicts are "
                        "copied there and back on a later hit, e.g. 8GiB (default: the device pool's size; 0: off)")
    s.add_argument("--speculative", metavar="ngram|mtp|draft:DIR",
                   help="speculative decoding with n-gram drafts, the model's own multi-token-prediction layers "
                        "(mtp: DeepSeek-V3, Kimi-K2, GLM-4.5) or the converted small model in DIR (same "
                        "tokenizer), verified per decode step; same output distribution")
    s.add_argument("--num-draft-tokens", type=int, metavar="K", help="draft tokens verified per step (default 4)")
    s.add_argument("--micro-batches", type=int, metavar="M",
                   help="a pipeline (--mesh stage=N) cuts each decode step's rows into M micro-batches in flight "
                        "through the stages (default: N)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; more answer 429 with Retry-After")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGINT/SIGTERM before they are cancelled")
    s.add_argument("--no-warmup", action="store_true", help="compile step shapes on first use, not before serving")
    s.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    _add_quant_args(s)
    _add_mesh_arg(s)
    _add_compile_cache_arg(s)
    _add_process_args(s)


def cmd_serve(args: argparse.Namespace) -> int:
    """``dayzero serve``."""
    from dayzero.engine.server_run import run_serve

    if args.max_queue < 0:
        raise CommandError(f"--max-queue {args.max_queue} is negative; pass 0 or more")
    return run_serve(args, _placement(args.mesh))


def cmd_convert(args: argparse.Namespace) -> int:
    """``dayzero convert``."""
    from dayzero.convert import convert_checkpoint

    placement = _placement(args.mesh)
    stats: dict = {}
    dst = convert_checkpoint(args.src, args.dst, dtype=args.dtype, progress=not args.no_progress,
                             quantize=args.quantize, placement=placement, resume=args.resume,
                             threads=args.threads, stats=stats, max_memory=args.max_memory)
    print(f"converted {args.src} -> {dst}: {stats['bytes_read'] / 1e6:.1f} MB read in {stats['seconds']:.1f} s "
          f"({stats['mb_per_s']:.1f} MB/s, {stats['threads']} threads)", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """``dayzero generate``."""
    from dayzero.engine.generate import Engine
    from dayzero.engine.runtime import kernels_record, options_from_args
    from dayzero.engine.sampling import SamplingParams

    placement = _placement(args.mesh)
    if args.logprobs and not args.json:
        raise CommandError("--logprobs needs --json (log-probabilities are reported in the JSON object)")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)
    prompt = args.prompt if args.prompt is not None else _parse_ids(args.prompt_ids)
    speculative = speculative_config(args)
    images = _images(args.image)  # read before the model loads: a bad file fails fast
    engine = Engine.load(args.model, placement=placement, **options_from_args(args))
    chat = args.chat
    if images is not None and isinstance(prompt, str):
        prompt, chat = _image_chat_ids(engine, prompt, len(images)), False
    stream = None if args.json else (lambda _row, text: print(text, end="", flush=True))
    result = engine.generate(
        prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        chat=chat,
        logprobs=args.logprobs,
        on_text=stream,
        speculative=speculative,
        images=images,
    )
    if args.json:
        out = result.to_json()
        out["kernels"] = kernels_record(engine.run)
        out["run"] = engine.run.describe()
        out["compile_s"] = round(engine.compile_s, 3)  # this run's step compiles (a cache hit is a read)
        print(json.dumps(out))
    else:
        print()
    return 0


def _images(paths: list[str] | None) -> list | None:
    """``--image`` files decoded to RGB (an unreadable one raises ``ImageError`` naming it)."""
    if paths is None:
        return None
    from dayzero.engine.images import ImageError, load_image

    images = []
    for i, path in enumerate(paths):
        try:
            images.append(load_image(path))
        except ImageError as e:
            raise ImageError(f"--image {i + 1} of {len(paths)}: {e}") from None
    return images


def _image_chat_ids(engine, text: str, images: int) -> list[int]:
    """``--prompt`` with ``--image``: one user turn through the chat template, the images'
    placeholders before the text."""
    if engine.tokenizer is None:
        raise CommandError("--image with --prompt needs the model's tokenizer and chat template, which this model "
                           "lacks; pass --prompt-ids with one image placeholder id per image")
    return engine.tokenizer.encode_chat(text, images=images)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """``--speculative``, ``--num-draft-tokens`` and ``--ngram`` of ``generate`` and ``bench``
    (read by :func:`speculative_config`)."""
    p.add_argument("--speculative", metavar="ngram|mtp|draft:DIR",
                   help="speculative decoding with this drafter (ngram: prompt lookup; mtp: the model's own "
                        "multi-token-prediction layers: DeepSeek-V3, Kimi-K2, GLM-4.5; draft:DIR: the converted "
                        "small model in DIR, same tokenizer); same output distribution")
    p.add_argument("--num-draft-tokens", type=int, metavar="K", help="draft tokens verified per step (default 4)")
    p.add_argument("--ngram", metavar="MIN,MAX", help="suffix lengths the ngram drafter looks up (default 2,4)")


def speculative_config(args: argparse.Namespace):
    """The options of :func:`add_speculative_args` as a ``SpecConfig`` (None without
    ``--speculative``); ``draft:DIR`` loads the draft model."""
    from dayzero.engine.runtime import options_from_args
    from dayzero.engine.speculative import SpecConfig

    if args.speculative is None:
        if args.num_draft_tokens is not None or args.ngram is not None:
            raise CommandError("--num-draft-tokens and --ngram set speculative decoding; add --speculative ngram")
        return None
    options = {"num_draft_tokens": args.num_draft_tokens} if args.num_draft_tokens is not None else {}
    kind, _, draft_dir = args.speculative.partition(":")
    if kind == "draft":
        if not draft_dir:
            raise CommandError("--speculative draft needs the draft model's directory: --speculative draft:DIR")
        if args.ngram is not None:
            raise CommandError("--ngram sets the ngram drafter; drop it with --speculative draft:DIR")
        from dayzero.engine.generate import Engine

        # The draft runs as the target does (weight and KV storage), on one device, on the reference path.
        run = dict(options_from_args(args), kernels="reference")
        return SpecConfig("draft", draft=Engine.load(draft_dir, progress=False, **run), **options)
    if args.speculative == "mtp":
        if args.ngram is not None:
            raise CommandError("--ngram sets the ngram drafter; drop it with --speculative mtp")
        return SpecConfig("mtp", **options)
    if args.speculative != "ngram":
        raise CommandError(f"--speculative {args.speculative!r} is unknown; use ngram, mtp or draft:DIR")
    if args.ngram is not None:
        try:
            options["ngram"] = tuple(int(n) for n in args.ngram.split(","))
        except ValueError:
            raise CommandError(f"--ngram {args.ngram!r} is not two integers MIN,MAX; pass e.g. --ngram 1,3") from None
    return SpecConfig("ngram", **options)


def cmd_bench(args: argparse.Namespace) -> int:
    """``dayzero bench``."""
    from dayzero.tools.bench import run_bench

    return run_bench(args, _placement(args.mesh))


def cmd_verify(args: argparse.Namespace) -> int:
    """``dayzero verify``."""
    from dayzero.tools.verify import run_verify

    placement = _placement(args.mesh)
    return run_verify(args, _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None, placement)


def cmd_check(args: argparse.Namespace) -> int:
    """``dayzero check``."""
    from dayzero.convert.check import run_check

    parse_mesh(args.mesh)  # checked for consistency; a checkpoint check runs no model
    return run_check(args)


def cmd_launch_local(args: argparse.Namespace) -> int:
    """``dayzero launch-local``."""
    from dayzero.engine.launch import launch_local

    known = tuple(name for name in COMMANDS if name != "launch-local")
    return launch_local(args.cmd, args.processes, args.devices_per_process, known)


def cmd_plan(args: argparse.Namespace) -> int:
    """``dayzero plan``: exit 0 when the plan fits, 1 when it does not."""
    from dayzero.tools.plan import run_plan

    return run_plan(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": cmd_convert,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "verify": cmd_verify,
    "check": cmd_check,
    "launch-local": cmd_launch_local,
    "plan": cmd_plan,
    "serve": cmd_serve,
}


def _start_processes(args: argparse.Namespace) -> None:
    """Join a multi-host run if asked; processes other than 0 print no results (stdout muted)."""
    if args.command == "launch-local":
        return
    group = ProcessGroup(args.coordinator, args.num_processes, args.process_id)
    initialize(group)
    if group.is_multi_process:
        # The collectives' native code logs to file descriptor 1: point it at stderr, so stdout
        # carries the command's results only (and those from process 0 only).
        results = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(results, "w") if group.process_id == 0 else open(os.devnull, "w")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dayzero`` console script."""
    args = build_parser().parse_args(argv)
    try:
        _start_processes(args)
        if hasattr(args, "compile_cache"):
            from dayzero.engine.compile_cache import enable

            enable(args.compile_cache)
        return COMMANDS[args.command](args)
    except (CommandError, MeshError) as e:
        print(f"dayzero: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dayzero: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - user errors are reported, bugs re-raised
        if isinstance(e, _user_errors()):
            print(f"dayzero: error: {e}", file=sys.stderr)
            return 2
        _exit_if_peer_lost(args, e)
        raise


def _exit_if_peer_lost(args: argparse.Namespace, error: Exception) -> None:
    """In a multi-host run, a runtime error (typically a collective whose peer process has gone)
    ends this process at once, after one line on stderr: a normal exit would wait in the
    runtime's shutdown barrier for the dead peer until its timeout, then abort with a stack dump.
    """
    import jax

    if getattr(args, "num_processes", None) is None or not isinstance(error, jax.errors.JaxRuntimeError):
        return
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    print(
        f"dayzero: error: process {args.process_id} of {args.num_processes} stopped on a runtime error "
        f"({first[:200]}); in a multi-host run this usually means another process died, see its log",
        file=sys.stderr, flush=True,
    )
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
