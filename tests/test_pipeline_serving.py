"""The serving engine on a pipeline (stage) mesh: served tokens equal one device with chunked
prefill, preemption, swap to host memory and the host prefix tier all exercised (8 faked devices
in a subprocess: ``tests/pipeline_serving_checks.py``), and the micro-batch option's checks."""

from __future__ import annotations

import jax
import pytest

from dayzero.engine import Engine, ServingConfig, ServingEngine
from dayzero.engine.cli import build_parser
from dayzero.engine.generate import GenerationError
from dayzero.engine.server_run import serving_config
from dayzero.model.weights import abstract_weights, init_weights
from tests.mesh_checks import run_part
from tests.pipeline_checks import dense_config


def _check_served(got: dict, mesh: str, stages: int, micro: int | None) -> None:
    run, one = got[mesh], got["one_device"]
    # A quantized KV cache rounds keys and values the mesh summed in another order: one on a
    # rounding boundary lands a step away (measured 2e-4 with int8). A wrong page, slot or scale
    # would move logprobs by O(0.1) and the tokens with them.
    assert run["same_tokens"] and run["logprob_diff"] < 1e-3, run
    assert len(run["stages"]) == stages and run["pool_spec"][0] == "stage", run
    if micro is not None:
        assert run["decode_micro_batches"] == micro, run
    # Decode steps ran several at a time with (at least S) micro-batches in flight, except for
    # latent attention on an expert axis (XLA cannot compile that yet: serving_inflight).
    assert (run["in_flight_calls"] >= 1) == ("expert" not in mesh or "latent" not in got["case"]), run
    assert got["generate_same_tokens"] and got["generate_in_flight"] >= stages, got
    # The run went through what it is meant to check, as the one-device run did.
    assert run["preemptions"] >= 1 and run["swapped_in"] >= 1 and one["preemptions"] >= 1, (run, one)


def test_pipeline_serving_dense_equals_one_device():
    """With an int8 KV cache, stage=2 x tensor=4 (two micro-batches, so decode steps run in
    flight, after warmup) and data=2 x stage=2 x tensor=2 (two replicas, each a two-stage
    pipeline) serve the tokens one device serves, greedy and seeded sampled requests alike; Engine.generate's in-flight decode of
    sampled rows gives one device's tokens too."""
    got = run_part("dense", module="tests.pipeline_serving_checks", fast_compile=True, timeout=600)
    _check_served(got, "stage2xtensor4", 2, 2)
    assert got["stage2xtensor4"]["host_pages"] >= 1 and got["stage2xtensor4"]["cached_tokens"] >= 16
    replicated = got["data2xstage2xtensor2"]
    assert replicated["replicas"] == 2
    assert replicated["same_tokens"] and replicated["logprob_diff"] < 1e-3, replicated


@pytest.mark.slow
@pytest.mark.parametrize("case,mesh,stages,micro", [("moe", "stage4xexpert2", 4, 4),
                                                     ("dense_first", "stage2xtensor2xexpert2", 2, 1),
                                                     ("latent", "stage2xtensor2xexpert2", 2, 2),
                                                     ("gpt_oss", "stage2xtensor2xexpert2", 2, 2)])
def test_pipeline_serving_moe_equals_one_device(case, mesh, stages, micro):
    """Four MoE stages with expert parallelism inside each, DeepSeek-style dense first layers on
    stage 0 with an fp8 KV cache, latent attention with an int8 one, and gpt-oss (a sliding and
    a full attention layer, one a stage, with sinks) serve the tokens one device serves."""
    got = run_part(case, module="tests.pipeline_serving_checks", fast_compile=True, timeout=600)
    _check_served(got, mesh, stages, micro)


