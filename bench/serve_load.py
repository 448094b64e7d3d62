"""Load benchmark of ``dayzero serve`` against llama.cpp's OpenAI server, swept over concurrency.

    python bench/serve_load.py [--clients 1,4,16,64] [--prompt-len 128] [--new-tokens 64]
        [--requests 4] [--max-duration 120] [--servers dayzero,llamacpp]
        [--json PATH] [--plot PATH] [--gguf PATH] [--threads N]

Both servers serve the embedded SmolLM2-135M-Instruct (dayzero converts the GGUF that llama.cpp
loads, ``default_gguf_path()``), each started as a subprocess on a free loopback port, measured
one after the other in the same run, and stopped at the end (also on an error or Ctrl-C).

Workload: at each concurrency level, that many clients each send streaming ``/v1/completions``
requests back to back (``stream_options.include_usage``), ``--requests`` each, starting no new
one after ``--max-duration`` seconds (every client sends at least one). Every request has its own
prompt of exactly ``--prompt-len`` tokens (single-token words drawn from a seeded generator, so
no two share a prefix and no prefix cache helps), the same list for both servers, greedy, and
must produce exactly ``--new-tokens`` tokens: dayzero is asked with vLLM's ``ignore_eos``,
llama.cpp by biasing every end-of-generation token away (``logit_bias`` -100). The lengths are
checked (streamed usage, else ``finish_reason`` "length" plus the usage of one request without
streaming); a mismatch counts as an error, as does any failed request.

llama.cpp's ``--threads`` defaults to every core; on a loaded shared machine one thread can be
far faster (its OpenMP threads spin at barriers), so pass what the machine allows and report it.

Reported per server and level: requests/s and output tokens/s over the level's wall time (its
start to the last response), TTFT (send to first streamed token) and TPOT ((last token - first
token) / (tokens - 1), per request) p50/p99, and the ratio dayzero / llama.cpp of output tokens/s.
A short untimed warm-up round runs on each server first.

dayzero's serve options are chosen to make its warm-up (which compiles every step shape before
it listens) short while covering the workload: ``--slots`` = the largest level, ``--max-context``
= prompt + new tokens, pages of 64 positions (one table width), a pool of slots x (pages per
sequence + 1) (admission keeps a free page per running request), ``--max-chunk`` = the prompt's
bucket (one prefill chunk per request). Its warm-up still compiles every sampling variant
(modes x masks x top logprobs x decode batches), most of the ~100 shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

PAGE_SIZE = 64
READY = re.compile(r"dayzero: ready (http://\S+)")
# Common English words; those the tokenizer encodes (with a leading space) as one token build prompts.
WORDS = """the of and to in is was for on are as with his they at be this from have or by one had
not but what all were when we there can an your which their said if do will each about how up out
them then she many some so these would other into has more her two like him see time could no make
than first been its who now people my made over did down only way find use may water long little
very after words called just where most know get through back much before go good new write our
used me man too any day same right look think also around another came come work three word must
because does part even place well such here take why things help put years different away again
off went old number great tell men say small every found still between name should home big give
air line set own under read last never us left end along while might next sound below saw
something thought both few those always looked show large often together asked house world going
want school important until form food keep children feet land side without boy once animals life
enough took sometimes four head above kind began almost live page got earth need far hand high year
mother light parts country father let night following picture being study second eyes soon times
story boys since white days ever paper hard near sentence better best across during today others
sure means knew why""".split()


@dataclasses.dataclass
class Result:
    """One request as the client saw it (times from ``time.perf_counter``)."""

    sent: float
    first: float | None = None  # first streamed chunk with a token
    last: float | None = None  # last streamed chunk with a token
    tokens: int = 0  # completion tokens (the server's usage)
    error: str | None = None


# ---- statistics --------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, numpy's default), None for no values."""
    return float(np.percentile(values, q)) if values else None


def tpot(r: Result) -> float | None:
    """Time per output token after the first: (last - first) / (tokens - 1); None below 2 tokens."""
    return (r.last - r.first) / (r.tokens - 1) if r.tokens >= 2 else None


