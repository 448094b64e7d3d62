"""``dayzero check``: validate a checkpoint before converting it (or a converted one).

For a source (an HF directory, sharded or not; a PyTorch ``.bin/.pt/.pth`` beside its
config.json; a ``.gguf`` file), each file gets:

- its sha256, compared with ``--sha256-file`` when given (``sha256sum`` lines ``<hex>  <name>``,
  or a dayzero checkpoint directory / manifest.json, whose manifest records the sha256 of the
  source files it was converted from); without a list the hashes are only reported;
- for weight files, the converter's own reader: for safetensors the header is JSON, every
  tensor's byte span equals dtype size * shape and ends inside the file, and the safetensors
  library's validation rejects overlapping or gapped offsets; for PyTorch a ``weights_only``
  load of a flat state dict; for GGUF the header and every tensor's data inside the file;
- a NaN/Inf scan of every tensor, streamed one tensor at a time (GGUF tensors dequantized).

Then SRC is opened as ``dayzero convert`` opens it, its config parsed (GGUF: from the metadata),
and its tensor names and shapes compared with the converter's name map for that config:
missing, unexpected and wrong-shape tensors are all listed, not just the first.

A converted dayzero directory (one with a manifest.json) is checked against its manifest instead:
every stored tensor's checksum, shape and dtype (``dayzero.convert.verify_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dayzero.convert import verify_checkpoint
from dayzero.convert.checkpoint import MANIFEST, file_sha256, read_manifest
from dayzero.convert.convert import STORAGE_DTYPES, fixed_dtypes
from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map import source_tensors, with_kept_mtp
from dayzero.convert.readers import GGUFTensorReader, SafetensorsReader, TorchReader
from dayzero.convert.sources import TORCH_SUFFIXES, open_source
from dayzero.model.config import ConfigError
from dayzero.model.hf_config import parse_hf_config

SCAN_BLOCK = 1 << 26  # elements per isfinite pass: bounds the boolean temporary to 64 MB
_SHA_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")  # sha256sum: text mode "  ", binary " *"


class CheckError(ValueError):
    """Bad input to ``dayzero check`` itself (SRC missing, unreadable sha256 list)."""


@dataclasses.dataclass
class FileResult:
    """What was found about one file."""

    name: str
    bytes: int
    sha256: str
    expected_sha256: str | None = None
    tensors: int | None = None  # tensors scanned (None: not a weight file)
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong with the file."""
        return not self.problems


@dataclasses.dataclass
class CheckReport:
    """Everything ``dayzero check`` found; ``to_json()`` is what ``--json`` prints."""

    src: str
    kind: str
    files: list[FileResult]
    structure: dict[str, Any]  # the tensor plan (source) or manifest check (converted)
    problems: list[str]  # problems not tied to one file (listed files missing, plan, config)
    total_bytes: int

    @property
    def all_problems(self) -> list[str]:
        """Every problem, file problems prefixed with the file name."""
        return [f"{f.name}: {p}" for f in self.files for p in f.problems] + self.problems

    @property
    def passed(self) -> bool:
        """True when no problem was found."""
        return not self.all_problems

    def to_json(self) -> dict[str, Any]:
        """One JSON-serialisable object."""
        return {
            "src": self.src, "kind": self.kind,
            "files": [{**dataclasses.asdict(f), "ok": f.ok} for f in self.files],
            "structure": self.structure, "problems": self.all_problems,
            "total_bytes": self.total_bytes, "passed": self.passed,
        }


# --- sha256 lists ----------------------------------------------------------------------------------


