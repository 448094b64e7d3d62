"""Resumable conversion (``convert --resume``) and parallel reads (``threads``).

A conversion of a tiny 4-layer, many-shard checkpoint is SIGKILLed in a subprocess at a known
point (the test-only hook ``DAYZERO_TEST_CONVERT_KILL_AFTER_GROUPS``: two groups recorded, the
third saved but not yet recorded) and resumed in-process. The oracle is an uninterrupted
conversion of the same source: same manifest (per-tensor sha256) and same array values.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dayzero.convert import ConvertError, load_checkpoint
from dayzero.convert.parallel import ReadAhead
from dayzero.convert.staging import KILL_AFTER_ENV, PROGRESS
from dayzero.engine.cli import main
from dayzero.model.weights import named_leaves
from tests.convert_helpers import convert, save_hf, small_hf_model

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ["globals", "layer_000", "layer_001", "layer_002", "layer_003"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny llama (4 layers: 5 groups) in many safetensors shards."""
    root = tmp_path_factory.mktemp("resume")
    return save_hf(small_hf_model("llama", num_hidden_layers=4), root / "hf", max_shard_size="40KB")


@pytest.fixture(scope="module")
def reference(source) -> Path:
    """The uninterrupted conversion (one read thread)."""
    return convert(source, source.parent / "reference", threads=1)


