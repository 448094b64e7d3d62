"""DeepSeek-V4's hyper-connections (``dayzero.model.hyper``) against HF's modules, fp32 on CPU.

The oracle is the ``attn_hc`` / ``ffn_hc`` (``DeepseekV4HyperConnection``) of layers of the tiny
randomised HF model (tests/v4_helpers.py: random hc base and scale) and its ``hc_head``
(``DeepseekV4HyperHead``), on random streams [2,7,4,64]. ``mix`` is compared with the module's
(post, comb, collapsed); ``merge`` with the decoder layer's
``post * out + comb.T @ streams``; ``head`` with the head module. The fn weights are also tried
scaled up x4, so the gates differ strongly from token to token (with HF's init the projected
mixes are ~0.3 and the gates sit near their bias). Wrong variants (Sinkhorn ending on a row
normalisation, comb not transposed in the merge) are checked to fail the same tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dayzero.model import hyper
from dayzero.model.config import HyperConfig
from dayzero.model.compressed_weights import HyperWeights
from tests.v4_helpers import tiny_hf_model

TOL = 1e-5  # fp32, relative to the largest magnitude of the reference


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


def _config(hf, iters: int | None = None) -> HyperConfig:
    c = hf.config
    return HyperConfig(mult=c.hc_mult, sinkhorn_iters=iters or c.hc_sinkhorn_iters, eps=c.hc_eps)


def _streams(seed: int) -> np.ndarray:
    """Random streams [2,7,4,64], with a different RMS per token so the norm matters."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 7, 4, 64)).astype(np.float32)
    return x * rng.uniform(0.1, 5.0, (2, 7, 1, 1)).astype(np.float32)


def _close(ours, ref, label: str) -> None:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (label, ours.shape, ref.shape)
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err < TOL, f"{label}: relative error {err:.2e}"


def _weights(module, fn_scale: float) -> HyperWeights:
    j = lambda t: jnp.asarray(t.detach().numpy())  # noqa: E731
    return HyperWeights(fn=j(module.fn) * fn_scale, base=j(module.base), scale=j(module.scale))


def _hf_mix(module, streams: np.ndarray, fn_scale: float, iters: int | None = None):
    """HF's (post, comb, collapsed) with the module's fn scaled by ``fn_scale`` and, if given,
    ``iters`` Sinkhorn iterations (both restored after)."""
    saved_fn, saved_iters = module.fn.detach().clone(), module.hc_sinkhorn_iters
    with torch.no_grad():
        module.fn.mul_(fn_scale)
        module.hc_sinkhorn_iters = iters or saved_iters
        try:
            post, comb, collapsed = module(torch.from_numpy(streams))
        finally:
            module.fn.copy_(saved_fn)
            module.hc_sinkhorn_iters = saved_iters
    return post.numpy(), comb.numpy(), collapsed.numpy()


# (layer, module, fn scale, Sinkhorn iterations): HF's 20 iterations converge, which hides the
# order of the normalisations; 2 iterations (col, row, col) do not, so the order is checked there.
CASES = [(0, "attn_hc", 1.0, None), (3, "ffn_hc", 4.0, None), (1, "attn_hc", 4.0, 2)]


@pytest.mark.parametrize("layer,name,fn_scale,iters", CASES)
def test_mix_and_merge_match_hf(hf, layer, name, fn_scale, iters):
    """``mix`` gives HF's post, comb (after Sinkhorn) and collapsed block input; ``merge`` gives
    the decoder layer's new streams for a random block output."""
    module = getattr(hf.model.layers[layer], name)
    streams = _streams(layer)
    post, comb, collapsed = _hf_mix(module, streams, fn_scale, iters)
    eps = hf.config.rms_norm_eps
    got_in, got_post, got_comb = jax.jit(hyper.mix, static_argnums=(1, 3))(
        _weights(module, fn_scale), _config(hf, iters), jnp.asarray(streams), eps)
    _close(got_post, post, "post")
    _close(got_comb, comb, "comb")
    _close(got_in, collapsed, "block input")
    assert np.ptp(comb[..., 0, 1]) > 1e-3, "the comb matrices barely differ between tokens: the test would be weak"

    out = np.random.default_rng(9).standard_normal((2, 7, 64)).astype(np.float32)
    with torch.no_grad():
        p, c, s, o = (torch.from_numpy(a) for a in (post, comb, streams, out))
        ref = p.unsqueeze(-1) * o.unsqueeze(-2) + torch.matmul(c.transpose(-1, -2), s)
    got = jax.jit(hyper.merge)(jnp.asarray(streams), jnp.asarray(out), got_post, got_comb)
    _close(got, ref.numpy(), "merged streams")


