"""The run configuration (``dayzero.engine.runtime``): every runtime option resolved and checked in
one place, with one error type, and what the engine, the serving engine and the CLI read from it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dayzero.engine import Engine, ServingConfig, ServingEngine
from dayzero.engine.runtime import RunConfigError, resolve_run, weights_storage, with_kernels
from dayzero.kernels import KernelMode
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import KVQuant, QuantConfig, WeightQuant
from dayzero.model.weights import abstract_weights, init_weights, quantize_weights
from tests.serving_models import FAMILIES, LATENT

DENSE = parse_hf_config(FAMILIES["dense"])  # 4 query heads over 2 kv heads
MOE = parse_hf_config(dict(LATENT, first_k_dense_replace=1))  # latent attention, 4 routed experts


class FakePlacement:
    """What the checks read of a placement: its axis sizes (no devices needed)."""

    def __init__(self, **sizes):
        self.axes = {"data": 1, "tensor": 1, "expert": 1, **sizes}
        self.rules = dataclasses.make_dataclass("Rules", ["name"])("fake")


def test_auto_resolves_to_the_platform_choices():
    run = resolve_run(DENSE)
    if jax.default_backend() == "cpu":
        assert run.kernels is KernelMode.REFERENCE and run.dtype == jnp.float32
    assert run.weights is WeightQuant.NONE and run.kv_cache is KVQuant.NONE and run.placement is None
    described = run.describe()
    assert described["requested"] == {"dtype": "auto", "quantize": "auto", "kv_cache": "auto", "kernels": "auto"}
    assert described["kernels"] == run.kernels.value and described["mesh"] is None


@pytest.mark.parametrize("options, fragments", [
    (dict(quantize="int3"), ["'int3'", "int8, fp8, fp8-block, int4"]),
    (dict(kv_cache="int2"), ["'int2'", "none, int8, fp8"]),
    (dict(kernels="triton"), ["'triton'", "pallas_interpret"]),
    (dict(capacity_factor=0.0), ["capacity_factor 0.0", "> 0"]),
    (dict(grouped_matmul="einsum"), ["'einsum'", "expert_loop, ragged_dot"]),
    (dict(capacity_factor=1.5), ["expert > 1", "--mesh expert=N"]),
    (dict(stored=QuantConfig(WeightQuant.INT8), quantize="fp8"), ["stored quantized as int8", "--quantize fp8"]),
])
def test_bad_options_are_one_error_type_naming_the_value(options, fragments):
    with pytest.raises(RunConfigError) as error:
        resolve_run(DENSE, **options)
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_pallas_off_gpu_names_what_runs_instead():
    if jax.default_backend() != "cpu":
        pytest.skip("pallas runs on GPU")
    with pytest.raises(RunConfigError, match="pallas cannot run on cpu.*pallas_interpret"):
        resolve_run(DENSE, kernels="pallas")


def test_a_stored_quantization_is_kept():
    stored = QuantConfig(WeightQuant.FP8_BLOCK, (32, 32))
    assert resolve_run(DENSE, stored=stored).quant == stored
    assert resolve_run(DENSE, stored=stored, quantize="fp8-block").quant == stored
    assert resolve_run(DENSE, quantize="int4").quant == QuantConfig(WeightQuant.INT4)


def test_meshes_the_model_cannot_use_are_refused():
    with pytest.raises(RunConfigError, match="expert=4 needs a Mixture-of-Experts model"):
        resolve_run(DENSE, placement=FakePlacement(expert=4))
    with pytest.raises(RunConfigError, match="4 experts do not split evenly over expert=8"):
        resolve_run(MOE, placement=FakePlacement(expert=8))


def test_moe_dispatch_options_go_with_the_expert_axis():
    run = resolve_run(MOE, placement=FakePlacement(expert=2), capacity_factor=1.25, grouped_matmul="ragged_dot")
    assert run.capacity_factor == 1.25 and run.describe()["grouped_matmul"] == "ragged_dot"


def test_kernels_on_a_mesh_need_whole_heads_per_device():
    """Each device's kernel needs whole kv heads with their query heads (2 kv heads: tensor=4 is
    refused, tensor=2 runs); latent attention has no kv heads, its 4 query heads split 4 ways."""
    with pytest.raises(RunConfigError, match="2 kv heads to split evenly over tensor=4.*--kernels reference"):
        resolve_run(DENSE, kernels="pallas_interpret", placement=FakePlacement(tensor=4))
    assert resolve_run(DENSE, kernels="pallas_interpret", placement=FakePlacement(tensor=2)).on_kernels
    assert resolve_run(DENSE, kernels="reference", placement=FakePlacement(tensor=4)).kernels is KernelMode.REFERENCE
    assert resolve_run(MOE, kernels="pallas_interpret", placement=FakePlacement(tensor=4, expert=2)).on_kernels
    with pytest.raises(RunConfigError, match="4 query heads to split evenly over tensor=8"):
        resolve_run(MOE, kernels="pallas_interpret", placement=FakePlacement(tensor=8))


def test_auto_kernels_take_the_reference_path_where_they_cannot_split(monkeypatch):
    """Where ``auto`` means the kernels (a GPU, faked here), a mesh whose tensor size the heads do
    not divide resolves to the reference path (the platform's best that runs there), and one they
    divide keeps the kernels; asked for by name, the first is refused."""
    import dayzero.kernels.mode as mode

    monkeypatch.setitem(mode.AUTO_DEFAULTS, mode.current_platform(), KernelMode.PALLAS_INTERPRET)
    assert resolve_run(DENSE, placement=FakePlacement(tensor=4)).kernels is KernelMode.REFERENCE
    assert resolve_run(DENSE, placement=FakePlacement(tensor=2)).kernels is KernelMode.PALLAS_INTERPRET
    with pytest.raises(RunConfigError, match="kv heads"):
        resolve_run(DENSE, kernels="pallas_interpret", placement=FakePlacement(tensor=4))


def test_a_run_and_loose_options_together_are_refused():
    weights = init_weights(abstract_weights(DENSE), jax.random.key(0))
    with pytest.raises(RunConfigError, match="either run= or placement/kv_cache/kernels"):
        Engine(DENSE, weights, kernels="reference", run=resolve_run(DENSE))


def test_a_serving_engines_own_kernels_are_checked_against_the_run():
    run = resolve_run(DENSE, placement=FakePlacement(tensor=4))
    with pytest.raises(RunConfigError, match="kv heads"):
        with_kernels(run, DENSE, "pallas_interpret")
    assert with_kernels(run, DENSE, None) is run
    changed = with_kernels(resolve_run(DENSE), DENSE, "pallas_interpret")
    assert changed.kernels is KernelMode.PALLAS_INTERPRET and changed.describe()["requested"]["kernels"] == "pallas_interpret"


@pytest.mark.parametrize("scheme, block", [("int8", None), ("fp8", None), ("int4", None), ("int4-all", None),
                                           ("fp8-block", (16, 32))])
def test_weights_storage_reads_the_scheme_back(scheme, block):
    quant = QuantConfig(WeightQuant(scheme), block or (128, 128))
    weights = quantize_weights(init_weights(abstract_weights(MOE), jax.random.key(0)), abstract_weights(MOE, quant))
    assert weights_storage(weights) == quant


def test_engine_and_serving_engine_read_one_run():
    """``Engine(kernels=...)`` resolves once; its serving engine takes the same kernels and pages,
    unless the serving config names its own (checked the same way)."""
    weights = init_weights(abstract_weights(DENSE), jax.random.key(0))
    engine = Engine(DENSE, weights, kv_cache="int8", kernels="pallas_interpret")
    assert engine.run.kernels is KernelMode.PALLAS_INTERPRET and engine.kv_cache is KVQuant.INT8
    config = ServingConfig(slots=1, max_context=32)
    assert ServingEngine(engine, config).config.kernels is KernelMode.PALLAS_INTERPRET
    assert ServingEngine(engine, dataclasses.replace(config, kernels="reference")).config.kernels is KernelMode.REFERENCE
    with pytest.raises(RunConfigError):
        Engine(DENSE, weights, kernels="bogus")


def test_generate_on_kernels_is_the_engines_own_route():
    """``Engine.generate`` with a kernel mode serves the prompts on the paged cache (the route the
    CLI takes too): the reference engine's greedy tokens, for a batch of ragged prompts."""
    weights = init_weights(abstract_weights(DENSE), jax.random.key(0), scale=0.2)
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    ref = Engine(DENSE, weights).generate(prompts, max_new_tokens=5, logprobs=True, ignore_eos=True)
    got = Engine(DENSE, weights, kernels="pallas_interpret").generate(prompts, max_new_tokens=5, logprobs=True,
                                                                       ignore_eos=True)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) < 1e-4


def test_a_page_pool_the_kernels_cannot_address_is_refused_before_allocation():
    """An int8 pool of 2 kv heads x P pages x 16 slots x 16 dims with 2^31 < 512 P <= 2^32 elements
    would overflow Pallas Triton's 32-bit offsets: refused when the serving engine sizes it (no
    allocation: ``resolve`` only computes shapes); fp32 pages, the reference path, or the pool split
    over tensor=2 (each device holds half of it) are fine."""
    pages = (1 << 22) + 8  # 512 * pages = 2^31 + 4096 elements
    config = ServingConfig(slots=1, page_size=16, num_pages=pages, max_context=64)
    on_kernels = resolve_run(DENSE, kv_cache="int8", kernels="pallas_interpret")
    with pytest.raises(RunConfigError, match=f"num_pages={pages}.*int8 page pool.*--kernels reference"):
        config.resolve(DENSE, on_kernels)
    for run in (resolve_run(DENSE, kv_cache="none", kernels="pallas_interpret"), resolve_run(DENSE, kv_cache="int8"),
                resolve_run(DENSE, kv_cache="int8", kernels="pallas_interpret", placement=FakePlacement(tensor=2))):
        assert config.resolve(DENSE, run).num_pages == pages
