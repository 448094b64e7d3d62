"""The deployment planner's per-sequence states: a linear-attention hybrid's state rows and the
prefix cache's state snapshots, and DeepSeek-V4's paged pool, pages, chunks and steps
(``model/footprint_v4.py``). The models and workloads are tests/test_plan.py's."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import _run  # the in-process CLI runner (exit status, stdout, stderr)
from tests.test_plan import _latent, _llama, _work
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.presets import load_preset
from dayzero.sharding.planner import PlanError, evaluate, plan


def _v4() -> ModelConfig:
    """The V4 tests' tiny model (layers sliding, CSA r=4, HCA r=16, CSA; window 16, H=64, J=32)."""
    from dayzero.tools.plan_check import TEST_CONFIGS

    return parse_hf_config(TEST_CONFIGS["test-v4"])


# ---- linear-attention hybrids: state rows and their snapshots -----------------------------------


def test_a_hybrids_state_rows_are_a_replicas_own():
    """Qwen3-Next (36 Gated DeltaNet layers, 12 attention layers of 2 kv heads x 256), 4 rows of
    4096 positions on data=2: each replica holds its 2 rows whole, the linear states (declared on
    ``batch``) included, not split again over ``data``. Per row: 256 pages of 16 positions of keys
    and values per attention layer (bf16), and per linear layer the conv inputs [3, 16, 128] twice
    and [3, 32, 128] (bf16) and the recurrent state [32, 128, 128] (fp32)."""
    footprint = DecodeFootprint(load_preset("qwen3-next-80b-a3b"))
    pages = 12 * 4096 * 2 * 2 * 256 * 2
    states = 36 * ((2 * 3 * 16 * 128 + 3 * 32 * 128) * 2 + 32 * 128 * 128 * 4)
    p = evaluate(footprint, _work(devices=2, batch=4, context=4096), {"data": 2})
    assert p.bytes["kv_cache"] == 2 * (pages + states)


def test_a_hybrids_state_snapshots_by_hand():
    """Qwen3-Next, 4 rows: the prefix cache keeps 4 copies of a slot's linear states per planned
    row of a replica (the serving default), laid out as the slot states (value and key heads over
    tensor). data=2: 2 rows a replica, 8 snapshot rows whole on each device; tensor=2: 16 rows,
    each device holding half of each; ``state_snapshots`` given: that many rows a replica."""
    footprint = DecodeFootprint(load_preset("qwen3-next-80b-a3b"))
    states = 36 * ((2 * 3 * 16 * 128 + 3 * 32 * 128) * 2 + 32 * 128 * 128 * 4)  # one slot's, as above
    work = _work(devices=2, batch=4, context=4096)
    assert evaluate(footprint, work, {"data": 2}).bytes["state_snapshots"] == 8 * states
    assert evaluate(footprint, work, {"tensor": 2}).bytes["state_snapshots"] == 16 * states // 2
    given = evaluate(footprint, _work(devices=2, batch=4, context=4096, state_snapshots=3), {"data": 2})
    assert given.bytes["state_snapshots"] == 3 * states
    assert evaluate(footprint, _work(devices=2, batch=4, state_snapshots=0), {"data": 2}).bytes["state_snapshots"] == 0
    # A model without per-sequence states keeps none (its prefix cache shares pages only).
    assert evaluate(DecodeFootprint(_llama()), _work(), {"tensor": 4}).bytes["state_snapshots"] == 0
    with pytest.raises(PlanError, match="state_snapshots must be at least 0"):
        _work(state_snapshots=-1)


def test_the_planned_snapshot_rows_are_the_serving_engines_default():
    """``ServingConfig.resolve`` keeps 4 snapshot rows per slot for a hybrid and DeepSeek-V4, none
    for a model without per-sequence states, and a given count as given: as ``Workload.snapshot_rows``
    plans them for a replica's rows."""
    from dayzero.engine.paged_steps import ServingConfig
    from dayzero.tools.plan_measure import TINY_HYBRID

    for config in (parse_hf_config(TINY_HYBRID), _v4()):
        assert ServingConfig(slots=3, max_context=64).resolve(config).state_snapshots == _work().snapshot_rows(3)
        given = ServingConfig(slots=3, max_context=64, state_snapshots=5).resolve(config).state_snapshots
        assert given == _work(state_snapshots=5).snapshot_rows(3) == 5
    assert ServingConfig(slots=3, max_context=64).resolve(_llama()).state_snapshots == 0


