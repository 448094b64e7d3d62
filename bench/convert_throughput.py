"""Conversion throughput (MB/s of source tensors) with 1 vs N read threads, with and without hashing.

Writes a random many-shard HF llama checkpoint (``convert_memory.write_checkpoint``, one shard
per layer) in a temporary directory, converts it in a fresh interpreter per setting and deletes
everything afterwards. "Without hashing" replaces the source-file and per-tensor sha256 with a
no-op in the child (a measurement only: such a manifest is useless). Each child also reports its
peak RSS above its baseline, to show that N threads keep memory bounded. ``--reads-only`` also
replaces the Orbax write of each group with a no-op, to time the pooled part alone.

    python bench/convert_throughput.py [--layers 6] [--hidden 1024] [--threads 1,4] [--repeat 2] [--reads-only]

Prints one JSON line per run: threads, hashing, mb, convert_s, mb_per_s, peak_above_baseline_mb.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from convert_memory import write_checkpoint

CHILD = r"""
import json, resource, sys
import psutil
import dayzero.convert, dayzero.convert.convert as c
if sys.argv[4] == "0":
    c.file_sha256 = lambda path: ""
    c.array_sha256 = lambda x: ""
if sys.argv[5] == "1":
    def consume(self, group, leaves, pieces, *rest):  # read, transform and hash every piece; write none
        for piece in pieces:
            for done in (piece.while_writing, piece.written):
                if done is not None:
                    done()
    c.GroupWriter.save = consume
baseline = psutil.Process().memory_info().rss
stats = {}
dayzero.convert.convert_checkpoint(sys.argv[1], sys.argv[2], progress=False, threads=int(sys.argv[3]), stats=stats)
stats["peak_above_baseline"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
print(json.dumps(stats))
"""


def run(src: Path, dst: Path, threads: int, hashing: bool, reads_only: bool) -> dict:
    """One conversion in a fresh interpreter; its stats."""
    flags = ["1" if hashing else "0", "1" if reads_only else "0"]
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst), str(threads), *flags],
                         check=True, capture_output=True, text=True)
    shutil.rmtree(dst)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    """Build the checkpoint, run every setting ``--repeat`` times, print one JSON line per run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--threads", default="1,4", help="comma-separated thread counts")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--reads-only", action="store_true", help="skip the Orbax writes (time the pool alone)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="convert-throughput-") as scratch:
        src = Path(scratch) / "hf"
        write_checkpoint(src, args.layers, args.hidden, args.intermediate, args.vocab)
        for _ in range(args.repeat):
            for threads in (int(t) for t in args.threads.split(",")):
                for hashing in (True, False):
                    s = run(src, Path(scratch) / "out", threads, hashing, args.reads_only)
                    print(json.dumps({"threads": threads, "hashing": hashing, "reads_only": args.reads_only,
                                      "mb": round(s["bytes_read"] / 1e6), "convert_s": round(s["seconds"], 2), "mb_per_s": round(s["mb_per_s"], 1),
                                      "peak_above_baseline_mb": round(s["peak_above_baseline"] / 2**20)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
