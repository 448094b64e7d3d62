"""The linear-attention reference (dayzero.model.delta_rule) against HF's pure-PyTorch Gated DeltaNet
(modeling_qwen3_next) and Kimi Delta Attention (modeling_kimi_linear) functions, fp32 on CPU.

Log-decays are drawn per head (and per key channel for KDA) from near 0 (-0.001 per token) to
strong (-10 and below), so a chunk's cumulative decay underflows fp32: the case where exp(-cumsum)
alone would overflow. Head dims differ (dk != dv) so a swapped state axis cannot pass.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dayzero.model.delta_rule import (
    causal_conv,
    delta_rule,
    delta_rule_chunked,
    delta_rule_recurrent,
    gated_rms_norm,
)
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_next import modeling_qwen3_next as qwen

# Small programs: XLA's optimisation passes cost more compile time than they save.
pytestmark = pytest.mark.usefixtures("quick_compiles")


def _torch_path(fn):
    """HF's torch implementation itself, past any hub-kernel / FLA dispatch wrapper."""
    return getattr(fn, "__wrapped__", fn)


HF_GDN_CHUNK = _torch_path(qwen.torch_chunk_gated_delta_rule)
HF_GDN_RECURRENT = _torch_path(qwen.torch_recurrent_gated_delta_rule)
HF_KDA_CHUNK = _torch_path(kimi.chunk_kimi_delta_attention)
HF_KDA_RECURRENT = _torch_path(kimi.recurrent_kimi_delta_attention)
HF_CONV = _torch_path(qwen.causal_conv1d_fn)
HF_CONV_STEP = _torch_path(qwen.causal_conv1d_update)

# (Hk, Hv, dk, dv): GDN with two value heads per key head; KDA as Kimi-Linear has it (Hk == Hv).
SHAPES = {"gdn": (2, 4, 16, 8), "kda": (4, 4, 16, 8)}
# Of the largest magnitude of the compared array. Measured: at most 5e-6 (fp32 against HF's fp32);
# the smallest deliberate fault tried (the decay or beta scaled by 0.99 in one place) gave 4e-4.
RTOL = 2e-5


def _assert_close(actual, expected, rtol=RTOL):
    """Assert max |actual - expected| <= rtol * max |expected| (and equal shapes)."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-6)
    err = float(np.abs(actual - expected).max())
    assert err <= rtol * scale, f"max error {err:.3g} over scale {scale:.3g} (rtol {rtol})"


def _inputs(kind, b, t, seed, with_state=True, shapes=None):
    """Random q, k, v, g, beta, state (numpy fp32) for ``kind`` "gdn" or "kda"."""
    hk, hv, dk, dv = shapes or SHAPES[kind]
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, t, hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    gshape = (b, t, hv) if kind == "gdn" else (b, t, hv, dk)
    # -softplus(randn) (~ -0.7) times a per-head (per-channel) strength from 0.005 to 8.
    strength = np.exp(rng.uniform(np.log(0.005), np.log(8.0), gshape[2:])).astype(np.float32)
    g = (-np.logaddexp(0.0, rng.standard_normal(gshape)) * strength).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, hv))))).astype(np.float32)
    state = rng.standard_normal((b, hv, dk, dv)).astype(np.float32) if with_state else None
    return q, k, v, g, beta, state


def _hf(kind, form, q, k, v, g, beta, state, chunk=64):
    """HF's output [B,T,Hv,dv] and final state, as numpy."""
    t = [torch.from_numpy(np.array(a)) for a in (q, k, v, g, beta)]
    init = None if state is None else torch.from_numpy(state.copy())
    kw = dict(initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if kind == "kda" and q.shape[2] != v.shape[2]:  # HF's KDA has no grouping: repeat as GDN does
        t[0], t[1] = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in t[:2])
    fn = {("gdn", "chunked"): HF_GDN_CHUNK, ("gdn", "recurrent"): HF_GDN_RECURRENT,
          ("kda", "chunked"): HF_KDA_CHUNK, ("kda", "recurrent"): HF_KDA_RECURRENT}[kind, form]
    if form == "chunked":
        kw["chunk_size"] = chunk
    with torch.no_grad():
        out, final = fn(*t, **kw)
    return out.numpy(), final.numpy()


def _ours(form, q, k, v, g, beta, state, num_new=None, chunk=64):
    args = [jnp.asarray(a) for a in (q, k, v, g, beta)]
    st = None if state is None else jnp.asarray(state)
    nn = None if num_new is None else jnp.asarray(num_new, jnp.int32)
    if form == "chunked":
        out, final = delta_rule_chunked(*args, st, nn, chunk=chunk)
    elif form == "recurrent":
        out, final = delta_rule_recurrent(*args, st, nn)
    else:
        out, final = delta_rule(*args, st, nn, chunk=chunk)
    return np.asarray(out), np.asarray(final)


