"""Multi-host runs on one machine: ``dayzero launch-local`` starts N processes of one JAX
multi-controller run (gloo collectives on CPU).

Two processes x four CPU devices with --mesh tensor=8 give the tokens and logprobs of one
process on one device; a failing or killed process stops the whole run quickly, with its exit
status and a message naming it; bad launch requests are one-line errors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dayzero.engine.cli import main

PROMPT = "3,1,4,1,5,9,2,6"
NEW = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dayzero(*args: str) -> list[str]:
    return [sys.executable, "-m", "dayzero.engine.cli", *map(str, args)]


@pytest.fixture(scope="module")
def model_dir(hf_factory, tmp_path_factory):
    """A tiny llama whose 8 heads, 8 kv heads, MLP and vocabulary all split over tensor=8."""
    model = hf_factory.build("llama", seed=4, num_attention_heads=8, num_key_value_heads=8)
    _, dz = hf_factory.save_and_convert(model, tmp_path_factory.mktemp("multihost"))
    return dz


def _generate_args(model_dir) -> list[str]:
    return ["generate", "--model", str(model_dir), "--prompt-ids", PROMPT, "--max-new-tokens", str(NEW),
            "--json", "--logprobs"]


def test_two_processes_match_one_device(model_dir, capsys):
    assert main(_generate_args(model_dir)) == 0
    one = json.loads(capsys.readouterr().out)
    cmd = _dayzero("launch-local", "--processes", 2, "--devices-per-process", 4, "--",
                   *_generate_args(model_dir), "--mesh", "tensor=8")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # process 0's result only, nothing from the runtime
    two = json.loads(lines[0])
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == NEW
    assert max(abs(a - b) for a, b in zip(two["logprobs"], one["logprobs"])) < 1e-5
    assert "[1] " in proc.stderr  # the second process ran, its stderr prefixed


@pytest.fixture(scope="module")
def moe_dir(tiny_moe_hf, tmp_path_factory):
    """The tiny Qwen3-MoE converted with int8 weights."""
    from dayzero.convert import convert_checkpoint

    return convert_checkpoint(tiny_moe_hf, tmp_path_factory.mktemp("multihost_moe") / "dz", progress=False,
                              quantize="int8")


# Slow for suite time: quantized kernels on a mesh serve in one process by default (test_mesh_serving).
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["tensor=2,expert=4", "data=2,tensor=4"])
def test_two_processes_serve_quantized_moe_on_kernels(moe_dir, capsys, mesh):
    """Everything at once over two processes x four devices: int8 weights, expert parallelism
    (tensor=2 x expert=4) or data x tensor, an int8 KV cache and the kernels (interpreted) reading
    its pages inside shard_map, generation on the paged serving path; the tokens of one process
    on one device with the same settings. (Across processes a data replica's devices are another
    process's, so serving there is one engine over the whole mesh: ``ServingEngine.replicas``.)"""
    run = ["--kv-cache", "int8", "--kernels", "pallas_interpret"]
    assert main([*_generate_args(moe_dir), *run]) == 0
    one = json.loads(capsys.readouterr().out)
    cmd = _dayzero("launch-local", "--processes", 2, "--devices-per-process", 4, "--",
                   *_generate_args(moe_dir), *run, "--mesh", mesh)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    axes = {a: int(n) for a, n in (part.split("=") for part in mesh.split(","))}
    assert two["run"]["mesh"] == axes and two["run"]["quantize"] == "int8"
    assert two["run"]["kernels"] == "pallas_interpret" and two["run"]["kv_cache"] == "int8"
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == NEW
    assert max(abs(a - b) for a, b in zip(two["logprobs"], one["logprobs"])) < 1e-4


def test_killed_process_stops_the_run(model_dir):
    # A long benchmark on a mesh spanning both processes: they are in collectives together when
    # process 1 dies, which is where a survivor would otherwise wait.
    cmd = _dayzero("launch-local", "--processes", 2, "--devices-per-process", 1, "--",
                   "bench", "--model", model_dir, "--prompt-len", 8, "--new-tokens", 100, "--repeats", 100,
                   "--mesh", "tensor=2")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = {}
    for line in proc.stderr:
        if line.startswith("[launch-local] process "):
            _, _, index, _, pid = line.split()
            pids[int(index)] = int(pid)
        if line.startswith("[1] "):  # process 1's runtime is up (gloo reports its connections)
            break
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    assert time.monotonic() - killed < 30, "the launcher did not stop the run in time"
    assert proc.returncode == 128 + signal.SIGKILL, rest[-2000:]
    assert "process 1 was killed by SIGKILL" in rest
    with pytest.raises(ProcessLookupError):  # process 0 was stopped too
        os.kill(pids[0], 0)


def test_failing_process_exit_code_is_propagated(tmp_path):
    cmd = _dayzero("launch-local", "--processes", 2, "--devices-per-process", 1, "--",
                   "generate", "--model", tmp_path / "missing", "--prompt-ids", "1,2")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "missing" in proc.stderr and "exited with code 2" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args, fragment", [
    (["--processes", "2", "--devices-per-process", "1"], "needs a dayzero command"),
    (["--processes", "2", "--devices-per-process", "1", "--", "frobnicate"], "'frobnicate'"),
    (["--processes", "2", "--devices-per-process", "1", "--", "generate", "--coordinator", "h:1"], "--coordinator"),
    (["--processes", "0", "--devices-per-process", "1", "--", "check", "x"], "--processes 0"),
])
def test_bad_launch_requests_are_one_line_errors(args, fragment, capsys):
    assert main(["launch-local", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dayzero: error:") and fragment in err[0], err


def test_two_process_conversion_for_a_mesh(hf_factory, model_dir, tmp_path):
    # Each process writes the shards it holds; process 0 the files around them.
    import numpy as np

    from dayzero.convert import load_checkpoint, verify_checkpoint
    from dayzero.model.weights import named_leaves

    dst = tmp_path / "for_mesh"
    cmd = _dayzero("launch-local", "--processes", 2, "--devices-per-process", 4, "--",
                   "convert", model_dir.parent / "hf", dst, "--mesh", "tensor=8", "--no-progress")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((dst / "manifest.json").read_text())["mesh"] == {"data": 1, "tensor": 8, "expert": 1, "stage": 1}
    assert sorted(p.name for p in dst.parent.iterdir()) == ["for_mesh"]  # no temporary left
    assert verify_checkpoint(dst) > 0
    want, got = named_leaves(load_checkpoint(model_dir)[1]), named_leaves(load_checkpoint(dst)[1])
    assert all(np.array_equal(np.asarray(want[k]), np.asarray(got[k])) for k in want)
