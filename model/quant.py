"""Quantized weights and caches: int8 / FP8 / int4 values with float32 scales, or MXFP4 (e2m1
values with power-of-two scales), dequantized on read.

A :class:`QuantizedArray` stands where a float array would in the weight tree or the KV cache. It
holds the stored ``values`` and their ``scale`` (real value = values * scale), plus static
metadata saying how the scale is laid out:

- channel layout (``block`` None): one scale per position outside ``in_axes``; the scale has the
  values' rank with size 1 on ``in_axes``. For a weight, ``in_axes`` are the axes contracted with
  the activation (one scale per output channel, symmetric absmax / qmax); for a KV cache they are
  the head dimension (one scale per token and head).
- block layout (``block`` = (bi, bo)): the leaf is seen as a matrix [*batch, In, Out] (batch = the
  axes before ``in_axes``, In = the ``in_axes``, Out = the rest, flattened), with one scale per
  [bi, bo] block, scale shape [*batch, ceil(In/bi), ceil(Out/bo)]; the last blocks of a dimension
  may be partial (DeepSeek's FP8 checkpoints have them, e.g. 576 = 4.5 x 128 rows). Scales can
  be given exactly per a finer block that divides the block (:func:`reblocked`): that is how a
  mesh whose shards start inside a block gets shard-local scales
  (``dayzero.model.weights.mesh_aligned_specs``).

MXFP4 (``ValueFormat.MXFP4``, the OCP microscaling format gpt-oss publishes its routed experts
in) is the block layout with block (32, 1) (:data:`MXFP4_BLOCK`): ``values`` are float4_e2m1fn
(+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) and ``scale`` is float8_e8m0fnu, a bare power of two 2^(byte -
127), one per 32 inputs of each output column. Values are one array element each, so that
slicing an expert or a tile of rows or columns is ordinary array slicing, and XLA packs them:
on XLA:CPU (jax 0.10.2) a float4_e2m1fn (or int4) array costs 0.5 bytes per element (measured:
process RSS grows 0.500 bytes per element for 256M-element arrays; its compiled parameter
layout is ``f4e2m1fn[...]{...:E(4)}``), although ``on_device_size_in_bytes()`` and ml_dtypes'
itemsize say 1, as numpy on the host holds them. An MXFP4 stack so costs 0.5 + 1/32 = 0.53
bytes per weight in memory, as packed in the checkpoint (bfloat16: 2); :func:`stored_bytes`
counts it so. A loop that reads a stack (the expert loop, the ragged tiles) gets an XLA:CPU
float16 copy of its values (2 bytes per element, as for fp8) and a float32 one of its scales.
Dequantizing multiplies each value by its scale in float32, which is exact (2 significant bits
times a power of two) except where XLA:CPU flushes subnormals to zero: scale byte 0 (2^-127 is
itself subnormal) and results below 2^-126 of byte 1, an error of at most 6 x 2^-127; real
checkpoints use byte 0 for all-zero blocks at most.

Forward code reads every cached array through :func:`dequantized`, which returns the
compute-dtype array (a plain array is only cast), and applies every projection weight through
``dayzero.model.quant_matmul.linear``. Dequantizing right before the contraction is what
XLA:GPU/TPU fuse into the matmul's operand read. XLA:CPU does not (measured on SmolLM2 shapes,
one decode matvec: [576 x 1536] 0.08 ms fp32 against 0.18 ms int8; [576 x 49152] 4.7 ms against
38-63 ms; its int8 x int8 and bf16 dots were as slow): there ``linear`` runs a decode step's
product as a scan over tiles of rows, each dequantized while it is in cache, which brings int8 to
about fp32's speed (see that module and :data:`AUTO_WEIGHTS`). XLA:CPU converts int4 and fp8 to
fp32 ~10x slower than int8 (the [576 x 49152] matvec, one row tile at a time: int4 100-180 ms,
fp8 150-230 ms, int8 6-8 ms, fp32 11-23 ms, on a loaded 2-core host). int8 per channel and int4
per group skip the scan where the native kernels build (``dayzero.kernels.cpu_matvec``) and
decode 1.6-1.9x and 1.85-2.6x faster than fp32 (SmolLM2-135M, ``bench/quant.py``); fp8 has no
native kernel and still costs time on CPU.

Why not Google's qwix: its core ``QArray`` (qvalue, scale, static qtype) is close to this type, but
(a) its scale tiles must divide every dimension, so DeepSeek's partial 128 x 128 blocks would need
padding of the stored weights; (b) it has no notion of which axes a weight contracts, which our
abstract specs need to derive scale shapes, logical axes and restore targets from one tree; (c) its
PTQ path intercepts Flax modules, and dayzero's model is pure functions over a typed pytree; (d) its
quantized dot_general does not help XLA:CPU (its int8 x int8 dot measured 84 ms against 3.3 ms for
the fp32 [576 x 49152] matvec). What remains is absmax quantization and a broadcast multiply, which
is shorter than the adapter a dependency would need.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class QuantError(ValueError):
    """An unknown quantization scheme, or one that does not fit the checkpoint."""


class ValueFormat(enum.Enum):
    """How quantized values are stored, with the largest magnitude they represent."""

    INT8 = "int8"  # symmetric [-127, 127]: -128 unused, so that negation is exact
    FP8 = "float8_e4m3fn"  # e4m3: 3 mantissa bits, largest finite 448
    INT4 = "int4"  # [-8, 7], scaled as llama.cpp's q4_0 (see _int4_scale)
    MXFP4 = "mxfp4"  # e2m1, largest 6, with a power-of-two (e8m0) scale per MXFP4_BLOCK

    @property
    def dtype(self) -> jnp.dtype:
        """The stored element type."""
        return jnp.dtype({"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "int4": jnp.int4,
                          "mxfp4": jnp.float4_e2m1fn}[self.value])

    @property
    def scale_dtype(self) -> jnp.dtype:
        """The stored scale type: float32, or e8m0 (a bare power of two) for MXFP4."""
        return jnp.dtype(jnp.float8_e8m0fnu if self is ValueFormat.MXFP4 else jnp.float32)

    @property
    def qmax(self) -> float:
        """The magnitude a block's absmax is mapped to (at most, for MXFP4's power-of-two scales;
        int4's greatest value, its largest magnitude being stored as ``INT4_LOWEST``)."""
        return {"int8": 127.0, "float8_e4m3fn": 448.0, "int4": 7.0, "mxfp4": 6.0}[self.value]


