"""Continuous batching on a mesh (8 faked CPU devices): tiny MoE models with quantized weights,
served on ``tensor=2,expert=4`` and ``data=2,tensor=4`` on the reference path and on the kernels
(``pallas_interpret``, inside ``shard_map``), with int8 and fp8 KV pages, give the tokens of
single-device serving with the same settings (``tests/mesh_serving_checks.py``; one subprocess
per model, since the device count is fixed when jax starts).

The DeepSeek-V3 case stores fp8 blocks of 32 x 32 over 64-wide experts: ``tensor=4`` cuts every
block in half, which the engine re-blocks exactly (``quant.reblocked``) so each shard's scales
match its values.
"""

from __future__ import annotations

import pytest

from tests.mesh_checks import run_part
from tests.mesh_serving_checks import CASES, RUNS

# Same maths on one device and on the mesh, summed in another order: fp32 rounding only. A wrong
# shard of a scale or a page would change logprobs by O(0.1) and tokens with them.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return request.param, run_part(request.param, module="tests.mesh_serving_checks", timeout=600)


def test_served_tokens_equal_one_device(case):
    name, result = case
    assert result["devices"] == 8
    runs = {k: v for k, v in result.items() if k != "devices"}
    assert len(runs) == len(RUNS[name])
    for run, got in runs.items():
        assert got["same_tokens"], run
        assert got["logprob_diff"] < LOGPROB_TOL, run


def test_the_mesh_runs_what_was_asked(case):
    """The resolved configuration is the one requested (nothing silently swapped for another
    path), and per-head pages are split over tensor like the contiguous cache."""
    name, result = case
    for (axes, kernels, kv), run in zip(RUNS[name], (v for k, v in result.items() if k != "devices")):
        assert run["run"]["kernels"] == kernels and run["run"]["kv_cache"] == kv
        assert run["run"]["mesh"] == axes
        assert run["run"]["quantize"] == CASES[name][1].weights.value
        if not name.startswith("deepseek"):  # latent pools are whole on every device
            assert run["pool_spec"][0] == "tensor"
