"""Where the stage mesh and weight offload meet the rest of the runtime: what
``engine/runtime.py`` refuses in one place, and an Engine with offloaded layers.

The refusals are checked on a stand-in placement (only its axis sizes are read), so no
multi-device process is needed; the pipeline itself is tested in ``tests/test_pipeline.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest

from dayzero.engine.generate import Engine
from dayzero.engine.runtime import (RunConfig, RunConfigError, _check_pipeline, check_page_pool, default_dtype,
                                    resolve_run)
from dayzero.kernels.mode import KernelMode
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import KVQuant, QuantConfig, WeightQuant
from dayzero.model.weights import abstract_weights, init_weights
from tests.serving_models import DSA, LATENT
from tests.test_weight_offload import dense_config

STAGES = SimpleNamespace(axes={"data": 1, "tensor": 2, "expert": 1, "stage": 2})


def test_stage_mesh_with_offload_is_refused():
    with pytest.raises(RunConfigError, match="--offload-weights .* stage"):
        _check_pipeline(dense_config(), STAGES, QuantConfig(), KVQuant.NONE, KernelMode.REFERENCE, True)
    _check_pipeline(dense_config(), STAGES, QuantConfig(), KVQuant.NONE, KernelMode.REFERENCE, False)


def test_stage_mesh_refusals_come_from_the_pipeline():
    sparse = parse_hf_config(dict(DSA, num_hidden_layers=4))
    with pytest.raises(RunConfigError, match=r"stage=2 \(pipeline parallelism\) does not support DeepSeek sparse "
                                             "attention"):
        _check_pipeline(sparse, STAGES, QuantConfig(), KVQuant.NONE, KernelMode.REFERENCE, False)


def test_stage_mesh_runs_latent_attention_and_quantized_weights():
    """What the pipeline no longer refuses: DeepSeek-V3's latent attention, weights in every
    quantized format and a quantized KV cache (the runtime's check passes them;
    tests/test_pipeline.py runs them)."""
    latent = parse_hf_config(dict(LATENT, num_hidden_layers=4, first_k_dense_replace=1))
    for weights in WeightQuant:
        _check_pipeline(latent, STAGES, QuantConfig(weights), KVQuant.NONE, KernelMode.REFERENCE, False)
        _check_pipeline(dense_config(), STAGES, QuantConfig(weights), KVQuant.NONE, KernelMode.REFERENCE, False)
    for kv in KVQuant:  # and a quantized KV cache (tests/test_pipeline_serving.py serves with one)
        _check_pipeline(latent, STAGES, QuantConfig(), kv, KernelMode.REFERENCE, False)


def test_serving_on_a_stage_mesh_is_not_refused():
    run = RunConfig(default_dtype(), QuantConfig(), KVQuant.NONE, KernelMode.REFERENCE, placement=STAGES)
    check_page_pool(run, dense_config(), num_pages=8, page_size=16)


def test_engine_with_offloaded_layers_generates_the_same_tokens():
    config = dense_config()
    weights = init_weights(abstract_weights(config), jax.random.key(0), scale=0.2)
    prompt = [[3, 14, 15, 92, 65]]
    plain = Engine(config, weights, None).generate(prompt, max_new_tokens=6)
    run = resolve_run(config, dtype=weights.embed.dtype, offload_weights=True)
    engine = Engine(config, weights, None, run=run)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(engine.weights.layers)} == {"pinned_host"}
    assert engine.run.describe()["offload_weights"] is True
    got = engine.generate(prompt, max_new_tokens=6)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
