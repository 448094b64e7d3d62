"""The deployment planner checked against what runs, not against itself.

1. Weights and KV: per-device bytes of the arrays the engine places (``Engine(...)`` on a mesh of
   faked CPU devices, weights quantized at load and re-blocked by the engine, the page pools a
   ``ServingEngine`` allocates), read from each array's addressable shards, equal the planner's to
   the byte, for every model at reduced size (``tools/plan_measure.reduced``: DeepSeek-V3,
   Kimi-K2, frontier-3t-1m, a Llama-3-8B-like GQA model, a Qwen3-30B-A3B-like GQA MoE) on three
   meshes, with and without quantization. A forgotten scale, a leaf split that the engine
   replicates or a block re-blocked otherwise changes the bytes of some device.
2. Recommendations: the mesh ``plan`` recommends loads with the options planned for and runs a
   prefill chunk and a decode step (all of them, as the memory shrinks: slow).
3. Activations: the planner's decode and prefill-chunk peaks against XLA's compiled memory
   analysis of the serving engine's steps (temporaries + outputs; a replica's decode over the
   widest block table and its prefill chunks, reference path), on configurations the copy
   counts were not fitted on (held out), and on the ones they were (``tools/plan_check.CASES``).

4. Pipeline (``stage``) meshes: per-device weights and KV of a tiny model's stage-stacked arrays
   placed as ``model.pipeline`` places them (``tests/plan_checks.part_staged``), and the stage
   ranges, equal to the planner's (a planner putting the head on the last stage only, or
   balancing the layers otherwise, fails it).

DeepSeek-V4 (tiny, ``tests/v4_helpers``): weights, the serving engine's paged pool (entry pages,
rings and compressor states per slot) and the cache ``Engine.generate`` allocates in part 1; its
activations against the serving engine's compiled forward over that pool
(``tools/plan_check.V4_CASES``), slow.
State snapshots (the prefix cache's copies of per-slot states, ``PagedSteps.snapshots``): the
tiny V4's and a tiny Qwen3-Next's (``plan_measure.TINY_HYBRID``, a linear-attention hybrid, whose
attention pages and linear states are measured beside them) in part 1, a component of their own,
laid out as after the warmup's first copy, and a fresh tree, before it, laid out the same.
4-bit values: part 1 counts each shard at the bytes per element the device was measured to hold
(RSS on XLA:CPU: 0.5 for int4 and float4_e2m1fn, whose ``nbytes`` says 1), so a planner that
counted them at their numpy itemsize would fail it.

Tolerances. Weights and KV: exact (both are shapes and dtypes; nothing is estimated). Held-out
activations: 25%. The copy counts stand for XLA's buffer assignment, which keeps a copy more or
less with the shapes: where the planner models the structure, held-out ratios measured 0.94-1.09;
where it missed one (a buffer held per layer, a split it did not know), they were 0.37, 0.59, 1.45,
3.4, 12.7. 25% passes the first kind and fails the second. Activations are also a small part of a
deployment's memory (358 MiB of DeepSeek-V3's 43 GiB per device at batch 16), so 25% of them moves
a fit decision by under 1% there. Fitted decode cases: 10%, as before. Known misses are strict
xfails: each says what the planner gets wrong, and fixing it makes the test fail until the mark
goes.
"""

from __future__ import annotations

import pytest

from dayzero.tools.plan_check import CASES, V4_CASES
from tests.mesh_checks import result_of
from tests.plan_checks import FULL_OPTIONS, HYBRID, HYBRID_ROWS, V4, V4_MESHES, V4_ROWS, start

TOLERANCE = 0.25
FITTED_TOLERANCE = 0.10
# The held-out activation cases of the default suite (the cheapest to compile of each kind).
DEFAULT_HELD_OUT = ("gqa-dense-dp", "gqa-moe-dp")
# The fitted cases compiled on 64 faked devices (the full-size README rows take minutes: bench only).
FITTED_TESTS = ("test-gqa", "test-dsa", "test-mla", "test-mla-ep")
# The held-out cases of the other families (DeepSeek-V4's run one process each: test_v4_activations_agree_with_xla).
HELD_OUT = tuple(name for name, case in CASES.items() if not case.fitted and name not in V4_CASES)


