"""The converted checkpoint on disk: Orbax groups, manifest, loading and verification.

Layout of a converted checkpoint ``DST``::

    config.json           dayzero's parsed ModelConfig (ModelConfig.to_json())
    hf_config.json        the source config dict as given (built from metadata for GGUF)
    tokenizer.json ...    tokenizer and generation files carried over from the source
    weights/globals/      Orbax StandardCheckpointer: embed, final_norm, lm_head (untied only)
    weights/layer_000/    one Orbax checkpoint per decoder layer, keys as in LayerWeights
    ...
    manifest.json         written last: versions, source files with sha256, per-leaf checksums,
                          the weight quantization ("quantization", see QuantConfig)

A quantized leaf is stored as two arrays, ``attn/q/values`` and ``attn/q/scale``, as the
quantized abstract tree (``abstract_weights(config, stored_quantization(manifest))``) declares.

One checkpoint per layer lets a loader restore group by group and a conversion resume group by
group; the converter fills each one piece by piece (:class:`GroupWriter`), so its memory follows
the largest tensor, not the group.

Converted for a mesh (``convert --mesh``), each leaf is laid out by the mesh's rules: its zarr
chunks are the per-device shards (split further down to ``CHUNK_BYTES``), each process writes the
shards it holds, and the manifest records the mesh, the rules and every leaf's partition spec.
Either way the loader restores every leaf straight into whatever sharding the loading run asks
for: chunks are a storage layout, not a constraint on the reader.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map import group_of, key_in_group
from dayzero.model.config import ModelConfig
from dayzero.model.quant import QuantConfig
from dayzero.model.weights import Weights, abstract_weights, is_spec, leaf_path, named_leaves, shape_structs
from dayzero.sharding.distributed import barrier, is_primary_process

FORMAT = "dayzero-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def dayzero_version() -> str:
    """The installed dayzero version (recorded in every manifest)."""
    try:
        return importlib.metadata.version("dayzero")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def array_sha256(x: np.ndarray) -> str:
    """sha256 of an array's bytes in C order (its stored representation)."""
    return hashlib.sha256(_raw_bytes(x)).hexdigest()


def update_sha256(h: Any, x: np.ndarray) -> None:
    """Feed an array's bytes in C order to a running sha256 ``h``: slices along axis 0 fed in
    order hash as the whole array does (:func:`array_sha256`)."""
    h.update(_raw_bytes(x))


def _raw_bytes(x: np.ndarray) -> np.ndarray:
    # Viewed as raw bytes: the buffer protocol does not know ml_dtypes' bfloat16.
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in chunks so memory stays flat."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def nest(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """``{("attn", "q"): x}`` -> ``{"attn": {"q": x}}`` (Orbax trees are nested dicts)."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _lookup(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


# Chunks of at most this many bytes: tensorstore encodes and writes one chunk at a time, so
# its buffers stay small instead of one compressed copy of each whole array.
CHUNK_BYTES = 16 * 2**20


class _DropOcdbtMergeNotice(logging.Filter):
    """Orbax logs a warning per save that it found no OCDBT data to merge; we use none on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT" not in record.getMessage()


def _glibc() -> Any:
    """glibc, or None (another C library: the calls below are glibc's)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them in its arenas otherwise)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _map_large_allocations(during: bool) -> None:
    """While converting, every allocation of 1 MiB or more is its own mapping, returned to the
    OS when freed. glibc would otherwise raise its threshold to 32 MiB after the first large
    free and serve source tensors, transformed copies and tensorstore's chunk buffers from
    per-thread arenas that keep their pages (malloc_trim gives back only part): measured,
    60-130 MB above the tensors themselves. Afterwards the threshold is set where glibc's own
    adjustment settles in a process that frees large arrays (its 64-bit ceiling, 32 MiB,
    trimming at twice that), since the adjustment cannot be turned back on."""
    libc = _glibc()
    if libc is None:
        return
    if during:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 << 20)
    else:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)


