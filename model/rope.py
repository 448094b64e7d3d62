"""Rotary position embeddings: frequency schemes (default, linear, dynamic NTK, llama3, YaRN).

Partial rotary (``RopeConfig.partial_rotary_factor`` < 1, GLM-4.5): only the first
R = int(head_dim * factor) dims of each head are rotated, with frequencies computed for a head
of R dims (as HF computes them, for every scheme); :func:`rope_cos_sin` returns tables of width R
and :func:`apply_rope` rotates the first R dims of whatever it is given, so every attention path
that calls the two (contiguous cache, paged serving, the kernels, which get q/k already rotated)
handles it alike.

Frequencies that do not depend on the sequence are computed once on the host in float64 and
rounded to float32, as the reference computes them in float32 from the same formulas. Dynamic NTK
depends on the longest position seen so far, so it is computed inside the jitted graph.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dayzero.model.config import RopeConfig, RopeType


def _base_exponents(head_dim: int) -> np.ndarray:
    return np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim


def _default_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** _base_exponents(head_dim))).astype(np.float32)


def _llama3_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    inv_freq = _default_inv_freq(rope.theta, head_dim)
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 for a context stretched ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rope: RopeConfig) -> float:
    """YaRN's cos/sin magnitude scale (DeepSeek's mscale / mscale_all_dim form included)."""
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    base, dim = rope.theta, head_dim

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(base) ** _base_exponents(dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (np.float32(rope.factor) * pos_freqs)
    return (interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight).astype(np.float32)


def static_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [R/2] for every scheme whose frequencies do not move with length."""
    head_dim = rope.rotary_dim(head_dim)
    if rope.type is RopeType.DEFAULT or rope.type is RopeType.DYNAMIC:
        return _default_inv_freq(rope.theta, head_dim)
    if rope.type is RopeType.LINEAR:
        return (_default_inv_freq(rope.theta, head_dim) / np.float32(rope.factor)).astype(np.float32)
    if rope.type is RopeType.LLAMA3:
        return _llama3_inv_freq(rope, head_dim)
    if rope.type is RopeType.YARN:
        return _yarn_inv_freq(rope, head_dim)
    raise ValueError(f"unhandled rope type {rope.type}")


def _dynamic_ntk_inv_freq(rope: RopeConfig, head_dim: int, max_position: int, seq_len: jnp.ndarray) -> jnp.ndarray:
    """Dynamic NTK: the base grows once the sequence passes ``max_position`` (HF semantics)."""
    seq_len = jnp.maximum(seq_len.astype(jnp.float32), float(max_position))
    factor = rope.factor
    base = rope.theta * ((factor * seq_len / max_position) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** jnp.asarray(_base_exponents(head_dim)))


def mrope_axes(rope: RopeConfig, num_freqs: int) -> np.ndarray:
    """Which position axis (0 temporal, 1 height, 2 width) each of the ``num_freqs`` rotary
    frequencies reads under interleaved M-RoPE (HF Qwen3-VL's ``recomposition_frequencies``):
    frequency i is height's if i % 3 == 1 and i < 3 * section[1], width's if i % 3 == 2 and
    i < 3 * section[2], temporal's otherwise."""
    section = rope.mrope_section
    if not section or not rope.mrope_interleaved:
        raise ValueError(f"positions [3, B, T] need interleaved M-RoPE; the config has mrope_section={section}, "
                         f"mrope_interleaved={rope.mrope_interleaved}: pass positions [B, T]")
    axes = np.zeros(num_freqs, np.int32)
    for axis in (1, 2):
        axes[axis: 3 * section[axis]: 3] = axis
    return axes


def rope_cos_sin(
    rope: RopeConfig, head_dim: int, max_position: int, positions: jnp.ndarray, seq_len: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables [B, T, R] (fp32) for integer ``positions`` [B, T]; R = ``rope.rotary_dim(head_dim)``.

    ``positions`` [3, B, T] (temporal, height, width; ``dayzero.model.mrope``) rotate by
    interleaved M-RoPE (:func:`mrope_axes`); equal axes give exactly the tables of [B, T].

    ``seq_len`` is only used by dynamic NTK: the longest sequence seen so far, as HF tracks it.
    """
    if rope.type is RopeType.DYNAMIC:
        if seq_len is None:
            seq_len = jnp.max(positions) + 1
        inv_freq = _dynamic_ntk_inv_freq(rope, rope.rotary_dim(head_dim), max_position, seq_len)
    else:
        inv_freq = jnp.asarray(static_inv_freq(rope, head_dim))
    if positions.ndim == 3:  # M-RoPE: each frequency reads the position of its own axis
        positions = jnp.moveaxis(positions[mrope_axes(rope, inv_freq.shape[0])], 0, -1)  # [B, T, R/2]
        angles = positions.astype(jnp.float32) * inv_freq
    else:
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    scale = yarn_attention_factor(rope) if rope.type is RopeType.YARN else 1.0
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x`` [B, T, heads, H] by the half-split convention HF Llama uses.

    With tables [B, T, R] narrower than H (partial rotary) only ``x[..., :R]`` is rotated, its
    pairs (i, i + R/2), and ``x[..., R:]`` passes unchanged (HF's ``apply_rotary_pos_emb``).
    """
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :R], cos, sin), x[..., R:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def apply_rope_trailing(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate the trailing R dims of ``x`` [B, T, heads, H] with adjacent pairs (x0, x1), (x2, x3),
    ..., leaving ``x[..., :H-R]`` unchanged: DeepSeek-V4's layout [nope | rope] (HF's
    ``deepseek_v4.apply_rotary_pos_emb``). Tables [B, T, R] as :func:`rope_cos_sin` makes them.

    The result stays in the interleaved layout (V4 reads keys as values, so the stored rows must
    be HF's, not a permutation of them); ``sin`` negated undoes the rotation.
    """
    R = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - R], x[..., x.shape[-1] - R:]
    rotated = apply_rope(deinterleave(rope), cos, sin)
    # Back to adjacent pairs: [a0..a(R/2-1), b0..] -> [a0, b0, a1, b1, ...].
    rotated = jnp.stack([rotated[..., : R // 2], rotated[..., R // 2:]], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated], axis=-1)


def deinterleave(x: jnp.ndarray) -> jnp.ndarray:
    """Rotary pairs stored adjacent, (x0, x1), (x2, x3), ... -> the half-split layout
    [x0, x2, ..., x1, x3, ...] that :func:`apply_rope` rotates.

    DeepSeek's checkpoints keep pairs adjacent; HF's ``apply_rotary_pos_emb_interleave`` returns
    exactly ``apply_rope(deinterleave(x))``. Queries and keys are both permuted, so their dot
    products are those of the interleaved rotation.
    """
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