def test_the_planners_tiny_hybrid_is_the_linear_tests_tiny_model():
    """plan_measure's tiny Qwen3-Next is tests/linear_helpers' (QWEN_TEXT, QWEN_MOE and
    qwen_next_config's dense width and dense first layer; read from its source: importing it
    imports torch)."""
    import ast
    from pathlib import Path

    from dayzero.tools.plan_measure import TINY_HYBRID

    tree = ast.parse((Path(__file__).parent / "linear_helpers.py").read_text())
    calls = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign)}
    tiny = {kw.arg: ast.literal_eval(kw.value) for name in ("QWEN_TEXT", "QWEN_MOE") for kw in calls[name].keywords}
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "qwen_next_config")
    (merged,) = [n for n in ast.walk(fn) if isinstance(n, ast.Dict)]  # {**QWEN_TEXT, **QWEN_MOE, key: value, **changes}
    extra = {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(merged.keys, merged.values) if k is not None}
    assert TINY_HYBRID == {**tiny, **extra, "model_type": "qwen3_next"}


# ---- DeepSeek-V4: its paged pool and steps (model/footprint_v4.py) ------------------------------


def test_the_planners_tiny_v4_is_the_v4_tests_tiny_model():
    """plan_check's copy of tests/v4_helpers.TINY (read from its source: importing the module
    imports torch, 10 s here)."""
    import ast
    from pathlib import Path

    from dayzero.tools.plan_check import TEST_CONFIGS

    tree = ast.parse((Path(__file__).parent / "v4_helpers.py").read_text())
    (call,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "TINY"]
    tiny = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}  # TINY = dict(key=value, ...)
    assert TEST_CONFIGS["test-v4"] == {**tiny, "model_type": "deepseek_v4"}


def test_v4_pages_are_the_serving_engines():
    """The planner's V4 page is the serving engine's default (16 rounded up to a multiple of the
    ratios: 16 for the tiny model's 4 and 16, 128 for the published 4 and 128), and its narrowest
    table is ServingConfig's."""
    from dayzero.engine.paged_steps import ServingConfig, default_page_size
    from dayzero.model.footprint_v4 import MIN_TABLE_PAGES, page_size

    for config in (_v4(), load_preset("deepseek-v4-flash"), load_preset("deepseek-v4-pro")):
        assert page_size(config, _work()) == default_page_size(config)
    assert (page_size(_v4(), _work()), page_size(load_preset("deepseek-v4-flash"), _work())) == (16, 128)
    assert MIN_TABLE_PAGES == ServingConfig.min_table_pages
    # The footprint's page, for every family, is the serving engine's default.
    for config in (_llama(), _latent(), load_preset("qwen3-next-80b-a3b"), load_preset("deepseek-v4-flash")):
        assert DecodeFootprint(config).page_size(_work()) == default_page_size(config)


def test_a_plan_reports_the_page_it_planned_with():
    """``Plan.page_size`` and the JSON's ``workload.page_size`` are the page the cache and steps were
    planned with: 128 for DeepSeek-V4-Flash (not the Workload's base of 16), 16 for a Llama."""
    flash = plan(DecodeFootprint(load_preset("deepseek-v4-flash")), _work(devices=8, device_memory=141 * 10**9),
                 {"tensor": 8})
    assert flash.page_size == 128 and flash.to_json()["workload"]["page_size"] == 128
    llama = plan(DecodeFootprint(_llama()), _work(), {"tensor": 4})
    assert llama.page_size == 16 and llama.to_json()["workload"]["page_size"] == 16