class WeightQuant(enum.Enum):
    """Weight quantization schemes (``dayzero convert --quantize``, ``Engine.load(quantize=)``).

    Applied to the projections of attention (q/k/v/o, MLA's q/kv LoRA and up-projections), dense
    MLPs, shared and routed experts; never to norms, biases, routers, the DSA indexer, the
    embedding or a checkpoint's output head (see ``weights.ParamSpec.in_axes``). The CPU engine's
    [D,V] head copy of a tied embedding is int8 under int8, int4 and int4-all
    (``dayzero.engine.runtime.TIED_HEAD_FORMAT``).

    ``int4`` is for MoE models (4-bit experts, the bulk of the bytes; attention int8); on a dense
    model it is int8. ``int4-all`` is 4 bits everywhere in groups of 32 inputs, with q4_0's 16
    levels and scales (``_int4_scale``): on SmolLM2-135M it decodes 1.85-2.6x faster than fp32 on
    CPU at a mean KL of 0.267 (llama.cpp's q4_0: 0.27; ``bench/quant.py``).
    """

    NONE = "none"
    INT8 = "int8"  # per output channel, absmax / 127
    FP8 = "fp8"  # e4m3 per output channel, absmax / 448
    FP8_BLOCK = "fp8-block"  # e4m3 per [in, out] block (128 x 128, or a native FP8 checkpoint's)
    INT4 = "int4"  # routed experts int4 in groups of INT4_GROUP inputs per output; the rest int8
    INT4_ALL = "int4-all"  # every projection int4 in groups of INT4_ALL_GROUP inputs per output
    MXFP4 = "mxfp4"  # routed experts MXFP4 (gpt-oss's published format, kept as stored); the rest float
    # Routed experts MXFP4, every other projection fp8-block: DeepSeek-V4's published formats (FP4
    # experts, FP8 weights with 128 x 128 block scales), both kept as stored.
    MXFP4_FP8_BLOCK = "mxfp4+fp8-block"