def summarize(results: list[Result], start: float, end: float) -> dict:
    """Throughput over ``end - start`` and latency percentiles of the requests that succeeded."""
    ok = [r for r in results if r.error is None]
    wall = end - start
    ttfts = [r.first - r.sent for r in ok]
    tpots = [t for t in map(tpot, ok) if t is not None]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    errors = sorted({r.error for r in results if r.error is not None})
    return {
        "requests": len(ok), "errors": len(results) - len(ok), "error_kinds": errors[:5],
        "wall_s": wall, "req_s": len(ok) / wall, "out_tok_s": sum(r.tokens for r in ok) / wall,
        "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "tpot_p50_ms": ms(percentile(tpots, 50)), "tpot_p99_ms": ms(percentile(tpots, 99)),
    }


# ---- prompts -----------------------------------------------------------------------------------


def single_token_words(encode) -> list[str]:
    """The words of ``WORDS`` that ``encode`` turns into exactly one token after a space."""
    words = [w for w in dict.fromkeys(WORDS) if len(encode(" " + w)) == 1]
    if len(words) < 100:
        raise SystemExit(f"only {len(words)} single-token words for this tokenizer; extend WORDS")
    return words


def make_prompts(words: list[str], length: int, count: int, seed: int = 0) -> list[str]:
    """``count`` prompts of ``length`` single-token words each, the same for a given ``seed``."""
    rng = random.Random(seed)
    return ["".join(" " + w for w in rng.choices(words, k=length)) for _ in range(count)]


# ---- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (its own process group; output to ``log``), stopped by :meth:`stop`."""

    def __init__(self, name: str, cmd: list[str], log: Path):
        self.name, self.cmd, self.log = name, cmd, log
        self.lines: list[str] = []
        self._out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # Ctrl-C reaches us, and we stop it
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._out.write(line)
            self._out.flush()

    def ready(self, pattern: re.Pattern, timeout: float) -> re.Match:
        """The first output line matching ``pattern``, which says the server is ready (waits; if
        it exits, times out or we are interrupted meanwhile, the server is stopped)."""
        try:
            return self._wait_line(pattern, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_line(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline, seen = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                if m := pattern.search(line):
                    return m
            seen = len(self.lines)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}; see {self.log}")
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s; see {self.log}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a graceful stop), then SIGKILL of its process group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


