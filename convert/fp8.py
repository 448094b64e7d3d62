"""DeepSeek's block-wise FP8 checkpoints, dequantized while reading.

DeepSeek-V3 and Kimi-K2 publish most linear weights as ``float8_e4m3fn`` with a float32
``<name>_scale_inv`` beside each ``<name>`` (``weight`` -> ``weight_scale_inv``): one scale per
block of [block_out, block_in] elements (128 x 128), shape [ceil(out/128), ceil(in/128)]; the
last blocks of a dimension that is not a multiple of 128 are partial. The real weight is
``w * scale_inv`` of its block. DeepSeek-V4 names the scale of ``<module>.weight``
``<module>.scale`` instead (:data:`V4_NAMES`) and stores it as ``float8_e8m0fnu`` (ue8m0, a bare
power of two 2^(byte - 127), which float32 holds exactly); its FP4 experts share that naming and
are read by ``dayzero.convert.mxfp4.RowFp4Reader``, so only ``float8_e4m3fn`` weights pair here.

:class:`Fp8DequantReader` wraps a source reader so that such a weight reads as the dequantized
float32 tensor and its scale disappears from the name space: the name maps, the streaming loop
and the checks never see FP8 at all. Norms, the router and biases stay in their own dtypes.
Converting with ``--quantize fp8-block`` reads the stored FP8 values and scales instead
(:meth:`Fp8DequantReader.get_scaled`, used by ``dayzero.convert.quantize``) and keeps them, as
a DeepSeek-V4 checkpoint with FP4 experts does by default (``mxfp4+fp8-block``).
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np

from dayzero.convert.errors import ConvertError
from dayzero.model.quant import ValueFormat

SCALE_SUFFIX = "_scale_inv"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# (weight suffix, scale suffix): weight <base><w> has its block scales in <base><s>.
V3_NAMES = ("", SCALE_SUFFIX)
V4_NAMES = (".weight", ".scale")


def dequantize_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 ``w * scale_inv`` with each scale broadcast over its [block_out, block_in] block.

    ``w`` [out, in] (FP8 or any float), ``scale_inv`` [ceil(out/bo), ceil(in/bi)].
    """
    return w.astype(np.float32) * expand_block_scales(scale_inv, block, w.shape)


def expand_block_scales(scale_inv: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    """float32 [out, in]: each element's block scale, from ``scale_inv`` [ceil(out/bo), ceil(in/bi)]."""
    bo, bi = block
    out, inp = shape
    expected = (math.ceil(out / bo), math.ceil(inp / bi))
    if scale_inv.shape != expected:
        raise ValueError(f"scales of shape {list(scale_inv.shape)} for a {list(shape)} weight in "
                         f"{bo}x{bi} blocks; expected {list(expected)}")
    # Repeat each scale over its block, then cut the partial last blocks to the weight's size.
    return np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:out, :inp]


class Fp8DequantReader:
    """A reader that presents every FP8 weight with a ``_scale_inv`` as its float32 dequantization.

    Scale tensors are consumed here and not listed by ``keys()``; an FP8 tensor without a scale,
    or a scale without its weight, is an error (the checkpoint is incomplete). ``naming`` says
    where a weight's scale is: :data:`V3_NAMES` (``_scale_inv``) or :data:`V4_NAMES` (``.scale``,
    paired with ``float8_e4m3fn`` weights only; any other ``.scale`` passes through).
    """

    stored_as = ValueFormat.FP8  # the format ``get_scaled`` gives (see convert.quantize.native_leaf)

    def __init__(self, inner, block: tuple[int, int], where: str = "", naming: tuple[str, str] = V3_NAMES):
        self.inner = inner
        self.block = block
        self.files: list[Path] = inner.files
        names = set(inner.keys())
        self._scale_of = self._pairs(names, naming, where)
        unscaled = sorted(n for n in names if np.dtype(inner.dtype(n)) == FP8 and n not in self._scale_of)
        if unscaled:
            base = unscaled[0][: len(unscaled[0]) - len(naming[0])]
            raise ConvertError(f"{where} has the FP8 tensor '{unscaled[0]}' without its '{base}{naming[1]}'; "
                               "it cannot be dequantized")

    def _pairs(self, names: set[str], naming: tuple[str, str], where: str) -> dict[str, str]:
        """``{weight: its scale}``. V3's naming pairs every ``_scale_inv``; V4's ``.scale`` also ends
        other tensors' names (its FP4 experts'), so there only ``float8_e4m3fn`` weights pair."""
        w, s = naming
        pairs = {}
        for scale in sorted(n for n in names if n.endswith(s)):
            weight = scale[: -len(s)] + w
            if naming is V3_NAMES and weight not in names:
                raise ConvertError(f"{where} has the FP8 scale '{scale}' but no tensor '{weight}'; it is incomplete")
            if naming is V3_NAMES or (weight in names and np.dtype(self.inner.dtype(weight)) == FP8):
                pairs[weight] = scale
        return pairs

    def keys(self) -> list[str]:
        """Tensor names, without the scales."""
        scales = set(self._scale_of.values())
        return [n for n in self.inner.keys() if n not in scales]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape as stored (dequantization keeps it)."""
        return self.inner.shape(name)

    def dtype(self, name: str) -> np.dtype:
        """float32 for dequantized weights, else the stored type."""
        return np.dtype(np.float32) if name in self._scale_of else self.inner.dtype(name)

    def is_scaled(self, name: str) -> bool:
        """Whether ``name`` is an FP8 weight with block scales (read it with :meth:`get_scaled`)."""
        return name in self._scale_of

    def get_scaled(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An FP8 weight as stored, [out, in] float8_e4m3fn, with its per-element float32 scales
        [out, in] (each block's ``scale_inv`` repeated over the block)."""
        x = self.inner.get(name)
        scale = self.inner.get(self._scale_of[name])
        if x.ndim != 2:
            raise ConvertError(f"FP8 tensor '{name}' has shape {list(x.shape)}; block scales need a 2-D weight")
        try:
            return x, expand_block_scales(scale, self.block, x.shape)
        except ValueError as e:
            raise ConvertError(f"FP8 tensor '{name}': {e}; the checkpoint does not match its quantization_config") from None

    def get(self, name: str) -> np.ndarray:
        """One tensor; FP8 weights come back dequantized to float32."""
        if name not in self._scale_of:
            return self.inner.get(name)
        x, scales = self.get_scaled(name)
        return x.astype(np.float32) * scales
