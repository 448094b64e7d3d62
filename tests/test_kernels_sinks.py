"""Attention sinks (gpt-oss): the references against HF's own gpt_oss attention, the kernels
(interpret mode) against the references, and the sink counted once across the paged kernel's
splits.

HF's ``eager_attention_forward`` (transformers/models/gpt_oss) appends each query head's sink
logit to the row of scaled, masked scores, subtracts the row max, softmaxes and drops the sink's
column: a key that is always visible with value zero. It runs here in float64 as the oracle.
A row whose keys are all masked gives zeros there (the finite sink beats HF's finfo.min mask), as
in ours. Shapes are tiny for interpret mode; the helpers, tolerances and the quick-compile
fixture are test_kernels_attention.py's.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import (KernelError, flash_attention, flash_attention_pallas, flash_attention_reference,
                             paged_attention, paged_attention_pallas, paged_attention_reference)
from dayzero.kernels.check import triton_calls
from dayzero.kernels.flash_attention import FlashBlocks
from tests.test_kernels_attention import (HEADS, INTERPRET, SPLITS, TOL, WIDE_SPLITS, assert_close, flash_inputs,
                                          normal, paged_inputs, ragged_rows, run)

SDS = jax.ShapeDtypeStruct
ON_GPU = jax.default_backend() == "gpu"
pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)


def head_sinks(rng, N, none_last=False):
    """Per-head sinks of both signs; head 0's (+4) outweighs most rows' keys, so a sink that
    is lost or counted twice moves the output well past the tolerances. ``none_last``: the
    last head's sink is -inf (no sink: exp(-inf) = 0 must not meet inf - inf anywhere)."""
    sinks = rng.standard_normal(N).astype(np.float32) * 2
    sinks[0] = 4.0
    if none_last:
        sinks[-1] = -np.inf
    return sinks