def test_v4_pool_bytes_by_hand():
    """Tiny V4, 2 rows of 200 positions, bf16, pages of 16: each row's table holds 13 pages (208
    positions), so per row and layer the pool holds 52 CSA entries and index keys (4 a page) and 13
    HCA entries (1 a page); per slot the window rings 4 x [16, 64] and the compressor states: CSA
    kv and gate [8, 128] and the indexer's [8, 64], twice each, HCA's [16, 64] twice. The pages
    are whole on every device (``latent_pages``), as are a replica's slots."""
    footprint = DecodeFootprint(_v4())
    states = 2 * (2 * 8 * 128 + 2 * 8 * 64) + 2 * 16 * 64
    rings, pages = 4 * 16 * 64, 13 * (2 * 4 * 64 + 2 * 4 * 32 + 1 * 64)  # per row
    p = evaluate(footprint, _work(devices=2, batch=2, context=200), {"tensor": 2})
    assert p.bytes["kv_cache"] == 2 * 2 * (rings + pages + states) and p.bytes["kv_scales"] == 0
    # int8 rings, entries and index keys (the states stay bf16), one fp32 scale per row.
    q = evaluate(footprint, _work(devices=2, batch=2, context=200, kv_cache="int8"), {"tensor": 2})
    assert q.bytes["kv_cache"] == 2 * (rings + pages + 2 * states)
    assert q.bytes["kv_scales"] == 2 * 4 * (4 * 16 + 13 * (2 * 4 + 2 * 4 + 1))
    # data=2: each replica holds its own row's pages and slot, whole.
    d = evaluate(footprint, _work(devices=2, batch=2, context=200), {"data": 2})
    assert d.bytes["kv_cache"] == 2 * (rings + pages + states)
    # The prefix cache's snapshots: 4 copies of a slot's rings and states per row of a replica,
    # whole (8 rows on tensor=2, 4 on data=2); int8 rings with a fp32 scale per ring row.
    assert p.bytes["state_snapshots"] == 8 * 2 * (rings + states)
    assert d.bytes["state_snapshots"] == 4 * 2 * (rings + states)
    assert q.bytes["state_snapshots"] == 8 * (rings + 4 * 16 * 4 + 2 * states)