def test_checkpoint_loads_each_layer_onto_its_stage_only(hf_factory, tmp_path):
    """Engine.load on a stage mesh reads each decoder layer onto the devices of the stage that runs
    it (never the whole model onto one stage's devices) and stacks them into what stage_weights
    makes of the checkpoint loaded on one device. (Across processes, where a process skips the
    other stages' layers, ``test_two_processes_one_stage_each`` and the serve test below load too.)"""
    model = hf_factory.build("llama", seed=4, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=3)
    _, model_dir = hf_factory.save_and_convert(model, tmp_path)
    got = run_part("load", str(model_dir), module="tests.pipeline_serving_checks", fast_compile=True)
    stage_of = [s for s, (a, b) in enumerate(got["ranges"]) for _ in range(a, b)]
    assert got["ranges"] == [[0, 2], [2, 3]] and got["stage_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert got["read_on"] == [got["stage_devices"][s] for s in stage_of]
    assert got["max_abs_diff"] == 0.0
    assert got["q_spec"][0] == "stage" and got["q_shape"][:2] == [2, 2] and got["q_shard_shape"][0] == 1


def test_micro_batches_need_a_stage_mesh():
    config = dense_config()
    engine = Engine(config, init_weights(abstract_weights(config), jax.random.key(0), scale=0.1))
    with pytest.raises(GenerationError, match="micro_batches=2 cuts a pipeline's decode steps; it needs a --mesh "
                                              "with stage > 1"):
        ServingEngine(engine, ServingConfig(slots=2, page_size=8, max_context=32, micro_batches=2))
    with pytest.raises(GenerationError, match="micro_batches=0 is invalid"):
        ServingConfig(micro_batches=0)
    args = build_parser().parse_args(["serve", "--micro-batches", "4"])
    assert serving_config(args).micro_batches == 4


def test_two_processes_one_stage_each_serve_as_one_device(hf_factory, tmp_path):
    """``launch-local --processes 2 --devices-per-process 1 -- serve --mesh stage=2``: each process
    holds one stage (its layers and its half of every page's layers); concurrent greedy and
    seeded streams equal one device's tokens."""
    import concurrent.futures
    import os
    import signal

    import openai

    from dayzero.engine.sampling import SamplingParams
    from tests.test_server import start_server, stop_server

    model = hf_factory.build("llama", seed=6, vocab_size=264, max_position_embeddings=256)
    _, model_dir = hf_factory.save_and_convert(model, tmp_path, tokenizer=True)
    launch = ("launch-local", "--processes", "2", "--devices-per-process", "1", "--")
    server = start_server(["--model", str(model_dir), "--served-model-name", "tiny", "--mesh", "stage=2",
                           "--slots", "4", "--max-context", "64", "--max-chunk", "32", "--no-warmup"],
                          timeout=400, launch=launch)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
        cases = [(f"stage {i} says", 0.0 if i % 2 else 1.0, 200 + i) for i in range(4)]

        def complete(case):
            prompt, temperature, seed = case
            reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=temperature,
                                              seed=seed, extra_body={"return_token_ids": True, "ignore_eos": True})
            return reply.choices[0].model_extra["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            served = list(pool.map(complete, cases, timeout=300))
        # Process 0 drains and tells process 1 to stop: both exit 0 (launch-local's status).
        pid = next(int(line.split("pid ")[1]) for line in iter(server.proc.stderr.readline, "")
                   if line.startswith("[launch-local] process 0 pid "))
        os.kill(pid, signal.SIGTERM)
        assert server.proc.wait(120) == 0
    finally:
        stop_server(server)
    engine = Engine.load(model_dir)
    for (prompt, temperature, seed), ids in zip(cases, served):
        one = engine.generate(prompt, max_new_tokens=8, ignore_eos=True,
                              sampling=SamplingParams(temperature=temperature, seed=seed))
        assert ids == one.token_ids, (prompt, temperature)


def test_auto_kernels_on_a_stage_mesh_resolve_to_the_reference_path(monkeypatch):
    """Where ``auto`` means the Pallas kernels (a GPU), a stage mesh gets the reference path, which
    the pipeline runs, instead of a refusal; the kernels asked for by name are still refused."""
    from dayzero.engine import runtime
    from dayzero.engine.runtime import RunConfigError, resolve_run
    from dayzero.kernels import KernelMode

    monkeypatch.setattr(runtime, "resolve_mode", lambda mode: KernelMode.PALLAS if mode in (
        KernelMode.AUTO, "auto") else KernelMode(getattr(mode, "value", mode)))
    monkeypatch.setattr(runtime, "check_placement", lambda model, placement: None)
    config = dense_config()

    class Axes:
        axes = {"data": 1, "stage": 2, "expert": 1, "tensor": 1}  # what the checks read of a placement

    assert resolve_run(config, kernels="auto", placement=Axes()).kernels is KernelMode.REFERENCE
    with pytest.raises(RunConfigError, match="does not support the Pallas attention kernels"):
        resolve_run(config, kernels="pallas_interpret", placement=Axes())