@pytest.fixture(scope="module")
def parts():
    """The default suite's device parts, started at once (compiling is single-threaded)."""
    procs = {
        "placed": start("placed"),
        "recommend": start("recommend", "kimi-k2", "fp8-block/fp8", fast_compile=True),
        "activations": start("activations", *DEFAULT_HELD_OUT),
    }
    return {name: result_of(proc, timeout=900) for name, proc in procs.items()}


def _check_placed(rows: list[dict]) -> None:
    from dayzero.model.footprint import held_itemsize

    for row in rows:
        where = (row["model"], row["mesh"], row["quantize"], row["kv_cache"])
        # The planner's bytes per element are what the device held, measured by RSS per dtype
        # (4-bit: 0.5, where nbytes says 1).
        assert {d: held_itemsize(d) for d in row["per_element"]} == row["per_element"], where
        assert row["refused"] is None, where
        assert row["equal"], (where, row["components"], row["differences"])
        assert not row["uneven"], where  # every device holds the same bytes of each component
        comps = {c: v["placed"] for c, v in row["components"].items()}
        # Scales exist exactly when asked for, so forgetting them cannot pass unseen.
        assert (comps["weight_scales"] > 0) == (row["quantize"] != "none"), where
        assert (comps["kv_scales"] > 0) == (row["kv_cache"] != "none"), where
        assert comps["kv_cache"] > 0, where  # the pools were measured
        # Snapshot rows exist exactly for the models with per-sequence states.
        assert (comps["state_snapshots"] > 0) == (row["model"] in (V4, HYBRID)), where


def test_placed_weight_and_kv_bytes_equal_the_planner(parts):
    rows = parts["placed"]["rows"]
    assert {r["model"] for r in rows} == {"deepseek-v3", "kimi-k2", "frontier-3t-1m", "llama3-8b", "qwen3-30b-a3b",
                                          V4, HYBRID}
    assert len(rows) == 5 * 3 * 2 + len(V4_ROWS) + len(HYBRID_ROWS)
    _check_placed(rows)


def _snapshot_rows(rows: list[dict]) -> list[dict]:
    out = [r for r in rows if r["model"] in (V4, HYBRID)]
    assert [(r["model"], r["quantize"], r["kv_cache"]) for r in out] == [
        (name, *o.split("/")) for name, pairs in ((V4, V4_ROWS), (HYBRID, HYBRID_ROWS)) for _, o in pairs]
    return out


def test_state_snapshots_equal_the_planner(parts):
    """The prefix cache's snapshot rows a ServingEngine makes (its default, 4 per slot) for the tiny
    V4 (rings, with int8/fp8 scales, and compressor states, whole) and the tiny Qwen3-Next (conv
    inputs and recurrent states, heads over tensor) on one device, tensor, data x tensor and
    tensor x expert meshes: per device, to the byte, the planner's ``state_snapshots``. The hybrid's
    rows make the multi-device case: split over tensor=2, each device holds half a row."""
    rows = _snapshot_rows(parts["placed"]["rows"])
    _check_placed(rows)
    for row in rows:
        snap = row["components"]["state_snapshots"]
        assert snap["placed"] == snap["planner"] > 0, (row["model"], row["mesh"], snap)


def test_fresh_state_snapshots_are_laid_out_as_the_slot_states(parts):
    """Before any copy (a server started with --no-warmup), the snapshot rows are where they will
    stay: each device holds what the planner counts."""
    for row in _snapshot_rows(parts["placed"]["rows"]):
        fresh = row["fresh_state_snapshots"]
        assert fresh["placed"] == fresh["planner"] and not fresh["uneven"], (row["model"], row["mesh"], fresh)


