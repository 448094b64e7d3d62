"""The staging directory of a conversion, ``DST.partial``, and resuming from it.

A conversion writes into ``DST.partial`` (a fixed name, so a later run finds it) and renames it
to DST when complete. Beside the weights it keeps ``progress.json``: the options that shape the
output and, for every group written so far, its manifest entries (per-tensor sha256) and the
size and mtime of the source files it was read from. The record is replaced atomically after
each group is on disk, so it never names a group that is not.

``dayzero convert --resume`` reopens the record, refuses if an option differs, and keeps a
recorded group only if its source files are unchanged and its arrays read back from disk with
the recorded checksums; every other group, and anything on disk the record does not name (a
group interrupted mid-write), is removed and converted again. A plain run that finds
``DST.partial`` refuses and says how to continue or discard it.

``fcntl.flock`` on ``DST.partial/.lock`` marks a live conversion: the kernel drops the lock when
its process dies, however it dies, so a lock that can be taken means the writer is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from dayzero.convert.checkpoint import array_sha256, read_group
from dayzero.convert.errors import ConvertError

PROGRESS = "progress.json"
LOCK = ".lock"
# Test-only: after this many groups are recorded, the next group is saved and the process then
# SIGKILLs itself before recording it (a deterministic "killed mid-conversion" for the tests).
KILL_AFTER_ENV = "DAYZERO_TEST_CONVERT_KILL_AFTER_GROUPS"

# The options that shape the output, in the order a mismatch is reported, with the name the
# user knows them by.
OPTION_NAMES = {
    "source": "source", "source_config": "source config.json", "dtype": "--dtype",
    "quantize": "--quantize", "mesh": "--mesh", "dayzero_version": "dayzero version",
}


def partial_dir(dst: Path) -> Path:
    """Where a conversion to ``dst`` stages its output: ``DST.partial`` beside it."""
    return dst.parent / f"{dst.name}.partial"


def busy(dst: Path) -> bool:
    """True while a live process converts into ``dst`` (holds its staging lock)."""
    return _locked(partial_dir(dst) / LOCK)


def refusal(partial: Path) -> ConvertError:
    """The error of a plain run that finds ``partial``: another run is writing it, or one was interrupted."""
    if _locked(partial / LOCK):
        return _busy(partial)
    return ConvertError(
        f"{partial} holds an interrupted conversion to this destination; run again with --resume to "
        f"continue it, or delete {partial} to start over"
    )


def _busy(partial: Path) -> ConvertError:
    return ConvertError(f"another dayzero convert is writing {partial} right now; wait for it to finish or stop it")


def _locked(path: Path) -> bool:
    """True when a live process holds the staging lock at ``path``."""
    try:
        with open(path) as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file: nobody holds it
        pass
    return False


def file_stamps(paths: list[Path]) -> dict[str, list[int]]:
    """``{path: [size, mtime_ns]}``: what a resume compares to tell a source file is unchanged."""
    stamps = {}
    for p in paths:
        st = os.stat(p)
        stamps[str(p)] = [st.st_size, st.st_mtime_ns]
    return stamps


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON to ``path`` so that a reader sees the old file or the new one, never a mix."""
    tmp = path.with_name(path.name + ".new")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Staging:
    """An open ``DST.partial``: its lock, its options and the groups recorded as complete."""

    def __init__(self, root: Path, options: dict[str, Any], groups: dict[str, Any] | None = None):
        self.root = root
        self.options = options
        self.groups: dict[str, Any] = groups or {}
        self._lock = None

    def lock(self) -> None:
        """Take the staging lock, or raise if a live conversion holds it (or the directory has
        just been renamed into place or removed by the conversion that held it)."""
        try:
            self._lock = open(self.root / LOCK, "a")
        except FileNotFoundError:
            raise ConvertError(f"{self.root} disappeared while this run looked at it (another conversion "
                               "finished or discarded it); run again") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise _busy(self.root) from None

    def unlock(self) -> None:
        """Release the lock (the directory may then be renamed or removed)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def save(self) -> None:
        """Replace the progress record atomically."""
        write_json_atomic(self.root / PROGRESS, {"options": self.options, "groups": self.groups})

    def record(self, group: str, entries: dict[str, Any], files: dict[str, list[int]]) -> None:
        """Note ``group`` as complete (its arrays are on disk) in the progress record."""
        self.groups[group] = {"tensors": entries, "files": files}
        self.save()

    def entries(self, order: list[str]) -> dict[str, Any]:
        """Every recorded tensor entry, groups in ``order`` (the same manifest however many runs made it)."""
        out: dict[str, Any] = {}
        for group in order:
            out.update(self.groups[group]["tensors"])
        return out


def create(partial: Path, options: dict[str, Any]) -> Staging:
    """A new, empty staging at ``partial``, made atomically: built, locked and recorded under a
    temporary name, then renamed, so another run finds either nothing or a locked directory with
    its record (never one it could take for an abandoned staging and remove)."""
    tmp = partial.with_name(f"{partial.name}.new-{os.getpid()}")
    tmp.mkdir()
    staging = Staging(tmp, options)
    staging.lock()
    staging.save()
    try:
        os.rename(tmp, partial)  # fails if a concurrent run's staging is there (a non-empty directory)
    except OSError:
        staging.unlock()
        shutil.rmtree(tmp, ignore_errors=True)
        raise refusal(partial) from None
    staging.root = partial
    return staging


def kill_point(done: int) -> bool:
    """True when the test-only hook asks to die after ``done`` recorded groups."""
    value = os.environ.get(KILL_AFTER_ENV)
    return value is not None and done == int(value)


def open_existing(partial: Path, options: dict[str, Any]) -> Staging | None:
    """The staging left by an interrupted run, locked, checked against this run's ``options``.

    None when it recorded nothing (killed before its first record): it is removed, nothing is lost.
    """
    staging = Staging(partial, options)
    staging.lock()
    try:
        record = json.loads((partial / PROGRESS).read_text())
        recorded = record["options"]
        groups = record["groups"]
    except (OSError, ValueError, KeyError, TypeError):
        staging.unlock()
        shutil.rmtree(partial)
        return None
    options = json.loads(json.dumps(options))  # as it reads back from the record (lists, not tuples)
    for key, label in OPTION_NAMES.items():
        old, new = recorded.get(key), options.get(key)
        if old != new:
            staging.unlock()
            where, old, new = _first_difference(old, new)
            raise ConvertError(
                f"{partial} was converted with {label}{where} {_show(old)}, this run has {_show(new)}; "
                f"rerun with the same {label}, or delete {partial} to start over"
            )
    staging.groups = groups
    return staging


def _first_difference(old: Any, new: Any) -> tuple[str, Any, Any]:
    """``(" [key]", old value, new value)`` of the first differing key of two dicts, else the values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return f" [{key}]", old.get(key), new.get(key)
    return "", old, new


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return "none" if value is None else str(value)


def keep_verified(staging: Staging, stamps_now: dict[str, list[int]]) -> list[str]:
    """Keep only the recorded groups that are intact; remove everything else under ``weights/``.

    A group is intact when the source files it read are unchanged and every array reads back
    from disk with the dtype, shape and sha256 recorded for it. Returns the groups dropped.
    """
    weights = staging.root / "weights"
    dropped = []
    for group, record in list(staging.groups.items()):
        if not _intact(weights, group, record, stamps_now):
            dropped.append(group)
            del staging.groups[group]
    if weights.is_dir():
        for entry in weights.iterdir():
            if entry.name not in staging.groups:  # dropped, or interrupted mid-write
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    staging.save()
    return dropped


def _intact(weights: Path, group: str, record: dict[str, Any], stamps_now: dict[str, list[int]]) -> bool:
    if any(stamps_now.get(path) != stamp for path, stamp in record["files"].items()):
        return False
    try:
        arrays = read_group(weights / group, record["tensors"])
    except ConvertError:
        return False
    for leaf, entry in record["tensors"].items():
        x = np.asarray(arrays[leaf])
        if str(x.dtype) != entry["dtype"] or list(x.shape) != entry["shape"] or array_sha256(x) != entry["sha256"]:
            return False
    return True