@dataclasses.dataclass
class Rows:
    """Rows ``[start, start + len(values))`` (along axis 0) of one array of a group, keyed by its
    path inside the group; ``while_writing`` runs while they are written (an in-order hash),
    ``written`` once they are on disk (and this writer holds them no more)."""

    key: tuple[str, ...]
    start: int
    values: np.ndarray
    while_writing: Callable[[], None] | None = None
    written: Callable[[], None] | None = None


# Chunks tensorstore encodes at once: each holds up to CHUNK_BYTES raw and as much encoded, so
# this bounds the writer's own buffers (cores alone would make them grow with the machine).
ENCODE_CONCURRENCY = 2


class GroupWriter:
    """Writes one group at a time, one piece of one array at a time, holding no copy of it.

    Orbax writes the group's checkpoint -- its tree (``_METADATA``) and each array's zarr
    metadata (format, compressor, fill value) -- from one-element placeholders; each array is
    then made at its real shape with the same metadata and filled in place through
    tensorstore, piece by piece. So the loop drops a leaf (or a slice of experts) as soon as it
    is on disk, and memory follows the largest piece, not the group. The result is the PyTree
    format Orbax's ``StandardCheckpointer`` restores: plain zarr (no OCDBT), every chunk stored
    (zeros too, as Orbax does), chunks of at most ``CHUNK_BYTES``.

    Laid out for a mesh (``shardings``), each array's chunks are its per-device shards (split
    further down to ``CHUNK_BYTES``) and each process writes the distinct shards its devices
    hold; without one, process 0 writes everything (every process has the same values).
    """

    def __init__(self, root: Path):
        import orbax.checkpoint as ocp
        import tensorstore as ts
        from orbax.checkpoint import type_handlers

        self._ocp, self._ts = ocp, ts
        self.root = root / "weights"
        if is_primary_process():  # in a multi-process run, one process makes the directories
            self.root.mkdir(parents=True, exist_ok=True)  # exists when resuming
        barrier("dayzero-convert-weights-dir")
        registry = type_handlers.create_type_handler_registry(
            (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        )
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=registry)
        self._ckpt = ocp.Checkpointer(handler)
        self._context = ts.Context({"data_copy_concurrency": {"limit": ENCODE_CONCURRENCY}})
        self._pending: tuple[list[Any], Rows] | None = None  # the piece being written
        _map_large_allocations(True)

    def save(self, group: str, leaves: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]],
             pieces: Iterable[Rows], shardings: dict | None = None) -> None:
        """Write ``weights/<group>``: its arrays (``{key: (shape, dtype)}``, keyed by their path
        inside the group) filled from ``pieces``, which together cover every row of each.

        A piece is still being written while the next one is asked for and started; then it is
        waited for, dropped and reported ``written`` (see :meth:`flush`): at most two are held
        here at once. ``shardings`` (same keys): lay each array out for its mesh.
        """
        directory = self.root / group
        self._save_placeholders(directory, leaves)
        arrays = self._make_arrays(directory, leaves, shardings or {})
        try:
            for piece in pieces:
                writes = self._start(*arrays[piece.key], piece)
                self.flush()
                self._pending = (writes, piece)
                del piece, writes
            self.flush()
        except BaseException:
            self._abandon()
            raise
        barrier(f"dayzero-convert-wrote-{group}")  # every process's shards are on disk

    def flush(self) -> None:
        """Wait for the piece being written, drop it and report it ``written`` (if there is one)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(*pending)

    def _abandon(self) -> None:
        """After a failure: let the write in flight end (nothing then writes into a staging
        directory that may be removed next); it is not reported written."""
        pending, self._pending = self._pending, None
        for w in pending[0] if pending is not None else ():
            try:
                w.result()
            except Exception:  # noqa: BLE001 - the failure being raised is the one to report
                pass

    def _save_placeholders(self, directory: Path, leaves: dict) -> None:
        tree = nest({key: np.zeros((1,) * len(shape), dtype) for key, (shape, dtype) in leaves.items()})
        notice = _DropOcdbtMergeNotice()
        logging.getLogger("absl").addFilter(notice)
        try:
            self._ckpt.save(directory, args=self._ocp.args.PyTreeSave(tree))
        finally:
            logging.getLogger("absl").removeFilter(notice)

    def _spec(self, directory: Path, key: tuple[str, ...]) -> dict[str, Any]:
        """The tensorstore spec of an array of the group, as Orbax writes and reads it."""
        return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(directory / ".".join(key))},
                "store_data_equal_to_fill_value": True}  # Orbax's reads want every chunk present

    def _make_arrays(self, directory: Path, leaves: dict, shardings: dict) -> dict[tuple[str, ...], tuple]:
        """``{key: (array, regions this process writes)}``: each placeholder remade at its shape."""
        for key, (shape, dtype) in leaves.items():
            if is_primary_process():
                spec = self._spec(directory, key)
                tiny = self._ts.open(spec, open=True, context=self._context).result()
                sharding = shardings.get(key)
                shard = tuple(shape) if sharding is None else sharding.shard_shape(tuple(shape))
                metadata = {**tiny.spec().to_json()["metadata"], "shape": list(shape),
                            "chunks": list(shard_chunks(shard, np.dtype(dtype).itemsize))}
                self._ts.open({**spec, "metadata": metadata}, create=True, delete_existing=True,
                              context=self._context).result()
        barrier(f"dayzero-convert-arrays-{directory.name}")
        arrays = {}
        for key, (shape, dtype) in leaves.items():
            store = self._ts.open(self._spec(directory, key), open=True, context=self._context).result()
            if tuple(store.shape) != tuple(shape) or store.dtype.numpy_dtype != np.dtype(dtype):
                raise AssertionError(f"{directory.name}/{'.'.join(key)} is {store.shape} {store.dtype}, "
                                     f"not {shape} {dtype}")
            arrays[key] = (store, _regions(tuple(shape), shardings.get(key)))
        return arrays

    @staticmethod
    def _start(store: Any, regions: list[tuple[slice, ...]], piece: Rows) -> list[Any]:
        """Start writing ``piece`` (and run its ``while_writing``); return the writes to wait for."""
        values = piece.values
        if values.dtype != store.dtype.numpy_dtype:  # tensorstore would cast, and the checksum would lie
            raise AssertionError(f"a {values.dtype} piece of {'.'.join(piece.key)} for a {store.dtype} array")
        if values.ndim == 0:
            writes = [store.write(values)] if regions else []
        else:
            rows = slice(piece.start, piece.start + values.shape[0])
            writes = []
            for region in regions:
                lo, hi = max(rows.start, region[0].start), min(rows.stop, region[0].stop)
                if lo < hi:
                    target = (slice(lo, hi), *region[1:])
                    part = values[(slice(lo - rows.start, hi - rows.start), *region[1:])]
                    # The values stay alive until the write is done: tensorstore need not copy them.
                    writes.append(store[target].write(part, can_reference_source_data_indefinitely=True))
        if piece.while_writing is not None:
            piece.while_writing()
        return writes

    @staticmethod
    def _finish(writes: list[Any], piece: Rows) -> None:
        """Wait for ``piece``'s writes, drop it and report it written."""
        for w in writes:
            w.result()
        written, piece.values, piece.while_writing = piece.written, None, None
        del piece
        _release_freed_memory()  # tensorstore's encoding buffers, freed into per-thread arenas
        if written is not None:
            written()

    def close(self) -> None:
        """Release Orbax's resources."""
        self._ckpt.close()
        _map_large_allocations(False)


def _regions(shape: tuple[int, ...], sharding: Any) -> list[tuple[slice, ...]]:
    """The parts of an array this process writes: all of it on process 0 without a sharding;
    with one, each distinct shard once, by the first device (in id order) that holds it, when
    that device is this process's."""
    if sharding is None:
        return [tuple(slice(0, n) for n in shape)] if is_primary_process() else []
    seen, mine = set(), []
    for device, index in sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id):
        region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        bounds = tuple((s.start, s.stop) for s in region)
        if bounds not in seen:
            seen.add(bounds)
            if device.process_index == jax.process_index():
                mine.append(region)
    return mine


def shard_chunks(shard: tuple[int, ...], itemsize: int, limit: int = CHUNK_BYTES) -> tuple[int, ...]:
    """A chunk shape that tiles ``shard`` exactly and holds at most ``limit`` bytes where it can.

    Axes are cut in order, the leading one first, each by the largest divisor of its length
    that fits: a slice of experts (or rows) then covers whole chunks, so writing it never reads
    back, merges and rewrites a chunk that spans the whole stack."""
    chunk = [max(1, n) for n in shard]
    for axis, n in enumerate(chunk):
        others = math.prod(chunk) // n * itemsize
        if n * others <= limit:
            break
        chunk[axis] = max((d for d in _divisors(n) if d * others <= limit), default=1)
    return tuple(chunk)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json``; its presence marks a complete checkpoint."""
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, "dayzero_version": dayzero_version(), **manifest}
    (root / MANIFEST).write_text(json.dumps(body, indent=1))


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a converted checkpoint, or a clear error if ``root`` is not one."""
    root = Path(root)
    if not root.is_dir():
        raise ConvertError(f"{root} is not a directory; pass a directory made by 'dayzero convert'")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        raise ConvertError(
            f"{root} has no {MANIFEST}, so it is not a complete dayzero checkpoint; convert the model again"
        ) from None
    except json.JSONDecodeError as e:
        raise ConvertError(f"{root / MANIFEST} is not valid JSON ({e}); convert the model again") from None
    if manifest.get("format") != FORMAT:
        raise ConvertError(f"{root} is not a dayzero checkpoint (manifest format {manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConvertError(
            f"{root} has checkpoint format version {manifest.get('format_version')}, this dayzero reads "
            f"{FORMAT_VERSION}; convert the model again"
        )
    return manifest