# (kind, head shapes, T, chunk, with an initial state): GDN grouped, KDA as Kimi-Linear (Hk == Hv)
# and per-channel decay with grouped heads (HF's KDA then runs on repeat_interleaved q, k). Three
# rows and explicit lengths, as test_ragged_rows has, so the two share their compiled programs.
CHUNKED_CASES = [("gdn", SHAPES["gdn"], 37, 16, True), ("gdn", SHAPES["gdn"], 130, 64, False),
                 ("kda", SHAPES["kda"], 37, 16, True), ("kda", SHAPES["gdn"], 130, 64, False)]
B = 3


@pytest.mark.parametrize("kind,shapes,t,chunk,with_state", CHUNKED_CASES)
def test_chunked_matches_hf_chunked(kind, shapes, t, chunk, with_state):
    """delta_rule_chunked = HF's chunked form, T not a multiple of the chunk, with and without an
    initial state, grouped heads and per-channel decay."""
    inputs = _inputs(kind, B, t, seed=t + with_state, with_state=with_state, shapes=shapes)
    out, final = _ours("chunked", *inputs, num_new=[t] * B, chunk=chunk)
    hf_out, hf_final = _hf(kind, "chunked", *inputs, chunk=chunk)
    _assert_close(out, hf_out)
    _assert_close(final, hf_final)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_recurrent_matches_hf_recurrent(kind):
    """delta_rule_recurrent = HF's token-by-token form (from zeros: the pieces tests)."""
    inputs = _inputs(kind, B, 37, seed=7)
    out, final = _ours("recurrent", *inputs, num_new=[37] * B)
    hf_out, hf_final = _hf(kind, "recurrent", *inputs)
    _assert_close(out, hf_out)
    _assert_close(final, hf_final)


def test_pieces_equal_whole():
    """A sequence fed whole (HF chunked) = fed through delta_rule in pieces of 5, 1, 17 and 14
    tokens carrying the state from zeros: the recurrent form hands over to the chunked form (chunk
    8, so both padded chunks and several chunks per call) and back."""
    q, k, v, g, beta, _ = _inputs("gdn", 2, 37, seed=11, with_state=False)
    hf_out, hf_final = _hf("gdn", "chunked", q, k, v, g, beta, None, chunk=16)
    s, outs = None, []
    for a, b in [(0, 5), (5, 6), (6, 23), (23, 37)]:
        o, s = _ours("auto", q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s, chunk=8)
        outs.append(o)
    _assert_close(np.concatenate(outs, axis=1), hf_out)
    _assert_close(s, hf_final)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_ragged_rows(kind, form):
    """Rows of 37, 5 and 0 real tokens in one call: row 1's first 5 outputs and final state equal
    those 5 tokens run alone, row 2 keeps its state exactly, row 0 is the plain sequence; garbage
    in the padding (NaN values, strong decay, beta 1) changes nothing, and outputs stay finite."""
    t = 37
    q, k, v, g, beta, state = _inputs(kind, B, t, seed=5)
    v[1, 5:] = np.nan
    g[1, 5:] = -50.0
    beta[1, 5:] = 1.0
    num_new = np.array([t, 5, 0], np.int32)
    out, final = _ours(form, q, k, v, g, beta, state, num_new=num_new, chunk=16)
    assert np.isfinite(out).all()
    alone = tuple(a[1:2] for a in (q, k, v, g, beta, state))
    hf_out, hf_final = _hf(kind, "recurrent", *(a[:, :5] for a in alone[:5]), alone[5])
    _assert_close(out[1:2, :5], hf_out)
    _assert_close(final[1:2], hf_final)
    np.testing.assert_array_equal(final[2], state[2])
    whole_out, whole_final = _hf(kind, "recurrent", *(a[:1] for a in (q, k, v, g, beta, state)))
    _assert_close(out[:1], whole_out)
    _assert_close(final[:1], whole_final)


def test_no_new_tokens():
    """T = 0: no output, the state unchanged (both forms)."""
    q, k, v, g, beta, state = (jnp.asarray(a) for a in _inputs("gdn", 1, 0, seed=0))
    for fn in (delta_rule_chunked, delta_rule_recurrent):
        out, final = fn(q, k, v, g, beta, state, None)
        assert out.shape == (1, 0, 4, 8)
        np.testing.assert_array_equal(final, state)


