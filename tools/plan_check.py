"""The planner's activation figures against XLA's compiled memory analysis of the serving steps.

Used by ``bench/plan_vs_xla.py`` and its tests. The steps are the serving engine's forward call
on the reference path (``paged_steps._forward_logits`` over the page pool, with the replica's
``Parallel``: latent attention split by position in ``shard_map``, expert-parallel MoE dispatch
when the mesh has ``expert`` > 1), each replica's on its own devices (with ``data`` > 1 the
step is compiled for the mesh without ``data``, ``engine.replicas``):

- decode: the replica's ``ceil(batch / data)`` rows of one token, each reading the block table
  of the widest bucket for ``context`` (``Workload.decode_positions``);
- prefill chunk: one row of T tokens over S positions for each chunk shape the planner sizes
  (``Workload.prefill_shapes``: the serving engine's chunk policy). ``Engine``'s contiguous
  chunk can be compiled beside it (``engine_chunk``); ``Engine``'s decode is not the deployment.

Sampling (a separate call in serving, ``PagedSteps.sample``) is not compiled: the planner's
output stage keeps the logits and their log-softmax, a few [B, V] fp32 rows.

XLA's activation figure is its temporary bytes plus its outputs. Needs as many (faked) devices
as the mesh has: run it in a process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``. Nothing is allocated: weights, cache and
host inputs are ``jax.ShapeDtypeStruct`` carrying the shardings the engine gives them (the
weights as ``generate.weight_specs`` declares them for the run: quantized and re-blocked).

DeepSeek-V4 (``V4_CASES``, tiny): the serving engine's forward over its paged pool (entries in
pages, rings and compressor states per slot: :func:`xla_v4_memory`), decode and the chunk shapes
of ``footprint_v4.chunk_shapes``.

Weights and KV bytes are not compared here: both sides would read them from the same
shardings. ``dayzero.tools.plan_measure`` compares them with arrays the engine places.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from dayzero.engine.generate import engine_step, weight_specs
from dayzero.engine.runtime import RunConfig, resolve_run
from dayzero.engine.sampling import SamplingMode, SamplingParams, batch_sampling
from dayzero.model.cache import cache_specs
from dayzero.model.config import ModelConfig
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.weights import shape_structs
from dayzero.sharding.placement import placement_for
from dayzero.sharding.planner import Workload, evaluate


def mesh_devices(axes: dict[str, int]) -> list:
    """The first devices of this process, as many as a mesh of ``axes`` has."""
    return jax.devices()[: math.prod(axes.values())]


def one_layer_per_kind(config: ModelConfig) -> ModelConfig:
    """``config`` cut to the first decoder layer of each kind (dense MLP, MoE)."""
    flags = config.moe.layers if config.moe is not None else (False,) * config.num_layers
    chosen = sorted({flags.index(f) for f in set(flags)})
    moe = None if config.moe is None else dataclasses.replace(config.moe, layers=tuple(flags[i] for i in chosen))
    windows = tuple(config.sliding_windows[i] for i in chosen)
    return dataclasses.replace(config, num_layers=len(chosen), moe=moe, sliding_windows=windows)


def engine_run(config: ModelConfig, axes: dict[str, int], work: Workload) -> RunConfig:
    """The run an engine resolves for ``work``'s options on a mesh of ``axes`` (reference attention),
    over the first devices of this process (it may have more)."""
    placement = placement_for(axes, mesh_devices(axes))
    if placement is None:
        raise ValueError(f"mesh {axes} is one device; plan_check compares sharded steps")
    return resolve_run(config, dtype=work.dtype, quantize=work.quantize, kv_cache=work.kv_cache,
                       kernels="reference", placement=placement)


def step_inputs(config: ModelConfig, run: RunConfig, batch: int, context: int, tokens: int) -> tuple[tuple, dict]:
    """Abstract (weights, tokens, num_new, rows, step) and ``{"cache": ...}`` of one engine step
    of ``tokens`` tokens per row, laid out as the engine lays them out: weights and cache by their
    logical axes (weights quantized and re-blocked as the run says), host inputs replicated
    (``Engine._host``)."""
    placement = run.placement
    specs = weight_specs(config, run, untied_head=False)
    weights = shape_structs(specs, run.dtype, placement.shardings(specs))
    replicated = placement.replicated()
    _, rows = batch_sampling([SamplingParams()] * batch)
    host = (jnp.zeros((batch, tokens), jnp.int32), jnp.ones((batch,), jnp.int32), rows, jnp.int32(1))
    host = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), host)
    cspecs = cache_specs(config, batch, context, run.kv_cache)
    return (weights, *host), {"cache": shape_structs(cspecs, run.dtype, placement.shardings(cspecs))}


def _memory(lowered) -> dict:
    """Per-device bytes of a lowered step once compiled; ``activations``: temporaries + outputs."""
    memory = lowered.compile().memory_analysis()
    return {
        "argument_bytes": int(memory.argument_size_in_bytes), "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes), "alias_bytes": int(memory.alias_size_in_bytes),
        "activations": int(memory.temp_size_in_bytes + memory.output_size_in_bytes),
    }


def _compiled_memory(config: ModelConfig, run: RunConfig, args: tuple, kwargs: dict) -> dict:
    step = jax.jit(functools.partial(engine_step, config, run.parallel), static_argnames=("mode",))
    return _memory(step.lower(*args, mode=SamplingMode.GREEDY, **kwargs))


def serving_step_inputs(config: ModelConfig, run: RunConfig, B: int, T: int, S: int, page_size: int) -> tuple:
    """Abstract (weights, tokens, num_new, cache) of the serving engine's forward call
    (``paged_steps._forward_logits``, the reference path) for ``B`` rows of ``T`` tokens, each
    reading a block table of ``ceil(S / page_size)`` pages from a pool of as many pages per row,
    laid out as ``PagedSteps`` lays it out (the pool by its logical axes; tables, lengths and
    host inputs replicated)."""
    from dayzero.model.paged_cache import paged_cache_specs

    placement = run.placement
    specs = weight_specs(config, run, untied_head=False)
    weights = shape_structs(specs, run.dtype, placement.shardings(specs))
    pages = -(-S // page_size)
    pool = paged_cache_specs(config, B * pages, page_size, batch=B, table_width=pages, kv_quant=run.kv_cache)
    cache = shape_structs(pool, run.dtype, placement.shardings(pool))
    replicated = placement.replicated()
    host = (jnp.zeros((B, T), jnp.int32), jnp.ones((B,), jnp.int32))
    tokens, num_new = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated) for x in host)
    tables = jax.ShapeDtypeStruct(cache.block_tables.shape, jnp.int32, sharding=replicated)
    cache = cache.replace(block_tables=tables,
                          lengths=jax.ShapeDtypeStruct((B,), jnp.int32, sharding=replicated),
                          rope_len=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
    return weights, tokens, num_new, cache


def _serving_memory(config: ModelConfig, run: RunConfig, B: int, T: int, S: int, page_size: int) -> dict:
    from dayzero.engine.paged_steps import _forward_logits

    args = serving_step_inputs(config, run, B, T, S, page_size)
    return _memory(_forward_logits.lower(*args, config=config, parallel=run.parallel))


def replica_run(config: ModelConfig, axes: dict[str, int], work: Workload) -> RunConfig:
    """The run of one serving replica: with ``data`` > 1 each replica runs on its own ``tensor``
    x ``expert`` devices (``engine.replicas``), so a step is compiled for the mesh without ``data``."""
    return engine_run(config, {**axes, "data": 1}, work)


def xla_serving_decode_memory(config: ModelConfig, axes: dict[str, int], work: Workload) -> dict:
    """Per-device bytes of the serving engine's decode forward on the reference path: one
    replica's ``ceil(batch / data)`` rows of one token, each reading the block table of the
    widest bucket for ``work.context`` (``Workload.decode_positions``), over the page pool."""
    rows = -(-work.batch // int(axes.get("data", 1)))
    return _serving_memory(config, replica_run(config, axes, work), rows, 1, work.decode_positions, work.page_size)


def xla_prefill_memory(config: ModelConfig, axes: dict[str, int], work: Workload, page_size: int = 16,
                       engine_chunk: bool = False) -> dict:
    """Per-device bytes of prefill chunks as the planner sizes them: one row of T tokens over S
    positions for each (T, S) of ``work.prefill_shapes()`` (the serving engine's chunk policy),
    lowered as the serving engine runs them on the reference path (``_forward_logits`` over a
    paged cache of ``page_size`` pages; with ``data`` > 1 each replica runs on its ``tensor`` x
    ``expert`` devices, ``engine.replicas``). ``{"shapes": [{"T", "S", "activations", ...}],
    "activations": the largest}``; ``engine_chunk``: each shape also as ``Engine``'s step over a
    contiguous cache of S positions (``"engine"``), for comparison."""
    replica = replica_run(config, axes, work)
    shapes = []
    for T, S in work.prefill_shapes():
        row = {"T": T, "S": S, **_serving_memory(config, replica, 1, T, S, page_size)}
        if engine_chunk:
            run = engine_run(config, axes, work)
            row["engine"] = _compiled_memory(config, run, *step_inputs(config, run, 1, S, T))["activations"]
        shapes.append(row)
    return {"shapes": shapes, "activations": max(r["activations"] for r in shapes)}


def v4_serving_inputs(config: ModelConfig, run: RunConfig, slots: int, B: int, T: int, S: int,
                      page_size: int) -> tuple:
    """Abstract (weights, tokens, num_new, cache) of the serving engine's forward call over a
    DeepSeek-V4 paged pool (``paged_cache_specs``: ``compressed_paged.PagedCompressedCache``, its
    entries in pages of ``page_size`` positions, ``slots`` rows of window rings and compressor
    states; laid out by its logical axes as ``PagedSteps`` lays it out; the step's block tables,
    slots, lengths and ``rope_len`` replicated) for ``B`` rows of ``T`` tokens, each reading a
    table of ``S / page_size`` pages; the cache is None for a chunk that reads none (``S`` = 0: a
    prompt's first chunk)."""
    from dayzero.model.paged_cache import paged_cache_specs

    placement = run.placement
    specs = weight_specs(config, run, untied_head=False)
    weights = shape_structs(specs, run.dtype, placement.shardings(specs))
    replicated = placement.replicated()
    host = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)  # noqa: E731
    cache = None
    if S:
        width = S // page_size
        pool = paged_cache_specs(config, slots * width, page_size, batch=B, table_width=width,
                                 kv_quant=run.kv_cache, state_slots=slots)
        cache = shape_structs(pool, run.dtype, placement.shardings(pool))
        cache = cache.replace(block_tables=host((B, width)), slots=host((B,)), lengths=host((B,)),
                              rope_len=host(()))
    return weights, host((B, T)), host((B,)), cache


def xla_v4_memory(config: ModelConfig, axes: dict[str, int], work: Workload,
                  stages: tuple[str, ...] = ("decode", "prefill")) -> dict:
    """DeepSeek-V4's serving steps as the planner sizes them (``footprint_v4.steps``), compiled as
    the serving engine runs them on the reference path (``paged_steps._forward_logits`` over the
    paged pool of the replica's ``ceil(batch / data)`` slots, pages of ``footprint_v4.page_size``
    positions, on its ``tensor`` x ``expert`` devices): the decode step (every slot's row, one
    token, over the widest table) and each prefill chunk of ``footprint_v4.chunk_shapes`` (one
    row; the first reads no cache). ``{"decode": memory, "prefill": {"shapes": [{"T", "S", ...}],
    "activations": the largest}}``."""
    from dayzero.engine.paged_steps import _forward_logits
    from dayzero.model import footprint_v4

    replica = replica_run(config, axes, work)
    slots = -(-work.batch // int(axes.get("data", 1)))
    page = footprint_v4.page_size(config, work)

    def memory(B: int, T: int, S: int) -> dict:
        args = v4_serving_inputs(config, replica, slots, B, T, S, page)
        return _memory(_forward_logits.lower(*args, config=config, parallel=replica.parallel))

    out: dict[str, Any] = {}
    if "decode" in stages:
        out["decode"] = memory(slots, 1, footprint_v4.decode_positions(work, page))
    if "prefill" in stages:
        shapes = [{"T": T, "S": S, **memory(1, T, S)} for T, S in footprint_v4.chunk_shapes(work, page)]
        out["prefill"] = {"shapes": shapes, "activations": max(r["activations"] for r in shapes)}
    return out


def planned_prefill_peaks(config: ModelConfig, name: str, work: Workload, axes: dict[str, int]) -> list[int]:
    """The planner's peak of each prefill shape (in ``work.prefill_shapes()`` order)."""
    from dayzero.model.footprint_steps import step_stages
    from dayzero.sharding.placement import rules_for_mesh
    from dayzero.sharding.planner import device_bytes

    full = {a: int(axes.get(a, 1)) for a in ("data", "tensor", "expert")}
    rules = rules_for_mesh(full)
    steps = DecodeFootprint(config, name).steps(work, full)["prefill"]
    return [max(sum(device_bytes(t, rules, full) for t in stage.tensors) for stage in step_stages(config, st))
            for st in steps]


def compare_activations(config: ModelConfig, name: str, work: Workload, axes: dict[str, int],
                        cut: bool = False, stages: tuple[str, ...] = ("decode", "prefill"),
                        engine_chunk: bool = False) -> dict:
    """The planner's decode and prefill activation peaks against XLA's, for ``config`` (or, with
    ``cut``, one layer of each kind of it: part of the activations grows with depth, so both
    sides are evaluated on the cut model) on a mesh of ``axes``; ratio = planner / XLA. The
    prefill figure is the largest over the chunk shapes; each shape is also given (``shapes``,
    with ``engine_chunk`` the same chunk as ``Engine``'s contiguous step too)."""
    model = one_layer_per_kind(config) if cut else config
    planned = evaluate(DecodeFootprint(model, name), work, axes)
    out: dict[str, Any] = {"model": name, "mesh": planned.mesh, "strategy": planned.strategy,
                           "batch": work.batch, "context": work.context, "prefill_chunk": work.prefill_chunk,
                           "dtype": work.dtype, "quantize": work.quantize, "kv_cache": work.kv_cache,
                           "cut": cut, "layers_compiled": model.num_layers, "refused": planned.refused,
                           "peak_stage": planned.peak_stage}
    v4 = xla_v4_memory(model, axes, work, stages) if model.compressed is not None else None
    if "decode" in stages:
        xla = v4["decode"] if v4 else xla_serving_decode_memory(model, axes, work)
        peak = planned.activation_peaks["decode"]
        out["decode"] = {"planner": peak, "xla": xla["activations"], "ratio": peak / xla["activations"]}
    if "prefill" in stages:
        xla = v4["prefill"] if v4 else xla_prefill_memory(model, axes, work, engine_chunk=engine_chunk)
        peak = planned.activation_peaks["prefill"]
        for row, mine in zip(xla["shapes"], planned_prefill_peaks(model, name, work, axes)):
            row.update(planner=mine, ratio=mine / row["activations"])
        out["prefill"] = {"planner": peak, "xla": xla["activations"], "ratio": peak / xla["activations"],
                          "shapes": xla["shapes"]}
    return out


# ---- the configurations checked ------------------------------------------------------------------

# The scaled-down configurations of tests/test_plan.py's former 64-device check (MLA with MoE
# behind a dense layer, DSA, GQA), on which the copy counts were fitted.
_DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
             "moe_intermediate_size": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1,
             "num_attention_heads": 16, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
             "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
             "v_head_dim": 32, "max_position_embeddings": 1 << 20}
TEST_CONFIGS = {
    "test-mla": _DEEPSEEK,
    "test-dsa": dict(_DEEPSEEK, model_type="deepseek_v32", index_topk=512, index_n_heads=16, index_head_dim=64),
    "test-gqa": {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 8},
    # The V4 tests' tiny DeepSeek-V4 (tests/v4_helpers.TINY, kept equal by tests/test_plan_states.py):
    # layers [sliding, CSA, HCA, CSA], CSA ratio 4, HCA 16, window 16, 4 heads of 64, 16 x 32 index heads.
    "test-v4": {
        "model_type": "deepseek_v4", "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "q_lora_rank": 32, "partial_rotary_factor": 0.25, "num_experts_per_tok": 2, "n_routed_experts": 8,
        "n_shared_experts": 1, "routed_scaling_factor": 1.5, "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"], "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 16, "o_groups": 2, "o_lora_rank": 16,
        "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8, "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    },
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration to check: a model (a ``plan_measure.MODELS`` name at ``size`` "full" or
    "reduced", or a :data:`TEST_CONFIGS` name), a mesh, a workload; ``cut``: compile one layer
    of each kind; ``fitted``: the copy counts were fitted on it (``Engine``'s decode, before
    the planner's decode became the serving decode; the serving decode's page gathers have no
    fitted count: their structure was read off the compiled buffers of gqa-dense-dp,
    gqa-kv-int8, kimi-ep4-batch16, dsa-tp, deepseek-kv-fp8, test-mla and test-dsa);
    ``chunk_budget``: the serving engine's (``Workload``'s default unless given)."""

    model: str
    mesh: str
    batch: int
    context: int
    prefill_chunk: int = 512
    kv_cache: str = "none"
    size: str = "reduced"
    cut: bool = False
    fitted: bool = False
    chunk_budget: int = Workload.chunk_budget

    @property
    def axes(self) -> dict[str, int]:
        """The mesh's axis sizes."""
        from dayzero.sharding.distributed import parse_mesh

        return parse_mesh(self.mesh)

    def config(self) -> ModelConfig:
        """The model configuration checked."""
        from dayzero.model.hf_config import parse_hf_config
        from dayzero.tools.plan_measure import full_config, reduced

        if self.model in TEST_CONFIGS:
            return parse_hf_config(TEST_CONFIGS[self.model])
        return full_config(self.model) if self.size == "full" else reduced(full_config(self.model))

    def workload(self, dtype: str = "float32") -> Workload:
        """The planner's workload for this case, at ``dtype`` (XLA:CPU is checked in fp32: its
        bf16 matmuls convert their operands to fp32 copies no GPU makes)."""
        return Workload(devices=math.prod(self.axes.values()), device_memory=80 << 30, kv_cache=self.kv_cache,
                        dtype=dtype, batch=self.batch, context=self.context, prefill_chunk=self.prefill_chunk,
                        chunk_budget=self.chunk_budget)


