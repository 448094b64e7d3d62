"""The gated delta rule kernels (``dayzero.kernels.delta_rule``) against the model's references.

Interpret mode on CPU (tiny shapes: dk 16, dv 32 in two 16-wide value tiles, chunks of 16-32):
the chunked kernel against ``delta_rule_chunked`` and, as the independent oracle (no chunking, no
WY transform, no triangular solve), against the token-by-token ``delta_rule_recurrent``; the decode
kernel against ``delta_rule_recurrent``. Every case pads some rows (ragged num_new, including 0)
and poisons their padding tokens with NaN, which must never reach an output or the state.

Tolerances: fp32 paths differ in summation order and in how the triangular system is solved
(block doubling against ``solve_triangular``): 2e-5 on outputs and states of size ~1. In bf16 both
read the same bf16 inputs and compute in fp32; only the output's final rounding differs, by at
most one bf16 ulp (2^-8 relative): 2^-6 as the other kernel tests.

Also: the validators, the CUDA lowering at realistic sizes (Hv = 32, dk = dv = 128, chunk 64;
kernels/check.py, no GPU needed) and, on a GPU only, the compiled kernels against the references.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import KernelError
from dayzero.kernels.check import triton_calls
from dayzero.kernels.delta_rule import (DeltaBlocks, chunked_delta_rule, chunked_delta_rule_pallas,
                                        chunked_delta_rule_reference, recurrent_delta_step,
                                        recurrent_delta_step_pallas, recurrent_delta_step_reference)
from dayzero.model import delta_rule as model

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

INTERPRET = "pallas_interpret"
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
SDS = jax.ShapeDtypeStruct
TOL = {F32: 2e-5, BF16: 2**-6}
ON_GPU = jax.default_backend() == "gpu"


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` jitted as one computation (eager dispatch of the interpreted
    kernels costs seconds in compiles of tiny ops)."""
    return jax.jit(functools.partial(fn, **kwargs))(*args)


def delta_inputs(rng, B, T, Hk, Hv, dk, dv, per_channel, dtype=F32, num_new=None, with_state=True, decay=0.5):
    """(q, k, v, g, beta, state, num_new) as numpy; g = -decay * lognormal (<= 0, per head or per key
    channel), beta in (0, 1); every padding token (t >= num_new[b]) is NaN in all five inputs."""
    q, k = (rng.standard_normal((B, T, Hk, dk), np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, Hv, dv), np.float32)
    g = -decay * np.exp(rng.standard_normal((B, T, Hv, dk) if per_channel else (B, T, Hv))).astype(np.float32)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hv)))).astype(np.float32)
    state = rng.standard_normal((B, Hv, dk, dv), np.float32) if with_state else None
    arrays = [q, k, v, g, beta]
    if num_new is not None:
        pad = np.arange(T)[None, :] >= np.asarray(num_new)[:, None]
        arrays = [np.where(pad.reshape(B, T, *([1] * (a.ndim - 2))), np.nan, a) for a in arrays]
        num_new = np.asarray(num_new, np.int32)
    q, k, v = (a.astype(jnp.dtype(dtype)) for a in arrays[:3])
    return q, k, v, arrays[3].astype(np.float32), arrays[4].astype(np.float32), state, num_new


def assert_close(actual, expected, dtype):
    """(out, state) pairs: out in ``dtype``, state fp32, no NaN, within TOL[dtype]."""
    (out, state), (out_ref, state_ref) = actual, expected
    assert out.dtype == out_ref.dtype == jnp.dtype(dtype) and state.dtype == state_ref.dtype == F32
    for a, e in ((out, out_ref), (state, state_ref)):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert not np.isnan(a).any()
        np.testing.assert_allclose(a, e, rtol=TOL[dtype], atol=TOL[dtype])


# --- chunked (prefill), interpret mode ---

DECAYS = {"gdn": False, "kda": True}
# Decay kind x dtype: both decays in fp32; bf16 (a load-time cast, the same for both) with per-head decay.
CASES = {"gdn-fp32": (False, F32), "kda-fp32": (True, F32), "gdn-bf16": (False, BF16)}
# The bf16 case runs under -m slow (suite time): the fp32 cases check the same kernel code.
CASE_PARAMS = [pytest.param(*v, id=k, marks=pytest.mark.slow) if "bf16" in k else pytest.param(*v, id=k)
               for k, v in CASES.items()]


