"""The ``dayzero`` command line (contract in DESIGN.md), mostly run in-process through
``dayzero.engine.cli.main``; one run goes through the installed console script.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dayzero.engine.cli import main

JSON_KEYS = {"text", "prompt_ids", "token_ids", "finish_reason"}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit status, stdout, stderr); argparse exits count as status."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _assert_one_line_error(rc: int, out: str, err: str, *fragments: str) -> None:
    assert rc != 0
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    assert lines[0].startswith("dayzero: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("dayzero")
    if script.exists():
        return [str(script)]
    found = shutil.which("dayzero")
    return [found] if found else [sys.executable, "-m", "dayzero.engine.cli"]


# ---- generate ------------------------------------------------------------------------------------


def test_generate_json_with_logprobs(tiny_model, tiny_engine, capsys):
    rc, out, err = _run(
        ["generate", "--model", tiny_model.dir, "--prompt-ids", "1,2,3", "--json", "--logprobs",
         "--max-new-tokens", "5"],
        capsys,
    )
    assert rc == 0, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    obj = json.loads(lines[0])
    assert JSON_KEYS | {"logprobs"} <= set(obj)
    assert obj["prompt_ids"] == [1, 2, 3]
    assert obj["finish_reason"] in ("stop", "length")
    assert 1 <= len(obj["token_ids"]) <= 5
    assert len(obj["logprobs"]) == len(obj["token_ids"])
    assert all(isinstance(lp, float) and lp <= 0 and math.isfinite(lp) for lp in obj["logprobs"])
    # The same request through the Python API gives the same answer.
    ref = tiny_engine.generate([1, 2, 3], max_new_tokens=5, logprobs=True)
    assert obj["token_ids"] == ref.token_ids
    assert obj["text"] == ref.text
    assert obj["finish_reason"] == ref.finish_reason
    assert obj["logprobs"] == pytest.approx(ref.logprobs, abs=1e-5)


def test_generate_json_without_logprobs_has_no_logprobs_key(tiny_model, capsys):
    rc, out, err = _run(
        ["generate", "--model", tiny_model.dir, "--prompt", "hello", "--json", "--max-new-tokens", "3",
         "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "--seed", "4"],
        capsys,
    )
    assert rc == 0, err
    obj = json.loads(out)
    assert JSON_KEYS <= set(obj) and "logprobs" not in obj
    assert obj["prompt_ids"] == list(b"hello")


def test_generate_streams_the_text(tiny_model, tiny_engine, capsys):
    """Without --json the text is streamed to stdout, then a newline."""
    rc, out, err = _run(
        ["generate", "--model", tiny_model.dir, "--prompt", "The quick brown fox", "--max-new-tokens", "16"],
        capsys,
    )
    assert rc == 0, err
    ref = tiny_engine.generate("The quick brown fox", max_new_tokens=16)
    assert out == ref.text + "\n"


def test_generate_chat_json(tiny_model, capsys):
    rc, out, err = _run(
        ["generate", "--model", tiny_model.dir, "--prompt", "hi", "--chat", "--json", "--max-new-tokens", "2"],
        capsys,
    )
    assert rc == 0, err
    assert json.loads(out)["prompt_ids"] == [256, *b"user\nhi", 257, *b"\n", 256, *b"assistant\n"]


def test_console_script_generate_json(tiny_model):
    """The installed ``dayzero`` entry point, in a fresh process."""
    proc = subprocess.run(
        [*_console_script(), "generate", "--model", str(tiny_model.dir), "--prompt-ids", "1,2,3", "--json",
         "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["prompt_ids"] == [1, 2, 3] and 1 <= len(obj["token_ids"]) <= 4


def test_console_script_user_error_has_no_traceback(tiny_model):
    proc = subprocess.run(
        [*_console_script(), "generate", "--model", str(tiny_model.dir), "--prompt-ids", "1,x"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    _assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "1,x")


# ---- user errors: one line on stderr, non-zero exit, no traceback ---------------------------------

GENERATE_ERRORS = {
    "empty_prompt": (["--prompt", ""], ["empty"]),
    "blank_prompt": (["--prompt", "   "], ["empty"]),
    "empty_ids": (["--prompt-ids", ","], []),
    "bad_ids": (["--prompt-ids", "1,x"], ["1,x"]),
    "float_ids": (["--prompt-ids", "1,2.5"], ["1,2.5"]),
    "oov_id": (["--prompt-ids", "1,99999"], ["99999"]),
    "negative_id": (["--prompt-ids", "1,-4"], ["-4"]),
    "negative_temperature": (["--prompt-ids", "1,2", "--temperature", "-1"], ["temperature", "-1"]),
    "top_p_zero": (["--prompt-ids", "1,2", "--top-p", "0"], ["top_p", "0"]),
    "top_p_above_one": (["--prompt-ids", "1,2", "--top-p", "1.5"], ["1.5"]),
    "negative_top_k": (["--prompt-ids", "1,2", "--top-k", "-3"], ["-3"]),
    "min_p_above_one": (["--prompt-ids", "1,2", "--min-p", "2"], ["2"]),
    "max_new_tokens_zero": (["--prompt-ids", "1,2", "--max-new-tokens", "0"], ["0"]),
    "past_context": (["--prompt-ids", "1,2", "--max-new-tokens", "1000"], ["1000", "256"]),
    "mesh_tensor_2": (["--prompt-ids", "1,2", "--mesh", "tensor=2"], ["tensor=2"]),
    "mesh_bad_axis": (["--prompt-ids", "1,2", "--mesh", "pipeline=2"], ["pipeline=2"]),
    "logprobs_without_json": (["--prompt-ids", "1,2", "--logprobs"], ["--json"]),
    "chat_with_ids": (["--prompt-ids", "1,2", "--chat"], ["chat"]),
    "partial_multihost": (["--prompt-ids", "1,2", "--num-processes", "2"], ["--coordinator"]),
}


@pytest.mark.parametrize("name", list(GENERATE_ERRORS))
def test_generate_user_errors(name, tiny_model, capsys):
    extra, fragments = GENERATE_ERRORS[name]
    rc, out, err = _run(["generate", "--model", tiny_model.dir, *extra], capsys)
    _assert_one_line_error(rc, out, err, *fragments)
    assert out == ""


def test_generate_kernels_pallas_on_cpu_is_the_kernels_error(tiny_model, capsys):
    if jax.default_backend() != "cpu":
        pytest.skip("pallas runs on GPU")
    rc, out, err = _run(["generate", "--model", tiny_model.dir, "--prompt-ids", "1,2", "--kernels", "pallas"], capsys)
    _assert_one_line_error(rc, out, err, "pallas cannot run on cpu", "pallas_interpret")
    assert rc == 2 and out == ""


def test_generate_kernels_pallas_interpret_matches_reference(tiny_model, tiny_engine, capsys):
    """--kernels pallas_interpret serves the request on the paged engine, decode on the paged
    kernels: the same greedy tokens as the reference, and --json reports what ran."""
    argv = ["generate", "--model", tiny_model.dir, "--prompt-ids", "1,2,3", "--json", "--logprobs",
            "--max-new-tokens", "4"]
    rc, out, err = _run([*argv, "--kernels", "pallas_interpret"], capsys)
    assert rc == 0, err
    obj = json.loads(out)
    ref = tiny_engine.generate([1, 2, 3], max_new_tokens=4, logprobs=True)
    assert obj["token_ids"] == ref.token_ids
    assert obj["text"] == ref.text
    np.testing.assert_allclose(obj["logprobs"], ref.logprobs, rtol=1e-4, atol=2e-5)
    platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else jax.default_backend()
    assert obj["kernels"] == {"requested": "pallas_interpret", "resolved": "pallas_interpret",
                              "platform": platform, "backend": "pallas_interpret"}
    rc, out, err = _run([*argv, "--kernels", "reference"], capsys)
    assert rc == 0, err
    assert json.loads(out)["kernels"] == {"requested": "reference", "resolved": "reference",
                                          "platform": platform, "backend": "xla"}


def test_generate_kernels_pallas_interpret_streams_text(tiny_model, tiny_engine, capsys):
    rc, out, err = _run(["generate", "--model", tiny_model.dir, "--prompt", "hi", "--max-new-tokens", "3",
                         "--kernels", "pallas_interpret"], capsys)
    assert rc == 0, err
    assert out == tiny_engine.generate("hi", max_new_tokens=3).text + "\n"


def test_generate_kernels_with_a_quantized_kv_cache(tiny_model, capsys):
    """The kernels read int8 pages with their scale pages: --kernels pallas_interpret --kv-cache int8
    runs, reports the resolved configuration, and gives the reference path's tokens and logprobs."""
    argv = ["generate", "--model", tiny_model.dir, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6", "--json",
            "--logprobs", "--kv-cache", "int8"]
    outs = {}
    for kernels in ("pallas_interpret", "reference"):
        rc, out, err = _run([*argv, "--kernels", kernels], capsys)
        assert rc == 0, err
        outs[kernels] = json.loads(out)
    got, ref = outs["pallas_interpret"], outs["reference"]
    assert got["run"]["kernels"] == "pallas_interpret" and got["run"]["kv_cache"] == "int8"
    assert got["kernels"]["resolved"] == "pallas_interpret"
    assert got["token_ids"] == ref["token_ids"]
    np.testing.assert_allclose(got["logprobs"], ref["logprobs"], atol=2e-5)


