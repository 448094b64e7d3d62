"""Readers for source checkpoints, all behind one small interface.

A reader has ``keys()``, ``shape(name)``, ``dtype(name)`` and ``get(name) -> np.ndarray`` (and
the file readers ``file_of(name)``) and hands out one tensor at a time, so the streaming loop in
:mod:`dayzero.convert.convert` holds no more than the tensors it is working on. ``get`` may run in
several threads at once: each call reads on its own. ``shape`` is always in PyTorch layout ([out, in] for linear
weights) so one name map shape check serves every format.

Safetensors are read with our own header parse and ``np.fromfile`` rather than
``safe_open(framework="numpy")`` -- numpy's safetensors path rejects bfloat16, and the "pt" path
needs torch (not a dependency of dayzero) and an upcast. ``ml_dtypes.bfloat16`` (which JAX
already depends on) reads the bytes exactly. ``fromfile`` copies each tensor into private memory
that is freed with it; a memory map kept open for the whole file would leave every page read
resident in the process until the end. ``safe_open`` still validates each file when opened.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import mmap
import re
from pathlib import Path
from typing import Any, Iterable, Protocol

import ml_dtypes
import numpy as np
from numpy.lib.array_utils import byte_bounds

from dayzero.convert.errors import ConvertError


class TensorReader(Protocol):
    """What the streaming loop needs from a source: names, shapes and one tensor at a time."""

    files: list[Path]

    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> np.dtype: ...

    def get(self, name: str) -> np.ndarray: ...


# --- safetensors -------------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    # DeepSeek-V4's ue8m0 block scales: a bare power of two 2^(byte - 127) (255 is NaN).
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER = 100 * 2**20  # the format's own limit; a larger length means a corrupt file


def _corrupt(path: Path, what: str) -> ConvertError:
    return ConvertError(f"{path} is truncated or corrupt ({what}); re-download or re-export it")


def _parse_safetensors_header(path: Path) -> tuple[int, dict[str, tuple[np.dtype, tuple[int, ...], int]]]:
    """``(data_start, {name: (dtype, shape, begin)})``, validating offsets against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _corrupt(path, "shorter than a safetensors header")
        n = int.from_bytes(raw, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise _corrupt(path, f"header length {n} exceeds the file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not JSON: {e}") from None
    header.pop("__metadata__", None)
    start, entries = 8 + n, {}
    for name, info in header.items():
        if info.get("dtype") not in _ST_DTYPES:
            raise ConvertError(f"tensor '{name}' in {path} has dtype {info.get('dtype')!r}, which dayzero cannot read")
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise _corrupt(path, f"tensor '{name}' spans {end - begin} bytes for shape {list(shape)}")
        if start + end > size:
            raise _corrupt(path, f"data of tensor '{name}' ends past the end of the file")
        entries[name] = (dtype, shape, start + begin)
    return start, entries


class SafetensorsReader:
    """One ``.safetensors`` file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        _, self._entries = _parse_safetensors_header(self.path)
        self._validate_with_safetensors()

    def _validate_with_safetensors(self) -> None:
        # The reference parser catches anything our header checks missed (overlaps, gaps).
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="numpy"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises its own untyped errors
            raise _corrupt(self.path, str(e)) from None

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape as stored."""
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        """Element type as stored (bfloat16 as ``ml_dtypes.bfloat16``)."""
        return self._entries[name][0]

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self.path

    def get(self, name: str) -> np.ndarray:
        """A private copy of one tensor, read straight from the file."""
        dtype, shape, offset = self._entries[name]
        count = math.prod(shape)
        data = np.fromfile(self.path, dtype=dtype, count=count, offset=offset)
        if data.size != count:
            raise _corrupt(self.path, f"data of tensor '{name}' is cut short")
        return data.reshape(shape)


# --- PyTorch state dicts -----------------------------------------------------------------------


class TorchReader:
    """A ``torch.save``'d state dict, memory-mapped so tensors are paged in only when read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        try:
            import torch
        except ImportError:
            raise ConvertError(f"reading {path} needs PyTorch; install torch or convert a safetensors copy") from None
        self._torch = torch
        try:
            state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ...
            raise ConvertError(
                f"{path} is not a readable PyTorch checkpoint ({str(e).splitlines()[0]}); "
                "it may be truncated, corrupt or in the pre-1.6 format - re-save it with torch.save"
            ) from None
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)] if isinstance(state, dict) else None
        if bad is None or bad:
            raise ConvertError(
                f"{path} is not a flat state dict of tensors (found {type(state).__name__}"
                f"{f' with non-tensor entry {bad[0]!r}' if bad else ''}); save model.state_dict() instead"
            )
        self._state = state

    def keys(self) -> list[str]:
        """Tensor names in the state dict."""
        return list(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape as stored."""
        return tuple(self._state[name].shape)

    def _ml_dtype(self, t: Any) -> tuple[Any, Any] | None:
        """(same-width integer torch dtype, ml_dtypes type) for the types numpy lacks: bfloat16
        and the float8 ones (DeepSeek's e4m3 weights and e8m0 scales), else None."""
        torch = self._torch
        views = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
            if hasattr(torch, name):
                views[getattr(torch, name)] = (torch.uint8, getattr(ml_dtypes, name))
        return views.get(t.dtype)

    def dtype(self, name: str) -> np.dtype:
        """Element type (bfloat16 and float8 as their ``ml_dtypes`` types)."""
        t = self._state[name]
        view = self._ml_dtype(t)
        if view is not None:
            return np.dtype(view[1])
        return np.dtype(str(t.dtype).removeprefix("torch."))

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self.path

    def get(self, name: str) -> np.ndarray:
        """A private copy of one tensor (bfloat16 and float8 reinterpreted bit for bit, no
        upcast), copied a block at a time, each block's mapped file pages released once copied
        (:func:`release_pages`): the tensor is resident once, not twice."""
        t = self._state[name]
        view = self._ml_dtype(t)
        x = t.view(view[0]).numpy().view(view[1]) if view is not None else t.numpy()
        out = np.empty(x.shape, x.dtype)
        mapped = _mappings(self.path)
        if not x.flags.c_contiguous:
            out[...] = x
            release_pages(mapped, *byte_bounds(x))
            return out
        src, dst = x.reshape(-1), out.reshape(-1)
        step = max(1, _COPY_BLOCK // max(1, x.itemsize))
        for i in range(0, src.size, step):
            dst[i:i + step] = src[i:i + step]
            release_pages(mapped, *byte_bounds(src[i:i + step]))
        return out


_MADV_DONTNEED = 4  # Linux's value (mmap.MADV_DONTNEED needs an mmap object, which torch does not expose)
_COPY_BLOCK = 16 * 2**20  # bytes of a mapped tensor copied (and released) at a time


def _mappings(path: Path) -> list[tuple[int, int]]:
    """``[(start, end)]`` of this process's memory mappings of the file ``path`` (none off Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    target, out = str(Path(path).resolve()), []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(v, 16) for v in fields[0].split("-"))
            out.append((start, end))
    return out


def release_pages(mapped: list[tuple[int, int]], low: int, high: int) -> None:
    """Drop the pages of addresses ``[low, high)`` that lie in ``mapped`` (a file's mappings,
    :func:`_mappings`) from this process: a memory-mapped checkpoint would otherwise keep every
    page read resident, and counted in RSS, until the end. Only pages of mappings of the file are
    touched, and they are clean, so a later read pages them in again from the file (or the page
    cache)."""
    page = mmap.PAGESIZE
    first, last = low // page * page, -(-high // page) * page
    for start, end in mapped:
        lo, hi = max(start, first), min(end, last)
        if lo < hi:
            _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


# --- several files as one ------------------------------------------------------------------------


class ShardedReader:
    """Several shard readers behind one name space (sharded HF checkpoints)."""

    def __init__(self, readers: Iterable[Any], index: dict[str, str] | None = None, where: str = ""):
        self._owner: dict[str, Any] = {}
        self.files: list[Path] = []
        for reader in readers:
            self.files += reader.files
            for name in reader.keys():
                if name in self._owner:
                    raise ConvertError(f"tensor '{name}' appears in two shards of {where}; the checkpoint is inconsistent")
                self._owner[name] = reader
        for name, file in (index or {}).items():
            owner = self._owner.get(name)
            if owner is None or owner.files[0].name != file:
                raise ConvertError(
                    f"the index of {where} puts tensor '{name}' in {file}, which does not hold it; "
                    "the checkpoint is incomplete or corrupt"
                )

    def keys(self) -> list[str]:
        """All tensor names across the shards."""
        return list(self._owner)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape as stored."""
        return self._owner[name].shape(name)

    def dtype(self, name: str) -> np.dtype:
        """Element type as stored."""
        return self._owner[name].dtype(name)

    def file_of(self, name: str) -> Path:
        """The shard that holds tensor ``name``."""
        return self._owner[name].file_of(name)

    def get(self, name: str) -> np.ndarray:
        """One tensor from whichever shard holds it."""
        return self._owner[name].get(name)


# --- GGUF ----------------------------------------------------------------------------------------

# llama.cpp's gguf-split names: <stem>-00001-of-00003.gguf.
_GGUF_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SPLIT_NO, _SPLIT_COUNT, _SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


def gguf_parts(path: Path) -> list[Path]:
    """Every part of the split GGUF file that ``path`` is one part of (``[path]`` if not split).

    Raises :class:`ConvertError` naming the first missing part.
    """
    match = _GGUF_SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["no"]) <= count:
        raise ConvertError(f"{path} claims to be part {int(match['no'])} of {count}; rename it as llama.cpp named it")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise ConvertError(
            f"GGUF part {missing[0]} is missing ({len(missing)} of {count} parts missing); download every part"
        )
    return parts


def _open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of one file, every tensor's data checked to lie inside the file."""
    import gguf

    try:
        file = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - GGUFReader raises ValueError, struct errors, ...
        raise ConvertError(f"{path} is not a valid GGUF file ({e}); it may be truncated or corrupt") from None
    size = path.stat().st_size
    for t in file.tensors:
        if t.data_offset + t.n_bytes > size:
            raise _corrupt(path, f"data of tensor '{t.name}' ends past the end of the file")
    return file


def _split_field(file: Any, key: str) -> Any:
    field = file.fields.get(key)
    return None if field is None else field.contents()


def _check_split(files: list[Any], parts: list[Path]) -> None:
    """Each part says it is part i of n, and together they hold the tensor count the first states.

    A file not named as a part must not be one (llama.cpp finds the other parts by their names)."""
    count = len(parts)
    if count == 1:
        total = _split_field(files[0], _SPLIT_COUNT)
        if total not in (None, 1):
            raise ConvertError(
                f"{parts[0]} is one part of a file split in {total}; give the parts llama.cpp's names "
                f"(<name>-00001-of-{total:05d}.gguf, ...) and pass any of them"
            )
        return
    for i, (file, path) in enumerate(zip(files, parts)):
        no, total = _split_field(file, _SPLIT_NO), _split_field(file, _SPLIT_COUNT)
        if (no, total) != (i, count):
            raise ConvertError(
                f"{path} says it is part {None if no is None else no + 1} of {total}, but its name makes it "
                f"part {i + 1} of {count}; the parts come from different splits - download them again"
            )
    expected = _split_field(files[0], _SPLIT_TENSORS)
    found = sum(len(f.tensors) for f in files)
    if expected is not None and expected != found:
        raise ConvertError(
            f"the parts of {parts[0]} hold {found} tensors, but the first part says {expected}; "
            "a part is truncated or from another split"
        )


# Element types the gguf package reads as plain numbers rather than quantized blocks.
_GGUF_PLAIN = ("F64", "I8", "I16", "I32", "I64")


class GGUFTensorReader:
    """A llama.cpp ``.gguf`` file; every tensor is dequantized to float32 when read.

    With ``split=True``, ``path`` may be any part of a file split by llama.cpp's gguf-split
    (``name-00001-of-0000N.gguf``): every part is read, metadata comes from the first.
    """

    def __init__(self, path: Path, split: bool = False):
        import gguf

        self.path = Path(path)
        self.files = gguf_parts(self.path) if split else [self.path]
        self._gguf = gguf
        self._parts = [_open_gguf(p) for p in self.files]
        if split:
            _check_split(self._parts, self.files)
        self.file = self._parts[0]
        self._tensors: dict[str, tuple[Any, Path, Any]] = {}
        for file, part in zip(self._parts, self.files):
            for t in file.tensors:
                if t.name in self._tensors:
                    raise ConvertError(
                        f"tensor '{t.name}' appears in two parts of {self.path}; the split is inconsistent"
                    )
                self._tensors[t.name] = (t, part, file)

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value of the first part (strings decoded, arrays as lists)."""
        field = self.file.fields.get(key)
        return default if field is None else field.contents()

    def metadata_keys(self) -> list[str]:
        """All metadata keys of the first part."""
        return list(self.file.fields)

    def keys(self) -> list[str]:
        """Tensor names in the file (all parts)."""
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape in PyTorch order ([out, in]): GGUF lists dimensions innermost first."""
        return tuple(int(d) for d in reversed(self._tensors[name][0].shape))

    def dtype(self, name: str) -> np.dtype:
        """Always float32: quantized and half tensors are dequantized on read."""
        return np.dtype(np.float32)

    def file_of(self, name: str) -> Path:
        """The file (part) that holds tensor ``name``."""
        return self._tensors[name][1]

    def get(self, name: str) -> np.ndarray:
        """One tensor dequantized to float32, in PyTorch layout."""
        t, part, file = self._tensors[name]
        try:
            if t.tensor_type.name in _GGUF_PLAIN:
                data = t.data
            else:
                data = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ConvertError(
                f"tensor '{name}' in {part} uses quantization {t.tensor_type.name}, which the gguf "
                "package cannot dequantize; use a file with another quantization"
            ) from None
        # Copied out when still a view of the mapped file; a dequantized tensor is already fresh.
        fresh = not np.may_share_memory(data, t.data)
        out = np.array(data, dtype=np.float32, copy=None if fresh else True).reshape(self.shape(name))
        self._drop_mapped_pages(file)
        return out

    @staticmethod
    def _drop_mapped_pages(file: Any) -> None:
        # GGUFReader maps the whole file; pages it has read would otherwise stay resident in this
        # process until the end, growing RSS to the file size. They remain in the page cache.
        mapping = getattr(file.data, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass
