"""gpt-oss's MXFP4 expert weights, read in the layout the published checkpoints use.

openai/gpt-oss-20b and -120b store each routed-expert stack ``X`` (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) as two uint8 tensors (OCP microscaling, MXFP4):

- ``X_blocks`` [E, out, in/32, 16]: 32 e2m1 values per block, two per byte; value 2k of a block
  is the low nibble of byte k, value 2k+1 the high nibble. A nibble is the e2m1 code, whose
  value is HF's ``FP4_VALUES[code]`` and ml_dtypes' float4_e2m1fn with that bit pattern.
- ``X_scales`` [E, out, in/32]: one e8m0 byte per block, the power of two 2^(byte - 127)
  (255 is NaN in the OCP format).

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
  inputs), everything else keeps its float dtype;
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
        [E, in/32, out]). A NaN scale (byte 255), or a value that overflows float32 (scale 2^127
        on a magnitude of 2 or more), is a ConvertError naming the tensor."""
        blocks, scales = self.inner.get(name + BLOCKS), self.inner.get(name + SCALES)
        big = np.maximum(blocks & 0x07, (blocks >> 4) & 0x07).max(axis=-1) >= 4  # a magnitude of 2 or more
        bad = (scales == 255) | ((scales == 254) & big)
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ConvertError(f"MXFP4 tensor '{name}' has scale byte {int(scales[at])} at {list(at)}, which makes "
                               "NaN or overflows float32; the checkpoint cannot be used as is")
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