def test_generate_huge_seed_is_not_a_traceback(tiny_model, capsys):
    """--seed 2**64 parses as an int; it must either work or be refused in one line."""
    rc, out, err = _run(
        ["generate", "--model", tiny_model.dir, "--prompt-ids", "1,2", "--temperature", "1", "--json",
         "--max-new-tokens", "2", "--seed", str(2**64)],
        capsys,
    )
    if rc == 0:
        assert len(json.loads(out)["token_ids"]) == 2
    else:
        _assert_one_line_error(rc, out, err, str(2**64))


def test_generate_missing_model_dir(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    rc, out, err = _run(["generate", "--model", missing, "--prompt-ids", "1,2"], capsys)
    _assert_one_line_error(rc, out, err, str(missing))


def test_generate_model_dir_without_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, out, err = _run(["generate", "--model", tmp_path / "empty", "--prompt-ids", "1,2"], capsys)
    _assert_one_line_error(rc, out, err)


def test_convert_into_existing_dst(tiny_model, tmp_path, capsys):
    dst = tmp_path / "exists"
    dst.mkdir()
    rc, out, err = _run(["convert", tiny_model.hf_dir, dst, "--no-progress"], capsys)
    _assert_one_line_error(rc, out, err, str(dst))
    assert list(dst.iterdir()) == []  # left untouched


def test_convert_missing_src(tmp_path, capsys):
    rc, out, err = _run(["convert", tmp_path / "nothing_here", tmp_path / "dst", "--no-progress"], capsys)
    _assert_one_line_error(rc, out, err, "nothing_here")
    assert not (tmp_path / "dst").exists()


def test_convert_mesh_and_bad_quantize_refused(tiny_model, tmp_path, capsys):
    for extra, fragments in ((["--mesh", "tensor=2"], ("tensor=2",)),
                             (["--quantize", "int3"], ("'int3'", "int8, fp8, fp8-block, int4")),
                             (["--quantize", "auto"], ("'auto'", "none, int8"))):
        rc, out, err = _run(["convert", tiny_model.hf_dir, tmp_path / "dst", "--no-progress", *extra], capsys)
        _assert_one_line_error(rc, out, err, *fragments)
        assert not (tmp_path / "dst").exists()


def test_convert_then_generate(tiny_model, tiny_engine, tmp_path, capsys):
    dst = tmp_path / "converted"
    rc, out, err = _run(["convert", tiny_model.hf_dir, dst, "--no-progress"], capsys)
    assert rc == 0, err
    assert (dst / "manifest.json").exists() and (dst / "tokenizer.json").exists()
    rc, out, err = _run(["generate", "--model", dst, "--prompt-ids", "4,5,6", "--json", "--max-new-tokens", "3"], capsys)
    assert rc == 0, err
    ref = tiny_engine.generate([4, 5, 6], max_new_tokens=3)
    assert json.loads(out)["token_ids"] == ref.token_ids


# ---- bench ---------------------------------------------------------------------------------------


def test_bench_json(tiny_model, capsys):
    rc, out, err = _run(
        ["bench", "--model", tiny_model.dir, "--prompt-len", "16", "--new-tokens", "4", "--json", "--repeats", "1"],
        capsys,
    )
    assert rc == 0, err
    obj = json.loads(out)
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb", "compile_s"):
        assert isinstance(obj[key], float) and math.isfinite(obj[key]), key
    assert obj["ttft_s"] > 0 and obj["prefill_tok_s"] > 0 and obj["decode_tok_s"] > 0
    assert obj["compile_s"] > 0 and obj["peak_rss_mb"] > 10
    assert obj["prompt_len"] == 16 and obj["new_tokens"] == 4 and obj["batch"] == 1


@pytest.mark.parametrize("flag", ["--prompt-len", "--new-tokens", "--batch", "--repeats"])
def test_bench_rejects_non_positive_sizes(flag, tiny_model, capsys):
    rc, out, err = _run(["bench", "--model", tiny_model.dir, flag, "0"], capsys)
    _assert_one_line_error(rc, out, err, flag)


def test_generate_streams_an_incomplete_utf8_tail(tiny_model, tiny_engine, capsys):
    """A streamed answer whose last token leaves an incomplete UTF-8 sequence still prints all of
    the final text (it ends in U+FFFD): streaming must flush at the end."""
    engine = tiny_engine
    full = engine.generate("hello", max_new_tokens=40, ignore_eos=True).token_ids
    cut = next((n for n in range(1, 41) if engine.tokenizer.decode(full[:n]).endswith("\ufffd")), None)
    assert cut is not None, "premise: the tiny model emits some non-ASCII byte"
    ref = engine.generate("hello", max_new_tokens=cut)
    rc, out, err = _run(["generate", "--model", tiny_model.dir, "--prompt", "hello", "--max-new-tokens", cut], capsys)
    assert rc == 0, err
    assert out == ref.text + "\n"