def hf_gpt_oss_attention(q, k, v, sinks, q_offsets, kv_lengths, window, causal=True):
    """HF's gpt_oss ``eager_attention_forward`` in float64 on q [B,T,N,H], k/v [B,S,K,H], with
    the additive mask HF builds (0 where visible, finfo.min elsewhere) from the masking
    contract written out here: key s < kv_length, s <= position (causal), position - s < window."""
    torch = pytest.importorskip("torch")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    pos = np.asarray(q_offsets)[:, None, None] + np.arange(T)[None, :, None]  # [B,T,1]
    s = np.arange(S)[None, None, :]
    visible = s < np.asarray(kv_lengths)[:, None, None]
    if causal:
        visible = visible & (s <= pos)
    if window is not None:
        visible = visible & (pos - s < window)
    mask = np.where(visible, 0.0, np.finfo(np.float64).min)[:, None]  # [B,1,T,S]
    t64 = lambda x: torch.from_numpy(np.asarray(x, np.float64))
    module = types.SimpleNamespace(num_key_value_groups=N // K, sinks=t64(sinks), training=False)
    out, _ = eager_attention_forward(module, t64(q).transpose(1, 2), t64(k).transpose(1, 2),
                                     t64(v).transpose(1, 2), t64(mask), scaling=H**-0.5)
    return out.numpy()  # [B,T,N,H]


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_hf_gpt_oss(window):
    """flash_attention_reference (fp32) with sinks equals HF's gpt_oss attention (float64), GQA,
    ragged rows: no keys at all (HF and ours give zeros), a chunk at offset 8, a full row; and
    paged_attention_reference, the same keys through a page table."""
    rng = np.random.default_rng(20)
    B, T, S = 3, 12, 20
    N, K, H = 4, 2, 16
    q_offsets, kv_lengths = np.array([0, 8, 8], np.int32), np.array([0, 20, 15], np.int32)
    q, k, v = (normal(rng, shape, jnp.float32) for shape in [(B, T, N, H), (B, S, K, H), (B, S, K, H)])
    sinks = head_sinks(rng, N)
    expected = hf_gpt_oss_attention(q, k, v, sinks, q_offsets, kv_lengths, window)
    assert not expected[0].any()  # HF: a row that sees no key gives zeros (all weight on the sink)
    ours = run(flash_attention_reference, q, k, v, q_offsets=q_offsets, kv_lengths=kv_lengths, window=window,
               sinks=sinks)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    assert not np.asarray(ours[0]).any()
    # Without the sinks the answer is different: the oracle sees them.
    plain = run(flash_attention_reference, q, k, v, q_offsets=q_offsets, kv_lengths=kv_lengths, window=window)
    assert np.abs(np.asarray(plain) - expected).max() > 0.1
    # Paged: 4 pages of 8 tokens per sequence, in a shuffled pool, the same keys.
    page, W = 8, 3
    tables = rng.permutation(B * W).reshape(B, W).astype(np.int32)
    kp, vp = (np.zeros((K, B * W, page, H), np.float32) for _ in range(2))
    for b in range(B):
        for w in range(W):
            chunk = slice(w * page, min((w + 1) * page, S))
            kp[:, tables[b, w], :chunk.stop - chunk.start] = k[b, chunk].transpose(1, 0, 2)
            vp[:, tables[b, w], :chunk.stop - chunk.start] = v[b, chunk].transpose(1, 0, 2)
    paged = run(paged_attention_reference, q, kp, vp, tables, kv_lengths, q_offsets=q_offsets, window=window,
                sinks=sinks)
    np.testing.assert_allclose(paged, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, dtype, window", [(HEADS["gqa"], jnp.float32, None), (HEADS["mqa"], jnp.bfloat16, 11)],
                         ids=["gqa-fp32", "mqa-bf16-window"])
def test_flash_kernel_sinks(heads, dtype, window):
    """The flash kernel with sinks (the last head's -inf) equals the reference: causal chunked
    prefill over ragged rows (no keys, full, a chunk at 8, one at 17), NaN in every padded key
    slot; with a window of 11 over 32-wide key blocks in the second case."""
    rng = np.random.default_rng(21)
    B, T, S = 4, 20, 37
    q_offsets = np.array([0, 0, 8, 17], np.int32)
    kv_lengths = np.array([0, 37, 28, 37], np.int32)
    q, k, v = flash_inputs(rng, B, T, S, heads, dtype, kv_lengths)
    kw = dict(q_offsets=q_offsets, kv_lengths=kv_lengths, window=window, sinks=head_sinks(rng, heads[0], True))
    expected = run(flash_attention_reference, q, k, v, **kw)
    if window:
        actual = run(flash_attention_pallas, q, k, v, interpret=True, blocks=FlashBlocks(block_q=16, block_k=32), **kw)
    else:
        actual = run(flash_attention, q, k, v, mode=INTERPRET, **kw)
    assert_close(actual, expected, dtype)
    assert not np.asarray(expected[0], np.float32).any()


@pytest.mark.parametrize("T, heads, dtype, window", [(5, HEADS["gqa"], jnp.float32, None),
                                                     (5, HEADS["mqa"], jnp.bfloat16, 5)], ids=["gqa-fp32", "mqa-bf16-window"])
def test_paged_kernel_sinks_split_three_ways(T, heads, dtype, window):
    """The paged kernel with sinks (the last head's -inf), its page list split three ways,
    equals the reference: ragged chunks of 5 (a row with no keys gives zeros; MQA's 20 rows
    span two row blocks), NaN in stale slots. The sink joins the merge of the splits once: a
    sink counted once per split is exp(sink) * 3 in the denominator, i.e. the reference with
    sinks + log 3, which is far from both."""
    rng = np.random.default_rng(22)
    kv_lengths, q_offsets = ragged_rows(T)
    q, k_pages, v_pages, tables = paged_inputs(rng, T, heads, dtype, kv_lengths)
    sinks = head_sinks(rng, heads[0], True)
    kw = dict(q_offsets=q_offsets, window=window)
    expected = run(paged_attention_reference, q, k_pages, v_pages, tables, kv_lengths, sinks=sinks, **kw)
    actual = run(paged_attention_pallas, q, k_pages, v_pages, tables, kv_lengths, interpret=True, blocks=SPLITS,
                 sinks=sinks, **kw)
    assert_close(actual, expected, dtype)
    assert not np.asarray(expected[0], np.float32).any()
    per_split = run(paged_attention_reference, q, k_pages, v_pages, tables, kv_lengths, sinks=sinks + np.float32(np.log(3.0)),
                    **kw)
    gap = np.abs(np.asarray(per_split, np.float32) - np.asarray(actual, np.float32)).max()
    assert gap > 10 * TOL[dtype], gap


def test_paged_kernel_sinks_decode():
    """Decode (T=1, the default offsets: the last key's position), a window of 6, two splits
    of four pages; the reference through the public op."""
    rng = np.random.default_rng(23)
    kv_lengths, _ = ragged_rows(1)
    q, k_pages, v_pages, tables = paged_inputs(rng, 1, HEADS["gqa"], jnp.float32, kv_lengths)
    kw = dict(window=6, sinks=head_sinks(rng, 4))
    expected = run(paged_attention, q, k_pages, v_pages, tables, kv_lengths, mode="reference", **kw)
    actual = run(paged_attention_pallas, q, k_pages, v_pages, tables, kv_lengths, interpret=True,
                 blocks=WIDE_SPLITS, **kw)
    assert_close(actual, expected, jnp.float32)


def test_sinks_of_minus_infinity_are_no_sinks():
    """A sink of -inf adds exp(-inf) = 0: the reference then equals its output without sinks,
    and a row with no keys still gives zeros, not NaN (the kernels meet a -inf head in the
    tests above)."""
    rng = np.random.default_rng(24)
    kv_lengths = np.array([0, 13], np.int32)
    q, k, v = flash_inputs(rng, 2, 9, 20, HEADS["gqa"], jnp.float32, kv_lengths)
    sinks = np.full((4,), -np.inf, np.float32)
    plain = run(flash_attention_reference, q, k, v, kv_lengths=kv_lengths)
    assert_close(run(flash_attention_reference, q, k, v, kv_lengths=kv_lengths, sinks=sinks), plain, jnp.float32)
    assert not np.asarray(plain[0]).any()


def _pallas_calls(fn, *args):
    """The pallas_call equations in ``fn``'s jaxpr (top level)."""
    return [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]


def test_without_sinks_the_kernels_are_unchanged():
    """sinks=None adds nothing: flash's kernel gets no sink operand (one more only with sinks),
    and the paged kernel's body is the same program with or without sinks (they join only the
    merge of the splits, outside it)."""
    rng = np.random.default_rng(25)
    sinks = head_sinks(rng, 4)
    q, k, v = flash_inputs(rng, 1, 16, 16, HEADS["gqa"], jnp.float32, np.array([16], np.int32))
    flash = lambda s: _pallas_calls(lambda q, k, v: flash_attention_pallas(q, k, v, sinks=s, interpret=True), q, k, v)
    assert [len(e.invars) for e in flash(None)] == [5]
    assert [len(e.invars) for e in flash(sinks)] == [6]
    kv_lengths, _ = ragged_rows(1)
    args = paged_inputs(rng, 1, HEADS["gqa"], jnp.float32, kv_lengths) + (kv_lengths,)
    paged = lambda s: _pallas_calls(lambda *a: paged_attention_pallas(*a, sinks=s, interpret=True), *args)
    (plain,), (sunk,) = paged(None), paged(sinks)
    assert str(plain.params["jaxpr"]) == str(sunk.params["jaxpr"])
    assert len(plain.invars) == len(sunk.invars)


def test_sinks_are_validated():
    """Sinks must be float32 [N], in both paths of both ops, before any work."""
    F32, I32 = jnp.float32, jnp.int32
    flash = (SDS((2, 5, 4, 16), F32), SDS((2, 7, 2, 16), F32), SDS((2, 7, 2, 16), F32))
    paged = (SDS((2, 3, 4, 16), F32), SDS((2, 9, 8, 16), F32), SDS((2, 9, 8, 16), F32), SDS((2, 3), I32),
             SDS((2,), I32))
    for arrays, fns in ((flash, (flash_attention_reference, flash_attention_pallas)),
                        (paged, (paged_attention_reference, paged_attention_pallas))):
        for bad, message in ((SDS((2,), F32), r"sinks must be float32 \[N=4\].*got float32\[2\]"),
                             (SDS((4,), jnp.bfloat16), r"sinks must be float32 \[N=4\].*got bfloat16\[4\]")):
            for fn in fns:
                kw = dict(interpret=True) if fn in (flash_attention_pallas, paged_attention_pallas) else {}
                with pytest.raises(KernelError, match=message):
                    fn(*arrays, sinks=bad, **kw)


# gpt-oss's shapes: 64 query heads over 8 kv heads of 64, a window of 128 on half the layers.
GPT_OSS_LOWERING = {
    "flash window": (lambda q, k, v, s, o, n: flash_attention_pallas(q, k, v, q_offsets=o, kv_lengths=n, window=128,
                                                                      sinks=s),
                     SDS((2, 300, 64, 64), jnp.bfloat16), SDS((2, 300, 8, 64), jnp.bfloat16),
                     SDS((2, 300, 8, 64), jnp.bfloat16), SDS((64,), jnp.float32), SDS((2,), jnp.int32),
                     SDS((2,), jnp.int32)),
    "flash 12 heads": (lambda q, k, v, s: flash_attention_pallas(q, k, v, sinks=s),
                       SDS((1, 64, 12, 64), jnp.float32), SDS((1, 64, 4, 64), jnp.float32),
                       SDS((1, 64, 4, 64), jnp.float32), SDS((12,), jnp.float32)),
    "paged decode": (lambda q, k, v, t, n, s: paged_attention_pallas(q, k, v, t, n, sinks=s),
                     SDS((8, 1, 64, 64), jnp.bfloat16), SDS((8, 600, 16, 64), jnp.bfloat16),
                     SDS((8, 600, 16, 64), jnp.bfloat16), SDS((8, 70), jnp.int32), SDS((8,), jnp.int32),
                     SDS((64,), jnp.float32)),
}


@pytest.mark.parametrize("case", GPT_OSS_LOWERING.values(), ids=GPT_OSS_LOWERING.keys())
def test_sink_kernels_lower_for_gpu(case):
    """With sinks, at gpt-oss's shapes (and a head count that is not a power of two), each
    kernel still lowers to one Pallas Triton call (the Python half of GPU compilation)."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    fn, *avals = case
    assert triton_calls(fn, *avals) == 1


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to compile the Pallas kernels")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_sink_kernels_match_reference_on_gpu(dtype):
    """Compiled kernels with sinks at gpt-oss's head layout (64 over 8, head dim 64), window
    128 and none, ragged rows with 0 keys, against the references."""
    rng = np.random.default_rng(26)
    tol = 1e-4 if dtype == jnp.float32 else 2**-6
    sinks = jnp.asarray(head_sinks(rng, 64))
    P, page, pps = 200, 16, 40
    tables = jnp.asarray(rng.permutation(P)[:3 * pps].reshape(3, pps), jnp.int32)
    lengths, offsets = jnp.array([0, page, 517], jnp.int32), jnp.array([0, 0, 477], jnp.int32)
    x = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    cases = [
        (flash_attention, (x(2, 300, 64, 64), x(2, 333, 8, 64), x(2, 333, 8, 64)),
         dict(q_offsets=jnp.array([0, 33], jnp.int32), kv_lengths=jnp.array([0, 333], jnp.int32))),
        (paged_attention, (x(3, 1, 64, 64), x(8, P, page, 64), x(8, P, page, 64), tables, lengths), {}),
        (paged_attention, (x(3, 40, 64, 64), x(8, P, page, 64), x(8, P, page, 64), tables, lengths),
         dict(q_offsets=offsets)),
    ]
    for op, arrays, kwargs in cases:
        for window in (None, 128):
            kw = dict(kwargs, window=window, sinks=sinks)
            with jax.default_matmul_precision("float32"):
                expected = jax.jit(lambda *a: op(*a, mode="reference", **kw))(*arrays)
            actual = jax.jit(lambda *a: op(*a, mode="pallas", **kw))(*arrays)
            np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                                       rtol=tol, atol=tol, err_msg=f"{op.__name__} window={window}")
