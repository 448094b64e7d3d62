"""The streaming conversion loop: source checkpoint -> dayzero checkpoint directory.

Target-driven: for each group (globals, then one per layer), for each leaf, read its source
tensor (or, for stacked experts, each of its source tensors in turn), check its shape before
touching the values, transform, cast to the storage dtype, check it is finite, write it into
the group's checkpoint and drop it. Peak memory follows the largest tensor, not a group: by
default about twice it (a tensor read and its transformed copy), or ``max_memory``, for which a
stack of experts too large is made and written a slice of experts at a time.

With ``quantize``, each projection the scheme quantizes is stored as ``<leaf>/values`` and
``<leaf>/scale`` (``dayzero.convert.quantize``) and the scheme is recorded in the manifest.

Everything is written into ``DST.partial`` next to DST and renamed into place only after the
manifest (written last) is on disk. Each completed group is recorded there, so a conversion that
is interrupted, killed or fails midway (a full disk) continues with ``resume``
(``dayzero.convert.staging``); a bad input (:class:`ConvertError`) removes the staging directory.

The leaves are read, transformed and hashed by a pool of ``threads`` threads, as many at a
time as the memory budget allows, and the source files' sha256 runs in that pool too
(``dayzero.convert.parallel``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from dayzero.convert.checkpoint import (
    GroupWriter, Rows, array_sha256, dayzero_version, file_sha256, update_sha256, write_manifest,
)
from dayzero.convert.errors import ConvertError
from dayzero.convert.quantize import quant_config, quantized_leaf, quantized_nodes
from dayzero.convert.name_map import (
    Combine, Recipe, check_shape, check_targets, group_of, key_in_group, plan, source_tensors, with_kept_mtp,
)
from dayzero.convert.parallel import Piece, ReadAhead, parse_memory, schedule, stored_names
from dayzero.convert.sources import Source, open_source
from dayzero.convert.tokenizer_export import copy_preprocessor_config, image_config_in
from dayzero.convert.staging import (
    LOCK, PROGRESS, Staging, create, file_stamps, keep_verified, kill_point, open_existing, partial_dir, refusal,
)
from dayzero.model.config import ConfigError, ModelConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import QuantConfig, QuantizedArray
from dayzero.model.weights import abstract_weights, named_leaves
from dayzero.sharding.distributed import barrier, is_primary_process

STORAGE_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
_HALF = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def storage_dtype(requested: str | None, source: Source, recipes: tuple[Recipe, ...],
                  fixed: dict[str, np.dtype] | None = None) -> np.dtype:
    """The one dtype every leaf is stored in, except the leaves of ``fixed`` (:func:`fixed_dtypes`).

    ``None`` keeps the source's precision without loss: a checkpoint that is all bfloat16 (or all
    float16) stays so; GGUF (dequantized), float32 and mixed sources are stored as float32. Only
    the leaves stored in it decide (not, e.g., a float32 sink beside bfloat16 weights).
    """
    if requested is not None:
        if requested not in STORAGE_DTYPES:
            raise ConvertError(f"dtype {requested!r} is not supported; choose one of {', '.join(STORAGE_DTYPES)}")
        return STORAGE_DTYPES[requested]
    fixed = fixed or {}
    dtypes = {np.dtype(source.reader.dtype(name)) for name, r in source_tensors(recipes) if r.target not in fixed}
    if len(dtypes) == 1 and dtypes <= set(_HALF):
        return dtypes.pop()
    return STORAGE_DTYPES["float32"]


def fixed_dtypes(config: ModelConfig) -> dict[str, np.dtype]:
    """``{leaf: dtype}`` of the leaves whose spec fixes their dtype whatever the storage dtype:
    float32 attention sinks, position biases and hyper-connection mixes, DeepSeek-V4's int32
    token -> experts tables. They are stored in that dtype, so the checkpoint keeps what the model
    reads (``load_checkpoint`` restores them in it)."""
    specs = named_leaves(abstract_weights(config))
    return {name: np.dtype(s.dtype) for name, s in specs.items() if s.dtype is not None}


def _is_integer(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "iu"


def _check_floating(source: Source, recipes: tuple[Recipe, ...], fixed: dict[str, np.dtype] | None = None) -> None:
    """Every source tensor is floating point, except that an integer leaf (a token table) needs an
    integer one."""
    fixed = fixed or {}
    for name, r in source_tensors(recipes):
        dtype = np.dtype(source.reader.dtype(name))
        if r.target in fixed and _is_integer(fixed[r.target]):
            if not _is_integer(dtype):
                raise ConvertError(f"tensor '{name}' in {source.path} has dtype {dtype}; {r.target} is a table of "
                                   "integer ids, so the checkpoint does not match its config")
        elif dtype.kind != "f" and dtype not in _HALF:
            raise ConvertError(
                f"tensor '{name}' in {source.path} has dtype {dtype}; quantized or integer weights "
                "are not supported, convert an unquantized checkpoint"
            )


def _read_part(recipe: Recipe, name: str, source: Source, storage: np.dtype) -> np.ndarray:
    """Read, check and transform one source tensor of a recipe, cast to ``storage`` (an integer
    dtype only for integer tables, whose values must fit it)."""
    where = str(source.path)
    x = source.reader.get(name)
    check_shape(recipe, name, x.shape, where)
    if _is_integer(storage):
        info = np.iinfo(storage)
        if x.size and (x.min() < info.min or x.max() > info.max):
            raise ConvertError(f"tensor '{name}' in {where} holds values outside {storage}; the checkpoint cannot "
                               "be used as is")
        return np.ascontiguousarray(recipe.apply(x), dtype=storage)
    with np.errstate(over="ignore"):  # an overflowing cast is reported just below, by name
        y = np.ascontiguousarray(recipe.apply(x), dtype=storage)
    if not _all_finite(y):
        cause = "overflows " + str(storage) if _all_finite(x) else "contains NaN or Inf values"
        raise ConvertError(f"tensor '{name}' in {where} {cause}; the checkpoint cannot be used as is")
    return y


def _all_finite(x: np.ndarray, block: int = 1 << 22) -> bool:
    """``np.isfinite(x).all()`` a block at a time: no boolean mask as large as the tensor."""
    flat = x.reshape(-1)
    return all(bool(np.isfinite(flat[i:i + block]).all()) for i in range(0, flat.size, block))


def _make_leaf(recipe: Recipe, source: Source, storage: np.dtype, expected: tuple[int, ...]) -> np.ndarray:
    """Read, check, transform and cast one leaf.

    A stacked leaf is filled one source tensor at a time, so peak memory is the leaf plus one
    expert, not the leaf twice.
    """
    if recipe.combine is Combine.ONLY:
        y = _read_part(recipe, recipe.source, source, storage)
        if y.shape != expected:
            raise AssertionError(f"recipe for {recipe.target} produced {y.shape}, the weight tree needs {expected}")
        return y
    if len(recipe.sources) != expected[0]:
        raise AssertionError(f"recipe for {recipe.target} stacks {len(recipe.sources)} tensors into {expected}")
    y = np.empty(expected, storage)
    for i, name in enumerate(recipe.sources):
        part = _read_part(recipe, name, source, storage)
        if part.shape != expected[1:]:
            raise AssertionError(f"recipe for {recipe.target} made a {part.shape} part of {expected}")
        y[i] = part
    return y


def _groups(recipes: tuple[Recipe, ...]) -> dict[str, list[Recipe]]:
    groups: dict[str, list[Recipe]] = {}
    for r in recipes:
        groups.setdefault(group_of(r.target), []).append(r)
    return dict(sorted(groups.items(), key=lambda kv: kv[0] != "globals"))


def _stored_arrays(r: Recipe, source: Source, storage: np.dtype, shape: tuple[int, ...],
                   node: QuantizedArray | None) -> tuple[dict[str, np.ndarray], str | None]:
    """``({suffix: array}, how)`` for one leaf: ``{"": leaf}`` unquantized (how None), else its
    values and scale (how as ``quantized_leaf`` says)."""
    if node is None:
        return {"": _make_leaf(r, source, storage, shape)}, None
    # Quantized leaves are read in float32 so that only the quantization rounds them.
    return quantized_leaf(r, source, node, shape, lambda: _make_leaf(r, source, np.dtype(np.float32), shape))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything decided before the first tensor is read."""

    config: ModelConfig
    recipes: tuple[Recipe, ...]
    storage: np.dtype
    quant: QuantConfig
    placement: Any
    fixed: dict[str, np.dtype] = dataclasses.field(default_factory=dict)  # leaves stored in their own dtype
    pieces: tuple[Any, ...] = ()  # what the read pool makes, in order (``convert.parallel.schedule``)
    budget: int | None = None  # bytes the pieces being made and written may hold at once

    def options(self, source: Source) -> dict[str, Any]:
        """The options that shape the output (a resume must match them all)."""
        mesh = None if self.placement is None else {"mesh": self.placement.axes, "rules": self.placement.rules.name}
        return {"source": str(source.path.resolve()), "source_config": self.config.to_json(),
                "dtype": str(self.storage), "quantize": self.quant.weights.value, "mesh": mesh,
                "dayzero_version": dayzero_version()}