CASES = {
    # Fitted: the README's table (full size, one layer of each kind) and the tests' 64-device cases.
    "deepseek-v3": Case("deepseek-v3", "data=2,tensor=32", 16, 131072, size="full", cut=True, fitted=True),
    "kimi-k2": Case("kimi-k2", "data=2,tensor=32", 16, 131072, size="full", cut=True, fitted=True),
    "deepseek-v3-ep": Case("deepseek-v3", "tensor=8,expert=8", 16, 131072, size="full", cut=True, fitted=True),
    "test-mla": Case("test-mla", "data=4,tensor=16", 8, 262144, fitted=True),
    "test-dsa": Case("test-dsa", "tensor=64", 8, 262144, fitted=True),
    "test-gqa": Case("test-gqa", "data=8,tensor=8", 64, 32768, fitted=True),
    "test-mla-ep": Case("test-mla", "tensor=8,expert=8", 64, 1024, fitted=True),
    # Held out: reduced models (plan_measure.reduced) on 8 devices, other meshes, batches, contexts.
    "gqa-dense-dp": Case("llama3-8b", "data=2,tensor=4", 8, 2048, 256),
    "gqa-moe-dp": Case("qwen3-30b-a3b", "data=2,tensor=4", 8, 1024, 256),
    "gqa-moe-kv-replicated": Case("qwen3-30b-a3b", "tensor=8", 8, 1024, 256),
    "kimi-ep": Case("kimi-k2", "tensor=4,expert=2", 8, 1024, 256),
    "kimi-ep4-batch16": Case("kimi-k2", "tensor=2,expert=4", 16, 512, 256),
    "deepseek-tp": Case("deepseek-v3", "tensor=8", 4, 2048, 256),
    "dsa-tp": Case("frontier-3t-1m", "tensor=8", 4, 2048, 256),
    "deepseek-kv-fp8": Case("deepseek-v3", "tensor=8", 4, 2048, 256, kv_cache="fp8"),
    "gqa-kv-int8": Case("llama3-8b", "tensor=8", 8, 2048, 256, kv_cache="int8"),
    # DeepSeek-V4 (tiny, the serving forward over its paged pool: xla_v4_memory). Fitted: footprint_v4's
    # structure was read off the buffer assignments of v4-tp (copy counts, the indexer's two points),
    # v4-ep (the tokens split over ``expert``) and v4-ep4 (one copy of the keys, the page gather fused
    # into their concatenation); the others are held out. v4-paged: a context that is no power of
    # two (each table reads 256 pages of 16, 4096 positions, for 3000) and a budget whose chunk
    # front is two shapes (256 tokens over 2048 positions, 128 over 4096).
    "v4-tp": Case("test-v4", "tensor=2", 4, 4096, 64, fitted=True),
    "v4-ep": Case("test-v4", "tensor=2,expert=2", 8, 2048, 128, fitted=True),
    "v4-ep4": Case("test-v4", "expert=4", 8, 4096, 64, fitted=True),
    "v4-dp-kv-int8": Case("test-v4", "data=2,tensor=2", 8, 4096, 32, kv_cache="int8"),
    "v4-tp-chunk256": Case("test-v4", "tensor=2", 2, 4096, 256),
    "v4-ep-kv-int8": Case("test-v4", "tensor=2,expert=2", 16, 2048, 64, kv_cache="int8"),
    "v4-paged": Case("test-v4", "tensor=2", 2, 3000, 256, chunk_budget=1 << 19),
}
V4_CASES = tuple(name for name, case in CASES.items() if case.model == "test-v4")


def check_case(name: str, stages: tuple[str, ...] = ("decode", "prefill")) -> dict:
    """:func:`compare_activations` for ``CASES[name]``, labelled fitted or held out."""
    case = CASES[name]
    result = compare_activations(case.config(), case.model, case.workload(), case.axes, cut=case.cut, stages=stages)
    return {**result, "case": name, "label": "fitted" if case.fitted else "held out"}
