"""DeepSeek-V4's MoE block (``dayzero.model.moe`` with sqrt-softplus scores, hash routing and the
clamped SwiGLU) against HF's ``DeepseekV4SparseMoeBlock``, fp32 on CPU.

The oracle is the ``mlp`` of layer 0 (``hash_moe``: experts from ``tid2eid[token id]``) and of
layer 2 (``moe``: top-C of sqrt(softplus(logits)) + score bias) of the tiny randomised HF model
(tests/v4_helpers.py: random score bias and tid2eid). The inputs mix tokens of RMS ~1 with tokens
scaled up to RMS ~60, whose gate/up pre-activations pass ``swiglu_limit`` (asserted), so the
clamp of both the routed and the shared experts matters; variants without it, with sigmoid
scores, or with top-k routing on the hash layer are checked to fail the tolerance. On the top-k
layer the margin at the routing choice's cut is asserted far above rounding.

The expert-parallel block (``moe_parallel.moe_expert_parallel``) on 8 faked CPU devices (expert=4
x tensor=2; 14 tokens, padded to 16) equals the one-device block on a hash-routed layer, and
``dispatch_stats`` counts what the block's own stats count. It runs in a subprocess
(``python -m tests.test_v4_moe ep``, via ``tests.mesh_checks.start_part``: the device count is
fixed when jax starts), started by the first test so that it overlaps the HF comparisons.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.model.config import MoEConfig, RouterScore
from dayzero.model.moe import GroupedMatmul, moe, route, swiglu
from dayzero.model.weights import MLPWeights, MoEWeights

TOL = 1e-5  # fp32, relative to the largest magnitude of the reference
MIN_ROUTER_GAP = 1e-4  # as tests/hf_helpers.py: 100x the hidden-state error cannot flip a choice
HASH_LAYER, TOPK_LAYER = 0, 2

# The tiny model's MoE (tests/v4_helpers.py TINY; checked against the HF config below). Kept here
# so that the device subprocess needs neither torch nor transformers.
D, E, C, F, V, LIMIT = 64, 8, 2, 32, 256, 10.0
CONFIG = MoEConfig(num_experts=E, experts_per_token=C, intermediate_size=F, layers=(True,) * 4,
                   score=RouterScore.SQRTSOFTPLUS, score_bias=True, routed_scaling=1.5, shared_experts=1,
                   swiglu_limit=LIMIT, hash_layers=(True, True, False, False))


def _inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hidden states [2,7,D] (every other token scaled to RMS ~60, the rest ~1) and token ids [2,7]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 7, D)).astype(np.float32)
    x[:, ::2] *= 60
    return x, rng.integers(0, V, (2, 7)).astype(np.int32)


# --------------------------------------------------------------------------- HF comparisons


@pytest.fixture(scope="module")
def started():
    """The 8-device check, started by the first test so that the HF comparisons overlap it."""
    from tests.mesh_checks import start_part

    return start_part("ep", module="tests.test_v4_moe", fast_compile=True)


@pytest.fixture(scope="module")
def hf():
    from tests.v4_helpers import tiny_hf_model

    model = tiny_hf_model(seed=0)
    c = model.config
    assert (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.vocab_size,
            c.swiglu_limit, c.routed_scaling_factor) == (D, E, C, F, V, LIMIT, CONFIG.routed_scaling)
    assert tuple(t == "hash_moe" for t in c.mlp_layer_types) == CONFIG.hash_layers
    return model


def _weights(mlp) -> MoEWeights:
    """HF's block weights in dayzero's layout (x @ W everywhere)."""
    n = lambda t: t.detach().numpy()  # noqa: E731
    gate_up, down = n(mlp.experts.gate_up_proj), n(mlp.experts.down_proj)  # [E,2F,D], [E,D,F]
    s = mlp.shared_experts
    return MoEWeights(
        router=jnp.asarray(n(mlp.gate.weight).T),
        gate=jnp.asarray(gate_up[:, :F].transpose(0, 2, 1)), up=jnp.asarray(gate_up[:, F:].transpose(0, 2, 1)),
        down=jnp.asarray(down.transpose(0, 2, 1)),
        score_bias=None if mlp.is_hash else jnp.asarray(n(mlp.gate.e_score_correction_bias)),
        shared=MLPWeights(*(jnp.asarray(n(p.weight).T) for p in (s.gate_proj, s.up_proj, s.down_proj))),
        tid2eid=jnp.asarray(n(mlp.gate.tid2eid).astype(np.int32)) if mlp.is_hash else None,
    )


def _hf_block(mlp, x: np.ndarray, ids: np.ndarray):
    """HF's routing (weights, experts sorted by expert id per token) and block output."""
    import torch

    with torch.no_grad():
        hx, hids = torch.from_numpy(x), torch.from_numpy(ids).long()
        _, weights, experts = mlp.gate(hx, hids) if mlp.is_hash else mlp.gate(hx)
        out = mlp(hx, input_ids=hids)
    order = np.argsort(experts.numpy(), axis=-1)
    return (np.take_along_axis(weights.numpy(), order, -1), np.take_along_axis(experts.numpy(), order, -1),
            out.numpy())