@pytest.mark.parametrize("name, kinds", [("deepseek-v4-flash", (2, 21, 20)), ("deepseek-v4-pro", (0, 30, 31))])
def test_v4_presets_plan_at_a_million_tokens(name, kinds):
    """The published V4 models plan at 1M positions on tensor=8 with pages of 128 positions: the
    pool counted by hand (8192 pages a row; window 128, H 512, J 128; a page holds 32 CSA entries
    and index keys (r=4) and one HCA entry (r=128); rings and states one slot's), whole on every
    device. The decode step reads the widest table (8192 pages, 1M positions); its peak is the CSA
    indexer over every cached index key ([1, 64, 262144 + 1] fp32 per-head scores beside the keys
    [1, 262145, 128]), its attention following index_topk (1024 picked rows), not the context. The
    chunks are the serving engine's: 512 tokens reading no cache, then the front of T x W x 128
    within the chunk budget, 512 tokens over 32 pages ... 16 tokens over 8192."""
    config = load_preset(name)
    assert [config.compressed.kinds.count(CompressKind(k)) for k in (
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")] == list(kinds)
    _, csa, hca = kinds
    footprint = DecodeFootprint(config, name)
    work = _work(devices=8, device_memory=141 * 10**9, batch=1, context=1 << 20, quantize="fp8-block")
    p = evaluate(footprint, work, {"tensor": 8})
    assert p.runs
    pages = (1 << 20) // 128
    per_layer = {"csa": pages * 32 * (512 + 128) + 2 * 8 * 1024 + 2 * 8 * 256, "hca": pages * 512 + 2 * 128 * 512}
    assert p.bytes["kv_cache"] == 2 * config.num_layers * 128 * 512 + 2 * (
        csa * per_layer["csa"] + hca * per_layer["hca"])
    # The prefix cache's 4 copies of the sequence's rings and compressor states, whole.
    assert p.bytes["state_snapshots"] == 4 * 2 * (config.num_layers * 128 * 512 + csa * (2 * 8 * 1024 + 2 * 8 * 256)
                                                  + hca * 2 * 128 * 512)
    E4 = (1 << 20) // 4
    index = (E4 + 1) * 128 * 2 + 64 * (E4 + 1) * 4  # keys bf16, per-head scores fp32, whole
    assert index <= p.activation_peaks["decode"] <= 1.15 * index  # beside the outputs and held rows
    (decode,) = footprint.steps(work, {"tensor": 8})["decode"]
    assert (decode.B, decode.T, decode.S) == (1, 1, 1 << 20)
    chunks = [(st.T, st.S) for st in footprint.steps(work, {"tensor": 8})["prefill"]]
    assert chunks == [(512, 0), (512, 4096), (256, 8192), (128, 16384), (64, 32768), (32, 65536), (16, 1 << 20)]
    assert p.activation_peaks["prefill"] > p.activation_peaks["decode"]


def test_v4_chunks_are_shaped_as_the_serving_engine_shapes_them():
    """footprint_v4.prompt_chunks against a walk of ServingConfig.chunk_shape over a whole prompt
    (every distinct (T, W) in order, at several contexts, chunk sizes, budgets and pages), and
    chunk_shapes' choice of them: the first chunk, then the shapes no other exceeds in both T
    and S = W x page."""
    from dayzero.engine.paged_steps import ServingConfig
    from dayzero.model.footprint_v4 import chunk_shapes, decode_positions, page_size, prompt_chunks

    cases = [(_v4(), 4096, 64, 1 << 21), (_v4(), 4096, 512, 1 << 18), (_v4(), 1000, 512, 1 << 21),
             (_v4(), 200, 512, 1 << 21), (_v4(), 3000, 256, 1 << 16), (_v4(), 2900, 256, 1 << 21),
             (load_preset("deepseek-v4-flash"), 100000, 512, 1 << 21)]
    for config, context, chunk, budget in cases:
        serving = ServingConfig(max_context=context, max_chunk=chunk, chunk_budget=budget).resolve(config)
        work = _work(devices=1, context=context, prefill_chunk=chunk, chunk_budget=budget)
        page = page_size(config, work)
        walked, start = {}, 0
        while start < context:
            T, W = serving.chunk_shape(start, context - start)
            walked[(T, W)] = None
            start += T
        assert prompt_chunks(work, page) == tuple(walked), (context, chunk, budget)
        assert decode_positions(work, page) == serving.max_table_pages * serving.page_size
    # A shorter last chunk after a run of full ones over the widest table (2900 = 11 x 256 + 84).
    assert prompt_chunks(_work(devices=1, context=2900, prefill_chunk=256), 16)[-2:] == ((256, 256), (128, 256))
    work = _work(devices=1, context=4096, prefill_chunk=512, chunk_budget=1 << 18)
    assert prompt_chunks(work, 16)[:4] == ((512, None), (256, 64), (128, 128), (64, 256))
    assert chunk_shapes(work, 16) == ((512, 0), (256, 1024), (128, 2048), (64, 4096))
    assert chunk_shapes(_work(devices=1, context=200), 16) == ((256, 0),)


def test_cli_plans_deepseek_v4_flash_at_a_million_tokens(capsys):
    argv = ["plan", "--preset", "deepseek-v4-flash", "--context", 1 << 20, "--devices", 8, "--device-memory",
            "141GB", "--quantize", "fp8-block"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and "FITS" in out, (out, err)
    assert "serving page pools, 128 positions a page, and window rings and compressor states per sequence" in out
    assert "the prefix cache's copies of per-sequence states: 4 rows, 4 per sequence" in out
    rc, out, err = _run(argv + ["--json"], capsys)
    result = json.loads(out)
    best = result["recommended"]
    assert best["bytes_per_device"]["kv_cache"] > 0 and best["bytes_per_device"]["activations"] > 0
    assert best["bytes_per_device"]["state_snapshots"] > 0 and result["workload"]["page_size"] == 128
