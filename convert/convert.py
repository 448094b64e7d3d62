"""The streaming conversion loop: source checkpoint -> dayzero checkpoint directory.

Target-driven: for each group (globals, then one per layer), for each leaf, read its source
tensor (or, for stacked experts, each of its source tensors in turn), check its shape before
touching the values, transform, cast to the storage dtype, check it is finite, and add it to the
group; save the group with Orbax and drop it. Peak memory is about the largest group plus the
largest source tensor, never the whole model.

With ``quantize``, each projection the scheme quantizes is stored as ``<leaf>/values`` and
``<leaf>/scale`` (``dayzero.convert.quantize``) and the scheme is recorded in the manifest.

Everything is written into ``DST.tmp-<random>`` next to DST and renamed into place only after
the manifest (written last) is on disk; any error or interrupt removes the temporary directory.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from dayzero.convert.checkpoint import GroupWriter, array_sha256, file_sha256, write_manifest
from dayzero.convert.errors import ConvertError
from dayzero.convert.quantize import quant_config, quantized_leaf
from dayzero.convert.name_map import (
    Combine, Recipe, check_shape, check_targets, group_of, key_in_group, plan, source_tensors,
)
from dayzero.convert.sources import Source, open_source
from dayzero.model.config import ConfigError, ModelConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import QuantConfig, QuantizedArray
from dayzero.model.weights import abstract_weights, is_spec_node, leaf_path, named_leaves
from dayzero.sharding.distributed import barrier, is_primary_process, shared_token

STORAGE_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
_HALF = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def storage_dtype(requested: str | None, source: Source, recipes: tuple[Recipe, ...]) -> np.dtype:
    """The one dtype every leaf is stored in.

    ``None`` keeps the source's precision without loss: a checkpoint that is all bfloat16 (or all
    float16) stays so; GGUF (dequantized), float32 and mixed sources are stored as float32.
    """
    if requested is not None:
        if requested not in STORAGE_DTYPES:
            raise ConvertError(f"dtype {requested!r} is not supported; choose one of {', '.join(STORAGE_DTYPES)}")
        return STORAGE_DTYPES[requested]
    dtypes = {np.dtype(source.reader.dtype(name)) for name, _ in source_tensors(recipes)}
    if len(dtypes) == 1 and dtypes <= set(_HALF):
        return dtypes.pop()
    return STORAGE_DTYPES["float32"]


def _check_floating(source: Source, recipes: tuple[Recipe, ...]) -> None:
    for name, _ in source_tensors(recipes):
        dtype = np.dtype(source.reader.dtype(name))
        if dtype.kind != "f" and dtype not in _HALF:
            raise ConvertError(
                f"tensor '{name}' in {source.path} has dtype {dtype}; quantized or integer weights "
                "are not supported, convert an unquantized checkpoint"
            )


def _read_part(recipe: Recipe, name: str, source: Source, storage: np.dtype) -> np.ndarray:
    """Read, check and transform one source tensor of a recipe, cast to ``storage``."""
    where = str(source.path)
    x = source.reader.get(name)
    check_shape(recipe, name, x.shape, where)
    with np.errstate(over="ignore"):  # an overflowing cast is reported just below, by name
        y = np.ascontiguousarray(recipe.apply(x), dtype=storage)
    if not np.isfinite(y).all():
        cause = "overflows " + str(storage) if np.isfinite(x).all() else "contains NaN or Inf values"
        raise ConvertError(f"tensor '{name}' in {where} {cause}; the checkpoint cannot be used as is")
    return y


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


def _quantized_nodes(config: ModelConfig, quant: QuantConfig) -> dict[str, QuantizedArray]:
    """``{leaf path: quantized spec node}`` of the leaves ``quant`` quantizes."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract_weights(config, quant), is_leaf=is_spec_node)
    return {leaf_path(path): node for path, node in flat if isinstance(node, QuantizedArray)}


def _stored_arrays(r: Recipe, source: Source, storage: np.dtype, shape: tuple[int, ...],
                   node: QuantizedArray | None) -> tuple[dict[str, np.ndarray], str | None]:
    """``({suffix: array}, how)`` for one leaf: ``{"": leaf}`` unquantized (how None), else its
    values and scale (how as ``quantized_leaf`` says)."""
    if node is None:
        return {"": _make_leaf(r, source, storage, shape)}, None
    # Quantized leaves are read in float32 so that only the quantization rounds them.
    return quantized_leaf(r, source, node, shape, lambda: _make_leaf(r, source, np.dtype(np.float32), shape))


