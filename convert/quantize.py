"""Quantized leaves for the converter (``dayzero convert --quantize``).

A leaf the scheme quantizes (a :class:`~dayzero.model.quant.QuantizedArray` node of
``abstract_weights(config, quant)``) is stored as two arrays, ``<leaf>/values`` and
``<leaf>/scale``. It is made in one of two ways:

- from float: the leaf is read and transformed as an unquantized one would be (in float32), then
  quantized on the host, one expert at a time for expert stacks;
- native (``fp8-block`` from a DeepSeek block-FP8 checkpoint; ``mxfp4``, the default, from
  gpt-oss's MXFP4 experts, ``dayzero.convert.mxfp4``; ``mxfp4+fp8-block``, the default, from
  DeepSeek-V4's FP8 weights and FP4 experts): the stored e4m3 / e2m1 values go through the
  recipe's transforms (transposes, head splits, gate/up de-interleaving: pure rearrangements)
  unchanged, and their block scales are carried into the leaf's [in, out] blocks. That works
  when every block of the leaf holds one source scale; :func:`native_leaf` checks it by moving
  the per-element scales through the same transforms (so a transform along the output axis
  moves MXFP4's per-column scales with their columns). A leaf whose rows mix source blocks (e.g.
  MLA's k_up when a head's key rows do not fill whole 128-row blocks) is dequantized and
  quantized again instead.

A source may be read through two such readers at once (V4: the FP4 one wrapping the FP8 one,
``dayzero.convert.sources``); each leaf is kept in the format of the reader that stores it so
(:func:`stored_reader`).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map import Combine, Recipe, check_shape
from dayzero.convert.sources import Source
from dayzero.model.config import ModelConfig
from dayzero.model.quant import (
    QuantConfig, QuantError, QuantizedArray, ValueFormat, WeightQuant, matrix_dims, parse_weight_quant, quantize,
)
from dayzero.model.weights import abstract_weights, is_spec_node, leaf_path

_quantize = jax.jit(quantize, static_argnums=(1, 2, 3))

CONVERT_CHOICES = tuple(q.value for q in WeightQuant)


def stored_reader(reader, fmt: ValueFormat):
    """The reader of ``reader``'s chain (a reader, its ``inner``, that one's ...) whose
    ``get_scaled`` gives values stored in ``fmt`` (``Fp8DequantReader``: FP8,
    ``Mxfp4Reader`` / ``RowFp4Reader``: MXFP4), or None. The wrappers pass every other tensor
    through under its own name, so the one found reads it as the outer one names it."""
    while reader is not None:
        if getattr(reader, "stored_as", None) is fmt:
            return reader
        reader = getattr(reader, "inner", None)
    return None


def quantized_nodes(config: ModelConfig, quant: QuantConfig) -> dict[str, QuantizedArray]:
    """``{leaf path: quantized spec node}`` of the leaves ``quant`` quantizes."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract_weights(config, quant), is_leaf=is_spec_node)
    return {leaf_path(path): node for path, node in flat if isinstance(node, QuantizedArray)}


def _source_block(fp8) -> tuple[int, int]:
    """A block-FP8 reader's block in dayzero's input-first layout ([out, in] in the checkpoint)."""
    bo, bi = fp8.block
    return bi, bo


def _as_stored(source: Source, config: ModelConfig | None, recipes: tuple[Recipe, ...]) -> QuantConfig:
    """No ``--quantize``: an MXFP4 source's experts stay MXFP4; with FP8 weights beside them
    (DeepSeek-V4) those stay FP8 too (``mxfp4+fp8-block``), provided every leaf that scheme
    stores in FP8 is read from FP8 tensors only (checked from the headers when ``config`` is
    given): the scheme would otherwise round a float source tensor to FP8 that the user never
    asked to quantize, so such a source keeps the experts alone (``mxfp4``)."""
    if stored_reader(source.reader, ValueFormat.MXFP4) is None:
        return QuantConfig()
    fp8 = stored_reader(source.reader, ValueFormat.FP8)
    if fp8 is None:
        return QuantConfig(WeightQuant.MXFP4)
    both = QuantConfig(WeightQuant.MXFP4_FP8_BLOCK, _source_block(fp8))
    if config is None:
        return both
    by_target = {r.target: r for r in recipes}
    fp8_leaves = [t for t, node in quantized_nodes(config, both).items() if node.fmt is ValueFormat.FP8]
    stored = all(t in by_target and all(fp8.is_scaled(n) for n in by_target[t].sources) for t in fp8_leaves)
    return both if stored else QuantConfig(WeightQuant.MXFP4)


def quant_config(name: str | None, source: Source, config: ModelConfig | None = None,
                 recipes: tuple[Recipe, ...] = ()) -> QuantConfig:
    """The :class:`QuantConfig` for ``--quantize name`` on this source (``config`` and
    ``recipes``: its parsed config and the name map's plan, see :func:`_as_stored`).

    None (no ``--quantize``) keeps what the source stores in a format dayzero keeps: an MXFP4
    checkpoint's experts (``mxfp4``), and with them DeepSeek-V4's FP8 weights
    (``mxfp4+fp8-block``); it is ``none`` for every other source (a block-FP8 one alone is
    dequantized). ``none`` asks for a float model whatever the source. ``fp8-block`` (and
    ``mxfp4+fp8-block``) on a block-FP8 checkpoint takes the checkpoint's block ([out, in]
    there, [in, out] in dayzero's input-first layout) so that its values can be kept as stored.
    """
    if name is None:
        return _as_stored(source, config, recipes)
    try:
        scheme = parse_weight_quant(name, allow_auto=False)
    except QuantError as e:
        raise ConvertError(f"--quantize: {e}") from None
    fp8 = stored_reader(source.reader, ValueFormat.FP8)
    if scheme in (WeightQuant.FP8_BLOCK, WeightQuant.MXFP4_FP8_BLOCK) and fp8 is not None:
        return QuantConfig(scheme, _source_block(fp8))
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
    reader = stored_reader(source.reader, node.fmt)
    if reader is None or node.block is None or not all(reader.is_scaled(name) for name in recipe.sources):
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
