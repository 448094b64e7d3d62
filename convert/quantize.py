"""Quantized leaves for the converter (``dayzero convert --quantize``).

A leaf the scheme quantizes (a :class:`~dayzero.model.quant.QuantizedArray` node of
``abstract_weights(config, quant)``) is stored as two arrays, ``<leaf>/values`` and
``<leaf>/scale``. It is made in one of two ways:

- from float: the leaf is read and transformed as an unquantized one would be (in float32), then
  quantized on the host, one expert at a time for expert stacks;
- native (``fp8-block`` from a DeepSeek block-FP8 checkpoint; ``mxfp4``, the default, from
  gpt-oss's MXFP4 experts, ``dayzero.convert.mxfp4``): the stored e4m3 / e2m1 values go through
  the recipe's transforms (transposes, head splits, gate/up de-interleaving: pure
  rearrangements) unchanged, and their block scales are carried into the leaf's [in, out]
  blocks. That works when every block of the leaf holds one source scale; :func:`native_leaf`
  checks it by moving the per-element scales through the same transforms (so a transform along
  the output axis moves MXFP4's per-column scales with their columns). A leaf whose rows mix
  source blocks (e.g. MLA's k_up when a head's key rows do not fill whole 128-row blocks) is
  dequantized and quantized again instead.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from dayzero.convert.errors import ConvertError
from dayzero.convert.fp8 import Fp8DequantReader
from dayzero.convert.mxfp4 import Mxfp4Reader
from dayzero.convert.name_map import Combine, Recipe, check_shape
from dayzero.convert.sources import Source
from dayzero.model.quant import (
    QuantConfig, QuantError, QuantizedArray, ValueFormat, WeightQuant, matrix_dims, parse_weight_quant, quantize,
)

_quantize = jax.jit(quantize, static_argnums=(1, 2, 3))

CONVERT_CHOICES = tuple(q.value for q in WeightQuant)


def quant_config(name: str | None, source: Source) -> QuantConfig:
    """The :class:`QuantConfig` for ``--quantize name`` on this source.

    None (no ``--quantize``) keeps an MXFP4 checkpoint's experts as stored (``mxfp4``) and is
    ``none`` for every other source (a block-FP8 one is dequantized); ``none`` asks for a float
    model whatever the source. ``fp8-block`` on a block-FP8 checkpoint takes the checkpoint's
    block ([out, in] there, [in, out] in dayzero's input-first layout) so that its values can be
    kept as stored.
    """
    if name is None and isinstance(source.reader, Mxfp4Reader):
        return QuantConfig(WeightQuant.MXFP4)
    try:
        scheme = parse_weight_quant(name or "none", allow_auto=False)
    except QuantError as e:
        raise ConvertError(f"--quantize: {e}") from None
    if scheme is WeightQuant.FP8_BLOCK and isinstance(source.reader, Fp8DequantReader):
        bo, bi = source.reader.block
        return QuantConfig(scheme, (bi, bo))
    return QuantConfig(scheme)


def quantize_host(y: np.ndarray, fmt: ValueFormat, in_axes: tuple[int, ...],
                  block: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(values, scale) of the float leaf ``y``; a stack with a leading batch axis (experts) is
    quantized one slice at a time, so the device holds one expert, not the stack."""
    if in_axes[0] > 0 and y.shape[0] > 1:
        parts = [quantize_host(y[i], fmt, tuple(a - 1 for a in in_axes), block) for i in range(y.shape[0])]
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
    q = _quantize(y, fmt, in_axes, block)
    return np.asarray(q.values), np.asarray(q.scale)


def _block_scales(per_element: np.ndarray, in_axes: tuple[int, ...], block: tuple[int, int]) -> np.ndarray | None:
    """The [*batch, ceil(In/bi), ceil(Out/bo)] block scales of per-element scales in the leaf's
    layout, or None if some block of the leaf holds more than one scale."""
    batch, n_in, n_out = matrix_dims(per_element.shape, in_axes)
    bi, bo = block
    matrix = per_element.reshape(*batch, n_in, n_out)
    sampled = matrix[..., ::bi, ::bo]
    expanded = np.repeat(np.repeat(sampled, bi, axis=-2), bo, axis=-1)[..., :n_in, :n_out]
    return np.ascontiguousarray(sampled) if np.array_equal(expanded, matrix) else None


# How quantized_leaf reports a leaf kept in its source's format (manifest "quantized").
NATIVE = {ValueFormat.FP8: "fp8-native", ValueFormat.MXFP4: "mxfp4-native"}


def native_leaf(recipe: Recipe, source: Source, node: QuantizedArray,
                expected: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, scale) of a leaf kept in the source's stored format (FP8 or MXFP4) with its block
    scales, or None when the source is not stored in ``node``'s format for this leaf or its
    blocks do not map onto the leaf's blocks."""
    reader = source.reader
    if not (isinstance(reader, (Fp8DequantReader, Mxfp4Reader)) and node.fmt is reader.stored_as
            and node.block is not None and all(reader.is_scaled(name) for name in recipe.sources)):
        return None
    stacked = recipe.combine is Combine.STACK
    in_axes = tuple(a - 1 for a in node.in_axes) if stacked else node.in_axes
    values, scales = [], []
    for name in recipe.sources:
        x, per_element = reader.get_scaled(name)
        check_shape(recipe, name, x.shape, str(source.path))
        scale = _block_scales(np.ascontiguousarray(recipe.apply(per_element)), in_axes, node.block)
        if scale is None:
            return None
        v = np.ascontiguousarray(recipe.apply(x))
        if not (np.isfinite(v.astype(np.float32)).all() and np.isfinite(scale).all()):
            raise ConvertError(f"tensor '{name}' in {source.path} contains NaN or Inf values; the checkpoint cannot be used as is")
        values.append(v)
        scales.append(scale)
    values, scale = (np.stack(values), np.stack(scales)) if stacked else (values[0], scales[0])
    if values.shape != expected:
        raise AssertionError(f"recipe for {recipe.target} produced {values.shape}, the weight tree needs {expected}")
    return values, scale


def quantized_leaf(recipe: Recipe, source: Source, node: QuantizedArray, expected: tuple[int, ...],
                   read_float: Callable[[], np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """``({"values": ..., "scale": ...}, how)`` for one quantized leaf; ``how`` is "fp8-native" or
    "mxfp4-native" when the source's stored values were kept, else "quantized" (from
    ``read_float()``)."""
    native = native_leaf(recipe, source, node, expected)
    if native is not None:
        return {"values": native[0], "scale": native[1]}, NATIVE[node.fmt]
    values, scale = quantize_host(read_float(), node.fmt, node.in_axes, node.block)
    return {"values": values, "scale": scale}, "quantized"