def test_bf16_inputs():
    """bf16 q, k, v: computed in fp32 (= HF fp32 on the same bf16 values), output rounded once to
    bf16, state fp32."""
    q, k, v, g, beta, state = _inputs("gdn", 1, 20, seed=9)
    bf = [np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in (q, k, v)]
    expected, expected_final = _hf("gdn", "chunked", *bf, g, beta, state, chunk=8)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)] + [jnp.asarray(g), jnp.asarray(beta)]
    out, final = delta_rule_chunked(*args, jnp.asarray(state), None, chunk=8)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    _assert_close(out, expected, rtol=2**-8)  # one bf16 rounding
    _assert_close(final, expected_final)


# --- causal convolution ----------------------------------------------------------------------


def _conv_inputs(b, t, c=6, w=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, t, c)).astype(np.float32), rng.standard_normal((w, c)).astype(np.float32),
            rng.standard_normal((b, w - 1, c)).astype(np.float32))


def _hf_conv(x, weight):
    """HF's causal_conv1d_fn + SiLU over x [B,T,C] from zeros, as [B,T,C]."""
    with torch.no_grad():
        out = HF_CONV(torch.from_numpy(x.transpose(0, 2, 1).copy()), torch.from_numpy(weight.T.copy()),
                      None, activation="silu")
    return out.numpy().transpose(0, 2, 1)


def test_conv_whole_matches_hf():
    """A fresh sequence: causal_conv = causal_conv1d_fn; its state = the last W-1 inputs."""
    x, weight, _ = _conv_inputs(2, 11)
    out, state = causal_conv(jnp.asarray(x), jnp.asarray(weight), None, jnp.array([11, 11], jnp.int32))
    _assert_close(out, _hf_conv(x, weight))
    np.testing.assert_array_equal(state, x[:, -3:])


def test_conv_continuation_matches_hf():
    """Prefill continuing a state (HF: the state prepended, the convolution over both, the last T
    kept) and one-token steps (HF's causal_conv1d_update, whose state it updates in place)."""
    x, weight, state = _conv_inputs(2, 7, seed=1)
    out, new_state = causal_conv(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(state), None)
    _assert_close(out, _hf_conv(np.concatenate([state, x], axis=1), weight)[:, -7:])
    np.testing.assert_array_equal(new_state, x[:, -3:])

    hf_state = torch.from_numpy(state.transpose(0, 2, 1).copy())
    ours = jnp.asarray(state)
    for i in range(5):
        with torch.no_grad():
            hf_out = HF_CONV_STEP(torch.from_numpy(x[:, i, :, None].copy()), hf_state,
                                  torch.from_numpy(weight.T.copy()), None, "silu")
        out, ours = causal_conv(jnp.asarray(x[:, i : i + 1]), jnp.asarray(weight), ours, jnp.ones(2, jnp.int32))
        _assert_close(out[:, 0], hf_out.numpy()[..., 0])
        np.testing.assert_array_equal(ours, hf_state.numpy().transpose(0, 2, 1))


def test_conv_pieces_and_ragged():
    """Fed in pieces (a padded row, a row with none new) = fed whole."""
    x, weight, _ = _conv_inputs(2, 12, seed=2)
    whole = _hf_conv(x, weight)
    # Row 0 takes pieces of 5 then 7; row 1 takes 2 (padded to 5), then 0 (all padding), then 10.
    out0, s = causal_conv(jnp.asarray(x[:, :5]), jnp.asarray(weight), None, jnp.array([5, 2], jnp.int32))
    xb = np.stack([x[0, 5:12], np.full((7, 6), 1e6, np.float32)])
    out1, s = causal_conv(jnp.asarray(xb), jnp.asarray(weight), s, jnp.array([7, 0], jnp.int32))
    _assert_close(np.concatenate([out0[0], out1[0]]), whole[0])
    _assert_close(out0[1, :2], whole[1, :2])
    np.testing.assert_array_equal(s[1], np.concatenate([np.zeros((1, 6), np.float32), x[1, :2]]))
    out2, s = causal_conv(jnp.asarray(x[1:, 2:12]), jnp.asarray(weight), s[1:], jnp.array([10], jnp.int32))
    _assert_close(out2[0], whole[1, 2:])
    np.testing.assert_array_equal(s[0], x[1, -3:])


