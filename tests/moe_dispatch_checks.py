"""Checks of the expert-parallel dispatch that need 8 (faked) CPU devices, run in a fresh
interpreter by tests/test_moe_dispatch.py (``tests.mesh_checks.start_part`` sets the flags).

``python -m tests.moe_dispatch_checks dispatch`` prints one JSON object of measurements:

- ``exact``: the dense exchange (the ``ragged_all_to_all`` contract emulated, the CPU default)
  against the one-device ``moe.moe`` on expert=8, float and fp8-block experts;
- ``capacity``: a capacity factor's DispatchStats and output against a numpy recomputation of
  each device's per-destination ranks (which pairs are kept) and of the block over kept pairs;
- ``hlo``: the dense exchange's bytes-moved figure against the lowered program's collectives, and
  the ragged exchange lowered (XLA:CPU cannot compile it) with its ops and buffer shapes;
- ``contract``: the dense emulation against a numpy reading of ``ragged_all_to_all``'s documented
  semantics, on offsets with gaps (not the packed ones the dispatch plans).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bench.moe_dispatch import collective_bytes
from dayzero.model import moe_parallel
from dayzero.model.config import MoEConfig
from dayzero.model.moe import moe, route, router_logits
from dayzero.model.moe_parallel import Exchange, Plan, moe_expert_parallel
from dayzero.model.parallel import Parallel
from dayzero.model.quant import ValueFormat, quantize
from dayzero.model.weights import MoEWeights
from dayzero.sharding.placement import placement_for
from tests.mesh_checks import rel_err

# 16 experts of width 16 over a 32-wide residual, top-4: on expert=8 each device owns 2 experts,
# fewer than a token's 4, so one token can send several rows to one device.
CONFIG = MoEConfig(num_experts=16, experts_per_token=4, intermediate_size=16, layers=(True,))
D = 32


def random_weights(seed: int) -> MoEWeights:
    """fp32 experts with O(1) activations (scale 1/sqrt(fan-in))."""
    E, F = CONFIG.num_experts, CONFIG.intermediate_size
    k = jax.random.split(jax.random.key(seed), 4)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape) * fan_in**-0.5  # noqa: E731
    return MoEWeights(router=normal(k[0], (D, E), 1), gate=normal(k[1], (E, D, F), D),
                      up=normal(k[2], (E, D, F), D), down=normal(k[3], (E, F, D), F))


def fp8_block(w: MoEWeights) -> MoEWeights:
    """``w`` with its expert stacks in fp8 blocks of 16 inputs x 8 outputs."""
    q = lambda x: quantize(x, ValueFormat.FP8, (1,), (16, 8))  # noqa: E731
    return w.replace(gate=q(w.gate), up=q(w.up), down=q(w.down))


def router_gap(w: MoEWeights, x) -> float:
    """The smallest margin between a token's C-th and (C+1)-th router logit (softmax routing
    ranks by logits): a near-tie would test rounding, not the dispatch."""
    s = np.sort(np.asarray(router_logits(w.router, jnp.reshape(x, (-1, D)))), axis=-1)
    C = CONFIG.experts_per_token
    return float((s[:, -C] - s[:, -C - 1]).min())


def run_block(w, x, par, with_stats=True):
    """The expert-parallel block on ``par``'s mesh (output, stats)."""
    return jax.jit(lambda w, x: moe_expert_parallel(w, CONFIG, x, par, with_stats=with_stats))(w, x)


def exact_checks(w, x, ref) -> dict:
    """Dense exchange, no drops, against the one-device block."""
    out = {}
    # tensor x expert (the width split) runs through the whole model in tests/test_mesh_engine.py.
    for name, axes, weights in (("ep8", {"expert": 8}, w), ("ep8_fp8_block", {"expert": 8}, fp8_block(w))):
        par = Parallel(placement_for(axes), exchange=Exchange.DENSE)
        block_ref = ref if weights is w else np.asarray(jax.jit(lambda w, x: moe(w, CONFIG, x))(weights, x))
        got, stats = run_block(weights, x, par)
        out[name] = {"err": rel_err(got, block_ref), "dropped": int(stats.pairs_dropped),
                     "routed": int(stats.pairs_routed), "quantized": weights is not w}
    return out


