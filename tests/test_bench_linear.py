"""bench/linear_decode.py (issue #16) on tiny sizes: its output, and its cache sizes against
bytes counted by hand from the shapes a Qwen3-Next-style hybrid and its full-attention twin hold."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

# A 4-layer hybrid (linear, linear, linear, full) and its all-attention twin, small enough that
# the four step compiles (two models x two contexts) dominate the run.
TINY = dict(hidden=32, mlp=48, layers=4, full_every=4, heads=4, kv_heads=2, head_dim=16,
            k_heads=2, v_heads=4, linear_dim=8, vocab=256)
CONV_KERNEL = 4  # the script's conv_kernel
CONTEXTS = (64, 512)


def _bench():
    """bench/linear_decode.py as a module (bench/ is scripts, not a package)."""
    path = Path(__file__).parents[1] / "bench" / "linear_decode.py"
    spec = importlib.util.spec_from_file_location("linear_decode", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _argv(**overrides) -> list[str]:
    sizes = TINY | overrides
    return [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _state_bytes() -> int:
    """One linear layer's cache: the q/k/v convolution tails (W - 1 inputs of Hk*dk, Hk*dk and
    Hv*dv, fp32 here) and the fp32 delta-rule state Hv x dk x dv."""
    t = TINY
    dk = dv = t["linear_dim"]
    return (CONV_KERNEL - 1) * (2 * t["k_heads"] * dk + t["v_heads"] * dv) * 4 + t["v_heads"] * dk * dv * 4


def _expected_bytes(context: int) -> tuple[int, int]:
    """(twin, hybrid) cache bytes for one row of ``context`` positions, counted by hand: fp32 K
    and V per attention layer, a state per linear layer, the int32 ``lengths`` [1] and
    ``rope_len`` scalar."""
    t = TINY
    kv_layer = 2 * t["kv_heads"] * t["head_dim"] * context * 4
    state = _state_bytes()
    full_layers = t["layers"] // t["full_every"]
    twin = t["layers"] * kv_layer + 8
    hybrid = full_layers * kv_layer + (t["layers"] - full_layers) * state + 8
    return twin, hybrid


@pytest.mark.slow  # 14 s, four whole-model compiles (suite time); the option checks below stay default
def test_tiny_run_reports_both_models_and_hand_counted_cache_bytes(tmp_path, capsys):
    out = tmp_path / "linear.json"
    result = _bench().main(["--contexts", ",".join(map(str, CONTEXTS)), "--steps", "2", "--warmup", "1",
                            "--bandwidth-mb", "4", "--json", str(out), *_argv()])

    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["context"] for r in result["rows"]] == list(CONTEXTS)
    for row in result["rows"]:
        twin, hybrid = _expected_bytes(row["context"])
        assert (row["full_cache_bytes"], row["hybrid_cache_bytes"]) == (twin, hybrid)
        assert row["full_cache_mb"] == pytest.approx(twin / 2**20)
        for name in ("full", "hybrid"):
            assert 0 < row[f"{name}_ms"] <= row[f"{name}_median_ms"]
        assert row["full_over_hybrid"] == pytest.approx(row["full_ms"] / row["hybrid_ms"])
        # the hybrid's cache beyond a quarter of the twin's: its 3 linear layers' states (and
        # 6 of the 8 bytes of lengths and rope_len, which both caches hold whole)
        assert row["linear_state_mb"] * 2**20 == pytest.approx(3 * _state_bytes(), abs=8)

    # What grows with the context is the attention layers' rows only: the hybrid's cache grows by
    # exactly its share of attention layers (1 in 4) of the twin's growth, its states not at all.
    first, last = result["rows"]
    twin_growth = last["full_cache_bytes"] - first["full_cache_bytes"]
    hybrid_growth = last["hybrid_cache_bytes"] - first["hybrid_cache_bytes"]
    assert hybrid_growth * TINY["full_every"] == twin_growth
    assert result["growth"]["hybrid_cache"] < result["growth"]["full_cache"]
    assert result["growth"]["full_ms"] == pytest.approx(last["full_ms"] / first["full_ms"])
    assert result["bandwidth_gb_s"] > 0
    assert first["linear_growth_ms"] == 0  # growth is counted from the first context
    expected = last["hybrid_ms"] - first["hybrid_ms"] - (last["full_ms"] - first["full_ms"]) / 4
    assert last["linear_growth_ms"] == pytest.approx(expected)

    table = capsys.readouterr().out
    assert "| context | full ms/token | hybrid ms/token | full/hybrid | full cache MB | hybrid cache MB |" in table
    assert "| linear layers' growth ms | linear states MB |" in table
    assert "| 512 |" in table and "growth 64 -> 512 tokens" in table


@pytest.mark.parametrize("args, fragment", [
    (["--contexts", "1"], "at least 2 tokens"),
    (["--contexts", "64,abc"], "comma-separated"),
    (["--contexts", "1000000000"], "half this machine's memory"),
    (["--full-every", "1"], "--full-every 1"),
    (["--kv-heads", "3"], "num_key_value_heads=3"),
])
def test_bad_options_are_one_clear_error(capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        _bench().parse_args([*_argv(), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