def test_conv_then_delta_rule_in_pieces():
    """A KDA layer's convolution and delta rule fed in pieces (3, 1, 17, 8 tokens), the conv state
    and the recurrent state carried from zeros = HF's convolution and chunked KDA over the whole."""
    h, _, d, dv = SHAPES["kda"]
    x, weight, _ = _conv_inputs(1, 29, c=2 * h * d + h * dv, seed=4)
    _, _, _, g, beta, _ = _inputs("kda", 1, 29, seed=4, with_state=False)

    def split(y):
        q, k, v = np.split(np.asarray(y), [h * d, 2 * h * d], axis=-1)
        return q.reshape(*q.shape[:2], h, d), k.reshape(*k.shape[:2], h, d), v.reshape(*v.shape[:2], h, dv)

    hf_out, hf_final = _hf("kda", "chunked", *split(_hf_conv(x, weight)), g, beta, None, chunk=8)
    conv_state, state, outs = None, None, []
    for a, b in [(0, 3), (3, 4), (4, 21), (21, 29)]:
        y, conv_state = causal_conv(jnp.asarray(x[:, a:b]), jnp.asarray(weight), conv_state, None)
        o, state = _ours("auto", *split(y), g[:, a:b], beta[:, a:b], state, chunk=8)
        outs.append(o)
    _assert_close(np.concatenate(outs, axis=1), hf_out)
    _assert_close(state, hf_final)


# --- gated RMS norm --------------------------------------------------------------------------


@pytest.mark.parametrize("activation,module", [("silu", qwen.Qwen3NextRMSNormGated),
                                               ("sigmoid", kimi.KimiLinearRMSNormGated)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_rms_norm_matches_hf(activation, module, dtype):
    """gated_rms_norm = HF's module (GDN: silu, KDA: sigmoid), fp32 and bf16 (weight in the model
    dtype, as loaded). In bf16 each activation follows its module's rounding: the results agree
    bit for bit here, where the other module's order differs in about a third of the entries; a
    1% allowance leaves room for a last-bit difference in rsqrt or the activation."""
    rng = np.random.default_rng(0)
    x, gate = (rng.standard_normal((64, 16)).astype(np.float32) * 3 for _ in range(2))
    weight = rng.normal(1.0, 0.3, 16).astype(np.float32)
    tdt = getattr(torch, dtype)
    norm = module(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(weight))
        norm.to(tdt)
        expected = norm(torch.from_numpy(x).to(tdt), torch.from_numpy(gate).to(tdt)).float().numpy()
    jdt = jnp.dtype(dtype)
    out = gated_rms_norm(jnp.asarray(x, jdt), jnp.asarray(weight, jdt), jnp.asarray(gate, jdt), 1e-6, activation)
    assert out.dtype == jdt
    out = np.asarray(out, np.float32)
    if dtype == "float32":
        _assert_close(out, expected, rtol=1e-6)
    else:
        assert np.mean(out != expected) <= 0.01
        np.testing.assert_allclose(out, expected, rtol=2**-8, atol=0)


# --- errors ----------------------------------------------------------------------------------


def test_bad_shapes_raise():
    """Mis-shaped arguments fail with the offending shape in the message."""
    q, k, v, g, beta, state = (jnp.asarray(a) for a in _inputs("gdn", 1, 4, seed=0))
    with pytest.raises(ValueError, match="multiple"):
        delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], None, None)
    with pytest.raises(ValueError, match="g has shape"):
        delta_rule(q, k, v, g[..., None], beta, None, None)
    with pytest.raises(ValueError, match="state has shape"):
        delta_rule(q, k, v, g, beta, state[..., :3], None)
    with pytest.raises(ValueError, match="num_new"):
        delta_rule(q, k, v, g, beta, None, jnp.array([1, 2]))
    with pytest.raises(ValueError, match="chunk"):
        delta_rule_chunked(q, k, v, g, beta, None, None, chunk=0)
    with pytest.raises(ValueError, match="activation"):
        gated_rms_norm(v, jnp.ones(8), v, 1e-6, "gelu")
    with pytest.raises(ValueError, match="state"):
        causal_conv(jnp.zeros((1, 3, 5)), jnp.zeros((4, 5)), jnp.zeros((1, 4, 5)), None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_realistic_heads_match_hf(kind):
    """Model-sized heads (dk = dv = 128), 300 tokens, chunk 64, both forms and delta_rule's choice
    = HF chunked."""
    shapes = (4, 8, 128, 128) if kind == "gdn" else (4, 4, 128, 128)
    inputs = _inputs(kind, 1, 300, seed=21, shapes=shapes)
    hf_out, hf_final = _hf(kind, "chunked", *inputs)
    for form in ("chunked", "recurrent", "auto"):
        out, final = _ours(form, *inputs)
        _assert_close(out, hf_out)
        _assert_close(final, hf_final)