def _write_weights(tmp: Path, source: Source, config: ModelConfig, recipes: tuple[Recipe, ...],
                   storage: np.dtype, progress: bool, quant: QuantConfig, placement: Any) -> dict[str, Any]:
    """Stream every group into ``tmp/weights``; return the per-leaf manifest entries.

    With a ``placement`` each leaf is written laid out for its mesh (see ``convert.checkpoint``).
    """
    specs = named_leaves(abstract_weights(config))
    nodes = _quantized_nodes(config, quant)
    shardings = None if placement is None else named_leaves(placement.shardings(abstract_weights(config, quant)))
    entries: dict[str, Any] = {}
    writer = GroupWriter(tmp)
    bar = tqdm(total=len(recipes), unit="tensor", file=sys.stderr, disable=not progress, desc="converting")
    try:
        for group, members in _groups(recipes).items():
            bar.set_postfix_str(group)
            arrays, layout = {}, {}
            for r in members:
                parts, how = _stored_arrays(r, source, storage, specs[r.target].shape, nodes.get(r.target))
                for suffix, y in parts.items():
                    name = f"{r.target}/{suffix}" if suffix else r.target
                    arrays[key_in_group(name)] = y
                    entries[name] = {"group": group, "shape": list(y.shape), "dtype": str(y.dtype),
                                     "sha256": array_sha256(y),
                                     "source": r.source if len(r.sources) == 1 else list(r.sources)}
                    if how:
                        entries[name]["quantized"] = how
                    if shardings is not None:
                        layout[key_in_group(name)] = shardings[name]
                        entries[name]["spec"] = list(shardings[name].spec)
                bar.update()
            writer.save(group, arrays, layout if shardings is not None else None)
            del arrays, parts, y  # the group is on disk; let it go before reading the next one
    finally:
        bar.close()
        writer.close()
    return entries


def _convert_into(tmp: Path, source: Source, dtype: str | None, progress: bool, quantize: str | None,
                  placement: Any) -> None:
    where = str(source.path)
    try:
        config = parse_hf_config(source.hf_config)
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from e
    name_map = source.name_map(config)
    for layout in (name_map.recipes, *name_map.alternatives):
        check_targets(layout, config)
    recipes = plan(name_map, source.reader.keys(), source.reader.shape, where)
    _check_floating(source, recipes)
    storage = storage_dtype(dtype, source, recipes)
    quant = quant_config(quantize, source)
    if placement is not None:
        _check_layout(config, placement)
    # In a multi-process run every process reads the source and holds its own shards, but the
    # files around the weights are written by process 0 alone.
    primary = is_primary_process()
    if primary:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(config.to_json(), indent=1))
        (tmp / "hf_config.json").write_text(json.dumps(source.hf_config, indent=1))
    tokenizer_files = source.export_tokenizer(tmp) if primary else []
    barrier("dayzero-convert-start")
    entries = _write_weights(tmp, source, config, recipes, storage, progress and primary, quant, placement)
    if not primary:
        return
    layout = {} if placement is None else {"mesh": placement.axes, "rules": placement.rules.name}
    write_manifest(tmp, {
        **layout,
        "dtype": str(storage),
        "quantization": quant.to_json(),
        "source": {
            "format": source.format,
            "path": str(source.path),
            "files": [{"name": p.name, "bytes": p.stat().st_size, "sha256": file_sha256(p)}
                      for p in source.reader.files],
        },
        "config": config.to_json(),
        "tokenizer_files": tokenizer_files,
        "groups": sorted({e["group"] for e in entries.values()}),
        "tensors": entries,
    })


def _move_into_place(tmp: Path, dst: Path) -> None:
    """Rename the finished temporary directory to DST (atomic on one file system)."""
    appeared = ConvertError(f"destination {dst} appeared during conversion; remove it and convert again")
    if dst.exists():
        raise appeared
    try:
        os.rename(tmp, dst)
    except OSError:
        # Another process (e.g. a concurrent first-use conversion) won the race to DST.
        if dst.exists():
            raise appeared from None
        raise


def _check_layout(config: ModelConfig, placement: Any) -> None:
    ep = placement.axes["expert"]
    if ep > 1 and (config.moe is None or config.moe.num_experts % ep):
        experts = "no experts" if config.moe is None else f"{config.moe.num_experts} experts"
        raise ConvertError(f"--mesh expert={ep} cannot lay out a model with {experts}; use a mesh that fits it")


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, dtype: str | None = None,
                       progress: bool = True, quantize: str | None = None, placement: Any = None) -> Path:
    """Convert a source checkpoint into a new dayzero checkpoint directory; return its path.

    ``src``: an HF model directory (config.json + safetensors or pytorch_model.bin, sharded or
    not), a PyTorch state-dict file (.bin/.pt/.pth, with config.json beside it) or a .gguf file.
    ``dst``: a directory that must not exist yet. ``dtype``: storage dtype, one of "float32",
    "bfloat16", "float16", or None to keep the source precision (see :func:`storage_dtype`).
    ``progress``: show a progress bar on stderr. ``quantize``: weight quantization, one of
    none, int8, fp8, fp8-block, int4 (``dayzero.model.quant.WeightQuant``; None: none); dtype
    then applies to the leaves left in float. ``placement`` (a
    ``dayzero.sharding.placement.Placement``): write the arrays laid out for its mesh (any mesh,
    or one device, can still load them). Raises :class:`ConvertError` (leaving no DST behind)
    for any problem with the inputs.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise ConvertError(f"destination {dst} already exists; choose a new directory or remove it first")
    source = open_source(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f"{dst.name}.tmp-{shared_token(secrets.token_hex(4))}"
    try:
        _convert_into(tmp, source, dtype, progress, quantize, placement)
        if is_primary_process():
            _move_into_place(tmp, dst)
    except BaseException:
        if is_primary_process():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier("dayzero-convert-done")  # no process reports success before DST is in place
    return dst
