"""The persistent compilation cache (engine/compile_cache.py): a second identical ``dayzero
generate`` reads every executable it needs from the cache directory, writes none, and gives the
same tokens; the setting is resolved as documented and a bad directory is a one-line error.

The oracle for "every executable came from the cache" is the directory itself: the first run
adds entries, the second adds none (a miss would write one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dayzero.engine import compile_cache
from dayzero.engine.cli import main


def _generate(model_dir, cache_dir) -> dict:
    cmd = [sys.executable, "-m", "dayzero.engine.cli", "generate", "--model", str(model_dir), "--prompt-ids",
           "5,6,7,8", "--max-new-tokens", "6", "--json", "--compile-cache", str(cache_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_second_identical_run_compiles_nothing_new(tiny_model, tmp_path):
    cache = tmp_path / "xla"
    cold = _generate(tiny_model.dir, cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "the first run wrote no cache entry"
    warm = _generate(tiny_model.dir, cache)
    assert sorted(p.name for p in cache.iterdir()) == entries  # every compile was a hit
    assert warm["token_ids"] == cold["token_ids"]
    assert warm["compile_s"] < cold["compile_s"]


def test_setting_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, "OFF")
    assert compile_cache.resolve(None) is None
    assert compile_cache.resolve(str(tmp_path)) == tmp_path  # the flag wins over the environment
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("DAYZERO_CACHE", str(tmp_path))
    default = compile_cache.resolve(None)
    assert default.parent == tmp_path / "xla" and "-jax-" in default.name
    assert compile_cache.resolve("off") is None


def test_unusable_directory_is_a_one_line_error(tiny_model, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc = main(["generate", "--model", str(tiny_model.dir), "--prompt-ids", "1,2", "--compile-cache",
               str(blocker / "cache")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and str(blocker / "cache") in err and "off" in err