class KVQuant(enum.Enum):
    """KV-cache quantization (``--kv-cache``, ``Engine.load(kv_cache=)``): one scale per token and
    head (per token for MLA latent rows and DSA indexer keys)."""

    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"


AUTO = "auto"
INT4_LOWEST = -8.0  # the int4 value the largest magnitude of a group is stored as
INT4_GROUP = 128  # inputs per int4 scale: the usual group-wise size for 4-bit weights
INT4_ALL_GROUP = 32  # inputs per int4 scale under int4-all (see WeightQuant.INT4_ALL)
FP8_BLOCK = (128, 128)  # [in, out] block of fp8-block when the source does not dictate one
MXFP4_BLOCK = (32, 1)  # [in, out] block of MXFP4: one scale per 32 inputs of each output (OCP MX)

# What "auto" means per platform (jax.default_backend()), chosen from measurements. On CPU
# (bench/quant.py, SmolLM2-135M, 128-token prompt, 2 shared cores): before the tiled matvec
# (dayzero.model.quant_matmul) fp32 decoded 19.3 tok/s, int8 weights 3.5, fp8 6.2, fp8-block 4.9,
# bf16 1.3, because XLA:CPU materialises the dequantized weight. With it (and an int8 copy of the
# tied output head), one run: fp32 29.3 tok/s, int8 26.7 (0.91x; KL mean 3.7e-3, max 2.7e-2,
# greedy agreement and prefix 1.0), llama.cpp q8_0 12.2 and q4_0 17.9 on the same host under
# load; a bare decode step measured 42.6 ms fp32 against 25.9 ms int8 in another. int8 is at
# best even with fp32, not reliably faster, and fp8/int4 convert ~10x slower than int8 on
# XLA:CPU, so auto keeps fp32 weights on CPU: quantization there buys memory (a quarter of the
# weight bytes), not time. An int8 / fp8 KV cache was as fast as fp32 at 128 tokens, but at a
# 2000-token prompt decoded 15.2 / 6.2 tok/s against 23.6 (the whole cache is converted each
# step), so auto keeps the fp32 cache too. Since then the native kernels (kernels/cpu_matvec)
# made int8 1.6-1.9x and int4-all 1.85-2.6x faster than fp32 (bench/quant.py, several runs; one
# interleaved: fp32 49.1, int8 78.2, int4-all 90.9 tok/s), but auto still keeps fp32 on CPU:
# quantizing changes the numerics (int4-all's KL 0.38 is a different model), which a user asks
# for by name, and every HF-parity check loads the default. GPU/TPU have not been measured yet;
# until they are, auto does not quantize there either.
AUTO_WEIGHTS = {"cpu": WeightQuant.NONE}
AUTO_KV = {"cpu": KVQuant.NONE}


def _parse(kind: type[enum.Enum], name: Any, auto: dict, what: str, allow_auto: bool) -> Any:
    if isinstance(name, kind):
        return name
    if name is None or (allow_auto and name == AUTO):
        return auto.get(jax.default_backend(), kind("none"))
    choices = ([AUTO] if allow_auto else []) + [k.value for k in kind]
    try:
        return kind(name)
    except ValueError:
        raise QuantError(f"{what} {name!r} is not a known scheme; choose one of {', '.join(choices)}") from None


def parse_weight_quant(name: str | WeightQuant | None, allow_auto: bool = True) -> WeightQuant:
    """The :class:`WeightQuant` named ``name`` ("auto"/None: the platform's choice)."""
    return _parse(WeightQuant, name, AUTO_WEIGHTS, "weight quantization", allow_auto)


def parse_kv_quant(name: str | KVQuant | None) -> KVQuant:
    """The :class:`KVQuant` named ``name`` ("auto"/None: the platform's choice)."""
    return _parse(KVQuant, name, AUTO_KV, "KV-cache quantization", True)


