"""Linear-attention hybrids on a mesh of 8 faked CPU devices: the same greedy tokens as one
device, generated and served (``tests/linear_mesh_checks.py``, in a subprocess: the device count
is fixed when jax starts).

Two tiny models of tests/linear_helpers.py, random weights drawn in the subprocess (the mesh and
the single device get the same weights; conversion is tests/test_linear_config.py's):
Qwen3-Next (GDN with 2 key heads and 4 value heads, gated GQA, 4 experts) and Kimi-Linear (KDA
with 2 heads, latent attention, 4 experts), on tensor=2 x expert=4 and data=4 x tensor=2.

Layout of the states (``linear_attn.state_specs``): value heads (conv_v, recurrent) split over
``tensor`` as query heads, key heads (conv_q, conv_k) as kv heads, each where the count divides
(else whole); rows (generate's contiguous cache) or slots (a serving pool) over ``data`` where
their count divides. In one process serving on data=D runs D replicas, each its own pool on
its tensor x expert devices (slots whole); a pool over the whole mesh (one serving engine over
several processes) is checked by its specs only.

Default suite: the specs, device-free (one subprocess per model, seconds). Slow: generate and
serving on both meshes against one device (one subprocess per model, both at once: ~3 min here).
"""

from __future__ import annotations

import json

import pytest

from dayzero.model.hf_config import parse_hf_config
from tests import linear_helpers as L
from tests.mesh_checks import result_of, start_part

# Same maths summed in another order across shards: fp32 rounding (measured up to ~6e-6). A wrong
# shard of a state or a head changes logprobs by O(0.1) and tokens with them.
LOGPROB_TOL = 5e-5
MODELS = {"qwen3_next": L.qwen_next_config, "kimi_linear": L.kimi_config}
HEADS = ["tensor", "None"]  # conv_*: [batch, W-1, heads, dim]; recurrent: [batch, heads, dk, dv]


def _config_json(model: str) -> str:
    return json.dumps(parse_hf_config(MODELS[model]().to_dict()).to_json())


def _parts(part: str, timeout: int) -> dict:
    """``part`` of tests/linear_mesh_checks.py for every model, the subprocesses started at once."""
    procs = {m: start_part(part, _config_json(m), module="tests.linear_mesh_checks", fast_compile=True)
             for m in MODELS}
    return {m: result_of(proc, timeout) for m, proc in procs.items()}


@pytest.fixture(scope="module")
def specs():
    return _parts("specs", 300)


def _expected(model: str, mesh: str, where: str) -> dict[str, list[str]]:
    """The specs the layout above gives (written from the models' head counts, not the rules)."""
    data, tensor = {"tp2ep4": (1, 2), "dp4tp2": (4, 2), "dp2tp4": (2, 4)}[mesh]
    key_heads, value_heads = (2, 4) if model == "qwen3_next" else (2, 2)
    rows = "data" if data > 1 and (4 if where == "contiguous" else 2) % data == 0 else "None"
    k = "tensor" if key_heads % tensor == 0 else "None"
    v = "tensor" if value_heads % tensor == 0 else "None"
    return {"conv_q": [rows, "None", k, "None"], "conv_k": [rows, "None", k, "None"],
            "conv_v": [rows, "None", v, "None"], "recurrent": [rows, v, "None", "None"]}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mesh", ["tp2ep4", "dp4tp2", "dp2tp4"])
@pytest.mark.parametrize("where", ["contiguous", "pool"])
def test_state_specs(specs, model, mesh, where):
    """Heads over tensor where their count divides it (data=2 x tensor=4: Qwen3-Next's 4 value
    heads split, its 2 key heads and Kimi's 2 heads whole), the contiguous cache's 4 rows and a
    whole-mesh pool's 2 slots over data where they divide (the pool's not on data=4)."""
    assert specs[model][mesh][where] == _expected(model, mesh, where)


@pytest.fixture(scope="module")
def runs():
    return _parts("run", 1200)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_served_matches_generate_on_one_device(runs, model):
    """The oracle's own consistency: one device's served tokens are its generated ones, and the
    greedy tokens are not degenerate."""
    out = runs[model]
    assert out["devices"] == 8
    assert out["served_vs_generate"]["same_tokens"] and out["served_vs_generate"]["logprob_diff"] < LOGPROB_TOL
    assert out["distinct_tokens"] > 4


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mesh", ["tp2ep4", "dp4tp2"])
@pytest.mark.parametrize("how", ["generate", "served"])
def test_mesh_matches_one_device(runs, model, mesh, how):
    """Greedy tokens equal one device's, logprobs within fp32 rounding (generate: against one
    device's generate; served: against one device's serving)."""
    got = runs[model][mesh][how]
    assert got["same_tokens"] and got["logprob_diff"] < LOGPROB_TOL


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mesh", ["tp2ep4", "dp4tp2"])
def test_served_pools_layout(runs, model, mesh):
    """The pools the servers held: one per data replica (4 on data=4), each laid out as a pool
    on tensor=2 (heads over tensor where they divide, slots whole)."""
    got = runs[model][mesh]
    assert got["replicas"] == (4 if mesh == "dp4tp2" else 1) and got["same_pools"]
    assert got["pool"] == _expected(model, "tp2ep4", "pool")