def _ours_routing(w: MoEWeights, config: MoEConfig, x: np.ndarray, ids: np.ndarray):
    weights, experts = route(w.router, config, jnp.asarray(x).reshape(-1, D), w.score_bias, None,
                             jnp.asarray(ids).reshape(-1), w.tid2eid)
    order = np.argsort(np.asarray(experts), axis=-1)
    return np.take_along_axis(np.asarray(weights), order, -1), np.take_along_axis(np.asarray(experts), order, -1)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _choice_gap(w: MoEWeights, x: np.ndarray) -> float:
    """The smallest margin between a token's C-th and (C+1)-th biased score (what top-k ranks)."""
    logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(w.router, np.float64)
    s = np.sort(np.sqrt(np.logaddexp(logits, 0)) + np.asarray(w.score_bias), axis=-1)
    return float((s[:, -C] - s[:, -C - 1]).min())


def _clamped_fraction(w: MoEWeights, x: np.ndarray) -> tuple[float, float]:
    """The fractions of the shared expert's gate (> limit) and up (|.| > limit) pre-activations,
    and of every routed expert's, that the clamp changes."""
    rows = x.reshape(-1, D)
    g, u = rows @ np.asarray(w.shared.gate), rows @ np.asarray(w.shared.up)
    rg, ru = np.einsum("nd,edf->enf", rows, np.asarray(w.gate)), np.einsum("nd,edf->enf", rows, np.asarray(w.up))
    frac = lambda g, u: float(np.mean((g > LIMIT) | (np.abs(u) > LIMIT)))  # noqa: E731
    return frac(g, u), frac(rg, ru)


@pytest.mark.parametrize("layer", [HASH_LAYER, TOPK_LAYER])
def test_block_matches_hf(started, hf, layer):
    """Router picks equal HF's, their weights and the block output (routed + clamped shared
    experts) within fp32 rounding; jitted, with the platform's grouped matmul."""
    mlp = hf.model.layers[layer].mlp
    assert mlp.is_hash == (layer == HASH_LAYER)
    w = _weights(mlp)
    x, ids = _inputs(layer)
    if not mlp.is_hash:
        assert _choice_gap(w, x) > MIN_ROUTER_GAP, "a near-tie at the routing cut: pick another input seed"
    shared_frac, routed_frac = _clamped_fraction(w, x)
    assert shared_frac > 0.05 and routed_frac > 0.05, (shared_frac, routed_frac)
    ref_weights, ref_experts, ref_out = _hf_block(mlp, x, ids)
    weights, experts = _ours_routing(w, CONFIG, x, ids)
    assert (experts == ref_experts).all()
    assert _rel(weights, ref_weights) < TOL
    out = jax.jit(lambda w, x, t: moe(w, CONFIG, x, tokens=t))(w, jnp.asarray(x), jnp.asarray(ids))
    assert _rel(out, ref_out) < TOL, _rel(out, ref_out)


@pytest.mark.slow  # 6 s; the parity tests above fail for each of these by the same tolerances
def test_wrong_variants_fail(hf):
    """The comparison can fail: no clamp (routed or shared), sigmoid scores, and top-k routing on
    the hash layer each land far outside the tolerance."""
    mlp = hf.model.layers[HASH_LAYER].mlp
    w = _weights(mlp)
    x, ids = _inputs(HASH_LAYER)
    _, ref_experts, ref_out = _hf_block(mlp, x, ids)
    # ragged_dot: at these sizes it compiles faster than the expert loop (each variant compiles)
    block = lambda w, config: moe(w, config, jnp.asarray(x), GroupedMatmul.RAGGED_DOT, jnp.asarray(ids))  # noqa: E731
    assert _rel(block(w, dataclasses.replace(CONFIG, swiglu_limit=None)), ref_out) > 100 * TOL
    rows = jnp.asarray(x).reshape(-1, D)
    s = w.shared
    assert _rel(swiglu(rows, s.gate, s.up, s.down), swiglu(rows, s.gate, s.up, s.down, CONFIG)) > 100 * TOL
    assert _rel(block(w, dataclasses.replace(CONFIG, score=RouterScore.SIGMOID)), ref_out) > 100 * TOL
    topk = w.replace(tid2eid=None, score_bias=jnp.zeros(E))
    _, experts = _ours_routing(topk, CONFIG, x, ids)
    assert (experts != ref_experts).any()
    assert _rel(block(topk, CONFIG), ref_out) > 100 * TOL


