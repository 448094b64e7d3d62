"""The planner's weight and KV figures against arrays the engine actually places, at reduced size.

``dayzero plan`` computes per-device bytes by arithmetic over abstract declarations; this module
measures them instead. A model is shrunk (:func:`reduced`) to a few MB with its structure kept
(latent or grouped-query attention, sparse attention, the MoE routing groups, the dense layers
before the MoE ones, head and expert counts that still divide the meshes), then built the way
the engine builds it: random float weights, quantized as ``Engine.load(quantize=...)`` quantizes
at load, handed to ``Engine(...)``, which resolves the run, re-blocks block scales for the mesh
and places every leaf; the KV is the page pools a ``ServingEngine`` over that engine allocates for
the rows and positions (the deployment's cache; each data replica's pool on its devices; for
DeepSeek-V4, tiny configs rather than :func:`reduced`, its paged pool with the slots' rings and
compressor states, and also the cache ``Engine.generate`` allocates; for DeepSeek-V4 and a
linear-attention hybrid (a tiny Qwen3-Next), the prefix cache's snapshot rows of the slots'
states, ``PagedSteps.snapshots``, a component of their own).
Per-device bytes are read back from the placed arrays, per component, and compared with
``planner.evaluate`` on the same reduced config, mesh and options: they must be equal. A shard's
bytes are its elements times what the device really holds per element of its dtype, measured once
per dtype (:func:`held_bytes_per_element`: the device's ``memory_stats`` where it has them, else
the process's resident memory), not ``nbytes``: ml_dtypes' itemsize says 1 for the 4-bit types,
which XLA packs two to a byte, so ``nbytes`` would agree with a planner making the same mistake.

:func:`run_recommendation` closes the loop: the mesh ``plan`` recommends is loaded and runs one
prefill chunk and one decode step.

Needs (faked) devices: run it in a process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (``python -m dayzero.tools.plan_measure``
sets it from ``--devices``). Full-size models cannot be placed on this machine; their figures are
the planner's arithmetic only, checked here at reduced size.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from collections import defaultdict
from typing import Any

# Published config.json files (the keys that matter) of the two grouped-query models the checks
# use beside the presets: a dense one (as bench/configs/llama3-8b.json) and a MoE one.
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "tie_word_embeddings": False,
}
MODELS = ("deepseek-v3", "kimi-k2", "frontier-3t-1m", "llama3-8b", "qwen3-30b-a3b")
# The linear-attention hybrid tests' tiny Qwen3-Next (tests/linear_helpers: QWEN_TEXT and QWEN_MOE,
# a dense width of 40 for layer 0; kept equal by tests/test_plan_states.py): Gated DeltaNet and attention
# layers alternating, 4 heads over 2 kv heads, 2 key and 4 value linear heads, 4 experts.
TINY_HYBRID = {
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_conv_kernel_dim": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "max_position_embeddings": 256, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20, "num_experts": 4, "num_experts_per_tok": 2,
    "intermediate_size": 40, "mlp_only_layers": [0],
}


def full_config(name: str):
    """The full-size ``ModelConfig`` of one of :data:`MODELS` (a preset or a published config)."""
    from dayzero.model.hf_config import parse_hf_config
    from dayzero.model.presets import PRESETS, load_preset

    if name in PRESETS:
        return load_preset(name)
    raw = {"llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}.get(name)
    if raw is None:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return parse_hf_config(raw)


def _round(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def reduced(config, moe_layers: int = 1, dense_layers: int | None = None, hidden: int = 256):
    """``config`` shrunk to a few MB, its structure kept.

    Kept: the attention kind (GQA with its query/kv head ratio, MLA with a q LoRA, DSA), the
    leading dense layers of a MoE model (DeepSeek-V3's 3, Kimi-K2's 1) followed by ``moe_layers``
    MoE layers (a dense model gets ``dense_layers``, default 2), experts per token, routing groups,
    shared experts, tied or untied head, and the awkward widths that exercise block re-blocking
    on a mesh (the latent row L+R = 96 is 0.75 of a 128 block, as 576 is 4.5 of them).
    Shrunk: widths by ``hidden`` / D (vocabulary by 128, to a multiple of 64), head counts above
    32 by 8 (128 -> 16, 64 -> 8: still divisible by 8), experts by 8 (256 -> 32, 384 -> 48), MLA
    ranks and head dims by 4-8, DSA top-k by 32 (2048 -> 64) with 16 index heads.
    """
    c = config
    scale = hidden / c.hidden_size
    N = c.num_heads if c.num_heads <= 32 else c.num_heads // 8
    flags = c.moe.layers if c.moe is not None else (False,) * c.num_layers
    leading = next((i for i, f in enumerate(flags) if f), len(flags))
    if c.moe is None:
        layer_flags = (False,) * (2 if dense_layers is None else dense_layers)
    else:
        layer_flags = (False,) * (leading if dense_layers is None else min(leading, dense_layers)) + (True,) * moe_layers
    changes: dict[str, Any] = dict(
        hidden_size=hidden, intermediate_size=_round(c.intermediate_size * scale, 32),
        vocab_size=_round(c.vocab_size / 128, 64), num_layers=len(layer_flags), num_heads=N,
        sliding_windows=tuple(c.sliding_windows[:len(layer_flags)]),
    )
    if c.mla is not None:
        m = c.mla
        mla = dataclasses.replace(
            m, q_lora_rank=None if m.q_lora_rank is None else _round(m.q_lora_rank * scale, 32),
            kv_lora_rank=max(32, m.kv_lora_rank // 8), nope_dim=max(16, m.nope_dim // 4),
            rope_dim=max(16, m.rope_dim // 2), v_head_dim=max(16, m.v_head_dim // 4))
        changes.update(mla=mla, num_kv_heads=N, head_dim=mla.rope_dim)
        if c.dsa is not None:
            changes["dsa"] = dataclasses.replace(c.dsa, topk=max(16, c.dsa.topk // 32), heads=16,
                                                 head_dim=max(mla.rope_dim, c.dsa.head_dim // 2))
    else:
        changes.update(num_kv_heads=c.num_kv_heads * N // c.num_heads, head_dim=max(16, c.head_dim // 8))
    if c.moe is not None:
        E = c.moe.num_experts // 8
        groups = c.moe.num_groups if E % c.moe.num_groups == 0 and E // c.moe.num_groups >= 2 else 1
        changes["moe"] = dataclasses.replace(
            c.moe, num_experts=E, experts_per_token=min(c.moe.experts_per_token, E),
            intermediate_size=_round(c.moe.intermediate_size * scale, 16), layers=layer_flags,
            num_groups=groups, groups_per_token=min(c.moe.groups_per_token, groups))
    return dataclasses.replace(c, **changes)


# ---- building as the engine builds --------------------------------------------------------------


def build_engine(config, axes: dict[str, int], quantize: str = "none", kv_cache: str = "none",
                 dtype: str = "bfloat16", seed: int = 0, weights=None):
    """An ``Engine`` over random weights of ``config`` (or ``weights`` from :func:`host_weights`)
    on a mesh of ``axes`` over this process's first devices (all 1: one device), the weights
    quantized at load as ``quantize`` says; the engine resolves the run, re-blocks block scales
    for the mesh and places them."""
    import jax

    from dayzero.engine.generate import Engine
    from dayzero.sharding.placement import placement_for

    if weights is None:
        weights = host_weights(config, quantize, dtype, seed)
    devices = jax.devices()[: math.prod(axes.values())]  # the process may have more (bench/plan_vs_xla.py)
    placement = placement_for(axes, devices)
    if placement is None:  # one device: on it, as Engine.load reads them (a mesh's Engine places them)
        weights = jax.device_put(weights, devices[0])
    return Engine(config, weights, placement=placement, kv_cache=kv_cache)


def random_weights(specs, seed: int, dtype: str, scale: float = 0.2):
    """Weights for a spec tree as host (numpy) arrays: N(0, ``scale``) matrices, ones and zeros
    where the spec says, in ``dtype`` or the leaf's fixed dtype. Drawn with numpy: ``init_weights`` draws with jax, which compiles
    a sampler per leaf shape (~0.5 s each here, 12 s for a reduced DeepSeek-V3)."""
    import jax.numpy as jnp
    import numpy as np

    from dayzero.model.weights import Init, map_specs

    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)

    def make(s):
        kind = jnp.dtype(s.dtype or dtype)  # a fixed dtype (fp32 sinks and gates, int32 tables) as declared
        if s.init is Init.ONES:
            return np.ones(s.shape, kind)
        if s.init is Init.ZEROS:
            return np.zeros(s.shape, kind)
        return (scale * rng.standard_normal(s.shape, np.float32)).astype(kind)

    return map_specs(make, specs)


def host_weights(config, quantize: str = "none", dtype: str = "bfloat16", seed: int = 0):
    """Random weights of ``config`` quantized as ``Engine.load(quantize=...)`` quantizes a float
    checkpoint at load (``quantize_weights`` with the plain specs), fetched to the host: an
    ``Engine`` built on any mesh from them re-blocks and places them itself (numpy scales re-block
    without compiling, where jax ones compile per shape: 0.1 s against 3-4 s per engine)."""
    import jax

    from dayzero.model.quant import QuantConfig, parse_weight_quant
    from dayzero.model.weights import abstract_weights, quantize_weights

    weights = random_weights(abstract_weights(config), seed, dtype)
    quant = QuantConfig(parse_weight_quant(quantize))
    return jax.device_get(quantize_weights(weights, abstract_weights(config, quant)))


def serving_steps(engine, batch: int, context: int, page_size: int = 16, settle: bool = True) -> list:
    """The ``PagedSteps`` of a ``ServingEngine`` over ``engine`` sized to hold ``batch`` rows of
    ``context`` positions (``ceil(context / page_size)`` pages per row; with ``data`` > 1 one
    per replica for its share of the rows, on its own devices), the serving defaults otherwise.
    Each holds the replica's page pool (``.pool``; for DeepSeek-V4 a
    ``compressed_paged.PagedCompressedCache``: the entries and index keys in pages, a window ring
    and compressor states per slot, a slot per row; ``page_size`` must then be a multiple of its
    ratios, ``footprint_v4.page_size``) and, for a model with per-sequence states (a hybrid, V4),
    the prefix cache's snapshot rows (``.snapshots``: ``ServingConfig.state_snapshots``' default,
    4 per slot). ``settle``: make the copy a warmup makes first (``PagedSteps.warmup``: an
    out-of-range snapshot row, which writes nothing), after which the snapshot rows are laid out as
    the slot states; the engine makes a fresh tree whole on the first device."""
    from dayzero.engine.paged_steps import ServingConfig
    from dayzero.engine.serving import ServingEngine

    replicas = 1 if engine.placement is None else engine.placement.axes["data"]
    rows = -(-batch // replicas)
    config = ServingConfig(slots=rows, page_size=page_size, num_pages=rows * -(-context // page_size),
                           max_context=context)
    steps = [replica.steps for replica in ServingEngine(engine, config).replicas]
    for st in steps:
        if settle and st.snapshots is not None:
            st.snapshot(0, st.serving.state_snapshots)
    return steps


def _components(tree: Any, plain: str, scales: str) -> list[tuple[str, str, Any]]:
    """(leaf name, component, array) of every array of a weight or cache tree: quantized values
    and plain arrays are ``plain``, quantized scales ``scales``."""
    import jax

    from dayzero.model.quant import QuantizedArray
    from dayzero.model.weights import leaf_path

    out = []
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QuantizedArray))
    for path, x in flat:
        name = leaf_path(path)
        if isinstance(x, QuantizedArray):
            out += [(name, plain, x.values), (name + ":scale", scales, x.scale)]
        else:
            out.append((name, plain, x))
    return out


# Per-step int32 host inputs of the serving pools' tree (the state slots' indices too; a hybrid's
# under its attention cache, ``attn/``), not KV storage (the planner omits them).
HOST_INPUTS = ("block_tables", "slots", "lengths", "rope_len")


def contiguous_cache(engine, batch: int, context: int):
    """The contiguous cache ``Engine.generate`` allocates for ``batch`` rows of ``context``
    positions (``init_cache`` with the engine's own cache shardings, as ``_prefill_chunks``
    makes it): DeepSeek-V4's window rings, entries and compressor states, the same bytes per
    device as its serving pool where ``context`` is a whole number of pages (``footprint_v4``)."""
    from dayzero.model.cache import init_cache

    return init_cache(engine.config, batch, context, engine.weights.embed.dtype, engine.kv_cache,
                      engine._cache_shardings(batch, context))


def cache_trees(engine, batch: int, context: int, page_size: int = 16, contiguous: bool = False,
                settle: bool = True) -> list[tuple[Any, str, str]]:
    """The KV the planner sizes, as the engine allocates it, as (tree, component of its values,
    component of its scales): the serving engine's pools (:func:`serving_steps`: page pools, with
    DeepSeek-V4's or a hybrid's per-slot states; ``kv_cache``, ``kv_scales``) and their prefix
    caches' snapshot rows (``state_snapshots``, values and scales; ``settle`` as there), or with
    ``contiguous`` the cache ``Engine.generate`` allocates (:func:`contiguous_cache`)."""
    if contiguous:
        return [(contiguous_cache(engine, batch, context), "kv_cache", "kv_scales")]
    out = []
    for steps in serving_steps(engine, batch, context, page_size, settle):
        out.append((steps.pool, "kv_cache", "kv_scales"))
        if steps.snapshots is not None:
            out.append((steps.snapshots, "state_snapshots", "state_snapshots"))
    return out


# Elements allocated to measure one dtype's held size: 128 MiB at its numpy itemsize, above glibc's
# largest mmap threshold (32 MiB), so the allocation is fresh pages that RSS counts, not reused heap.
_MEASURED_BYTES = 128 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@functools.lru_cache(maxsize=None)
def held_bytes_per_element(dtype_name: str) -> float:
    """Bytes per element a device of this process really holds for an array of ``dtype_name``,
    measured, not read off the dtype: an array of ``_MEASURED_BYTES / itemsize`` elements is
    made on the first device by a program compiled beforehand, and the growth of the device's
    ``memory_stats()["bytes_in_use"]`` (GPU, TPU) or, where it has none (XLA:CPU), of the
    process's resident memory, is divided by the elements (to the nearest eighth of a byte).
    XLA:CPU holds 4-bit types at 0.5 (ml_dtypes' itemsize and ``nbytes`` say 1)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype_name)
    elements = _MEASURED_BYTES // dtype.itemsize
    device = jax.devices()[0]
    make = jax.jit(lambda: jnp.ones((elements,), dtype)).lower().compile()

    def used() -> int:
        stats = device.memory_stats()
        return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else _rss()

    before = used()
    x = make()
    x.block_until_ready()
    grown = used() - before
    del x
    return round(grown / elements * 8) / 8


def held_nbytes(x) -> int:
    """Bytes a device holds for array (or shard) ``x``: its elements times the measured bytes per
    element of its dtype (:func:`held_bytes_per_element`), rounded up to a byte."""
    return math.ceil(x.size * held_bytes_per_element(x.dtype.name))


def placed_bytes(engine, batch: int, context: int, page_size: int = 16, contiguous: bool = False,
                 settle: bool = True) -> dict:
    """Per-device bytes of the engine's placed weights and of the KV it allocates for ``batch``
    rows of ``context`` positions (:func:`cache_trees`: the serving pools, their block tables or
    slot indices and lengths left out, and their snapshot rows; ``contiguous``:
    ``Engine.generate``'s cache), per component (:data:`COMPONENTS`), summed over each array's addressable
    shards device by device, each shard at the bytes the device holds (:func:`held_nbytes`:
    its elements times the measured bytes per element of its dtype, not ``nbytes``, which says
    1 for a 4-bit element held in half a byte): ``{"max": {component: the largest device's
    bytes}, "uneven": [components whose bytes differ between devices], "groups": {(component,
    global shape, bytes per element): bytes on the device holding the most}}`` (groups: for
    locating a difference), and ``"per_element"``: the measured bytes per element of each dtype."""
    arrays = _components(engine.weights, "weights", "weight_scales")
    for tree, plain, scales in cache_trees(engine, batch, context, page_size, contiguous, settle):
        arrays += [a for a in _components(tree, plain, scales) if not set(a[0].split("/")) & set(HOST_INPUTS)]
    per_device: dict[str, dict[int, int]] = {c: defaultdict(int) for c in COMPONENTS}
    groups: dict[tuple, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for _, component, x in arrays:
        for shard in x.addressable_shards:
            held = held_nbytes(shard.data)
            per_device[component][shard.device.id] += held
            groups[(component, tuple(x.shape), held_bytes_per_element(x.dtype.name))][shard.device.id] += held
    devices = {d for sizes in per_device.values() for d in sizes}  # every device holding any array
    return {"max": {c: max(per_device[c].values(), default=0) for c in COMPONENTS},
            "uneven": [c for c in COMPONENTS if len({per_device[c].get(d, 0) for d in devices}) > 1],
            "groups": {key: max(sizes.values()) for key, sizes in groups.items()},
            "per_element": {x.dtype.name: held_bytes_per_element(x.dtype.name) for _, _, x in arrays}}


COMPONENTS = ("weights", "weight_scales", "kv_cache", "kv_scales", "state_snapshots")


def planned_bytes(config, name: str, work, axes: dict[str, int]) -> dict:
    """The planner's per-device bytes of ``config`` under ``work`` on ``axes``: per component,
    per (component, global shape, itemsize) group as :func:`placed_bytes` groups them, and the
    engine's refusal (``{"bytes", "groups", "refused"}``)."""
    from dayzero.model.footprint import DecodeFootprint
    from dayzero.sharding.placement import rules_for_mesh
    from dayzero.sharding.planner import device_bytes, evaluate, logical_ways

    footprint = DecodeFootprint(config, name)
    plan = evaluate(footprint, work, axes)
    full = {a: int(axes.get(a, 1)) for a in ("data", "tensor", "expert")}
    rules = rules_for_mesh(full)
    groups: dict[tuple, int] = defaultdict(int)
    for t in footprint.weights(work, logical_ways(rules, full)) + footprint.cache(work, full):
        groups[(t.component.value, tuple(t.shape), t.itemsize)] += device_bytes(t, rules, full)
    return {"bytes": dict(plan.bytes), "groups": dict(groups), "refused": plan.refused}


def compare_placed(name: str, config, axes: dict[str, int], quantize: str = "none", kv_cache: str = "none",
                   dtype: str = "bfloat16", batch: int = 4, context: int = 256, weights=None) -> dict:
    """Placed-array bytes against the planner for ``config`` (reduced ``name``) on ``axes``: one
    row, with the arrays that differ (``differences``: per component, global shape and element
    size, the placed and the planned bytes on one device; the planner merges identical leaves,
    so arrays are matched by shape, not by name). The KV placed is the serving engine's pools,
    as deployed (not ``Engine.generate``'s contiguous cache), with pages of the planner's size
    (``DecodeFootprint.page_size``: ``footprint_v4.page_size`` for DeepSeek-V4), and for a model
    with per-sequence states (a hybrid, V4) the prefix cache's snapshot rows, laid out as after the
    warmup's first copy (``fresh_state_snapshots``: the bytes on the device holding the most of a
    fresh tree, before that copy, and whether devices differ). For DeepSeek-V4 ``Engine.generate``'s cache
    is compared too (``contiguous_kv_cache``, ``contiguous_kv_scales``): its rows split over
    ``data`` where the planner counts a replica's rows whole, and its entries in rows rather than
    pages, the same bytes per device (``context`` a whole number of pages)."""
    from dayzero.model.footprint import DecodeFootprint
    from dayzero.sharding.planner import Workload

    engine = build_engine(config, axes, quantize, kv_cache, dtype, weights=weights)
    devices = math.prod(axes.values())
    work = Workload(devices=devices, device_memory=1 << 40, quantize=quantize, kv_cache=kv_cache, dtype=dtype,
                    batch=batch, context=context)
    planned = planned_bytes(config, name, work, axes)
    page = DecodeFootprint(config, name).page_size(work)
    placed = placed_bytes(engine, batch, context, page)
    rows = {c: {"placed": placed["max"][c], "planner": planned["bytes"][c]} for c in COMPONENTS}
    fresh = None
    if planned["bytes"]["state_snapshots"]:
        before = placed_bytes(engine, batch, context, page, settle=False)
        fresh = {"placed": before["max"]["state_snapshots"], "planner": planned["bytes"]["state_snapshots"],
                 "uneven": "state_snapshots" in before["uneven"]}
    if config.compressed is not None:
        alone = placed_bytes(engine, batch, context, page, contiguous=True)["max"]
        rows.update({f"contiguous_{c}": {"placed": alone[c], "planner": planned["bytes"][c]}
                     for c in ("kv_cache", "kv_scales")})
    mine, theirs = placed["groups"], planned["groups"]
    differences = [{"component": key[0], "shape": key[1], "itemsize": key[2], "placed": mine.get(key),
                    "planner": theirs.get(key)} for key in sorted(set(mine) | set(theirs), key=str)
                   if mine.get(key) != theirs.get(key)]
    return {
        "model": name, "mesh": {a: n for a, n in axes.items() if n > 1}, "quantize": quantize, "kv_cache": kv_cache,
        "dtype": dtype, "batch": batch, "context": context, "page_size": page, "components": rows,
        "equal": all(r["placed"] == r["planner"] for r in rows.values()), "differences": differences,
        "uneven": placed["uneven"], "refused": planned["refused"], "per_element": placed["per_element"],
        "fresh_state_snapshots": fresh,
    }


# ---- the planner's recommendations run ----------------------------------------------------------


def recommended_meshes(config, name: str, quantize: str, kv_cache: str, dtype: str = "bfloat16",
                       devices: int = 8, context: int = 256) -> list[dict]:
    """Every distinct mesh ``plan`` recommends for ``config`` on ``devices`` devices as the device
    memory shrinks, with the workload that got it (``mesh``, ``batch``, ``devices_per_host``,
    ``device_memory``): per workload shape (4 rows on hosts of 8 devices; one row on hosts of 2,
    where tensor groups cross hosts and expert meshes win), one memory per runnable candidate,
    just enough for that candidate's total, so that each level forces a split."""
    from dayzero.model.footprint import DecodeFootprint
    from dayzero.sharding.planner import Workload, plan

    footprint = DecodeFootprint(config, name)
    found: dict[tuple, dict] = {}
    for batch, per_host in ((4, 8), (1, 2)):
        def work(memory: int) -> Workload:
            return Workload(devices=devices, device_memory=memory, quantize=quantize, kv_cache=kv_cache, dtype=dtype,
                            batch=batch, context=context, devices_per_host=per_host)

        totals = sorted({p.total for p in plan(footprint, work(1 << 40)).candidates if p.runs})
        for total in totals:
            memory = int(total / (1 - work(1).reserve)) + 1
            best = plan(footprint, work(memory)).recommended
            key = tuple(sorted(best.mesh.items()))
            # A pipeline ``model.pipeline`` does not run for this model yet (``pipeline_gap``) is
            # planned, not run: its figures are checked against placed arrays (plan_checks staged).
            if best.fits and best.pipeline_gap is None and key not in found:
                found[key] = {"mesh": dict(best.mesh), "batch": batch, "devices_per_host": per_host,
                              "device_memory": memory}
    return list(found.values())


def run_recommendation(name: str, config, rec: dict, quantize: str = "none", kv_cache: str = "none",
                       dtype: str = "bfloat16", prompt_len: int = 24, weights=None) -> dict:
    """Load ``config`` on a recommended mesh (``rec`` from :func:`recommended_meshes`) with these
    options and generate 2 tokens for ``rec["batch"]`` prompts of ``prompt_len`` tokens: one
    prefill chunk and one decode step. The error, if any, is returned in the row, not raised."""
    import numpy as np

    row: dict[str, Any] = {"model": name, "quantize": quantize, "kv_cache": kv_cache, **rec,
                           "mesh": {a: n for a, n in rec["mesh"].items() if n > 1}}
    try:
        engine = build_engine(config, rec["mesh"], quantize, kv_cache, dtype, weights=weights)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in range(rec["batch"])]
        done = engine.generate(prompts, max_new_tokens=2, ignore_eos=True)
        row["tokens"] = [c.token_ids for c in done]
        row["ok"] = all(len(c.token_ids) == 2 for c in done)
    except Exception as e:  # noqa: BLE001 -- reported: the point is whether the mesh runs
        row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"
    return row


# ---- command line ---------------------------------------------------------------------------------


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("placed", "recommend"))
    p.add_argument("--model", action="append", choices=MODELS, help="repeatable (default: all)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--mesh", action="append", help="AXIS=N,... (placed; repeatable; default tensor=8)")
    p.add_argument("--options", action="append", default=None,
                   help="QUANTIZE/KV_CACHE, e.g. fp8-block/fp8 (repeatable; default none/none)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    return p.parse_args(argv)


def main(argv=None) -> int:
    """``python -m dayzero.tools.plan_measure placed|recommend ...``: one JSON line per row; exit
    1 if any placed row differs from the planner or any recommended mesh fails to run."""
    args = _parse(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from dayzero.sharding.distributed import parse_mesh

    ok = True
    for name in args.model or MODELS:
        config = reduced(full_config(name))
        for option in args.options or ["none/none"]:
            quantize, kv = option.split("/")
            weights = host_weights(config, quantize, args.dtype)
            if args.what == "placed":
                for text in args.mesh or ["tensor=8"]:
                    row = compare_placed(name, config, parse_mesh(text), quantize, kv, args.dtype, args.batch,
                                         args.context, weights)
                    ok &= row["equal"]
                    print(json.dumps(row), flush=True)
                continue
            for rec in recommended_meshes(config, name, quantize, kv, args.dtype, args.devices, args.context):
                row = run_recommendation(name, config, rec, quantize, kv, args.dtype, weights=weights)
                ok &= row["ok"]
                print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