def start_dayzero(args, log: Path) -> tuple[Server, str]:
    """``dayzero serve`` with shapes cut to the workload; returns it and its base URL."""
    context = args.prompt_len + args.new_tokens
    per_seq = -(-context // PAGE_SIZE)
    cmd = [sys.executable, "-m", "dayzero.engine.cli", "serve", "--port", "0", "--served-model-name", "smollm2",
           "--slots", str(args.slots), "--max-context", str(context), "--page-size", str(PAGE_SIZE),
           "--num-pages", str(args.slots * (per_seq + 1)), "--max-chunk", str(args.max_chunk)]
    server = Server("dayzero", cmd, log)
    return server, server.ready(READY, args.start_timeout).group(1)


def llamacpp_eog_ids(gguf: Path) -> list[int]:
    """The tokens that end a llama.cpp generation (EOS, end-of-turn, ...) in ``gguf``'s vocabulary."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i)]


def start_llamacpp(args, log: Path) -> tuple[Server, str]:
    """``python -m llama_cpp.server`` on the GGUF with every core; returns it and its base URL."""
    port = free_port()
    n_ctx = max(512, args.prompt_len + args.new_tokens)
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf), "--model_alias", "smollm2",
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_batch", str(n_ctx),
           "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           "--interrupt_requests", "False"]  # (default True: a waiting request cuts the running stream short)
    server = Server("llama.cpp", cmd, log)
    server.ready(re.compile(r"Uvicorn running on"), args.start_timeout)
    return server, f"http://127.0.0.1:{port}"


# ---- load --------------------------------------------------------------------------------------


async def one_request(client, prompt: str, args, extra: dict) -> Result:
    """Send one streaming completion; time its tokens and check its length: by the streamed usage
    where the server sends one (dayzero), else by ``finish_reason`` "length" (llama-cpp-python
    streams no usage; :func:`check_lengths` checked its usage on a request without streaming)."""
    r = Result(sent=time.perf_counter())
    usage = finish = None
    try:
        stream = await client.completions.create(
            model=args.model_name, prompt=prompt, max_tokens=args.new_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            if chunk.choices:
                r.last = time.perf_counter()
                r.first = r.first or r.last
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # noqa: BLE001 -- any failure is one errored request, reported by kind
        r.error = f"{type(e).__name__}: {str(e)[:120]}"
        return r
    r.error = length_error(usage, finish, args) if r.first is not None else "no token in the stream"
    r.tokens = 0 if r.error else args.new_tokens
    return r


def length_error(usage, finish: str | None, args) -> str | None:
    """Why a response does not have ``--prompt-len`` / ``--new-tokens`` tokens (None if it has)."""
    if usage is not None and (usage.prompt_tokens, usage.completion_tokens) != (args.prompt_len, args.new_tokens):
        return (f"usage {usage.prompt_tokens} prompt / {usage.completion_tokens} completion tokens, "
                f"expected {args.prompt_len} / {args.new_tokens}")
    if finish != "length":
        return f"finish_reason {finish!r}, expected 'length' (max_tokens reached)"
    return None


async def check_lengths(url: str, prompt: str, args, extra: dict) -> None:
    """One request without streaming: its usage must show both lengths (raises if not)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=args.request_timeout) as c:
        out = await c.completions.create(model=args.model_name, prompt=prompt, max_tokens=args.new_tokens,
                                         temperature=0.0, extra_body=extra)
    if error := length_error(out.usage, out.choices[0].finish_reason, args):
        raise RuntimeError(f"{url}: {error}")


async def run_level(url: str, clients: int, prompts: list[str], args, extra: dict, requests: int,
                    max_duration: float) -> tuple[list[Result], float, float]:
    """``clients`` closed-loop clients, ``requests`` each (none started after ``max_duration``),
    client i sending ``prompts[i * requests:(i + 1) * requests]``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=args.request_timeout)
    start = time.perf_counter()
    results: list[Result] = []

    async def user(i: int) -> None:
        for k in range(requests):
            if k and time.perf_counter() - start > max_duration:
                return
            results.append(await one_request(client, prompts[i * requests + k], args, extra))

    try:
        await asyncio.gather(*(user(i) for i in range(clients)))
    finally:
        await client.close()
    return results, start, time.perf_counter()


async def served_model(url: str) -> str:
    """The name of the (first) model the server at ``url`` serves."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        return (await client.models.list()).data[0].id


def sweep(name: str, url: str, args, prompts: list[str], extra: dict) -> list[dict]:
    """The untimed warm-up round, then every level of ``--clients``; one summary per level."""
    args.model_name = asyncio.run(served_model(url))
    asyncio.run(check_lengths(url, prompts[0], args, extra))
    warm, _, _ = asyncio.run(run_level(url, args.warmup, prompts, args, extra, 1, 0.0))
    if any(r.error for r in warm):
        raise RuntimeError(f"{name}: the warm-up failed: {next(r.error for r in warm if r.error)}")
    rows, used = [], args.warmup
    for clients in args.clients:  # each level its own prompts: nothing cached from an earlier one
        level = prompts[used:used + clients * args.requests]
        used += clients * args.requests
        results, start, end = asyncio.run(run_level(url, clients, level, args, extra, args.requests, args.max_duration))
        row = {"clients": clients, **summarize(results, start, end)}
        rows.append(row)
        print(f"  {name} {clients:3d} clients: {row['requests']} requests ({row['errors']} errors), "
              f"{row['out_tok_s']:.1f} out tok/s, TTFT p50 {_fmt(row['ttft_p50_ms'])} ms", file=sys.stderr, flush=True)
    return rows


