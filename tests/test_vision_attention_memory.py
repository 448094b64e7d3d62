"""The vision towers' attention in bounded memory (dayzero.model.vision_qwen.segment_attention,
shared by the Qwen and Kimi towers): queries in blocks over all keys, so XLA's scratch grows
linearly in the patch count, not with its square; and the blocked result is the dense one.

The dense figure comes from the same code with the block made larger than the patch count (the
one-block path: the whole [P, P] score matrix per head, as the tower computed before), so the
memory test shows it would fail on the dense path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.model import vision_qwen
from dayzero.model.hf_config_vision import VisionConfig
from dayzero.model.vision_qwen import segment_attention, vision_forward, vision_layout
from dayzero.model.vision_weights import vision_specs
from dayzero.model.weights import init_weights, shape_structs

# A narrow tower (width 32, two heads of 16, one block) with many patches: attention dominates.
TINY = VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=32, patch_size=2,
                    temporal_patch_size=1, num_position_embeddings=64)
DENSE = 1 << 30  # a query block larger than any patch count: the one-block (dense) path


def _jitted():
    """A fresh jit of the tower (the block size is read at trace time; a shared jit would reuse
    one trace for both block sizes)."""
    return jax.jit(lambda w, pixels, layout: vision_forward(w, TINY, pixels, layout))


def _temp_bytes(monkeypatch, patches: int, block: int) -> int:
    """XLA's scratch for the tower over one image of ``patches`` patches (a 64-row grid)."""
    monkeypatch.setattr(vision_qwen, "VISION_QUERY_BLOCK", block)
    layout = vision_layout(TINY, [(1, 64, patches // 64)])
    as_struct = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    args = (shape_structs(vision_specs(TINY), jnp.float32), jax.ShapeDtypeStruct((patches, TINY.patch_dim), jnp.float32),
            jax.tree.map(as_struct, layout))
    return _jitted().lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_scratch_grows_linearly(monkeypatch):
    """Doubling 4096 -> 8192 patches doubles the blocked tower's scratch (ratio < 2.5), where the
    dense path's quadruples (> 3.5) and is several times larger."""
    blocked = [_temp_bytes(monkeypatch, p, vision_qwen.VISION_QUERY_BLOCK) for p in (4096, 8192)]
    dense = [_temp_bytes(monkeypatch, p, DENSE) for p in (4096, 8192)]
    assert dense[1] / dense[0] > 3.5, dense
    assert blocked[1] / blocked[0] < 2.5, blocked
    assert dense[1] > 4 * blocked[1], (dense, blocked)


def _reference(q, k, v, segment) -> np.ndarray:
    """Attention computed segment by segment in numpy (float64), padding rows zero."""
    q, k, v = (np.asarray(a, np.float64)[0] for a in (q, k, v))  # [P, N, H]
    out = np.zeros_like(q)
    for s in set(segment.tolist()) - {-1}:
        rows = np.flatnonzero(segment == s)
        scores = np.einsum("tnh,snh->nts", q[rows], k[rows]) / np.sqrt(q.shape[-1])
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[rows] = np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), v[rows])
    return out


def test_blocked_equals_dense_within_segments():
    """Two images of different sizes (300 and 172 patches) and 68 padding patches, in query blocks
    of 64 (blocks straddle the image boundary; the last block is all padding) and in one block:
    both equal a per-image reference, padding rows are zero."""
    rng = np.random.default_rng(0)
    P, N, H = 540, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((1, P, N, H)), jnp.float32) for _ in range(3))
    segment = np.full(P, -1, np.int32)
    segment[:300], segment[300:472] = 0, 1
    ref = _reference(q, k, v, segment)
    blocked = np.asarray(jax.jit(segment_attention, static_argnums=4)(q, k, v, jnp.asarray(segment), 64))[0]
    dense = np.asarray(segment_attention(q, k, v, jnp.asarray(segment), DENSE))[0]
    np.testing.assert_allclose(blocked, ref, atol=1e-5)
    np.testing.assert_allclose(blocked, dense, atol=1e-6)
    assert not np.any(blocked[472:])


@pytest.mark.parametrize("bucket", [1024, 1100])
def test_tower_blocked_equals_dense(monkeypatch, bucket):
    """The whole tower over two images of different grids, padded to ``bucket`` patches (1100: not
    a multiple of the block), in blocks of 256 against one block: equal to fp32 rounding."""
    grids = [(1, 24, 20), (1, 16, 12)]
    layout = jax.tree.map(jnp.asarray, vision_layout(TINY, grids, bucket))
    w = init_weights(vision_specs(TINY), jax.random.key(0), scale=0.2)
    pixels = jnp.asarray(np.random.default_rng(1).standard_normal((bucket, TINY.patch_dim)), jnp.float32)
    outs = []
    for block in (256, DENSE):
        monkeypatch.setattr(vision_qwen, "VISION_QUERY_BLOCK", block)
        outs.append(np.asarray(_jitted()(w, pixels, layout)[0]))
    scale = np.abs(outs[1]).max()
    assert scale > 0 and np.abs(outs[0] - outs[1]).max() / scale < 1e-6


def test_patch_buckets():
    """Powers of two up to 2048 patches, then four buckets per octave: every bucket at least the
    patches, a multiple of the merge unit and (above one block) of the query block, at most 25%
    padding above 2048 (896 px: 3136 patches in 3584), a bounded set up to Qwen's 65536 cap."""
    from types import SimpleNamespace

    from dayzero.engine.vision_step import MIN_PATCH_BUCKET, patch_bucket
    config = SimpleNamespace(vision=TINY)
    block = vision_qwen.VISION_QUERY_BLOCK
    assert [patch_bucket(config, n) for n in (1, 65, 900, 2048, 2049, 3136, 4097)] == [
        MIN_PATCH_BUCKET, 128, 1024, 2048, 2560, 3584, 5120]
    buckets = {patch_bucket(config, n) for n in range(1, 65537)}
    assert len(buckets) <= 30 and max(buckets) == 65536
    for n in range(1, 65537, 7):
        b = patch_bucket(config, n)
        assert b >= n and b % TINY.merge_unit == 0 and (b <= block or b % block == 0)
        assert b <= max(MIN_PATCH_BUCKET, 2 * n if n <= 2048 else 1.25 * n), (n, b)