KV_FORMATS = {KVQuant.INT8: ValueFormat.INT8, KVQuant.FP8: ValueFormat.FP8}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's weights are quantized (recorded in its manifest).

    ``block``: the [in, out] block of ``FP8_BLOCK``'s leaves and of ``MXFP4_FP8_BLOCK``'s FP8 ones
    (a native FP8 checkpoint's own block, transposed to dayzero's input-first layout, else
    :data:`FP8_BLOCK`).
    """

    weights: WeightQuant = WeightQuant.NONE
    block: tuple[int, int] = FP8_BLOCK

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict that :meth:`from_json` reads back."""
        return {"weights": self.weights.value, "block": list(self.block)}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> "QuantConfig":
        """Inverse of :meth:`to_json`; None (a checkpoint written before quantization) is none."""
        if not d:
            return cls()
        return cls(WeightQuant(d["weights"]), tuple(d.get("block", FP8_BLOCK)))


@struct.dataclass
class QuantizedArray:
    """Stored ``values`` and ``scale`` (float32; e8m0 for MXFP4) of one array; see the module
    docstring for layouts."""

    values: Any
    scale: Any
    fmt: ValueFormat = struct.field(pytree_node=False)
    in_axes: tuple[int, ...] = struct.field(pytree_node=False)
    block: tuple[int, int] | None = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array it stands for."""
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        """Its rank."""
        return len(self.values.shape)

    def __getitem__(self, index) -> "QuantizedArray":
        """One slice along the leading axis (e.g. one expert of a stack), still quantized."""
        if not self.in_axes or self.in_axes[0] == 0:
            raise TypeError(f"axis 0 of a {self.shape} quantized array shares its scales; it cannot be indexed")
        return QuantizedArray(self.values[index], self.scale[index], self.fmt,
                              tuple(a - 1 for a in self.in_axes), self.block)


def scale_shape(shape: tuple[int, ...], in_axes: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale's shape for values of ``shape`` (see the module docstring)."""
    if block is None:
        return tuple(1 if i in in_axes else n for i, n in enumerate(shape))
    batch, n_in, n_out = matrix_dims(shape, in_axes)
    return (*batch, math.ceil(n_in / block[0]), math.ceil(n_out / block[1]))


def matrix_dims(shape: tuple[int, ...], in_axes: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
    """(batch shape, In, Out) of the block layout's matrix view of an array of ``shape``."""
    first, last = in_axes[0], in_axes[-1]
    if tuple(in_axes) != tuple(range(first, last + 1)):
        raise ValueError(f"block scales need contiguous input axes, got {in_axes}")
    return tuple(shape[:first]), math.prod(shape[first : last + 1]), math.prod(shape[last + 1 :])


def _expand_blocks(scale: jax.Array, block: tuple[int, int], n_in: int, n_out: int) -> jax.Array:
    """Block scales [..., nI, nO] repeated to one per element [..., In, Out] (partial blocks cut)."""
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :n_in, :n_out]