def _plan(source: Source, dtype: str | None, quantize: str | None, placement: Any,
          max_memory: int | None = None) -> _Plan:
    where = str(source.path)
    try:
        config = with_kept_mtp(parse_hf_config(source.hf_config), source.reader.keys())
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from e
    image_config_in(source.tokenizer_dir, config)  # a bad preprocessor config is refused before anything is written
    name_map = source.name_map(config)
    for layout in (name_map.recipes, *name_map.alternatives):
        check_targets(layout, config)
    recipes = plan(name_map, source.reader.keys(), source.reader.shape, where)
    fixed = fixed_dtypes(config)
    _check_floating(source, recipes, fixed)
    storage = storage_dtype(dtype, source, recipes, fixed)
    quant = quant_config(quantize, source, config, recipes)
    if placement is not None:
        _check_layout(config, placement)
    p = _Plan(config, recipes, storage, quant, placement, fixed)
    pieces, budget = schedule(recipes, source.reader, _stored(p), set(quantized_nodes(config, quant)), max_memory)
    return dataclasses.replace(p, pieces=tuple(pieces), budget=budget)


def _stored(p: _Plan) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of every array the checkpoint stores (a quantized leaf's values
    and scale apart)."""
    specs = named_leaves(abstract_weights(p.config, p.quant))
    return {n: (s.shape, p.storage if s.dtype is None else np.dtype(s.dtype)) for n, s in specs.items()}


def _make_piece(piece: Piece, source: Source, p: _Plan, shape: tuple[int, ...], node: QuantizedArray | None,
                shardings: dict | None) -> list[tuple[str, np.ndarray, dict[str, Any]]]:
    """``[(name, array, manifest entry)]`` of one piece: read, transform, cast and, for a whole
    leaf, hash (a pool task). A slice of experts is made as a leaf of those experts alone (each
    expert is transformed and quantized on its own, so the slices make up the whole leaf)."""
    r = piece.recipe
    made = r if piece.stop is None else dataclasses.replace(r, sources=piece.sources())
    if piece.stop is not None:
        shape = (piece.stop - piece.start, *shape[1:])
    parts, how = _stored_arrays(made, source, p.fixed.get(r.target, p.storage), shape, node)
    out = []
    for suffix, y in parts.items():
        name = f"{r.target}/{suffix}" if suffix else r.target
        whole = list(y.shape) if piece.stop is None else [len(r.sources), *y.shape[1:]]
        entry = {"group": group_of(r.target), "shape": whole, "dtype": str(y.dtype),
                 "sha256": array_sha256(y) if piece.stop is None else None,
                 "source": r.source if len(r.sources) == 1 else list(r.sources)}
        if how:
            entry["quantized"] = how
        if shardings is not None:
            entry["spec"] = list(shardings[name].spec)
        out.append((name, y, entry))
    return out


def _source_bytes(source: Source, members: list[Recipe]) -> int:
    reader = source.reader
    return sum(math.prod(reader.shape(n)) * np.dtype(reader.dtype(n)).itemsize for n, _ in source_tensors(members))


def _files_of(source: Source) -> Any:
    """``source tensor names -> [files they are read from]``, or None when the reader cannot tell."""
    file_of = getattr(source.reader, "file_of", None)
    if file_of is None:
        return None
    return lambda names: sorted({file_of(n) for n in names})


def _group_files(source: Source, members: list[Recipe], stamps: dict[str, list[int]]) -> dict[str, list[int]]:
    """Stamps of the source files a group reads (all of them when the reader cannot tell)."""
    files_of = _files_of(source)
    if files_of is None:
        return stamps
    return {str(f): stamps[str(f)] for f in files_of([n for r in members for n in r.sources])}


def _group_pieces(reads: ReadAhead, writer: GroupWriter, pieces: list[Piece], entries: dict[str, Any],
                  bar: Any) -> Iterator[Rows]:
    """The writer's pieces of one group, in order, filling ``entries`` (manifest entries by name).

    A sliced leaf's sha256 is fed slice by slice, in order, while each slice is written. A
    result is released to the read pool once the writer has written all of it (the writer
    finishes its write first when the pool has no room for the next piece before that); this
    generator drops its own references to it before asking for the next."""
    hashes: dict[str, Any] = {}
    for piece in pieces:
        index, made = reads.take(writer.flush)
        for n, (name, y, entry) in enumerate(made):
            key = key_in_group(name)
            written = functools.partial(reads.release, index) if n == len(made) - 1 else None
            if piece.stop is None:
                entries[name] = entry
                yield Rows(key, 0, y, written=written)
                continue
            if name not in hashes:
                hashes[name], entries[name] = hashlib.sha256(), entry
            elif entry.get("quantized") != entries[name].get("quantized"):
                raise ConvertError(
                    f"the experts of {piece.recipe.target} are not all stored alike ({entries[name]['quantized']} "
                    f"and {entry['quantized']}), so they cannot be converted in slices; pass a larger --max-memory")
            yield Rows(key, piece.start, y, functools.partial(update_sha256, hashes[name], y), written)
            if piece.last:
                entries[name]["sha256"] = hashes.pop(name).hexdigest()
        del made, y, entry
        if piece.last:
            bar.update()


def _write_weights(staging: Staging, source: Source, p: _Plan, pool: ThreadPoolExecutor, threads: int,
                   progress: bool, stats: dict[str, Any]) -> list[str]:
    """Stream every group not yet recorded in ``staging`` into its ``weights/``, recording each;
    return the source files' sha256 (process 0; empty elsewhere).

    The pieces (leaves, or slices of experts) are made by the pool within the memory budget
    (see ``convert.parallel``) and written one at a time as they come (``GroupWriter``); each
    group is recorded once all of it is on disk. With a ``placement`` each leaf is written laid
    out for its mesh (see ``convert.checkpoint``).
    """
    specs = named_leaves(abstract_weights(p.config))
    stored = _stored(p)
    nodes = quantized_nodes(p.config, p.quant)
    shardings = (None if p.placement is None
                 else named_leaves(p.placement.shardings(abstract_weights(p.config, p.quant))))
    stamps = file_stamps(source.reader.files)
    todo = {g: m for g, m in _groups(p.recipes).items() if g not in staging.groups}
    by_group: dict[str, list[Piece]] = {}
    for piece in p.pieces:
        by_group.setdefault(group_of(piece.recipe.target), []).append(piece)
    files_of = _files_of(source)

    def make(piece: Piece) -> list[tuple[str, np.ndarray, dict[str, Any]]]:
        return _make_piece(piece, source, p, specs[piece.recipe.target].shape, nodes.get(piece.recipe.target),
                           shardings)

    primary = is_primary_process()
    reads = ReadAhead(pool, threads, [pc for g in todo for pc in by_group[g]], make,
                      None if files_of is None else lambda pc: files_of(pc.sources()), source.reader.files,
                      file_sha256 if primary else None, cost=lambda pc: pc.cost,
                      held=lambda made: sum(y.nbytes for _, y, _ in made), budget=p.budget)
    writer = GroupWriter(staging.root)
    bar = tqdm(total=sum(len(m) for m in todo.values()), unit="tensor", file=sys.stderr, disable=not progress,
               desc="converting")
    try:
        for group, members in todo.items():
            names = [n for r in members for n in stored_names(r, r.target in nodes)]
            leaves = {key_in_group(n): stored[n] for n in names}
            layout = None if shardings is None else {key_in_group(n): shardings[n] for n in names}
            entries: dict[str, Any] = {}
            writer.save(group, leaves, _group_pieces(reads, writer, by_group[group], entries, bar), layout)
            if primary:
                if kill_point(len(staging.groups)):
                    os.kill(os.getpid(), signal.SIGKILL)
                staging.record(group, {n: entries[n] for n in names}, _group_files(source, members, stamps))
            stats["bytes_read"] += _source_bytes(source, members)
            bar.set_postfix_str(f"{group} {_rate(stats):.1f} MB/s")
        stats["peak_reserved"] = reads.peak_reserved
        return reads.file_hashes() if primary else []
    finally:
        bar.close()
        writer.close()


def _rate(stats: dict[str, Any]) -> float:
    return stats["bytes_read"] / 1e6 / max(time.perf_counter() - stats["_start"], 1e-9)


def _write_metadata(root: Path, source: Source, p: _Plan) -> list[str]:
    """The files around the weights (written again on resume: they are cheap and deterministic)."""
    (root / "config.json").write_text(json.dumps(p.config.to_json(), indent=1))
    (root / "hf_config.json").write_text(json.dumps(source.hf_config, indent=1))
    return source.export_tokenizer(root) + copy_preprocessor_config(source.tokenizer_dir, root, p.config)


def _convert_into(staging: Staging, source: Source, p: _Plan, progress: bool, threads: int,
                  stats: dict[str, Any]) -> None:
    # In a multi-process run every process reads the source and holds its own shards, but the
    # files around the weights are written by process 0 alone.
    primary = is_primary_process()
    tokenizer_files = _write_metadata(staging.root, source, p) if primary else []
    barrier("dayzero-convert-start")
    with ThreadPoolExecutor(threads, thread_name_prefix="dayzero-convert") as pool:
        try:
            hashes = _write_weights(staging, source, p, pool, threads, progress and primary, stats)
            files = [{"name": f.name, "bytes": f.stat().st_size, "sha256": h}
                     for f, h in zip(source.reader.files, hashes)]
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    if not primary:
        return
    layout = {} if p.placement is None else {"mesh": p.placement.axes, "rules": p.placement.rules.name}
    order = list(_groups(p.recipes))
    write_manifest(staging.root, {
        **layout,
        "dtype": str(p.storage),
        "quantization": p.quant.to_json(),
        "source": {"format": source.format, "path": str(source.path), "files": files},
        "config": p.config.to_json(),
        "tokenizer_files": tokenizer_files,
        "groups": sorted(order),
        "tensors": staging.entries(order),
    })


def _move_into_place(staging: Staging, dst: Path) -> None:
    """Rename the finished staging directory to DST (atomic on one file system), holding its
    lock until it is there: a run that looks at ``DST.partial`` meanwhile finds it locked, or gone."""
    appeared = ConvertError(f"destination {dst} appeared during conversion; remove it and convert again")
    if dst.exists():
        raise appeared
    tmp = staging.root
    for scratch in (PROGRESS, PROGRESS + ".new"):  # the staging's own files are no part of the checkpoint
        (tmp / scratch).unlink(missing_ok=True)
    try:
        os.rename(tmp, dst)
    except OSError:
        # Another process (e.g. a concurrent first-use conversion) won the race to DST.
        if dst.exists():
            raise appeared from None
        raise
    (dst / LOCK).unlink(missing_ok=True)
    staging.unlock()


def _check_layout(config: ModelConfig, placement: Any) -> None:
    ep = placement.axes["expert"]
    if ep > 1 and (config.moe is None or config.moe.num_experts % ep):
        experts = "no experts" if config.moe is None else f"{config.moe.num_experts} experts"
        raise ConvertError(f"--mesh expert={ep} cannot lay out a model with {experts}; use a mesh that fits it")


def _open_staging(partial: Path, source: Source, options: dict[str, Any], resume: bool,
                  progress: bool) -> Staging:
    """This run's staging: the interrupted one, checked and trimmed to its intact groups, when
    resuming; else a new, empty one (process 0 makes it; the others only name it)."""
    if not is_primary_process():
        return Staging(partial, options)
    if resume and partial.exists():
        staging = open_existing(partial, options)
        if staging is not None:
            dropped = keep_verified(staging, file_stamps(source.reader.files))
            if progress:
                redo = f", redoing {len(dropped)} that no longer match ({', '.join(dropped)})" if dropped else ""
                print(f"dayzero: resuming {partial}: {len(staging.groups)} groups kept{redo}", file=sys.stderr)
            return staging
    return create(partial, options)


def default_threads() -> int:
    """Read threads when none are asked for: one per core, at most 8 (reads are I/O and hashing)."""
    return max(1, min(8, os.cpu_count() or 1))


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, dtype: str | None = None,
                       progress: bool = True, quantize: str | None = None, placement: Any = None,
                       resume: bool = False, threads: int | None = None,
                       stats: dict[str, Any] | None = None, max_memory: int | str | None = None) -> Path:
    """Convert a source checkpoint into a new dayzero checkpoint directory; return its path.

    ``src``: an HF model directory (config.json + safetensors or pytorch_model.bin, sharded or
    not), a PyTorch state-dict file (.bin/.pt/.pth, with config.json beside it) or a .gguf file.
    ``dst``: a directory that must not exist yet. ``dtype``: storage dtype, one of "float32",
    "bfloat16", "float16", or None to keep the source precision (see :func:`storage_dtype`).
    ``progress``: show a progress bar on stderr. ``quantize``: weight quantization, one of
    none, int8, fp8, fp8-block, int4, int4-all, mxfp4, mxfp4+fp8-block (``dayzero.model.quant.WeightQuant``);
    None keeps an MXFP4 checkpoint's experts as stored (and DeepSeek-V4's FP8 weights beside
    them: mxfp4+fp8-block) and is none otherwise, while none always makes a float model
    (``dayzero.convert.quantize.quant_config``); dtype then applies to the leaves left in float.
    ``placement`` (a ``dayzero.sharding.placement.Placement``): write the arrays laid out for its mesh (any mesh,
    or one device, can still load them). ``resume``: continue the interrupted conversion staged
    in ``DST.partial`` (see :mod:`dayzero.convert.staging`); without it such a directory is an
    error. ``threads``: how many source tensors are read, transformed and hashed at once
    (default :func:`default_threads`). ``max_memory`` (bytes, or a size such as "8GiB"): what the
    tensors being read, transformed and written may hold at once; a stack of experts that needs
    more is made and written a slice of experts at a time (the checkpoint is the same). By
    default it is what the largest leaf needs, about twice the largest tensor. ``stats``: if
    given, filled with ``bytes_read``, ``seconds``, ``mb_per_s``, ``threads``, ``memory_budget``,
    ``pieces`` (leaves and slices of experts made), ``peak_reserved`` (the most bytes the read pool
    reserved at once), ``groups_converted`` and ``groups_kept``.
    Raises :class:`ConvertError` for any problem with the inputs, leaving nothing behind; a run
    interrupted, killed or failing otherwise (a full disk) after its first group keeps
    ``DST.partial`` for ``resume``.
    """
    src, dst = Path(src), Path(dst)
    max_memory = parse_memory(max_memory)
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise ConvertError(f"{threads} read threads is not a positive number; pass --threads 1 or more")
    if dst.exists():
        raise ConvertError(f"destination {dst} already exists; choose a new directory or remove it first")
    partial = partial_dir(dst)
    if partial.exists() and not resume:
        raise refusal(partial)
    if resume and jax.process_count() > 1:
        raise ConvertError("--resume works in a single-process conversion only; run it without --num-processes")
    barrier("dayzero-convert-looked")  # every process has looked before process 0 makes the staging
    source = open_source(src)
    p = _plan(source, dtype, quantize, placement, max_memory)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = _open_staging(partial, source, p.options(source), resume, progress)
    stats = {} if stats is None else stats
    kept = len(staging.groups)
    stats.update(bytes_read=0, threads=threads, memory_budget=p.budget, pieces=len(p.pieces), groups_kept=kept,
                 _start=time.perf_counter())
    try:
        _convert_into(staging, source, p, progress, threads, stats)
        if is_primary_process():
            _move_into_place(staging, dst)
    except BaseException as e:
        if is_primary_process():
            # A crash, a full disk or an interrupt keeps what is done for --resume; a bad input
            # (ConvertError) needs another source, so nothing is kept (removed under the lock).
            if staging.groups and not isinstance(e, ConvertError) and partial.exists():
                again = ("run again with --resume to continue, or delete " if jax.process_count() == 1
                         else "--resume runs in one process: delete ")
                print(f"dayzero: {len(staging.groups)} converted groups are kept in {partial}; {again}{partial}",
                      file=sys.stderr)
            else:
                shutil.rmtree(partial, ignore_errors=True)
            staging.unlock()
        raise
    barrier("dayzero-convert-done")  # no process reports success before DST is in place
    seconds = time.perf_counter() - stats.pop("_start")
    stats.update(seconds=seconds, mb_per_s=stats["bytes_read"] / 1e6 / max(seconds, 1e-9),
                 groups_converted=len(_groups(p.recipes)) - kept)
    return dst
