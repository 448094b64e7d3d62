"""Recognise what SRC is and open it: an HF directory, a PyTorch state-dict file, or a GGUF file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dayzero.convert.errors import ConvertError
from dayzero.convert.fp8 import SCALE_SUFFIX, V3_NAMES, V4_NAMES, Fp8DequantReader
from dayzero.convert.gguf_config import hf_config_from_gguf
from dayzero.convert.mxfp4 import Mxfp4Reader, RowFp4Reader, is_mxfp4
from dayzero.convert.name_map import NameMap, gguf_name_map, hf_name_map
from dayzero.convert.name_map_v4 import expert_dtype, refusal
from dayzero.convert.readers import GGUFTensorReader, SafetensorsReader, ShardedReader, TorchReader, TensorReader
from dayzero.convert.tokenizer_export import copy_hf_tokenizer, write_gguf_tokenizer
from dayzero.model.config import ConfigError, ModelConfig
from dayzero.model.hf_config import fp8_block_size
TORCH_SUFFIXES = (".bin", ".pt", ".pth")


@dataclasses.dataclass
class Source:
    """An opened source checkpoint: its tensors, its HF config dict and where its tokenizer is."""

    path: Path
    format: str  # "safetensors", "torch" or "gguf"
    reader: TensorReader
    hf_config: dict[str, Any]
    tokenizer_dir: Path | None = None  # HF-style tokenizer files live here (None for GGUF)

    def name_map(self, config: ModelConfig) -> NameMap:
        """The name map for this source's tensor naming."""
        return gguf_name_map(config) if self.format == "gguf" else hf_name_map(config)

    def export_tokenizer(self, dst: Path) -> list[str]:
        """Write the tokenizer files into ``dst``; return their names."""
        if self.format == "gguf":
            return write_gguf_tokenizer(self.reader.metadata, dst)
        return copy_hf_tokenizer(self.tokenizer_dir, dst) if self.tokenizer_dir else []


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConvertError(f"no {path.name} at {path}; {what}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path} is not valid JSON ({e}); re-download it") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path} is not a JSON object; re-download it")
    return value


def _index(directory: Path, name: str) -> tuple[list[str], dict[str, str]] | None:
    """``(files, weight_map)`` from an HF ``*.index.json`` if the directory has one."""
    path = directory / name
    if not path.is_file():
        return None
    weight_map = _read_json(path, "").get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConvertError(f"{path} has no 'weight_map'; the checkpoint index is corrupt")
    files = sorted(set(weight_map.values()))
    for file in files:
        if not (directory / file).is_file():
            raise ConvertError(f"{path} lists shard {file}, which is missing from {directory}; download it")
    return files, weight_map


def _hf_dir_reader(directory: Path) -> tuple[str, TensorReader]:
    """Pick the weight files of an HF directory: safetensors first, then PyTorch ``.bin``."""
    for fmt, index_name, single, make in (
        ("safetensors", "model.safetensors.index.json", "model.safetensors", SafetensorsReader),
        ("torch", "pytorch_model.bin.index.json", "pytorch_model.bin", TorchReader),
    ):
        indexed = _index(directory, index_name)
        if indexed is not None:
            files, weight_map = indexed
            return fmt, ShardedReader([make(directory / f) for f in files], weight_map, str(directory))
        if (directory / single).is_file():
            return fmt, make(directory / single)
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        return "safetensors", ShardedReader([SafetensorsReader(p) for p in shards], None, str(directory))
    raise ConvertError(
        f"{directory} has no model.safetensors, *.safetensors or pytorch_model.bin; pass an HF model directory"
    )


def _dequantizing(reader: TensorReader, hf_config: dict[str, Any], where: Path) -> TensorReader:
    """The reader itself, or for a block-FP8 checkpoint one that dequantizes while reading, or for
    an MXFP4 one (gpt-oss) one that presents each blocks + scales pair as one tensor.

    DeepSeek-V4's published format is both: FP8 weights with e8m0 ``.scale`` blocks, read by an
    :class:`Fp8DequantReader` in V4's naming, under a :class:`RowFp4Reader` for the FP4 experts
    (``expert_dtype`` "fp4"). By default ``dayzero.convert.quantize`` keeps both as stored
    (``mxfp4+fp8-block``: each leaf read from the reader of its format, ``stored_reader``);
    ``--quantize none`` dequantizes everything."""
    if is_mxfp4(hf_config, str(where)):
        return Mxfp4Reader(reader, str(where))
    v4 = hf_config.get("model_type") == "deepseek_v4"
    try:
        block = fp8_block_size(_v4_block_config(hf_config) if v4 else hf_config)
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from None
    if block is not None:
        # A V4 checkpoint re-saved by transformers names its scales as DeepSeek-V3 does.
        v3_named = not v4 or any(n.endswith(SCALE_SUFFIX) for n in reader.keys())
        reader = Fp8DequantReader(reader, block, str(where), V3_NAMES if v3_named else V4_NAMES)
    if v4 and expert_dtype(hf_config) == "fp4":
        reader = RowFp4Reader(reader, str(where))
    return reader


def _v4_block_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` without V4.1's ``expert_dtype`` inside its quantization_config (read by
    :func:`~dayzero.convert.name_map_v4.expert_dtype`, not part of the FP8 block scheme)."""
    q = hf_config.get("quantization_config")
    if not isinstance(q, dict):
        return hf_config
    return {**hf_config, "quantization_config": {k: v for k, v in q.items() if k != "expert_dtype"}}


def _check_convertible(hf_config: dict[str, Any], where: Path) -> None:
    """Refuse, before any weight file is read, what cannot be converted (for DeepSeek-V4, experts
    stored in a format no reader decodes, ``dayzero.convert.name_map_v4.refusal``)."""
    why = refusal(hf_config)
    if why:
        raise ConvertError(f"{where}: {why}")


def open_source(src: Path) -> Source:
    """Open ``src`` for conversion, or raise :class:`ConvertError` saying what it should be."""
    if not src.exists():
        raise ConvertError(f"source {src} does not exist; pass an HF model directory, a .bin/.pt/.pth or a .gguf file")
    if src.is_dir():
        hf_config = _read_json(src / "config.json", "an HF model directory needs its config.json")
        _check_convertible(hf_config, src)
        fmt, reader = _hf_dir_reader(src)
        return Source(src, fmt, _dequantizing(reader, hf_config, src), hf_config, src)
    if src.suffix == ".gguf":
        reader = GGUFTensorReader(src, split=True)  # any part of a split file brings all parts
        hf_config = hf_config_from_gguf(
            lambda key: reader.metadata(key), reader.metadata_keys(),
            len(reader.metadata("tokenizer.ggml.tokens") or ()), "output.weight" in reader.keys(),
        )
        if "rope_freqs.weight" in reader.keys():
            raise ConvertError(
                f"{src} carries rope_freqs.weight (Llama-3.1 style RoPE scaling), which GGUF conversion "
                "does not support yet; convert the model's HF directory instead"
            )
        return Source(src, "gguf", reader, hf_config)
    if src.suffix in TORCH_SUFFIXES:
        hf_config = _read_json(
            src.parent / "config.json",
            f"a PyTorch state dict needs the model's HF config.json in the same directory as {src.name}",
        )
        _check_convertible(hf_config, src)
        return Source(src, "torch", _dequantizing(TorchReader(src), hf_config, src), hf_config, src.parent)
    raise ConvertError(
        f"cannot tell what {src} is from its name; pass an HF model directory, a .bin/.pt/.pth or a .gguf file"
    )
