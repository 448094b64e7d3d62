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

One checkpoint per layer is what keeps conversion streaming (one layer's arrays in memory at a
time) and lets a loader restore group by group.

Converted for a mesh (``convert --mesh``), each leaf is written as a ``jax.Array`` laid out by
the mesh's rules: its zarr chunks are the per-device shards (split further down to
``CHUNK_BYTES``), each process writes the shards it holds, and the manifest records the mesh,
the rules and every leaf's partition spec. Without a mesh, arrays are written whole from the
host. Either way the loader restores every leaf straight into whatever sharding the loading run
asks for: chunks are a storage layout, not a constraint on the reader.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any, Iterator

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
    # Viewed as raw bytes: the buffer protocol does not know ml_dtypes' bfloat16.
    return hashlib.sha256(np.ascontiguousarray(x).reshape(-1).view(np.uint8)).hexdigest()


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


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them in its arenas otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class GroupWriter:
    """Saves one group at a time with Orbax, synchronously, holding no copy of it.

    Orbax's default (``StandardCheckpointer``) deep-copies host arrays before its asynchronous
    write and, with OCDBT, buffers the encoded data until commit: together about three times a
    group. We write the same PyTree format (``StandardCheckpointer`` restores it) with a
    synchronous ``Checkpointer``, no deep copy (nothing mutates the arrays while we wait), plain
    zarr instead of OCDBT, and bounded chunks -- the peak stays near one group.
    """

    def __init__(self, root: Path):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import type_handlers

        self._ocp = ocp
        self.root = root / "weights"
        if is_primary_process():  # in a multi-process run, one process makes the directories
            self.root.mkdir(parents=True, exist_ok=True)  # exists when resuming
        barrier("dayzero-convert-weights-dir")
        registry = type_handlers.create_type_handler_registry(
            (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
            (jax.Array, type_handlers.ArrayHandler()),
        )
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=registry)
        self._ckpt = ocp.Checkpointer(handler)

    def save(self, group: str, arrays: dict[tuple[str, ...], np.ndarray], shardings: dict | None = None) -> None:
        """Write ``arrays`` (keyed by their path inside the group) as ``weights/<group>``.

        With ``shardings`` (same keys), each array is first laid out as a global ``jax.Array``
        with that sharding (every process passes the same host values and keeps its own
        shards), so Orbax writes one set of chunks per shard.
        """
        if shardings is not None:
            arrays = {k: _global_array(v, shardings[k]) for k, v in arrays.items()}
        tree = nest(arrays)
        save_args = jax.tree.map(lambda _: self._ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree)
        notice = _DropOcdbtMergeNotice()
        logging.getLogger("absl").addFilter(notice)
        try:
            self._ckpt.save(self.root / group, args=self._ocp.args.PyTreeSave(tree, save_args=save_args))
        finally:
            logging.getLogger("absl").removeFilter(notice)
        _release_freed_memory()

    def close(self) -> None:
        """Release Orbax's resources."""
        self._ckpt.close()


def _global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


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
    dtypes; ``dtype`` applies to the others.
    """
    root = Path(dst)
    manifest = read_manifest(root)
    config = read_config(root)
    specs = abstract_weights(config, stored_quantization(manifest))
    groups = _checked_groups(root, manifest, specs)
    if shardings is None:
        shardings = _on_one_device(specs)
    targets = named_leaves(shape_structs(specs, dtype, shardings))
    arrays: dict[str, Any] = {}
    for _, restored in _restore_groups(root, groups, targets):
        arrays.update(restored)
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return config, jax.tree.unflatten(treedef, [arrays[leaf_path(path)] for path, _ in flat])


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