def read_sha256_list(path: str | Path) -> dict[str, str]:
    """``{file name: sha256}`` from ``sha256sum`` output, or from a dayzero checkpoint's manifest.

    A dayzero checkpoint directory or its manifest.json gives the hashes of the source files it
    was converted from, so a source can be checked against an earlier conversion of it.
    """
    path = Path(path)
    if path.is_dir() or path.name == MANIFEST:
        try:
            manifest = read_manifest(path if path.is_dir() else path.parent)
        except ConvertError as e:
            raise CheckError(f"--sha256-file {path}: {e}") from None
        return {f["name"]: f["sha256"] for f in manifest["source"]["files"]}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckError(f"cannot read --sha256-file {path} ({e}); pass a file of '<sha256>  <name>' lines") from None
    hashes = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _SHA_LINE.match(line.strip())
        if match is None:
            raise CheckError(f"line {number} of {path} is not '<64 hex digits>  <file name>': {line.strip()[:80]!r}")
        hashes[Path(match.group(2)).as_posix().removeprefix("./")] = match.group(1).lower()
    return hashes


# --- one file ----------------------------------------------------------------------------------------


def open_weight_file(path: Path) -> Any:
    """The converter's reader for one weight file (raises :class:`ConvertError` if unreadable)."""
    if path.suffix == ".safetensors":
        return SafetensorsReader(path)
    if path.suffix == ".gguf":
        return GGUFTensorReader(path)
    return TorchReader(path)


def scan_tensors(reader: Any) -> tuple[int, list[str]]:
    """Read every tensor once, one at a time; return (count, problems for tensors with NaN/Inf)."""
    problems = []
    names = reader.keys()
    for name in names:
        try:
            x = reader.get(name)
        except ConvertError as e:
            problems.append(str(e))
            continue
        flat = x.reshape(-1)
        bad = sum(int(np.count_nonzero(~np.isfinite(flat[i:i + SCAN_BLOCK]))) for i in range(0, flat.size, SCAN_BLOCK))
        if bad:
            problems.append(f"tensor '{name}' has {bad} NaN/Inf value{'s' if bad > 1 else ''}")
        del x, flat  # one tensor at a time: let it go before reading the next
    return len(names), problems


def check_file(path: Path, name: str, expected: str | None, weights: bool) -> FileResult:
    """sha256 (against ``expected`` if given); for a weight file also its structure and values."""
    digest = file_sha256(path)
    result = FileResult(name, path.stat().st_size, digest, expected)
    if expected is not None and expected != digest:
        result.problems.append(f"sha256 is {digest}, the list says {expected}")
    if weights:
        try:
            result.tensors, found = scan_tensors(open_weight_file(path))
            result.problems += found
        except ConvertError as e:
            result.tensors = 0
            result.problems.append(str(e))
    return result


# --- the tensor plan -------------------------------------------------------------------------------


