"""Offline cubin compilation of the Pallas kernels (dayzero.tools.cubin) and its H200 limit checks.

Compiling needs the optional ``triton`` package (``pip install 'dayzero[gpu-check]'``); those
tests skip without it. The limit logic and the launch parameters read from the lowering do not.
"""

from __future__ import annotations

import importlib.util
import sys

import jax
import jax.numpy as jnp
import pytest

from dayzero.kernels import chunked_delta_rule_pallas, recurrent_delta_step_pallas
from dayzero.kernels.check import triton_modules
from dayzero.kernels.delta_rule import CHUNKED_BLOCKS_GPU, STEP_BLOCKS_GPU
from dayzero.tools import cubin
from dayzero.tools.cubin import H200, blocks_per_sm, check_row, limit_problems, parse_ptxas_report

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the optional triton package is not installed "
                                                         "(pip install 'dayzero[gpu-check]')")


def _delta_avals(B, T, H, d):
    """A small gated-delta-rule call: q, k, v, g, beta, state, num_new."""
    sds = jax.ShapeDtypeStruct
    return (sds((B, T, H, d), jnp.bfloat16), sds((B, T, H, d), jnp.bfloat16), sds((B, T, H, d), jnp.bfloat16),
            sds((B, T, H), jnp.float32), sds((B, T, H), jnp.bfloat16), sds((B, H, d, d), jnp.float32),
            sds((B,), jnp.int32))


def _row(registers=64, shared=0, warps=4, spill_store=0, spill_load=0):
    return {"registers": registers, "shared_bytes": shared, "num_warps": warps,
            "spill_store_bytes": spill_store, "spill_load_bytes": spill_load}


def test_launch_parameters_come_from_the_kernels_table():
    """triton_modules reports the warps and stages the kernel asked Pallas for (the chunked
    delta rule's table: 8 warps, 1 stage, neither the default) and its grid (B, Hv, value tiles)."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    [module] = triton_modules(chunked_delta_rule_pallas, *_delta_avals(2, 64, 4, 128))
    assert (module.num_warps, module.num_stages) == (CHUNKED_BLOCKS_GPU.num_warps, CHUNKED_BLOCKS_GPU.num_stages)
    assert (module.num_warps, module.num_stages) != (4, 3)
    assert module.grid == (2, 4, 128 // CHUNKED_BLOCKS_GPU.block_v)


@needs_triton
def test_compile_report_of_a_small_kernel():
    """A decode step compiles to an sm_90 cubin whose registers, spills and shared memory are
    plausible and whose launch parameters are the table's."""
    [row] = cubin.compile_report(recurrent_delta_step_pallas, *_delta_avals(2, 1, 4, 32))
    assert row["kernel"] == "dayzero_recurrent_delta_step"
    assert (row["num_warps"], row["num_stages"]) == (STEP_BLOCKS_GPU.num_warps, STEP_BLOCKS_GPU.num_stages)
    assert 1 <= row["registers"] <= H200.registers_per_thread
    assert row["shared_bytes"] >= 0 and row["stack_bytes"] >= 0
    assert row["spill_store_bytes"] >= 0 and row["spill_load_bytes"] >= 0
    assert row["fits"] and row["problems"] == [] and 1 <= row["blocks_per_sm"] <= H200.blocks_per_sm


def test_limits_at_the_edge_fit():
    """255 registers x 8 warps fill the 64K register file exactly; 227 KiB is the most a block
    may use: both launch, one block per SM."""
    row = _row(registers=255, shared=227 * 1024, warps=8)
    assert limit_problems(row) == []
    assert blocks_per_sm(255, 227 * 1024, 8) == 1


@pytest.mark.parametrize("row, words", [
    (_row(registers=256), "registers per thread"),
    (_row(registers=200, warps=16), "per SM"),
    (_row(shared=227 * 1024 + 1), "shared memory"),
], ids=["registers per thread", "register file", "shared memory"])
def test_limits_exceeded_are_named(row, words):
    """One past each limit is reported, naming the limit."""
    problems = limit_problems(row)
    assert problems and any(words in p for p in problems), problems
    assert not check_row(row)["fits"]


def test_blocks_per_sm_rounds_registers_per_warp():
    """Registers go to a warp in units of 256: 128 per thread x 4 warps leave room for 4 blocks,
    129 round up to 17 units per warp and leave room for only 3; shared memory (with 1 KiB
    reserved per block) or threads bind when they are tighter."""
    assert blocks_per_sm(128, 0, 4) == 4
    assert blocks_per_sm(129, 0, 4) == 3
    assert blocks_per_sm(32, 100 * 1024, 4) == 2
    assert blocks_per_sm(16, 0, 32) == 2  # 1024 threads per block, 2048 per SM


def test_spills_are_flagged_not_failed():
    """A kernel that spills still launches: it is flagged, and still fits."""
    row = check_row(_row(registers=255, spill_store=8, spill_load=4))
    assert row["spills"] and row["fits"]
    assert not check_row(_row(registers=255))["spills"]


def test_parse_ptxas_report():
    """ptxas -v's lines for one kernel give registers, stack frame and spill bytes; text without
    them is an error, not zeros."""
    report = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
              "ptxas info    : Function properties for k\n"
              "    424 bytes stack frame, 956 bytes spill stores, 720 bytes spill loads\n"
              "ptxas info    : Used 255 registers, used 1 barriers, 424 bytes cumulative stack size\n")
    assert parse_ptxas_report(report) == {"registers": 255, "stack_bytes": 424, "spill_store_bytes": 956,
                                          "spill_load_bytes": 720}
    with pytest.raises(ValueError, match="one kernel"):
        parse_ptxas_report("ptxas info    : 0 bytes gmem\n")


def test_cli_without_triton_says_how_to_install(monkeypatch, capsys):
    """Without triton (an import of it fails) the CLI exits 2 with one line naming the extra."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes ``import triton`` raise ImportError
    assert cubin.main([]) == 2
    err = capsys.readouterr().err
    assert "dayzero[gpu-check]" in err and "Traceback" not in err