def test_deepseek_v4_weights_and_cache_and_four_bit_values_equal_the_planner(parts):
    """The tiny V4's weights and cache to the byte: the serving engine's paged pool (entry pages
    of 16 positions, a ring and compressor states per slot) and Engine.generate's cache, on one
    device and on data x tensor and tensor x expert meshes; with int4 and MXFP4 experts, whose
    values the devices hold at half a byte each (measured), as the planner counts them."""
    rows = [r for r in parts["placed"]["rows"] if r["model"] == V4]
    assert [(r["quantize"], r["kv_cache"]) for r in rows] == [tuple(o.split("/")) for _, o in V4_ROWS]
    _check_placed(rows)
    assert all({"contiguous_kv_cache", "contiguous_kv_scales"} <= set(r["components"]) for r in rows)
    four_bit = {d: r["per_element"][d] for r in rows for d in ("int4", "float4_e2m1fn") if d in r["per_element"]}
    assert four_bit == {"int4": 0.5, "float4_e2m1fn": 0.5}


def test_the_recommended_expert_parallel_mesh_runs_quantized(parts):
    """Reduced Kimi-K2, fp8 blocks and an fp8 cache, one row on hosts of 2 devices: the planner
    recommends tensor=4 x expert=2, which loads and generates."""
    (row,) = parts["recommend"]["rows"]
    assert row["mesh"] == {"tensor": 4, "expert": 2}, row
    assert row["ok"], row.get("error")
    assert all(len(t) == 2 for t in row["tokens"])


def _within(result: dict, step: str, tolerance: float) -> bool:
    return abs(result[step]["ratio"] - 1) <= tolerance


@pytest.mark.parametrize("case", DEFAULT_HELD_OUT)
def test_held_out_activations_agree_with_xla(parts, case):
    result = parts["activations"][case]
    for step in ("decode", "prefill"):
        assert _within(result, step, TOLERANCE), (case, step, result[step])


@pytest.mark.slow  # 64 faked devices: about 30 s of compiling, a regression check of fitted cases
@pytest.mark.parametrize("case", FITTED_TESTS)
def test_fitted_decode_activations_agree_with_xla(slow_parts, case):
    """The configurations the copy counts were fitted on (64 devices) still agree (regression)."""
    result = slow_parts["fitted"][case]
    assert _within(result, "decode", FITTED_TOLERANCE), (case, result["decode"])


# ---- slow: everything ----------------------------------------------------------------------------

MODELS = ("deepseek-v3", "kimi-k2", "frontier-3t-1m", "llama3-8b", "qwen3-30b-a3b")

# Held-out (case, step) pairs the planner misses by more than the tolerance, as measured.
KNOWN_MISSES = {
    ("dsa-tp", "prefill"): "sparse attention's dense scan of a chunk: XLA keeps fewer score copies (1.45)",
    ("deepseek-kv-fp8", "decode"): "XLA:CPU has no fp8: it gathers the fp8 latent pages as f16, two bytes an "
                                   "element where the planner (for GPUs) counts one (0.70)",
}
FITTED_PREFILL_MISSES = {
    "test-mla-ep": "expert-parallel dispatch buffers of a 512-token chunk: the planner is 1.88x over",
    "test-dsa": "16 tokens over 262144, gathering the picked rows: XLA holds more beside the whole index scores "
                "[T*I, S] than the one copy counted (one in decode, where test-dsa and dsa-tp agree) (0.62)",
    "test-gqa": "64 tokens over 32768: XLA keeps more [1,1,128,S] fp32 score blocks live than the 2 counted (0.63)",
}


@pytest.fixture(scope="module")
def slow_parts():
    procs = {
        "placed": start("placed", "full"),
        "activations": start("activations", *HELD_OUT),
        "fitted": start("decode", *FITTED_TESTS, devices=64),
    }
    return {name: result_of(proc, timeout=1800) for name, proc in procs.items()}


