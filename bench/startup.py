"""Start-up cost of `dayzero generate`: a cold invocation against identical warm ones, one run.

    python bench/startup.py [--runs 3] [--prompt TEXT] [--json OUT]

Each run is the README's quick-start command (``dayzero generate --chat --prompt ... --json``)
as a fresh process, all against one new, empty compile cache (``--compile-cache`` in a temporary
directory; the converted model in ``$DAYZERO_CACHE`` is reused, so conversion is not timed).
Reported per run: wall time of the process, the engine's ``compile_s`` (time in the first call
of each step shape: tracing, lowering and compiling cold, reading the stored executable warm,
plus that call's own run), and the generated token ids, which must be equal across runs. The
import time of the CLI module (best of 3 fresh interpreters) is reported beside them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

QUICK_START_PROMPT = "What is the capital of France?"


def import_seconds(repeats: int = 3) -> float:
    """Best wall time of a fresh interpreter importing the CLI module (the first thing every
    ``dayzero`` command pays)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import dayzero.engine.cli"], check=True)
        times.append(time.perf_counter() - start)
    return min(times)


def one_run(prompt: str, compile_cache: str) -> dict:
    """One ``dayzero generate`` process: wall seconds, compile_s and the token ids."""
    cmd = [sys.executable, "-m", "dayzero.engine.cli", "generate", "--chat", "--prompt", prompt, "--json",
           "--compile-cache", compile_cache]
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    out = json.loads(done.stdout[done.stdout.index("{"):])
    return {"wall_s": round(wall, 2), "compile_s": out["compile_s"], "token_ids": out["token_ids"]}


def main() -> None:
    """Run the cold and warm invocations and print one table (and ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="invocations: the first is cold, the rest warm")
    ap.add_argument("--prompt", default=QUICK_START_PROMPT)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.runs < 2:
        ap.error(f"--runs {args.runs} must be at least 2 (one cold run, then warm ones)")
    with tempfile.TemporaryDirectory(prefix="dayzero-startup-") as cache:
        runs = [one_run(args.prompt, cache) for _ in range(args.runs)]
    if any(r["token_ids"] != runs[0]["token_ids"] for r in runs):
        raise SystemExit("token ids differ between runs: a stored executable computed something else")
    result = {"import_s": round(import_seconds(), 2), "runs": [{k: r[k] for k in ("wall_s", "compile_s")} for r in runs]}
    print(f"import {result['import_s']:.2f} s")
    for i, r in enumerate(result["runs"]):
        print(f"{'cold' if i == 0 else 'warm'} run {i + 1}: wall {r['wall_s']:6.2f} s, compile_s {r['compile_s']:6.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