def test_hash_layer_needs_tokens(hf):
    """A hash-routed layer without token ids, or with a score bias, is refused with a clear error."""
    w = _weights(hf.model.layers[HASH_LAYER].mlp)
    x, ids = _inputs(0)
    with pytest.raises(ValueError, match="pass tokens"):
        moe(w, CONFIG, jnp.asarray(x))
    with pytest.raises(ValueError, match="token ids"):
        moe(w, CONFIG, jnp.asarray(x), tokens=jnp.asarray(ids[:, :3]))
    with pytest.raises(ValueError, match="hash-routed layer has none"):
        moe(w.replace(score_bias=jnp.zeros(E)), CONFIG, jnp.asarray(x), tokens=jnp.asarray(ids))


def test_expert_parallel_hash_layer(started):
    """On expert=4 x tensor=2 (faked CPU devices), the expert-parallel block of a hash-routed
    layer equals the one-device block; its stats and ``dispatch_stats`` agree; missing ids are
    refused there too."""
    from tests.mesh_checks import result_of

    r = result_of(started)
    assert r["err"] < TOL, r
    assert r["routed"] == 14 * C and r["dropped"] == 0, r
    assert r["stats_equal"], r
    assert r["refused"], r
    assert r["clamped"] > 0.05, r


# --------------------------------------------------------------------------- device subprocess


def _random_hash_weights(seed: int) -> MoEWeights:
    """A hash-routed layer with HF-like scales (std 0.02) and a random tid2eid of distinct experts."""
    k = jax.random.split(jax.random.key(seed), 8)
    normal = lambda k, shape: jax.random.normal(k, shape) * 0.02  # noqa: E731
    tid2eid = jnp.argsort(jax.random.uniform(k[7], (V, E)), axis=-1)[:, :C].astype(jnp.int32)
    return MoEWeights(router=normal(k[0], (D, E)), gate=normal(k[1], (E, D, F)), up=normal(k[2], (E, D, F)),
                      down=normal(k[3], (E, F, D)),
                      shared=MLPWeights(normal(k[4], (D, F)), normal(k[5], (D, F)), normal(k[6], (F, D))),
                      tid2eid=tid2eid)


def _part_ep() -> dict:
    """The hash layer's expert-parallel block against the one-device one (8 faked devices)."""
    from dayzero.model.moe_parallel import dispatch_stats, moe_expert_parallel
    from dayzero.model.parallel import Parallel
    from dayzero.sharding.placement import placement_for

    w = _random_hash_weights(0)
    x, ids = (jnp.asarray(a) for a in _inputs(5))
    ref = jax.jit(lambda w, x, t: moe(w, CONFIG, x, tokens=t))(w, x, ids)
    placement = placement_for({"expert": 4, "tensor": 2})
    par = Parallel(placement)
    # Laid out as the engine lays the weights out (tid2eid split over the vocabulary).
    axes = MoEWeights(router=("embed", None), gate=("experts", "embed", "ffw"), up=("experts", "embed", "ffw"),
                      down=("experts", "ffw", "embed"), shared=MLPWeights(("embed", "ffw"), ("embed", "ffw"),
                                                                             ("ffw", "embed")),
                      tid2eid=("vocab", None))
    placed = jax.tree.map(lambda a, ax: jax.device_put(a, placement.sharding(ax, a.shape)), w, axes,
                          is_leaf=lambda v: isinstance(v, tuple) and all(isinstance(s, (str, type(None))) for s in v))
    got, stats = jax.jit(lambda w, x, t: moe_expert_parallel(w, CONFIG, x, par, with_stats=True, tokens=t))(
        placed, x, ids)
    alone = jax.jit(lambda r, x, t, table: dispatch_stats(r, None, CONFIG, x, par, tokens=t, tid2eid=table))(
        w.router, x, ids, w.tid2eid)
    try:
        jax.eval_shape(lambda w, x: moe_expert_parallel(w, CONFIG, x, par), w, x)
        refused = False
    except ValueError as e:
        refused = "pass tokens" in str(e)
    return {"err": _rel(got, ref), "routed": int(stats.pairs_routed), "dropped": int(stats.pairs_dropped),
            "stats_equal": stats.as_dict() == alone.as_dict(), "refused": refused,
            "clamped": _clamped_fraction(w, np.asarray(x))[0]}


PARTS = {"ep": _part_ep}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
