"""The expert-parallel dispatch's exchange (``dayzero.model.moe_parallel``): its plan, the dense
emulation of ``ragged_all_to_all`` that CPU runs, capacity drops and the bytes moved.

The 8-device checks run in one subprocess (``tests/moe_dispatch_checks.py``; the device count is
fixed when jax starts): the emulation against the one-device block (float and fp8-block experts)
and against ``ragged_all_to_all``'s documented semantics, drop counts against numpy, bytes against
the lowered HLO, and the ragged exchange lowered. XLA:CPU cannot compile ``ragged-all-to-all``:
``test_platform_exchange_on_one_device_matches_the_block`` runs it where the platform can
(bench/gpu_check.sh on a GPU), and the dense exchange here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.model.moe import moe
from dayzero.model.moe_parallel import DEFAULT_EXCHANGE, Exchange, exchange_plan, moe_expert_parallel, resolve_exchange
from dayzero.model.parallel import Parallel
from dayzero.sharding import rules as R
from dayzero.sharding.placement import Placement
from tests.mesh_checks import result_of, start_part

EXACT = 1e-5  # relative: the same pairs computed, in another order


@pytest.fixture(scope="module")
def started():
    """The 8-device checks, started by the first test so that the in-process ones overlap them
    (not autouse: ``-k platform_exchange``, the GPU check, starts no CPU subprocess)."""
    return start_part("dispatch", module="tests.moe_dispatch_checks", fast_compile=True)


@pytest.fixture(scope="module")
def checks(started):
    return result_of(started)


def test_plan_tiles_every_buffer_and_mirrors_the_way_back(started):
    """For a random count matrix, every device's plan against the contract's definition: the rows
    i sends j are sizes[i, j], contiguous in i's operand and in j's output, the slices packed
    without gap or overlap; receive sizes are the senders' send sizes; the way back swaps them."""
    ep = 5
    sizes = np.random.default_rng(0).integers(0, 4, (ep, ep))
    sizes[1, :] = 0  # a device that sends nothing
    plan = jax.jit(exchange_plan)
    fwd = [tuple(np.asarray(a) for a in plan(jnp.asarray(sizes), jnp.int32(me))) for me in range(ep)]
    back = [tuple(np.asarray(a) for a in plan(jnp.asarray(sizes.T), jnp.int32(me))) for me in range(ep)]
    for i in range(ep):
        in_off, send, out_off, recv = fwd[i]
        assert send.tolist() == sizes[i].tolist() and recv.tolist() == sizes[:, i].tolist()
        covered = sorted(r for j in range(ep) for r in range(in_off[j], in_off[j] + send[j]))
        assert covered == list(range(sizes[i].sum()))  # operand rows 0.. sum, each once
    for j in range(ep):
        landed = sorted(r for i in range(ep) for r in range(fwd[i][2][j], fwd[i][2][j] + sizes[i, j]))
        assert landed == list(range(sizes[:, j].sum()))  # j's output rows 0.. sum, each once
        # Back: j returns to i from where i's rows landed, to where i sent them from.
        for i in range(ep):
            assert back[j][0][i] == fwd[i][2][j] and back[j][1][i] == sizes[i, j]
            assert back[j][2][i] == fwd[i][0][j] and back[i][3][j] == sizes[i, j]


def test_the_exchange_is_chosen_in_one_place():
    assert DEFAULT_EXCHANGE["cpu"] is Exchange.DENSE  # XLA:CPU has no ragged-all-to-all
    assert DEFAULT_EXCHANGE["gpu"] is DEFAULT_EXCHANGE["tpu"] is Exchange.RAGGED
    assert resolve_exchange(Exchange.RAGGED) is Exchange.RAGGED
    with pytest.raises(ValueError, match="'ragged' is not one of"):
        resolve_exchange("ragged")


@pytest.mark.slow  # ~40 s on CPU, where it repeats the dense check; bench/gpu_check.sh runs it on a GPU
def test_platform_exchange_on_one_device_matches_the_block():
    """The platform's exchange on a one-device expert mesh against ``moe.moe``: on a GPU (one
    device: bench/gpu_check.sh) that is ragged_all_to_all compiled and run, over one participant;
    on CPU the dense emulation."""
    from tests.moe_dispatch_checks import CONFIG, D, random_weights

    kind = resolve_exchange(None)
    placement = Placement(R.make_mesh({"expert": 1}, jax.devices()[:1]), R.tensor_expert_parallel())
    par = Parallel(placement, exchange=kind)
    w = random_weights(1)
    x = jax.random.normal(jax.random.key(1), (2, 13, D))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(jax.jit(lambda w, x: moe(w, CONFIG, x))(w, x))
        block = jax.jit(lambda w, x: moe_expert_parallel(w, CONFIG, x, par, with_stats=True))
        lowered = block.lower(w, x).as_text(dialect="hlo")
        got, stats = block(w, x)
    assert ("ragged-all-to-all(" in lowered) == (kind is Exchange.RAGGED)
    assert int(stats.pairs_routed) == 26 * 4 and int(stats.pairs_dropped) == 0 and int(stats.rows_off_device) == 0
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=EXACT * np.abs(ref).max())


def test_dense_exchange_equals_the_one_device_block(checks):
    assert checks["devices"] == 8 and checks["router_gap"] > 1e-3  # no near-tie decides a route
    for case in checks["exact"].values():
        assert case["err"] < EXACT and case["dropped"] == 0 and case["routed"] == 26 * 4, case
    assert checks["exact"]["ep8_fp8_block"]["quantized"]


def test_emulation_follows_the_ragged_all_to_all_contract(checks):
    """Offsets with gaps on both sides, against a numpy reading of the documented semantics."""
    contract = checks["contract"]
    assert contract["fits"] and contract["rows_sent"] > 50 and contract["max_diff"] == 0.0


def test_capacity_drops_are_counted_as_numpy_counts_them(checks):
    cap = checks["capacity"]
    assert cap["numpy"]["pairs_dropped"] > 0  # the factor does drop here
    assert cap["stats"] == cap["numpy"] == cap["routing_only"]
    # Dropped pairs contribute nothing; the kept ones are exactly numpy's.
    assert cap["err"] < EXACT


def test_dense_bytes_moved_is_what_the_program_sends(checks):
    hlo = checks["hlo"]
    for factor in ("dense_None", "dense_1.0"):
        assert hlo[factor]["ops"] == ["all-gather", "all-to-all"]
        assert hlo[factor]["stats_bytes"] == hlo[factor]["hlo_bytes"] > 0
    assert hlo["dense_None"]["capacity"] == 4 * 4  # no drop: 4 tokens per device x 4 experts each
    assert hlo["dense_1.0"]["hlo_bytes"] < hlo["dense_None"]["hlo_bytes"] / 4


def test_ragged_exchange_lowers(checks):
    """The GPU/TPU path type-checks on CPU: two ragged all-to-alls and the count table's gather,
    no dense all-to-all; sent from the [pairs, D] sorted rows, received into [ep x capacity, D]."""
    ragged = checks["hlo"]["ragged"]
    assert sorted(ragged["ops"]) == ["all-gather", "ragged-all-to-all", "ragged-all-to-all"]
    assert ragged["ragged_shapes"] == [[8 * ragged["capacity"], 32], [16, 32]]
