"""dayzero bench: sweep output, peers, the PNG plot and the long-context soak (short version)."""

from __future__ import annotations

import json

import pytest

from dayzero.engine.cli import main
from dayzero.tools.measure import interleaved_speeds
from dayzero.tools.roofline import read_bandwidth, roofline
from dayzero.tools.soak import soak

SPEED_KEYS = {"ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb", "compile_s"}


def _bench_json(capsys, *args: str) -> dict:
    assert main(["bench", *args, "--json", "--repeats", "1"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # the --json contract keys are checked by the composed run below
def test_sweep_json_has_contract_keys_and_one_row_per_setting(tiny_model, capsys, tmp_path):
    plot = tmp_path / "bench.png"
    out = _bench_json(
        capsys, "--model", str(tiny_model.dir), "--prompt-len", "16,40", "--batch", "1,2",
        "--new-tokens", "4", "--plot", str(plot),
    )
    assert SPEED_KEYS <= out.keys()
    assert [(r["prompt_len"], r["batch"]) for r in out["runs"]] == [(16, 1), (16, 2), (40, 1), (40, 2)]
    for row in out["runs"]:
        assert row["ttft_s"] > 0 and row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
        assert row["kv_cache_mb"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs_the_composed_configuration_and_reports_it(tiny_model, capsys):
    """bench takes the run options generate takes (resolved in the same place): quantized weights,
    a quantized KV cache and the kernels at once, reported under "run"."""
    out = _bench_json(capsys, "--model", str(tiny_model.dir), "--prompt-len", "12", "--new-tokens", "3",
                      "--quantize", "int8", "--kv-cache", "fp8", "--kernels", "pallas_interpret")
    assert out["run"]["quantize"] == "int8" and out["run"]["kv_cache"] == "fp8"
    assert out["run"]["kernels"] == "pallas_interpret" and out["decode_tok_s"] > 0
    # The roofline of the same run: bandwidth measured here, the row's fraction of its limit.
    assert out["read_bandwidth"]["bytes_s"] > 0
    line = out["runs"][0]["roofline"]
    assert line["fraction"] == pytest.approx(out["decode_tok_s"] / line["roofline_tok_s"])


def test_roofline_is_bytes_per_step_over_the_measured_bandwidth():
    line = roofline(weights_bytes=1000, kv_bytes_per_position=10, prompt_len=100, new_tokens=20, batch=2,
                    decode_tok_s=50.0, bandwidth=1e6)
    assert line["bytes_per_step"] == 1000 + 2 * 10 * 110  # each row's cache at the mean position 110
    assert line["roofline_tok_s"] == pytest.approx(2 * 1e6 / 3200)
    assert line["fraction"] == pytest.approx(50.0 / (2 * 1e6 / 3200))
    measured = read_bandwidth(buffer_bytes=4 * 2**20, repeats=1)
    assert measured["bytes_s"] == max(measured["sum_bytes_s"], measured["matvec_bytes_s"]) > 0


def test_hf_peer_runs_in_the_same_process_and_reports_ratios(tiny_model, capsys):
    out = _bench_json(
        capsys, "--model", str(tiny_model.dir), "--prompt-len", "16", "--new-tokens", "4",
        "--vs-hf", str(tiny_model.hf_dir),
    )
    row = out["runs"][0]
    assert {"ttft_s", "prefill_tok_s", "decode_tok_s"} <= row["hf"].keys()
    assert row["ratio_hf"]["decode_tok_s"] == pytest.approx(row["decode_tok_s"] / row["hf"]["decode_tok_s"])


def test_peers_run_round_by_round_with_dayzero():
    """Each implementation is warmed up, then the repeats alternate (a, b, a, b, ...), and each
    figure is its own best: what makes two implementations sample the same stretch of a drifting
    machine."""
    calls = []

    def runner(name, timings):
        it = iter(timings)
        return lambda: calls.append(name) or next(it)

    runs = {"a": (runner("a", [(9.0, 9.0), (1.0, 3.0), (2.0, 1.5)]), [[1] * 10]),
            "b": (runner("b", [(9.0, 9.0), (4.0, 2.0), (3.0, 5.0)]), [[1] * 10] * 2)}
    out = interleaved_speeds(runs, new_tokens=4, repeats=2)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert out["a"] == {"ttft_s": 1.0, "prefill_tok_s": 10.0, "decode_tok_s": 2.0}
    assert out["b"] == {"ttft_s": 3.0, "prefill_tok_s": 20 / 3, "decode_tok_s": 3.0}


def test_soak_decodes_to_the_context_without_recompiling_or_growing(tiny_engine):
    result = soak(tiny_engine, max_len=tiny_engine.config.max_position_embeddings)
    assert result["steps"] == tiny_engine.config.max_position_embeddings - 16
    assert result["compiles_after_warmup"] == 0
    # The cache is allocated once at full length: the process must not keep growing.
    assert result["rss_growth_mb"] < 16
    assert len(result["windows"]) == 16


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompt-len", "0"], "--prompt-len"),
        (["--prompt-len", "abc"], "--prompt-len"),
        (["--prompt-len", "250", "--new-tokens", "64"], "context"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--prompt-len", "16", "--vs-hf", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--prompt-len", "16", "--vs-hf"], "SRC"),
    ],
)
def test_bad_bench_options_are_one_clear_error(tiny_model, capsys, args, fragment):
    assert main(["bench", "--model", str(tiny_model.dir), "--repeats", "1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dayzero: error:") and fragment in err and "Traceback" not in err


def _serve_load():
    """bench/serve_load.py as a module (bench/ is scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_serve_load_statistics_match_hand_computed_values():
    """Throughput, TTFT and TPOT percentiles of bench/serve_load.py on synthetic timings, against
    values worked out by hand (errored requests excluded from every figure)."""
    m = _serve_load()
    R = m.Result
    results = [R(sent=0.0, first=0.5, last=2.5, tokens=5),  # TTFT 0.5 s, TPOT 2.0 / 4 = 0.5 s
               R(sent=1.0, first=1.1, last=1.4, tokens=4),  # TTFT 0.1 s, TPOT 0.3 / 3 = 0.1 s
               R(sent=2.0, first=2.3, last=3.9, tokens=5),  # TTFT 0.3 s, TPOT 1.6 / 4 = 0.4 s
               R(sent=3.0, error="boom")]
    s = m.summarize(results, start=0.0, end=4.0)
    assert (s["requests"], s["errors"], s["error_kinds"]) == (3, 1, ["boom"])
    assert s["req_s"] == pytest.approx(3 / 4) and s["out_tok_s"] == pytest.approx(14 / 4)
    # sorted TTFTs 100, 300, 500 ms: p50 the middle one; p99 = 300 + 0.98 * (500 - 300)
    assert s["ttft_p50_ms"] == pytest.approx(300) and s["ttft_p99_ms"] == pytest.approx(496)
    # sorted TPOTs 100, 400, 500 ms: p99 = 400 + 0.98 * 100
    assert s["tpot_p50_ms"] == pytest.approx(400) and s["tpot_p99_ms"] == pytest.approx(498)
    assert m.tpot(R(sent=0.0, first=1.0, last=1.0, tokens=1)) is None


def test_serve_load_refuses_bad_arguments_and_fills_in_dayzero_shapes(capsys):
    m = _serve_load()
    args = m.parse_args(["--clients", "1,4,16", "--prompt-len", "100"])
    assert args.clients == [1, 4, 16] and args.slots == 16 and args.max_chunk == 128
    for bad, said in ((["--clients", "1,x"], "comma-separated"), (["--new-tokens", "1"], "at least 2"),
                      (["--servers", "vllm"], "unknown")):
        with pytest.raises(SystemExit):
            m.parse_args(bad)
        assert said in capsys.readouterr().err


def test_serve_load_prompts_have_the_asked_length_and_share_no_prefix():
    m = _serve_load()
    words = [f"w{i}" for i in range(50)]
    prompts = m.make_prompts(words, 10, 20, seed=3)
    assert prompts == m.make_prompts(words, 10, 20, seed=3)  # deterministic: both servers get these
    assert all(len(p.split()) == 10 and p.startswith(" ") for p in prompts)
    assert len({p.split()[0] + p.split()[1] for p in prompts}) > 15
