"""gpt-oss's MXFP4 expert weights, read in the layout the published checkpoints use.

openai/gpt-oss-20b and -120b store each routed-expert stack ``X`` (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) as two uint8 tensors (OCP microscaling, MXFP4):

- ``X_blocks`` [E, out, in/32, 16]: 32 e2m1 values per block, two per byte; value 2k of a block
  is the low nibble of byte k, value 2k+1 the high nibble. A nibble is the e2m1 code, whose
  value is HF's ``FP4_VALUES[code]`` and ml_dtypes' float4_e2m1fn with that bit pattern.
- ``X_scales`` [E, out, in/32]: one e8m0 byte per block, the power of two 2^(byte - 127)
  (255 is NaN in the OCP format).

DeepSeek-V4 stores its routed experts in the same numbers, one row-packed tensor per expert
projection (:class:`RowFp4Reader`).

The blocks run along the contracted (input) axis, out-major. Biases, attention, router and
embeddings are plain bfloat16 (``quantization_config``'s ``modules_to_not_convert``).

:class:`Mxfp4Reader` wraps a source reader so that each pair reads as one tensor ``X`` [E, in,
out]: the in-major layout of HF's ``GptOssExperts`` parameters and of bfloat16 gpt-oss
checkpoints, which is exactly what HF's ``convert_moe_packed_tensors`` dequantizes to. Name maps
written for the float checkpoint therefore apply unchanged, and the pair's two names never
reach them. ``get`` dequantizes, in bfloat16, which holds every MXFP4 value exactly;
``get_scaled`` gives the stored e2m1 values and their e8m0 scales in that same layout (a
transpose of the stored nibbles, not a re-quantization) for ``dayzero.convert.quantize``.

What ``dayzero convert`` does with them (``convert.quantize.quant_config``), as vLLM and
llama.cpp users expect of gpt-oss (both run its experts in MXFP4 as published):

- no ``--quantize``: the experts stay MXFP4 as stored (``WeightQuant.MXFP4``, scales per 32
  inputs), everything else keeps its float dtype; a DeepSeek-V4 source's FP8 weights stay FP8
  beside them (``WeightQuant.MXFP4_FP8_BLOCK``, ``convert.quantize.quant_config``);
- ``--quantize none``: a float model, the experts dequantized exactly (bfloat16 unless
  ``--dtype`` says otherwise);
- any other scheme: quantized from the dequantized float weights, like a float source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dayzero.convert.errors import ConvertError
from dayzero.model.quant import MXFP4_BLOCK, ValueFormat

BLOCKS, SCALES = "_blocks", "_scales"
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)
GROUP = MXFP4_BLOCK[0]  # values per scale: 16 bytes of two nibbles
_CONFIG_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


def is_mxfp4(hf_config: dict[str, Any], where: str) -> bool:
    """Whether ``hf_config`` declares an MXFP4 checkpoint (``quant_method`` "mxfp4").

    ``modules_to_not_convert`` is not needed (the reader sees which tensors are packed) and
    ``dequantize`` is an HF loading option, not a property of the files; any other key is refused.
    """
    q = hf_config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "mxfp4":
        return False
    unknown = sorted(set(q) - _CONFIG_KEYS)
    if unknown:
        raise ConvertError(f"{where}: MXFP4 quantization_config key '{unknown[0]}' is not supported; only "
                           f"{', '.join(sorted(_CONFIG_KEYS))} are")
    return True


def unpack(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stored ``blocks`` uint8 [*b, out, G, 16] and ``scales`` uint8 [*b, out, G] -> (e2m1 values
    [*b, G*32, out], e8m0 scales [*b, G, out]): in-major views of the same numbers."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low nibble first
    values = codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * GROUP).view(E2M1)
    return np.swapaxes(values, -1, -2), np.swapaxes(scales.view(E8M0), -1, -2)


def _check_scales(name: str, blocks: np.ndarray, scales: np.ndarray) -> None:
    """Raise a ConvertError naming ``name`` where a scale byte (uint8 [*b, G]) of ``blocks``
    (uint8 [*b, G, 16]) is NaN (255) or overflows float32 (and bfloat16): 2^127 (254) on a
    magnitude of 2 or more, 2^126 (253) on 4 or 6 (the float32 maximum is just under 2^128)."""
    code = np.maximum(blocks & 0x07, (blocks >> 4) & 0x07).max(axis=-1)  # magnitude code: 4 is 2.0, 6 is 4.0
    bad = (scales == 255) | ((scales == 254) & (code >= 4)) | ((scales == 253) & (code >= 6))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ConvertError(f"MXFP4 tensor '{name}' has scale byte {int(scales[at])} at {list(at)}, which makes "
                           "NaN or overflows float32; the checkpoint cannot be used as is")


def unpack_rows(packed: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V4's row-packed FP4 ``packed`` (int8 or uint8 [*b, out, in/2]) and ``scales``
    (e8m0 or uint8 [*b, out, in/32]) -> (e2m1 values [*b, out, in], e8m0 scales [*b, out, in/32]).
    Byte k of a row holds inputs 2k (low nibble) and 2k+1 (high nibble), scale j covers inputs
    32j ... 32j+31: each row is gpt-oss's blocks laid end to end, so :func:`unpack` reads them."""
    rows, row_scales = packed.view(np.uint8), scales.view(np.uint8)
    blocks = rows.reshape(*rows.shape[:-1], rows.shape[-1] // (GROUP // 2), GROUP // 2)
    values, block_scales = unpack(blocks, row_scales)
    return np.swapaxes(values, -1, -2), np.swapaxes(block_scales, -1, -2)


def dequantize(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [*b, in, out] from :func:`unpack`'s values and scales: each value times its block's
    power of two, exactly (numpy keeps subnormals, as HF's ``torch.ldexp`` does)."""
    return values.astype(np.float32) * np.repeat(scales.astype(np.float32), GROUP, axis=-2)


class Mxfp4Reader:
    """A reader presenting each ``X_blocks`` + ``X_scales`` pair as one tensor ``X`` [E, in, out]
    (see the module docstring); other tensors pass through.

    Every pair is checked from the headers when the reader is made: both halves present, uint8,
    blocks [E, out, G, 16] and scales [E, out, G] (16 bytes = 32 values per block). Like
    ``Fp8DequantReader`` it has no ``file_of``: a pair's halves may lie in two shard files, so a
    resumed conversion re-checks every source file.
    """

    stored_as = ValueFormat.MXFP4

    def __init__(self, inner, where: str = ""):
        self.inner = inner
        self.files: list[Path] = inner.files
        names = set(inner.keys())
        self._packed: dict[str, tuple[int, ...]] = {}
        for name in sorted(names):
            for mine, other in ((BLOCKS, SCALES), (SCALES, BLOCKS)):
                base = name[: -len(mine)]
                if name.endswith(mine) and base + other not in names:
                    raise ConvertError(f"{where} has the MXFP4 tensor '{name}' {list(inner.shape(name))} without "
                                       f"its '{base}{other}'; the checkpoint is incomplete")
            if name.endswith(BLOCKS):
                base = name[: -len(BLOCKS)]
                self._packed[base] = self._checked(base, where)

    def _checked(self, base: str, where: str) -> tuple[int, ...]:
        """The logical shape [E, in, out] of the pair ``base``, or a ConvertError naming it."""
        b, s = tuple(self.inner.shape(base + BLOCKS)), tuple(self.inner.shape(base + SCALES))
        dtypes = {np.dtype(self.inner.dtype(base + x)) for x in (BLOCKS, SCALES)}
        if len(b) != 4 or b[-1] != GROUP // 2 or b[:-1] != s:
            raise ConvertError(
                f"MXFP4 tensor '{base}' in {where} has blocks {list(b)} and scales {list(s)}; expected blocks "
                f"[E, out, in/{GROUP}, {GROUP // 2}] and scales [E, out, in/{GROUP}] ({GROUP} values per scale)")
        if dtypes != {np.dtype(np.uint8)}:
            raise ConvertError(f"MXFP4 tensor '{base}' in {where} is stored as {sorted(map(str, dtypes))}, "
                               "not uint8 blocks and scales; the checkpoint is not MXFP4")
        return (b[0], b[2] * GROUP, b[1])

    def keys(self) -> list[str]:
        """Tensor names: each pair under its logical name (where its blocks were), the rest as stored."""
        # Every name ending in _blocks or _scales is half of a checked pair.
        return [n[: -len(BLOCKS)] if n.endswith(BLOCKS) else n for n in self.inner.keys() if not n.endswith(SCALES)]

    def shape(self, name: str) -> tuple[int, ...]:
        """[E, in, out] for an MXFP4 pair, else as stored."""
        return self._packed[name] if name in self._packed else self.inner.shape(name)

    def dtype(self, name: str) -> np.dtype:
        """bfloat16 for an MXFP4 pair (it holds every MXFP4 value exactly), else as stored."""
        return BF16 if name in self._packed else self.inner.dtype(name)

    def is_scaled(self, name: str) -> bool:
        """Whether ``name`` is an MXFP4 pair (read it as stored with :meth:`get_scaled`)."""
        return name in self._packed

    def get_stored(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The pair ``name`` as stored, in-major: (e2m1 values [E, in, out], e8m0 scales
        [E, in/32, out]). A NaN scale (byte 255), or a value that overflows float32
        (:func:`_check_scales`), is a ConvertError naming the tensor."""
        blocks, scales = self.inner.get(name + BLOCKS), self.inner.get(name + SCALES)
        _check_scales(name, blocks, scales)
        return unpack(blocks, scales)

    def get_scaled(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The pair ``name`` as stored, in-major: e2m1 values [E, in, out] and each value's e8m0
        scale [E, in, out] (for ``convert.quantize.native_leaf``, which moves them alike through
        the recipe's transforms; one more byte per weight while the leaf is made)."""
        values, scales = self.get_stored(name)
        return values, np.repeat(scales, GROUP, axis=-2)

    def get(self, name: str) -> np.ndarray:
        """One tensor; an MXFP4 pair dequantized to bfloat16 [E, in, out], equal to HF's
        ``convert_moe_packed_tensors``."""
        if name not in self._packed:
            return self.inner.get(name)
        return dequantize(*self.get_stored(name)).astype(BF16)


class RowFp4Reader(Mxfp4Reader):
    """DeepSeek-V4's FP4 routed experts (``expert_dtype`` "fp4"): each ``<m>.weight`` stored as
    int8 [out, in/2] (two e2m1 values per byte, :func:`unpack_rows`) with ``<m>.scale`` e8m0
    [out, in/32] (one power of two per 32 inputs of a row) reads as one tensor ``<m>.weight``
    [out, in], the PyTorch layout of a float checkpoint, so that the name map's recipes apply
    unchanged; the scales leave the name space. ``get`` dequantizes to bfloat16 (exact);
    ``get_scaled`` gives the stored values with each one's scale for a native MXFP4 leaf (an
    expert's [in, out] after the recipe's transpose has exactly MXFP4's (32, 1) blocks).

    Layout sources: DeepSeek's inference/model.py ``Linear`` for ``float4_e2m1fn_x2`` (weight
    [out, in // 2], scale float8_e8m0fnu [out, in // 32], "1 scale per 32 fp4 elements along K");
    transformers' ``Fp8Dequantize._unpack_fp4`` (int8 storage, low nibble first); and the test
    fixtures of two other V4 loaders writing the published dtypes (``I8`` values, ``F8_E8M0``
    scales). The int8 pairs are told from FP8 weights by dtype; any other tensor passes through.
    """

    def __init__(self, inner, where: str = ""):  # noqa: D107 - see the class docstring
        self.inner = inner
        self.files: list[Path] = inner.files
        names = set(inner.keys())
        self._packed = {}
        for name in sorted(n for n in names if n.endswith(".weight") and _is_byte(inner.dtype(n))):
            scale = name[: -len(".weight")] + ".scale"
            if scale not in names:
                raise ConvertError(f"{where} has the FP4 tensor '{name}' {list(inner.shape(name))} without its "
                                   f"'{scale}'; the checkpoint is incomplete")
            self._packed[name] = self._checked_rows(name, scale, where)
        self._scales = {n[: -len(".weight")] + ".scale" for n in self._packed}

    def _checked_rows(self, name: str, scale: str, where: str) -> tuple[int, int]:
        """The logical shape [out, in] of FP4 weight ``name``, or a ConvertError naming it."""
        w, s = tuple(self.inner.shape(name)), tuple(self.inner.shape(scale))
        if len(w) != 2 or s != (w[0], w[1] * 2 // GROUP) or (w[1] * 2) % GROUP:
            raise ConvertError(f"FP4 tensor '{name}' in {where} has shape {list(w)} and scales {list(s)}; expected "
                               f"[out, in/2] and [out, in/{GROUP}] (two values per byte, one scale per {GROUP})")
        if np.dtype(self.inner.dtype(scale)) not in (E8M0, np.dtype(np.uint8)):
            raise ConvertError(f"FP4 tensor '{name}' in {where} has {self.inner.dtype(scale)} scales, not e8m0 "
                               "(F8_E8M0); the checkpoint is not in DeepSeek-V4's FP4 format")
        return w[0], w[1] * 2

    def keys(self) -> list[str]:
        """Tensor names, without the FP4 weights' scales."""
        return [n for n in self.inner.keys() if n not in self._scales]

    def shape(self, name: str) -> tuple[int, ...]:
        """[out, in] for an FP4 weight, else as stored."""
        return self._packed[name] if name in self._packed else self.inner.shape(name)

    def get_stored(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """FP4 weight ``name`` as stored: (e2m1 values [out, in], e8m0 scales [out, in/32]). A NaN
        or overflowing scale is a ConvertError naming the tensor."""
        packed = self.inner.get(name).view(np.uint8)
        scales = self.inner.get(name[: -len(".weight")] + ".scale").view(np.uint8)
        _check_scales(name, packed.reshape(*scales.shape, GROUP // 2), scales)
        return unpack_rows(packed, scales)

    def get_scaled(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """FP4 weight ``name``: e2m1 values [out, in] and each value's e8m0 scale [out, in]."""
        values, scales = self.get_stored(name)
        return values, np.repeat(scales, GROUP, axis=-1)

    def get(self, name: str) -> np.ndarray:
        """One tensor; an FP4 weight dequantized to bfloat16 [out, in] (exact)."""
        if name not in self._packed:
            return self.inner.get(name)
        values, scales = self.get_scaled(name)
        return (values.astype(np.float32) * scales.astype(np.float32)).astype(BF16)


def _is_byte(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in (np.dtype(np.int8), np.dtype(np.uint8))