def _head_weights(hf) -> HyperWeights:
    j = lambda t: jnp.asarray(t.detach().numpy())  # noqa: E731
    m = hf.model.hc_head
    return HyperWeights(fn=j(m.hc_fn), base=j(m.hc_base), scale=j(m.hc_scale))


def test_head_matches_hf(hf):
    """``head`` collapses the streams as HF's ``hc_head``."""
    module = hf.model.hc_head
    streams = _streams(5)
    with torch.no_grad():
        ref = module(torch.from_numpy(streams)).numpy()
    head = jax.jit(hyper.head, static_argnums=(1, 3))
    got = head(_head_weights(hf), _config(hf), jnp.asarray(streams), hf.config.rms_norm_eps)
    _close(got, ref, "head")


def test_expand_and_dtypes(hf):
    """``expand`` copies the embedding to every stream; bf16 streams keep their dtype through
    mix (block input), merge and head, while post/comb stay fp32."""
    config = _config(hf)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 64)), jnp.bfloat16)
    streams = hyper.expand(x, config)
    assert streams.shape == (2, 3, 4, 64) and bool(jnp.all(streams == x[:, :, None, :]))
    module = hf.model.layers[0].attn_hc
    block_in, post, comb = jax.eval_shape(lambda s: hyper.mix(_weights(module, 1.0), config, s, 1e-6), streams)
    assert block_in.dtype == jnp.bfloat16 and post.dtype == comb.dtype == jnp.float32
    assert jax.eval_shape(hyper.merge, streams, block_in, post, comb).dtype == jnp.bfloat16
    assert jax.eval_shape(lambda s: hyper.head(_head_weights(hf), config, s, 1e-6), streams).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="hc_mult=4"):
        hyper.mix(_weights(module, 1.0), config, streams[:, :, :3], 1e-6)


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def test_wrong_variants_fail(hf, monkeypatch):
    """The tolerance can fail: Sinkhorn as ``iters`` (column, row) pairs, i.e. ending on rows
    (HF: a column normalisation, then iters-1 (row, column) pairs), at 2 iterations, and a merge
    with comb not transposed are both far outside it. (Rows-first would not do: the softmax has
    already normalised the rows, so a leading row step changes almost nothing.)"""
    def rows_last(comb, iters, eps):
        for _ in range(iters):
            comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
            comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
        return comb

    module = hf.model.layers[1].attn_hc
    streams = _streams(1)
    _, comb, _ = _hf_mix(module, streams, 4.0, iters=2)
    with monkeypatch.context() as m:
        m.setattr(hyper, "sinkhorn", rows_last)
        # a fresh function: jit's trace cache would otherwise hand back the real mix's trace
        mix = jax.jit(lambda w, s: hyper.mix(w, _config(hf, 2), s, hf.config.rms_norm_eps))
        _, post, got = mix(_weights(module, 4.0), jnp.asarray(streams))
    assert _rel(got, comb) > 10 * TOL, "Sinkhorn ending on rows passes: the comparison cannot tell"

    out, merge = jnp.ones((2, 7, 64)), jax.jit(hyper.merge)
    ref = np.asarray(merge(jnp.asarray(streams), out, post, jnp.asarray(comb)))
    untransposed = merge(jnp.asarray(streams), out, post, jnp.swapaxes(jnp.asarray(comb), -1, -2))
    assert _rel(untransposed, ref) > 10 * TOL, "comb and comb.T merge alike: the merge check cannot tell"