def reblocked(x: QuantizedArray, block: tuple[int, int]) -> QuantizedArray:
    """``x`` (block layout) with its scales given per finer ``block`` (bi', bo'), where bi' divides
    ``x.block``'s bi and bo' its bo: exact, the values are unchanged and so is every dequantized
    element.

    Proof: fine block k of a dimension covers [k bi', (k+1) bi') (cut at the dimension's end).
    Coarse block boundaries are multiples of bi, hence of bi', so that range lies inside one
    coarse block, number floor(k bi' / bi) = k // (bi / bi'): the fine scale is the coarse one
    repeated bi / bi' times. A partial last coarse block (576 = 4.5 x 128) is no exception: its
    fine blocks are the first ceil(576 / bi') - 4 (bi / bi') of its repeats, so the repeated
    scales are cut to ceil(In / bi') (<= ceil(In / bi) (bi / bi')). Used to split a block-scaled
    weight where a shard of its values would start inside a block (see
    ``dayzero.model.weights.mesh_aligned_specs``); scales grow by (bi / bi') (bo / bo').
    Works on numpy and jax scales alike.
    """
    if x.block is None:
        raise QuantError(f"a channel-layout {x.fmt.value} array has no blocks to re-block to {tuple(block)}")
    fine = tuple(int(b) for b in block)
    if fine == tuple(x.block):
        return x
    (bi, bo), (fi, fo) = x.block, fine
    if len(fine) != 2 or fi < 1 or fo < 1 or bi % fi or bo % fo:
        raise QuantError(f"scales of block {tuple(x.block)} cannot be re-blocked exactly to {tuple(block)}: "
                         "each new block size must divide the old one")
    _, n_in, n_out = matrix_dims(x.shape, x.in_axes)
    xp = np if isinstance(x.scale, np.ndarray) else jnp
    scale = xp.repeat(xp.repeat(x.scale, bi // fi, axis=-2), bo // fo, axis=-1)
    return x.replace(scale=scale[..., : math.ceil(n_in / fi), : math.ceil(n_out / fo)], block=fine)


def _dequantize(x: QuantizedArray) -> jax.Array:
    values, scale = x.values.astype(jnp.float32), x.scale.astype(jnp.float32)
    if x.block is None:
        return values * scale
    batch, n_in, n_out = matrix_dims(x.shape, x.in_axes)
    matrix = values.reshape(*batch, n_in, n_out) * _expand_blocks(scale, x.block, n_in, n_out)
    return matrix.reshape(x.shape)


def dequantized(x: Any, dtype: Any) -> jax.Array:
    """The array ``x`` stands for, in ``dtype``: the one way forward code reads a weight or a
    cached array. A plain array is only cast (a no-op when it already is ``dtype``)."""
    if isinstance(x, QuantizedArray):
        return _dequantize(x).astype(dtype)
    return x.astype(dtype)


def _to_values(scaled: jax.Array, fmt: ValueFormat) -> jax.Array:
    """Values already divided by their scale (|scaled| <= qmax; int4: within [-8, 8]) in the
    stored format."""
    if fmt in (ValueFormat.FP8, ValueFormat.MXFP4):
        # Round to nearest even e4m3 / e2m1; within +-qmax by construction (casts saturate).
        return scaled.astype(fmt.dtype)
    low = INT4_LOWEST if fmt is ValueFormat.INT4 else -fmt.qmax
    return jnp.clip(jnp.round(scaled), low, fmt.qmax).astype(fmt.dtype)


def _safe_scale(absmax: jax.Array, fmt: ValueFormat) -> jax.Array:
    # An all-zero channel or block gets scale 1 (its values are 0 whatever the scale).
    return jnp.where(absmax > 0, absmax / fmt.qmax, 1.0).astype(jnp.float32)


def _power_of_two_scale(absmax: jax.Array) -> jax.Array:
    """MXFP4's e8m0 scales: the least 2^k with absmax / 2^k <= 6 (no value saturates), k within
    [-126, 127] so that the scale is a normal float32 (XLA:CPU flushes subnormals); an all-zero
    block gets 2^0. Built from its exponent bits, so it is exact."""
    mantissa, exponent = jnp.frexp(absmax / ValueFormat.MXFP4.qmax)  # = mantissa 2^exponent, mantissa in [0.5, 1)
    k = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    k = jnp.where(absmax > 0, jnp.clip(k, -126, 127), 0)
    return jax.lax.bitcast_convert_type((k + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)


def _int4_scale(low: jax.Array, high: jax.Array) -> jax.Array:
    """int4 scales as llama.cpp's q4_0 chooses them: the value of largest magnitude (of ``low``,
    ``high``: each group's least and greatest) comes back as -8 times the scale, so the group uses
    all 16 levels where absmax / 7 would leave -8 unused; the scale is negative where that value
    is positive. A value of the other sign within 1/16 of it saturates at 7 (one step off)."""
    extreme = jnp.where(-low > high, low, high)
    return jnp.where(extreme != 0, extreme / INT4_LOWEST, 1.0).astype(jnp.float32)


def _block_scale(x: jax.Array, axes: tuple[int, ...], fmt: ValueFormat, keepdims: bool = False) -> jax.Array:
    """The scale of each block (or channel) of ``x``, whose elements lie along ``axes``, in
    ``fmt.scale_dtype``. Only int4 reads the signs: the other formats reduce |x| once (the KV
    caches quantize every step's new rows here)."""
    if fmt is ValueFormat.INT4:
        return _int4_scale(jnp.min(x, axis=axes, keepdims=keepdims), jnp.max(x, axis=axes, keepdims=keepdims))
    absmax = jnp.max(jnp.abs(x), axis=axes, keepdims=keepdims)
    return _power_of_two_scale(absmax) if fmt is ValueFormat.MXFP4 else _safe_scale(absmax, fmt)


def quantize(x: jax.Array, fmt: ValueFormat, in_axes: tuple[int, ...],
             block: tuple[int, int] | None = None) -> QuantizedArray:
    """Absmax quantization of ``x`` in the layout given by ``in_axes`` and ``block`` (symmetric;
    int4 with q4_0's 16 levels, see :func:`_int4_scale`; MXFP4: block layout only, with
    power-of-two scales, see :func:`_power_of_two_scale`)."""
    x = jnp.asarray(x, jnp.float32)
    in_axes = tuple(in_axes)
    if block is None:
        if fmt is ValueFormat.MXFP4:
            raise QuantError(f"mxfp4 has one scale per block of inputs; pass block={MXFP4_BLOCK}, not None")
        scale = _block_scale(x, in_axes, fmt, keepdims=True)
        return QuantizedArray(_to_values(x / scale, fmt), scale, fmt, in_axes, None)
    batch, n_in, n_out = matrix_dims(x.shape, in_axes)
    bi, bo = block
    ni, no = math.ceil(n_in / bi), math.ceil(n_out / bo)
    matrix = x.reshape(*batch, n_in, n_out)
    pad = [(0, 0)] * len(batch) + [(0, ni * bi - n_in), (0, no * bo - n_out)]
    blocks = jnp.pad(matrix, pad).reshape(*batch, ni, bi, no, bo)
    scale = _block_scale(blocks, (-3, -1), fmt)
    values = _to_values(matrix / _expand_blocks(scale.astype(jnp.float32), block, n_in, n_out), fmt)
    return QuantizedArray(values.reshape(x.shape), scale, fmt, in_axes, tuple(block))


def quantize_like(x: jax.Array, like: QuantizedArray) -> QuantizedArray:
    """``x`` quantized with ``like``'s format and layout (e.g. new keys for a quantized cache)."""
    return quantize(x, like.fmt, like.in_axes, like.block)


def as_stored(x: jax.Array, cache: Any) -> jax.Array:
    """``x`` [..., C] (new rows for a cache) as ``cache`` gives them back once written: quantized
    with its format, one scale per row, then dequantized; unchanged when ``cache`` is not a
    quantized array. A step's own new keys and values are read this way beside the cached ones,
    so that every path (the contiguous cache, the paged reference, the kernels, which write the
    new rows into the pages before reading them) attends over the same stored values."""
    if not isinstance(cache, QuantizedArray):
        return x
    return dequantized(quantize(x, cache.fmt, (x.ndim - 1,)), x.dtype)


def take_along_axis(x: Any, indices: jax.Array, axis: int) -> Any:
    """``jnp.take_along_axis`` that keeps a channel-layout quantized array quantized (its scale
    has size 1 on the axes the indices broadcast over)."""
    if not isinstance(x, QuantizedArray):
        return jnp.take_along_axis(x, indices, axis=axis)
    if x.block is not None or axis in x.in_axes:
        raise ValueError("take_along_axis reads whole rows of a channel-layout quantized array only")
    return x.replace(values=jnp.take_along_axis(x.values, indices, axis=axis),
                     scale=jnp.take_along_axis(x.scale, indices, axis=axis))


# 4-bit element types, which XLA packs two to a byte (measured on XLA:CPU, see the module
# docstring) while ml_dtypes' itemsize says 1.
NIBBLE_TYPES = {jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4), jnp.dtype(jnp.float4_e2m1fn)}


def stored_bytes(tree: Any) -> int:
    """Bytes of every array in a tree (weights or cache) as XLA holds them, quantized values and
    scales included: half a byte per int4 / float4 element (rounded up per array)."""
    def one(x) -> int:
        dtype = jnp.dtype(x.dtype)
        return -(-x.size // 2) if dtype in NIBBLE_TYPES else x.size * dtype.itemsize
    return int(sum(one(x) for x in jax.tree.leaves(tree)))


def describe_weights(tree: Any) -> str:
    """The stored formats of a weight tree's quantized leaves, e.g. "int8" or "int4/128x1+int8"
    ("none" when nothing is quantized), for reports."""
    nodes = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedArray))
             if isinstance(x, QuantizedArray)]
    names = {x.fmt.value + ("" if x.block is None else f"/{x.block[0]}x{x.block[1]}") for x in nodes}
    return "+".join(sorted(names)) or "none"