@pytest.fixture(scope="module")
def killed_once(source) -> Path:
    """``DST.partial`` of a conversion SIGKILLed after recording 2 groups and saving a third."""
    dst = source.parent / "killed"
    code = ("import sys; from dayzero.convert import convert_checkpoint; "
            "convert_checkpoint(sys.argv[1], sys.argv[2], progress=False, threads=2)")
    env = {**os.environ, KILL_AFTER_ENV: "2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code, str(source), str(dst)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = dst.parent / "killed.partial"
    assert not dst.exists() and partial.is_dir()
    return partial


@pytest.fixture()
def killed(killed_once, tmp_path) -> Path:
    """A private copy of the killed conversion's staging; returns its DST."""
    shutil.copytree(killed_once, tmp_path / "out.partial")
    return tmp_path / "out"


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Same manifest (checksums, order, everything) and the same array values."""
    assert json.loads((got / "manifest.json").read_text()) == json.loads((want / "manifest.json").read_text())
    _, a = load_checkpoint(got)
    _, b = load_checkpoint(want)
    a, b = named_leaves(a), named_leaves(b)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def test_killed_conversion_resumes_to_the_uninterrupted_result(killed, source, reference):
    partial = killed.parent / "out.partial"
    recorded = json.loads((partial / PROGRESS).read_text())["groups"]
    assert list(recorded) == GROUPS[:2]
    # The third group reached the disk but not the record: it must be redone, not trusted.
    assert sorted(p.name for p in (partial / "weights").iterdir()) == GROUPS[:3]
    stats = {}
    convert(source, killed, resume=True, stats=stats)
    assert (stats["groups_kept"], stats["groups_converted"]) == (2, 3)
    assert_same_checkpoint(killed, reference)
    assert not partial.exists()
    assert not {PROGRESS, ".lock"} & {p.name for p in killed.iterdir()}


def test_plain_rerun_refuses_and_names_resume(killed, source, capsys):
    partial = killed.parent / "out.partial"
    before = sorted(p.name for p in partial.rglob("*"))
    assert main(["convert", str(source), str(killed), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--resume" in err and f"delete {partial}" in err, err
    assert sorted(p.name for p in partial.rglob("*")) == before  # nothing touched


def test_a_live_conversion_is_not_resumed_or_refused_as_interrupted(killed, source):
    import fcntl

    with open(killed.parent / "out.partial" / ".lock", "a") as held:  # as a live converter holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        for resume in (False, True):
            with pytest.raises(ConvertError, match="another dayzero convert is writing"):
                convert(source, killed, resume=resume)
    convert(source, killed, resume=True)  # once its writer is gone


@pytest.mark.parametrize("option, value, needle", [
    ("dtype", "bfloat16", "--dtype float32, this run has bfloat16"),
    ("quantize", "int8", "--quantize none, this run has int8"),
])
def test_resume_with_a_different_option_is_refused(killed, source, option, value, needle):
    with pytest.raises(ConvertError) as info:
        convert(source, killed, resume=True, **{option: value})
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert (killed.parent / "out.partial" / PROGRESS).is_file()  # kept for a resume with the right options


def test_corrupted_completed_group_is_redone(killed, source, reference):
    partial = killed.parent / "out.partial"
    # The biggest file of layer_000 holds its array chunks; flip one byte in the middle.
    files = [p for p in (partial / "weights" / "layer_000").rglob("*") if p.is_file()]
    chunk = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    stats = {}
    convert(source, killed, resume=True, stats=stats)
    assert (stats["groups_kept"], stats["groups_converted"]) == (1, 4)
    assert_same_checkpoint(killed, reference)


def test_full_disk_keeps_the_done_groups_and_bad_input_keeps_nothing(tmp_path, source, reference, monkeypatch):
    from dayzero.convert.checkpoint import GroupWriter

    real_save = GroupWriter.save

    def save(self, group, *args):
        if group == "layer_001":
            raise OSError(28, "No space left on device")
        real_save(self, group, *args)

    monkeypatch.setattr(GroupWriter, "save", save)
    dst = tmp_path / "out"
    with pytest.raises(OSError, match="No space"):
        convert(source, dst)
    partial = tmp_path / "out.partial"
    assert list(json.loads((partial / PROGRESS).read_text())["groups"]) == GROUPS[:2]
    monkeypatch.setattr(GroupWriter, "save", real_save)
    convert(source, dst, resume=True)
    assert_same_checkpoint(dst, reference)

    # A NaN in layer 1: the input is bad, nothing is kept (as before the first group).
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.1.mlp.up_proj.weight"]
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = np.nan
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="NaN"):
        convert(bad, tmp_path / "bad_out")
    assert not list(tmp_path.glob("bad_out*"))


def test_one_and_many_threads_give_the_same_checkpoint(tmp_path, source, reference, capsys):
    dst = tmp_path / "out"
    assert main(["convert", str(source), str(dst), "--threads", "4", "--no-progress"]) == 0
    assert "MB/s, 4 threads)" in capsys.readouterr().err
    assert_same_checkpoint(dst, reference)  # the reference was converted with one thread


def _drain(reads: ReadAhead, n: int) -> list:
    """Take ``n`` results in order, releasing each at once (as written)."""
    out = []
    for _ in range(n):
        index, result = reads.take(lambda: None)
        out.append(result)
        reads.release(index)
    return out


def test_read_ahead_keeps_its_byte_budget_and_hashes_each_file_once():
    hashed = []
    items = list(range(12))
    files = [Path("a"), Path("b")]
    cost = {i: 10 for i in items}
    with ThreadPoolExecutor(8) as pool:
        reads = ReadAhead(pool, 8, items, lambda i: time.sleep(0.01) or i, lambda i: [files[i % 2]], files,
                          lambda f: hashed.append(f) or f.name, cost=cost.get, budget=30)
        assert _drain(reads, 12) == items  # in order
        assert reads.peak_reserved == 30  # 3 pieces of 10 at a time, though 8 threads were free
        assert reads.file_hashes() == ["a", "b"] and sorted(hashed) == files  # each file hashed once
        cost[5] = 100  # larger than the budget: it runs, alone
        reads = ReadAhead(pool, 8, items, lambda i: i, None, files, None, cost=cost.get, budget=30)
        assert _drain(reads, 12) == items and reads.peak_reserved == 100
        # Without a byte budget, the count: 2 threads being made + 2 results being written.
        reads = ReadAhead(pool, 2, items, lambda i: i, None, files, None, cost=lambda i: 1)
        assert _drain(reads, 12) == items and reads.peak_reserved == 4