def stored_quantization(manifest: dict[str, Any]) -> QuantConfig:
    """How a checkpoint's weights are stored (none for checkpoints written before quantization)."""
    return QuantConfig.from_json(manifest.get("quantization"))


def read_config(root: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a converted checkpoint (read before its weights, e.g. to place them)."""
    root = Path(root)
    try:
        return ModelConfig.from_json(json.loads((root / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"{root / 'config.json'} is missing or unreadable ({e}); convert the model again") from None


def _checked_groups(root: Path, manifest: dict[str, Any], specs: Any) -> dict[str, dict[tuple[str, ...], str]]:
    """``{group: {key: leaf}}`` after checking the manifest against the config's weight tree."""
    declared = named_leaves(specs)
    tensors = manifest.get("tensors", {})
    if set(tensors) != set(declared):
        diff = sorted(set(tensors) ^ set(declared))
        raise ConvertError(f"{root} does not match its config (tensor '{diff[0]}' differs); convert the model again")
    groups: dict[str, dict[tuple[str, ...], str]] = {}
    for leaf, spec in declared.items():
        if tuple(tensors[leaf]["shape"]) != spec.shape:
            raise ConvertError(
                f"tensor '{leaf}' in {root} has shape {tensors[leaf]['shape']}, the config needs "
                f"{list(spec.shape)}; convert the model again"
            )
        groups.setdefault(group_of(leaf), {})[key_in_group(leaf)] = leaf
    for group in groups:
        if not (root / "weights" / group / "_CHECKPOINT_METADATA").is_file():
            raise ConvertError(f"{root} is incomplete: weights/{group} is missing; convert the model again")
    return groups


def _restore_groups(root: Path, groups: dict[str, dict[tuple[str, ...], str]],
                    targets: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Restore each group into its targets; yield ``(group, {leaf: array})``."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        for group, keys in groups.items():
            target = nest({key: targets[leaf] for key, leaf in keys.items()})
            try:
                restored = ckpt.restore(root / "weights" / group, target)
            except Exception as e:  # noqa: BLE001 - tensorstore/orbax raise many error types
                raise ConvertError(
                    f"cannot read weights/{group} of {root} ({str(e).splitlines()[0]}); it is corrupt, convert again"
                ) from None
            yield group, {leaf: _lookup(restored, key) for key, leaf in keys.items()}


def read_group(path: Path, entries: dict[str, Any]) -> dict[str, Any]:
    """The arrays of one saved group (``weights/<group>``), in their stored dtypes, on one device.

    ``entries``: ``{leaf: manifest entry}`` (its ``shape`` and ``dtype``) of the group's leaves.
    Raises :class:`ConvertError` if the group cannot be read.
    """
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    targets = {leaf: jax.ShapeDtypeStruct(tuple(e["shape"]), jnp.dtype(e["dtype"]), sharding=device)
               for leaf, e in entries.items()}
    groups = {path.name: {key_in_group(leaf): leaf for leaf in entries}}
    return dict(next(_restore_groups(path.parent.parent, groups, targets))[1])


def load_checkpoint(dst: str | Path, dtype: Any = jnp.float32, shardings: Any = None) -> tuple[ModelConfig, Weights]:
    """Load a converted checkpoint as ``(config, weights)``.

    Every leaf is restored by Orbax straight into ``dtype`` (the one conversion, done at load and
    never inside jit) and placed with ``shardings`` -- a pytree matching the weight tree with a
    ``jax.sharding.Sharding`` per leaf -- or on the default device when None. Quantized leaves
    (a checkpoint converted with ``--quantize``) come back as ``QuantizedArray`` in their stored
    dtypes; ``dtype`` applies to the others. A leaf group placed only on other processes' devices
    (``engine.staged_load``: another process's pipeline stage) is not read.
    """
    root = Path(dst)
    manifest = read_manifest(root)
    config = read_config(root)
    specs = abstract_weights(config, stored_quantization(manifest))
    groups = _checked_groups(root, manifest, specs)
    if shardings is None:
        shardings = _on_one_device(specs)
    targets = named_leaves(shape_structs(specs, dtype, shardings))
    # A group none of whose leaves this process holds a shard of (another process's pipeline
    # stage) is not read: its leaves are global arrays with no data here.
    remote = {g for g, keys in groups.items() if not any(_addressable(targets[leaf]) for leaf in keys.values())}
    arrays: dict[str, Any] = {leaf: jax.make_array_from_single_device_arrays(t.shape, t.sharding, [], dtype=t.dtype)
                              for g in remote for leaf in groups[g].values() for t in [targets[leaf]]}
    for _, restored in _restore_groups(root, {g: k for g, k in groups.items() if g not in remote}, targets):
        arrays.update(restored)
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return config, jax.tree.unflatten(treedef, [arrays[leaf_path(path)] for path, _ in flat])


def _addressable(target: jax.ShapeDtypeStruct) -> bool:
    """Whether this process holds a device of ``target``'s sharding."""
    return any(d.process_index == jax.process_index() for d in target.sharding.device_set)


def _on_one_device(specs: Any) -> Any:
    """A sharding tree placing every leaf whole on this process's first device."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: default, specs, is_leaf=is_spec)


def verify_checkpoint(dst: str | Path) -> int:
    """Recompute every leaf's checksum against the manifest; return the number of leaves checked.

    Raises :class:`ConvertError` naming the first tensor whose stored bytes, shape or dtype differ.
    """
    root = Path(dst)
    manifest = read_manifest(root)
    specs = abstract_weights(read_config(root), stored_quantization(manifest))
    groups = _checked_groups(root, manifest, specs)
    stored = jnp.dtype(manifest["dtype"])
    # Restore in the stored dtype so the bytes hashed are the bytes written; onto one device
    # explicitly, since a checkpoint written from a mesh records that mesh's topology.
    targets = named_leaves(shape_structs(specs, stored, _on_one_device(specs)))
    checked = 0
    for _, restored in _restore_groups(root, groups, targets):
        for leaf, value in restored.items():
            value = np.asarray(value)
            entry = manifest["tensors"][leaf]
            if str(value.dtype) != entry["dtype"] or array_sha256(value) != entry["sha256"]:
                raise ConvertError(f"tensor '{leaf}' in {root} does not match its manifest checksum; convert again")
            checked += 1
    return checked