# ---- report ------------------------------------------------------------------------------------


def _fmt(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(result: dict) -> str:
    """The per-level table of every server, then the dayzero / llama.cpp ratio of output tokens/s."""
    lines = ["| server | clients | requests | errors | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | "
             "TPOT p50 ms | TPOT p99 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, server in result["servers"].items():
        for r in server["levels"]:
            lines.append(f"| {name} | {r['clients']} | {r['requests']} | {r['errors']} | {_fmt(r['req_s'], 2)} | "
                         f"{_fmt(r['out_tok_s'], 1)} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} | "
                         f"{_fmt(r['tpot_p50_ms'], 1)} | {_fmt(r['tpot_p99_ms'], 1)} |")
    if result.get("ratio"):
        lines += ["", "| clients | dayzero / llama.cpp output tok/s |", "|---:|---:|"]
        lines += [f"| {c} | {_fmt(v, 2)} |" for c, v in result["ratio"].items()]
    return "\n".join(lines)


def ratios(servers: dict) -> dict:
    """dayzero's output tokens/s over llama.cpp's, per level both measured."""
    if not {"dayzero", "llama.cpp"} <= servers.keys():
        return {}
    theirs = {r["clients"]: r["out_tok_s"] for r in servers["llama.cpp"]["levels"]}
    return {str(r["clients"]): r["out_tok_s"] / theirs[r["clients"]]
            for r in servers["dayzero"]["levels"] if theirs.get(r["clients"])}


def plot(result: dict, path: Path) -> None:
    """Output tokens/s and TTFT (p50 solid, p99 dashed) against clients, one line per server."""
    from dayzero.tools.plot import _pyplot

    plt = _pyplot()
    fig, (ax_tok, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, server in result["servers"].items():
        levels = server["levels"]
        clients = [r["clients"] for r in levels]
        line, = ax_tok.plot(clients, [r["out_tok_s"] for r in levels], "o-", label=name)
        ax_ttft.plot(clients, [r["ttft_p50_ms"] for r in levels], "o-", color=line.get_color(), label=f"{name} p50")
        ax_ttft.plot(clients, [r["ttft_p99_ms"] for r in levels], "s--", color=line.get_color(), label=f"{name} p99")
    levels = sorted({r["clients"] for server in result["servers"].values() for r in server["levels"]})
    for ax, ylabel in ((ax_tok, "output tokens/s (all clients)"), (ax_ttft, "TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_ttft.set_yscale("log")
    s = result["settings"]
    fig.suptitle(f"serving load: {s['prompt_len']}-token prompts, {s['new_tokens']} new tokens, streaming "
                 f"(SmolLM2-135M, {s['cpus']} CPUs)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``--clients`` becomes a list of ints)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,4,16,64", help="concurrency levels, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--requests", type=int, default=4, help="requests per client and level")
    p.add_argument("--max-duration", type=float, default=120.0,
                   help="seconds after which a level's clients start no new request (each sends one)")
    p.add_argument("--warmup", type=int, default=4, help="concurrent requests of the untimed warm-up round")
    p.add_argument("--servers", default="dayzero,llamacpp", help="which to measure: dayzero, llamacpp or both")
    p.add_argument("--slots", type=int, help="dayzero --slots (default: the largest level)")
    p.add_argument("--max-chunk", type=int, help="dayzero --max-chunk (default: the prompt's power-of-two bucket)")
    p.add_argument("--gguf", help="the GGUF llama.cpp serves (default: the embedded model's)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: every core)")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds a server may take to be ready")
    p.add_argument("--request-timeout", type=float, default=1200.0, help="seconds one request may take")
    p.add_argument("--dayzero-url", help="measure this running dayzero server (model name smollm2) instead of starting one")
    p.add_argument("--llamacpp-url", help="measure this running llama.cpp server instead of starting one")
    p.add_argument("--logs", default="/tmp", help="folder for the servers' output")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of tokens/s and TTFT against clients")
    args = p.parse_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        p.error(f"--clients {args.clients!r} is not a comma-separated list of integers; e.g. 1,4,16,64")
    args.servers = args.servers.split(",")
    for name, value, least in (("--clients", min(args.clients), 1), ("--prompt-len", args.prompt_len, 1),
                               ("--new-tokens", args.new_tokens, 2), ("--requests", args.requests, 1),
                               ("--warmup", args.warmup, 1), ("--threads", args.threads, 1)):
        if value < least:
            p.error(f"{name} {value} is too small; it must be at least {least}")
    if unknown := set(args.servers) - {"dayzero", "llamacpp"}:
        p.error(f"--servers {sorted(unknown)} unknown; name dayzero and/or llamacpp")
    args.slots = args.slots or max(args.clients)
    args.max_chunk = args.max_chunk or min(512, max(16, 1 << (args.prompt_len - 1).bit_length()))
    return args


def load() -> str:
    """The machine's load averages (1, 5, 15 min), which shared runs should report."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def request_extra(name: str, args) -> dict:
    """The non-OpenAI request fields that make server ``name`` produce exactly ``--new-tokens``."""
    if name == "dayzero":
        return {"ignore_eos": True}
    # Every end-of-generation token stops llama.cpp, so all are biased away. Not min_tokens too:
    # llama-cpp-python 0.3.36 then drops both (``logits_processor = logits_processor.extend(...)``
    # is None). repeat_penalty: its server's default is 1.1; dayzero, like OpenAI, has none.
    return {"logit_bias": {str(i): -100 for i in llamacpp_eog_ids(args.gguf)}, "repeat_penalty": 1.0}


def measure(name: str, args, prompts: list[str]) -> dict:
    """Start server ``name`` (or use the running one given by URL), sweep it, stop it."""
    given = args.dayzero_url if name == "dayzero" else args.llamacpp_url
    started = time.perf_counter()
    if given:
        server, url, note = None, given, "a running server"
    elif name == "dayzero":
        server, url = start_dayzero(args, Path(args.logs) / "serve_load_dayzero.log")
        note = f"continuous batching, {args.slots} slots" + (
            f" (clients above {args.slots} queue)" if max(args.clients) > args.slots else "")
    else:
        server, url = start_llamacpp(args, Path(args.logs) / "serve_load_llamacpp.log")
        note = f"one sequence at a time (requests queue on a lock), {args.threads} threads"
    ready_s = time.perf_counter() - started
    print(f"{name}: ready in {ready_s:.0f} s at {url} ({note})", file=sys.stderr, flush=True)
    extra = request_extra(name, args)
    try:
        levels = sweep(name, url, args, prompts, extra)
    finally:
        if server is not None:
            server.stop()
    return {"command": " ".join(server.cmd) if server else url, "ready_s": ready_s, "note": note,
            "request_extra": extra, "levels": levels}


def main(argv: list[str] | None = None) -> int:
    """Run the sweep on each server, print the table, write the JSON and the plot."""
    args = parse_args(argv)
    # SIGTERM as Ctrl-C: unwind, so that the servers (in their own sessions) are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from dayzero.engine.default_model import default_gguf_path, default_model_dir
    from dayzero.engine.tokenizer import Tokenizer

    args.gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    tokenizer = Tokenizer(default_model_dir())
    words = single_token_words(lambda t: tokenizer.encode(t, add_special_tokens=False))
    prompts = make_prompts(words, args.prompt_len, args.warmup + sum(args.clients) * args.requests)
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "logs")} |
              {"gguf": str(args.gguf), "cpus": os.cpu_count(), "load_before": load()}, "servers": {}}
    for name in args.servers:
        result["servers"]["dayzero" if name == "dayzero" else "llama.cpp"] = measure(name, args, prompts)
    result["settings"]["load_after"] = load()
    result["ratio"] = ratios(result["servers"])
    print(markdown(result))
    print(f"\nload average before {result['settings']['load_before']}, after {result['settings']['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