@pytest.mark.slow
def test_placed_bytes_equal_the_planner_for_every_scheme_and_four_meshes(slow_parts):
    rows = slow_parts["placed"]["rows"]
    assert len(rows) == 5 * 4 * len(FULL_OPTIONS) + len(V4_MESHES) * (len(FULL_OPTIONS) + 1) + len(HYBRID_ROWS)
    _check_placed(rows)


@pytest.mark.slow  # compiling tiny V4's steps takes 20-40 s a shape here (1-2 min a case)
@pytest.mark.parametrize("case", V4_CASES)
def test_v4_activations_agree_with_xla(case):
    """Tiny V4's serving steps over its paged pool, fitted (the cases footprint_v4's structure was
    read off: a regression) and held out, within the held-out tolerance: every buffer of a tiny V4
    step is small, so XLA's schedule puts different sets beside the largest (measured 0.90-1.03).
    v4-paged tells the paged steps from the former slot cache's: its tables address 4096
    positions for a context of 3000, and its chunk budget makes a 256-token chunk over 2048
    positions the prefill peak (a planner reading the context, and T x context within the
    budget, measured 0.72 and 0.60 there)."""
    result = result_of(start("activations", case), timeout=1800)[case]
    for step in ("decode", "prefill"):
        assert _within(result, step, TOLERANCE), (step, result[step])


def _pairs():
    for case in HELD_OUT:
        for step in ("decode", "prefill"):
            reason = KNOWN_MISSES.get((case, step))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            yield pytest.param(case, step, marks=marks, id=f"{case}-{step}")


@pytest.mark.slow
@pytest.mark.parametrize("case, step", list(_pairs()))
def test_every_held_out_activation_case(slow_parts, case, step):
    result = slow_parts["activations"][case]
    assert _within(result, step, TOLERANCE), (case, step, result[step])


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.xfail(reason=FITTED_PREFILL_MISSES[c], strict=True)]
                                               if c in FITTED_PREFILL_MISSES else []) for c in FITTED_TESTS])
def test_fitted_configurations_prefill_activations(case):
    """The prefill chunk's peak on the fitted configurations (its copy counts are the decode
    step's: held out for the prefill figure)."""
    result = result_of(start("activations", case, devices=64), timeout=1800)[case]
    assert _within(result, "prefill", TOLERANCE), (case, result["prefill"])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_every_recommended_mesh_runs(model):
    """Each distinct mesh the planner recommends for reduced ``model`` as the device memory
    shrinks (4 rows on hosts of 8; one row on hosts of 2), with and without fp8 blocks and an fp8
    cache, loads and generates."""
    procs = [start("recommend", model, option, "all", fast_compile=True) for option in ("none/none", "fp8-block/fp8")]
    rows = [row for proc in procs for row in result_of(proc, timeout=1800)["rows"]]
    assert len(rows) >= 2
    for row in rows:
        assert row["ok"], (row["mesh"], row["quantize"], row.get("error"))


def test_pipeline_meshes_agree_with_placed_stage_stacked_arrays():
    """Per-device weights and KV of a stage mesh: the planner against a tiny model's weights and
    cache stacked [stage, slot, ...] and placed as ``model.pipeline`` places them (padded slots,
    the embedding and head whole on every stage), on stage=2,tensor=4 / stage=4,expert=2 /
    stage=4,tensor=2; the stage ranges must be the pipeline's own."""
    from tests.plan_checks import STAGED

    rows = result_of(start("staged"), timeout=600)["rows"]
    assert [(r["model"], r["mesh"]) for r in rows] == list(STAGED)
    for row in rows:
        where = (row["model"], row["mesh"])
        assert row["planned_ranges"] == row["ranges"], where
        for part in ("weights", "kv_cache"):
            assert row[part]["planned"] == row[part]["placed"], (where, part, row[part])