@pytest.mark.parametrize("decay, dtype", CASE_PARAMS)
def test_chunked_grouped_heads_ragged(decay, dtype):
    """GQA-style heads (Hk=2 serve Hv=4), T=37 (two full chunks of 16 and a partial one), an
    initial state, rows with 37, 20 (ends mid-chunk) and 0 real tokens (state passes through,
    outputs 0); against the chunked reference and the token-by-token recurrence."""
    rng = np.random.default_rng(0)
    args = delta_inputs(rng, 3, 37, 2, 4, 16, 32, decay, dtype, num_new=[37, 20, 0])
    actual = run(chunked_delta_rule, *args, chunk=16, mode=INTERPRET)
    assert_close(actual, run(chunked_delta_rule_reference, *args, chunk=16), dtype)
    assert_close(actual, run(model.delta_rule_recurrent, *args), dtype)
    np.testing.assert_array_equal(np.asarray(actual[1][2]), args[5][2])  # no real token: state untouched
    out = np.asarray(actual[0], np.float32)
    assert not out[1, 20:].any() and not out[2].any()  # padding tokens read out 0


@pytest.mark.slow  # 5 s (suite time); the reference's strong-decay case is checked against HF by default
@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
def test_chunked_fresh_state_strong_decay(decay):
    """No initial state, all tokens real (num_new None), Hk == Hv (Kimi's layout), chunks of 32
    over T = 70 and a strong decay (log decays down to about -100 per token: cumulative decays
    underflow inside a chunk, where a factored exp(gamma_i) * exp(-gamma_j) would overflow)."""
    rng = np.random.default_rng(1)
    args = delta_inputs(rng, 2, 70, 2, 2, 16, 32, decay, with_state=False, decay=8.0)
    assert_close(run(chunked_delta_rule_pallas, *args, chunk=32, interpret=True),
                 run(model.delta_rule_recurrent, *args), F32)


@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
def test_chunked_short_prompt_and_alike_keys(decay):
    """T = 5 < chunk (one chunk of 16, 11 tokens past T) with ragged rows; then keys that are
    nearly the same vector, beta ~ 1 and almost no decay, the case where the triangular system is
    worst conditioned (powers of L grow like binomials; the solve must not form them)."""
    rng = np.random.default_rng(2)
    args = delta_inputs(rng, 2, 5, 1, 2, 16, 16, decay, num_new=[5, 3])
    assert_close(run(chunked_delta_rule, *args, mode=INTERPRET), run(model.delta_rule_recurrent, *args), F32)

    q, k, v, g, beta, state, _ = delta_inputs(rng, 1, 64, 2, 2, 16, 16, decay, decay=1e-4)
    k = (k[:, :1] + 1e-3 * k).astype(np.float32)
    beta = np.full_like(beta, 0.999)
    args = (q, k, v, g, beta, state, None)
    assert_close(run(chunked_delta_rule, *args, chunk=32, mode=INTERPRET), run(model.delta_rule_recurrent, *args),
                 F32)


@pytest.mark.slow
@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
def test_chunked_chunk64_wider_heads(decay):
    """The GPU's chunk of 64 (five doubling levels) at dk = 32, dv = 64 in 32-wide tiles over
    T = 200 with ragged rows and a grouped layout."""
    rng = np.random.default_rng(3)
    args = delta_inputs(rng, 2, 200, 1, 2, 32, 64, decay, num_new=[200, 130])
    actual = run(chunked_delta_rule_pallas, *args, chunk=64, interpret=True, blocks=DeltaBlocks(block_v=32))
    assert_close(actual, run(model.delta_rule_chunked, *args, chunk=64), F32)
    assert_close(actual, run(model.delta_rule_recurrent, *args), F32)


# --- recurrent (decode), interpret mode ---


@pytest.mark.parametrize("decay, dtype", CASE_PARAMS)
def test_step_decode_ragged(decay, dtype):
    """Decode: one token per row, a row with none (a padding slot: state untouched, output 0);
    then a 3-token verify step with rows of 3, 1 and 0 real tokens."""
    rng = np.random.default_rng(4)
    for T, num_new in ((1, [1, 0, 1]), (3, [3, 1, 0])):
        args = delta_inputs(rng, 3, T, 2, 4, 16, 32, decay, dtype, num_new=num_new)
        actual = run(recurrent_delta_step, *args, mode=INTERPRET)
        assert_close(actual, run(recurrent_delta_step_reference, *args), dtype)
        silent = num_new.index(0)
        np.testing.assert_array_equal(np.asarray(actual[1][silent]), args[5][silent])
        assert not np.asarray(actual[0], np.float32)[silent].any()