def _is_floating(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype in STORAGE_DTYPES.values()


def _dtype_accepted(source_dtype: np.dtype, fixed: np.dtype | None) -> bool:
    """As the converter decides: an integer leaf (a token table) takes integer tensors, every
    other leaf floating-point ones."""
    if fixed is not None and fixed.kind in "iu":
        return source_dtype.kind in "iu"
    return _is_floating(source_dtype)


def check_plan(source: Any) -> tuple[dict[str, Any], list[str]]:
    """Compare an opened source's tensors with the converter's name map for its config."""
    try:
        config = with_kept_mtp(parse_hf_config(source.hf_config), source.reader.keys())
        name_map = source.name_map(config)
    except (ConfigError, ConvertError) as e:
        return {"config": None}, [f"config: {e}"]
    reader = source.reader
    names = set(reader.keys())
    # The layout the checkpoint has (per-expert or fused MoE tensors), as the converter picks it.
    pairs = source_tensors(name_map.layout_for(names, reader.shape))
    wanted = {name for name, _ in pairs}
    present = [(name, r) for name, r in pairs if name in names]
    missing = [name for name, _ in pairs if name not in names]
    unexpected = sorted(n for n in names - wanted if not name_map.is_ignored(n))
    # Deliberately not converted (e.g. DeepSeek-V3's MTP modules): said, not hidden. DeepSeek-V4's
    # are converted and kept, so they count among the expected tensors.
    ignored = sorted(n for n in names - wanted if name_map.is_ignored(n))
    mtp = config.mtp_layers if any(r.target.startswith("mtp/") for _, r in pairs) else 0
    wrong_shape = [
        f"tensor '{name}' has shape {list(reader.shape(name))}, expected {list(r.source_shape)}"
        for name, r in present if tuple(reader.shape(name)) != r.source_shape
    ]
    fixed = fixed_dtypes(config)
    not_float = [f"tensor '{name}' has dtype {reader.dtype(name)}, which conversion does not accept"
                 for name, r in present if not _dtype_accepted(np.dtype(reader.dtype(name)), fixed.get(r.target))]
    label = f"{config.family.value}, {config.num_layers} layers" + (f" + {mtp} MTP kept" if mtp else "")
    info = {"config": label, "expected": len(wanted),
            "present": len(names), "missing": missing, "unexpected": unexpected, "ignored": ignored,
            "wrong_shape": wrong_shape, "not_float": not_float}
    problems = ([f"missing tensor '{n}'" for n in missing] + [f"unexpected tensor '{n}'" for n in unexpected]
                + wrong_shape + not_float)
    return info, problems


# --- whole checkpoints ------------------------------------------------------------------------------


def _candidate_files(src: Path) -> tuple[Path, list[Path]]:
    """(base directory, files to hash): a directory's top-level files, or a file (+ config.json)."""
    if src.is_dir():
        return src, sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
    files = [src]
    if src.suffix in TORCH_SUFFIXES and (src.parent / "config.json").is_file():
        files.append(src.parent / "config.json")
    return src.parent, files


def _open(src: Path, files: list[Path]) -> tuple[Any, set[Path], str | None]:
    """(source or None, the weight files, why it would not open) -- as ``dayzero convert`` opens it."""
    try:
        source = open_source(src)
        return source, {Path(p).resolve() for p in source.reader.files}, None
    except ConvertError as e:
        # Scan every likely weight file instead, so a corrupt one is named in its own row.
        guess = {p.resolve() for p in files if p.suffix in (".safetensors", ".gguf")
                 or (p.suffix in TORCH_SUFFIXES and (p == src or p.name.startswith("pytorch_model")))}
        return None, guess, str(e)


def _with_listed(src: Path, base: Path, files: list[Path], hashes: dict[str, str] | None,
                 sha_file: str | None) -> tuple[list[Path], list[str]]:
    """Add files a sha256 list names inside a directory SRC; report listed files that are missing.

    For a single-file SRC the list may cover other files too (a whole repository's list): only
    the entries for SRC's own files matter then.
    """
    if hashes is None or not src.is_dir():
        return files, []
    have = {p.relative_to(base).as_posix() for p in files}
    extra = [base / name for name in sorted(set(hashes) - have) if (base / name).is_file()]
    missing = [f"{name} is listed in {sha_file} but missing" for name in sorted(set(hashes) - have)
               if not (base / name).is_file()]
    return files + extra, missing


def _check_files(base: Path, files: list[Path], weights: set[Path], hashes: dict[str, str] | None,
                 sha_file: str | None) -> list[FileResult]:
    results = []
    for path in files:
        name = path.relative_to(base).as_posix()
        is_weights = path.resolve() in weights
        result = check_file(path, name, (hashes or {}).get(name), is_weights)
        if hashes is not None and name not in hashes and is_weights:
            # The point of a list is to vouch for the weights; an unlisted weight file is unvouched.
            result.problems.append(f"weight file has no sha256 in {sha_file}")
        results.append(result)
    return results


def check_source(src: Path, hashes: dict[str, str] | None = None, sha_file: str | None = None) -> CheckReport:
    """Check a source checkpoint (see the module docstring)."""
    base, files = _candidate_files(src)
    source, weights, open_error = _open(src, files)
    files, problems = _with_listed(src, base, files, hashes, sha_file)
    results = _check_files(base, files, weights, hashes, sha_file)
    if source is not None:
        structure, plan_problems = check_plan(source)
        problems += plan_problems
    elif all(r.ok for r in results):
        structure = {"error": open_error}
        problems.append(open_error)
    else:
        structure = {"error": "not checked: a weight file is unreadable"}
    kind = source.format if source is not None else "unreadable"
    return CheckReport(str(src), kind, results, structure, problems, sum(r.bytes for r in results))


def check_converted(dst: Path, hashes: dict[str, str] | None = None, sha_file: str | None = None) -> CheckReport:
    """Check a converted dayzero directory against its manifest."""
    base, files = _candidate_files(dst)
    files, problems = _with_listed(dst, base, files, hashes, sha_file)
    results = _check_files(base, files, set(), hashes, sha_file)
    try:
        structure: dict[str, Any] = {"tensors_verified": verify_checkpoint(dst)}
    except ConvertError as e:
        structure = {"error": str(e)}
        problems.append(str(e))
    total = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    return CheckReport(str(dst), "dayzero", results, structure, problems, total)


def check(src: str | Path, sha256_file: str | Path | None = None) -> CheckReport:
    """Check SRC: a source checkpoint, or a converted dayzero directory (it has a manifest.json)."""
    src = Path(src)
    if not src.exists():
        raise CheckError(f"{src} does not exist; pass an HF model directory, a .bin/.pt/.pth, a .gguf file "
                         "or a converted dayzero directory")
    hashes = None if sha256_file is None else read_sha256_list(sha256_file)
    label = None if sha256_file is None else str(sha256_file)
    if src.is_dir() and (src / MANIFEST).is_file():
        return check_converted(src, hashes, label)
    return check_source(src, hashes, label)


# --- output ---------------------------------------------------------------------------------------------


def human_size(n: int) -> str:
    """Bytes in B/KB/MB/GB/TB (powers of 1024)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def _structure_line(report: CheckReport) -> str:
    s = report.structure
    if "error" in s:
        if s["error"].startswith("not checked"):
            return f"  SKIP  structure: {s['error']}"
        what = "manifest: the stored tensors" if report.kind == "dayzero" else "structure: SRC"
        return f"  FAIL  {what} cannot be read as 'dayzero convert' would (see below)"
    if "tensors_verified" in s:
        return f"  OK    manifest: {s['tensors_verified']} stored tensors match their checksums"
    if s.get("config") is None:
        return "  FAIL  structure: the config cannot be parsed (see below)"
    bad = s["missing"] or s["unexpected"] or s["wrong_shape"] or s["not_float"]
    verdict = "FAIL" if bad else "OK  "
    counts = (f"{len(s['missing'])} missing, {len(s['unexpected'])} unexpected, "
              f"{len(s['wrong_shape'])} wrong shape, {len(s['not_float'])} not floating point, "
              f"{len(s['ignored'])} ignored (not converted)")
    return f"  {verdict}  tensors ({s['config']}): {s['expected']} expected, {s['present']} present; {counts}"


def format_report(report: CheckReport) -> str:
    """Per-file verdicts (OK / FAIL: reason), the structure verdict, every problem and a summary."""
    lines = [f"dayzero check: {report.src} ({report.kind})"]
    for f in report.files:
        what = f"{f.tensors} tensors scanned, " if f.tensors is not None else ""
        lines.append(f"  {'OK  ' if f.ok else 'FAIL'}  {f.name} ({human_size(f.bytes)}, {what}sha256 {f.sha256})")
        lines += [f"          FAIL: {p}" for p in f.problems]
    lines.append(_structure_line(report))
    lines += [f"          FAIL: {p}" for p in report.problems]
    scanned = sum(f.tensors or 0 for f in report.files) + report.structure.get("tensors_verified", 0)
    count = len(report.all_problems)
    verdict = "OK" if report.passed else f"FAIL ({count} problem{'s' if count > 1 else ''})"
    lines.append(f"summary: {len(report.files)} files, {human_size(report.total_bytes)}, "
                 f"{scanned} tensors checked: {verdict}")
    return "\n".join(lines)


def run_check(args: Any) -> int:
    """``dayzero check`` with parsed arguments: 0 when all is well, 1 (first problem on stderr) if not."""
    report = check(args.src, args.sha256_file)
    print(json.dumps(report.to_json()) if args.json else format_report(report))
    if not report.passed:
        problems = report.all_problems
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"dayzero check: FAIL: {problems[0]}{more}", file=sys.stderr)
        return 1
    return 0