def numpy_dispatch(w, x, ep: int, capacity: int) -> dict:
    """Which pairs a capacity keeps, recomputed in numpy from the one-device routing: device d
    holds tokens [d*n, (d+1)*n); a pair is kept when fewer than ``capacity`` earlier pairs of its
    device (token order) go to its expert's device. The counts, and the block over kept pairs."""
    tokens = np.asarray(x, np.float64).reshape(-1, D)
    N, C, L = tokens.shape[0], CONFIG.experts_per_token, CONFIG.num_experts // ep
    routed = jax.jit(lambda r, t: route(r, CONFIG, t))(w.router, jnp.asarray(x).reshape(-1, D))
    probs, experts = (np.asarray(a) for a in routed)
    n = -(-N // ep)
    keep = np.zeros((N, C), bool)
    sizes = np.zeros((ep, ep), int)  # kept rows [source, destination]
    for d in range(ep):
        used = np.zeros(ep, int)
        for t in range(d * n, min(N, (d + 1) * n)):
            for c in range(C):
                dest = experts[t, c] // L
                keep[t, c] = used[dest] < capacity
                used[dest] += 1
                sizes[d, dest] += keep[t, c]
    gate, up, down = (np.asarray(a, np.float64) for a in (w.gate, w.up, w.down))
    out = np.zeros_like(tokens)
    for t in range(N):
        for c in np.nonzero(keep[t])[0]:
            e = experts[t, c]
            h = tokens[t] @ gate[e]
            out[t] += probs[t, c] * ((h / (1 + np.exp(-h))) * (tokens[t] @ up[e])) @ down[e]
    out_rows, back_rows = sizes.sum(axis=1) - np.diag(sizes), sizes.sum(axis=0) - np.diag(sizes)
    return {"pairs_routed": N * C, "pairs_dropped": int((~keep).sum()), "rows_off_device": int(out_rows.sum()),
            "max_rows_sent": int((out_rows + back_rows).max()), "max_rows_received": int(sizes.sum(axis=0).max()),
            "out": out.reshape(np.shape(x))}


def capacity_checks(w, x, factor: float) -> dict:
    """A capacity factor on expert=8: DispatchStats and output against :func:`numpy_dispatch`."""
    par = Parallel(placement_for({"expert": 8}), factor, exchange=Exchange.DENSE)
    got, stats = run_block(w, x, par)
    want = numpy_dispatch(w, x, 8, stats.capacity)
    alone = jax.jit(moe_parallel.dispatch_stats, static_argnums=(2, 4))(w.router, None, CONFIG, x, par)
    keys = ("pairs_routed", "pairs_dropped", "rows_off_device", "max_rows_sent", "max_rows_received")
    return {"capacity": stats.capacity, "stats": {k: int(getattr(stats, k)) for k in keys},
            "routing_only": {k: int(getattr(alone, k)) for k in keys},
            "numpy": {k: want[k] for k in keys}, "err": rel_err(got, want["out"])}


def hlo_checks(w, x) -> dict:
    """Bytes moved per device by the dense exchange: the stats' figure and the lowered program's
    collectives; the ragged exchange lowered (not compiled: XLA:CPU has no ragged-all-to-all)."""
    out = {}
    placement = placement_for({"expert": 8})
    for factor in (None, 1.0):
        par = Parallel(placement, factor, exchange=Exchange.DENSE)
        # The dense figure depends on the shapes alone (its counts stay abstract here).
        _, stats = jax.eval_shape(lambda w, x: moe_expert_parallel(w, CONFIG, x, par, with_stats=True), w, x)
        text = jax.jit(lambda w, x: moe_expert_parallel(w, CONFIG, x, par)).lower(w, x).as_text(dialect="hlo")
        ops = collective_bytes(text)
        out[f"dense_{factor}"] = {"stats_bytes": stats.bytes_moved(per_device=True),
                                  "hlo_bytes": sum(op["bytes_sent"] for op in ops),
                                  "ops": sorted({op["op"] for op in ops}), "capacity": stats.capacity}
    par = Parallel(placement, exchange=Exchange.RAGGED)
    text = jax.jit(lambda w, x: moe_expert_parallel(w, CONFIG, x, par)).lower(w, x).as_text(dialect="hlo")
    ops = collective_bytes(text)
    out["ragged"] = {"ops": [op["op"] for op in ops],
                     "ragged_shapes": [op["shape"] for op in ops if op["op"] == "ragged-all-to-all"],
                     "capacity": par.capacity(-(-x.shape[0] * x.shape[1] // 8), CONFIG.experts_per_token)}
    return out


def contract_checks(seed: int = 0) -> dict:
    """The dense emulation of ragged_all_to_all against a numpy reading of its docstring, with
    random sizes and gaps between both the sent and the received slices."""
    ep, S, M, most = 8, 40, 48, 3
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, most + 1, (ep, ep))  # [source, destination]
    gaps_in, gaps_out = rng.integers(0, 2, (ep, ep)), rng.integers(0, 2, (ep, ep))
    in_off = np.cumsum(sizes + gaps_in, axis=1) - sizes  # slices in source order, a gap before each
    out_off = np.cumsum(sizes + gaps_out, axis=0) - sizes  # received in destination's source order
    operand = rng.normal(size=(ep, S, 2)).astype(np.float32)
    want = np.full((ep, M, 2), -1.0, np.float32)  # rows nobody writes keep the output's value
    for i in range(ep):
        for j in range(ep):
            want[j, out_off[i, j]:out_off[i, j] + sizes[i, j]] = operand[i, in_off[i, j]:in_off[i, j] + sizes[i, j]]
    placement = placement_for({"expert": 8})

    def body(operand, in_off, send, out_off, recv):
        plan = Plan(in_off[0], send[0], out_off[0], recv[0])
        output = jnp.full((M, 2), -1.0, jnp.float32)
        return moe_parallel._dense_ragged_all_to_all(operand[0], output, plan, axis="expert", max_send=most)[None]

    run = jax.jit(jax.shard_map(body, mesh=placement.mesh, in_specs=P("expert"), out_specs=P("expert")))
    as32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    got = run(operand, as32(in_off), as32(sizes), as32(out_off), as32(sizes.T))
    return {"max_diff": float(np.abs(np.asarray(got) - want).max()), "rows_sent": int(sizes.sum()),
            "fits": bool(in_off[:, -1].max() + most <= S and out_off[-1].max() + most <= M)}


def part_dispatch() -> dict:
    w = random_weights(1)  # its smallest router margin over both token sets: 0.011
    x = jax.random.normal(jax.random.key(1), (2, 13, D))  # 26 tokens: ep=8 pads to 32
    wide = jax.random.normal(jax.random.key(2), (2, 32, D))  # 64 tokens, 8 per device of ep=8
    ref = np.asarray(jax.jit(lambda w, x: moe(w, CONFIG, x))(w, x))
    out = {"devices": len(jax.devices()), "router_gap": min(router_gap(w, x), router_gap(w, wide))}
    for name, check in (("exact", lambda: exact_checks(w, x, ref)), ("capacity", lambda: capacity_checks(w, wide, 1.0)),
                        ("hlo", lambda: hlo_checks(w, x)), ("contract", contract_checks)):
        start = time.perf_counter()
        out[name] = check()
        out[name + "_s"] = time.perf_counter() - start
    return out


PARTS = {"dispatch": part_dispatch}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