def test_step_without_state_continues_a_prefill():
    """Prefill 20 tokens with the chunked kernel, then decode 2 tokens with the step kernel from
    its state: the same as the recurrence over all 22 (also: no initial state, per-head decay)."""
    rng = np.random.default_rng(5)
    q, k, v, g, beta, _, _ = delta_inputs(rng, 2, 22, 2, 4, 16, 32, False, with_state=False)
    out, state = run(chunked_delta_rule, q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], None, None,
                     mode=INTERPRET)
    tail = run(recurrent_delta_step, q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], state, None,
               mode=INTERPRET)
    expected = run(model.delta_rule_recurrent, q, k, v, g, beta, None, None)
    assert_close((jnp.concatenate([out, tail[0]], axis=1), tail[1]), expected, F32)


# --- dispatch and validation ---


def test_modes_dispatch():
    """mode=reference is the model's code; pallas on a CPU is refused, not silently replaced."""
    rng = np.random.default_rng(6)
    args = delta_inputs(rng, 1, 3, 1, 2, 16, 16, False)
    for ours, theirs in ((functools.partial(chunked_delta_rule, chunk=16), functools.partial(
            model.delta_rule_chunked, chunk=16)), (recurrent_delta_step, model.delta_rule_recurrent)):
        for a, e in zip(run(ours, *args, mode="reference"), run(theirs, *args)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
        if not ON_GPU:
            with pytest.raises(KernelError, match="cannot run on cpu"):
                ours(*args, mode="pallas")


GOOD = dict(q=SDS((2, 5, 2, 16), F32), k=SDS((2, 5, 2, 16), F32), v=SDS((2, 5, 4, 32), F32),
            g=SDS((2, 5, 4), F32), beta=SDS((2, 5, 4), F32), state=None, num_new=None)

BAD_CALLS = {
    "q rank": (dict(q=SDS((2, 5, 16), F32)), r"q must be \[B,T,Hk,dk\], got shape \(2, 5, 16\)"),
    "k shape": (dict(k=SDS((2, 5, 2, 8), F32)), r"k has shape \(2, 5, 2, 8\) but q has \(2, 5, 2, 16\)"),
    "v length": (dict(v=SDS((2, 6, 4, 32), F32)), r"v has shape \(2, 6, 4, 32\), expected \[B=2, T=5"),
    "heads": (dict(v=SDS((2, 5, 3, 32), F32), g=SDS((2, 5, 3), F32), beta=SDS((2, 5, 3), F32)),
              "3 value heads are not a multiple of 2 query/key heads"),
    "v dtype": (dict(v=SDS((2, 5, 4, 32), BF16)), "v has dtype bfloat16 but q has float32"),
    "g shape": (dict(g=SDS((2, 5, 4, 32), F32)), r"g has shape \(2, 5, 4, 32\), expected \[B,T,Hv\]"),
    "beta shape": (dict(beta=SDS((2, 5, 2), F32)),
                   r"beta has shape \(2, 5, 2\), expected \[B,T,Hv\] = \(2, 5, 4\)"),
    "state dtype": (dict(state=SDS((2, 4, 16, 32), BF16)), r"state must be float32 \[B,Hv,dk,dv\]"),
    "state shape": (dict(state=SDS((2, 4, 32, 16), F32)),
                    r"state must be float32 .*got float32\[2, 4, 32, 16\]"),
    "num_new": (dict(num_new=SDS((2,), F32)), r"num_new must be int32 \[B=2\], got float32"),
}


@pytest.mark.parametrize("case", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_validators_name_the_bad_input(case):
    """Both ops, reference and kernel wrapper alike, reject the input before any work."""
    changes, message = case
    args = list({**GOOD, **changes}.values())
    for fn in (chunked_delta_rule_reference, recurrent_delta_step_reference,
               functools.partial(chunked_delta_rule_pallas, interpret=True),
               functools.partial(recurrent_delta_step_pallas, interpret=True)):
        with pytest.raises(KernelError, match=message):
            fn(*args)


def test_pallas_sizes_point_at_the_reference():
    """Sizes Triton cannot tile are refused by the kernel with the way out; the reference runs them."""
    rng = np.random.default_rng(7)
    args = delta_inputs(rng, 1, 4, 1, 1, 24, 16, False)
    with pytest.raises(KernelError, match=r"dk=24 must be a power of two >= 16.*--kernels reference"):
        chunked_delta_rule_pallas(*args, interpret=True)
    with pytest.raises(KernelError, match=r"dk=24 must be a power of two >= 1.*--kernels reference"):
        recurrent_delta_step_pallas(*args, interpret=True)
    assert run(chunked_delta_rule_reference, *args, chunk=16)[0].shape == (1, 4, 1, 16)
    args = delta_inputs(rng, 1, 4, 1, 1, 16, 16, False)
    with pytest.raises(KernelError, match=r"chunk=24 must be a power of two >= 16.*chunk=64.*--kernels refer"):
        chunked_delta_rule_pallas(*args, chunk=24, interpret=True)
    with pytest.raises(KernelError, match=r"chunk must be a positive int, got 0"):
        chunked_delta_rule_reference(*args, chunk=0)
    args = delta_inputs(rng, 1, 4, 1, 1, 16, 40, False)
    with pytest.raises(KernelError, match=r"dv=40 gives value tiles of 16.*--kernels reference"):
        chunked_delta_rule_pallas(*args, interpret=True)
    # dv = 8: the decode kernel tiles it (no matrix products), the chunked one cannot.
    args = delta_inputs(rng, 1, 1, 1, 1, 16, 8, False)
    assert run(recurrent_delta_step_pallas, *args, interpret=True)[0].shape == (1, 1, 1, 8)
    with pytest.raises(KernelError, match=r"dv=8 gives value tiles of 8.* >= 16 that divide dv"):
        chunked_delta_rule_pallas(*args, interpret=True)


# --- GPU lowering, checked without a GPU (the Python half of Pallas Triton compilation) ---


def _prefill_avals(B, T, Hk, Hv, dk, dv, per_channel, dtype):
    return (SDS((B, T, Hk, dk), dtype), SDS((B, T, Hk, dk), dtype), SDS((B, T, Hv, dv), dtype),
            SDS((B, T, Hv, dk) if per_channel else (B, T, Hv), F32), SDS((B, T, Hv), dtype),
            SDS((B, Hv, dk, dv), F32), SDS((B,), I32))


LOWERING_CASES = {
    # Qwen3-Next's GDN: 16 q/k heads, 32 value heads, dk = dv = 128.
    "chunked gdn bf16": (functools.partial(chunked_delta_rule_pallas, chunk=64),
                         _prefill_avals(2, 1000, 16, 32, 128, 128, False, BF16)),
    # Kimi-Linear's KDA: 32 heads, per-channel decay.
    "chunked kda bf16": (functools.partial(chunked_delta_rule_pallas, chunk=64),
                         _prefill_avals(1, 700, 32, 32, 128, 128, True, BF16)),
    "chunked gdn fp32 no state": (lambda q, k, v, g, b: chunked_delta_rule_pallas(q, k, v, g, b, None, None),
                                  _prefill_avals(1, 300, 4, 8, 128, 128, False, F32)[:5]),
    "decode gdn": (recurrent_delta_step_pallas, _prefill_avals(64, 1, 16, 32, 128, 128, False, BF16)),
    "decode kda": (recurrent_delta_step_pallas, _prefill_avals(64, 1, 32, 32, 128, 128, True, BF16)),
    "verify 4 tokens": (recurrent_delta_step_pallas, _prefill_avals(8, 4, 16, 32, 128, 128, False, BF16)),
}


@pytest.mark.parametrize("case", LOWERING_CASES.values(), ids=LOWERING_CASES.keys())
def test_kernels_lower_for_gpu(case):
    """Each kernel, at the GPU table's tiles and realistic sizes, lowers to one Pallas Triton call."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    fn, avals = case
    assert triton_calls(fn, *avals) == 1


# --- compiled on a GPU (skipped elsewhere) ---


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to compile the Pallas kernels")
@pytest.mark.parametrize("decay, dtype", CASES.values(), ids=CASES.keys())
def test_compiled_kernels_match_reference_on_gpu(decay, dtype):
    """Prefill over 1000 tokens (ragged: 1000, 517 and 0 real) at Qwen3-Next's head layout and
    chunk 64, then a decode step from its state, compiled, against the references in full fp32.
    The kernels' fp32 products are 3xTF32: 5e-4 allows for that over 16 chunks."""
    tol = 5e-4 if dtype == F32 else 2**-6
    rng = np.random.default_rng(8)
    Hk = 32 if decay else 16
    args = delta_inputs(rng, 3, 1000, Hk, 32, 128, 128, decay, dtype, num_new=[1000, 517, 0])
    step = delta_inputs(rng, 3, 1, Hk, 32, 128, 128, decay, dtype, num_new=[1, 1, 0])
    for name, op, arrays in (("chunked", functools.partial(chunked_delta_rule, chunk=64), args),
                             ("decode", recurrent_delta_step, step)):
        with jax.default_matmul_precision("float32"):  # the reference in full fp32, not TF32
            expected = jax.jit(lambda *a: op(*a, mode="reference"))(*arrays)
        actual = jax.jit(lambda *a: op(*a, mode="pallas"))(*arrays)
        for a, e, what in zip(actual, expected, ("out", "state")):
            a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
            assert not np.isnan(a).any(), (name, what)
            np.testing.assert_allclose(a, e, rtol=tol, atol=tol, err_msg=f"{name} {what}")
