"""What a model holds while decoding, declared abstractly for the memory planner.

:class:`DecodeFootprint` implements ``dayzero.sharding.planner.Footprint``: the weights (from
``abstract_weights``), the cache (from ``cache_specs``) and the transient buffers of one decode
step (one new token per row), each a ``planner.Tensor`` with logical axes, so that the planner
sizes every one of them on any mesh with the same rules the model runs with.

The transient buffers follow the code of the engine's decode step (``generate.engine_step``:
``transformer.forward`` with the mesh's hand-written blocks, then sampling): a stage is a point
of the step with the buffers live there together, the activation peak is the largest stage,
and every stage includes the step's outputs (each layer's new cache rows) and the per-layer
buffers XLA holds for the whole step (``_held``). Checked against XLA's compiled memory
analysis of that step by ``bench/plan_vs_xla.py``; the copy counts below are what XLA
materialised there:

- latent attention (``mla_parallel.attend_latent_split``): the scores over each device's
  cached positions [B, N, S/tp] and their exponentials, two fp32 arrays split like the cache's
  positions (the queries are gathered whole on each device instead); at another point, the
  queries and the fp32 output of all heads;
- sparse attention (DeepSeek-V3.2): the indexer's per-head scores (split like the cache); the
  head-summed scores gathered whole for the top-k (two copies) with a whole mask; then the k
  picked latent rows, gathered whole on every device (two copies);
- grouped-query attention: two fp32 score arrays [B, K, G, S] split by kv head;
- MoE (``moe.moe``): the routed rows [B*C, D] for the whole batch (the global sort by expert
  gathers every row): three copies (gathered, the loop's carry, back in pair order) beside the
  loop's output held from the start (``_held``); the current expert's three matrices (the loop
  slices them); router scores. With ``expert`` > 1 (``moe_parallel``), R = ep x capacity rows
  [R, D] per device instead: three zeroed buffers per MoE layer held from the start (the send
  buffer, the expert loop's output, its unsorted copy) and two in flight (received rows, their
  sorted copy); Under data parallelism XLA reused one of the copies (measured: three in all, not
  four), so the figure is high there by one [B*C, D] buffer when the MoE stage is the peak;
- dense MLP: three [B, F] arrays;
- output: the fp32 logits [B, V] and their log-softmax for sampling.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from dayzero.model.config import ModelConfig
from dayzero.model.cache import cache_specs
from dayzero.model.weights import abstract_weights, named_leaves, parameter_count
from dayzero.sharding.planner import ITEMSIZE, Component, KVDtype, Stage, Tensor, WeightDtype, Workload

# DeepSeek's FP8 checkpoints: one fp32 scale per 128x128 block; the embedding, lm_head and router
# stay bfloat16 (as do 1-D leaves: norms, biases, the score bias).
FP8_BLOCK = 128
KEPT_BF16 = ("embed", "lm_head", "router")
SCALE_ITEMSIZE = 4
# Copies XLA materialised (module docstring).
SCORE_COPIES = 2
REPLICATED_GQA_SCORE_COPIES = 4
ROUTED_ROW_COPIES = 3
HELD_DISPATCH_BUFFERS = 3
DISPATCH_BUFFERS_IN_FLIGHT = 2
LOGIT_COPIES = 2


@dataclasses.dataclass(frozen=True)
class DecodeFootprint:
    """The planner's view of ``config`` (see ``dayzero.sharding.planner.Footprint``)."""

    config: ModelConfig
    name: str = "model"

    @property
    def parameters(self) -> int:
        """Parameters of the abstract weight tree."""
        return parameter_count(abstract_weights(self.config))

    @property
    def num_experts(self) -> int | None:
        """Routed experts per MoE layer (None for a dense model)."""
        return None if self.config.moe is None else self.config.moe.num_experts

    def weights(self, work: Workload) -> list[Tensor]:
        """Every weight leaf at ``work.weight_dtype``, plus block scales for float8."""
        return list(_weight_tensors(self.config, work.weight_dtype))

    def cache(self, work: Workload) -> list[Tensor]:
        """The cache for ``work.batch`` rows of ``work.context`` positions, plus per-row scales
        for one-byte KV dtypes."""
        return list(_cache_tensors(self.config, work.kv_dtype, work.batch, work.context))

    def activations(self, work: Workload, mesh: dict[str, int]) -> list[Stage]:
        """The decode step's stages (module docstring); each includes the step's outputs."""
        c = self.config
        B, k = work.batch, work.compute_itemsize
        expert = mesh.get("expert", 1)
        outputs = _outputs(c, B, k) + _held(c, B, k, expert)
        if c.mla is None:
            stages = [Stage("attention over the cache", outputs + _gqa_attention(c, work, mesh.get("tensor", 1)))]
        elif c.dsa is None:
            stages = [Stage("attention over the cache", outputs + _latent_attention(c, work)),
                      Stage("attention queries and output", outputs + _latent_queries(c, work))]
        else:
            stages = [Stage(name, outputs + tensors) for name, tensors in _sparse_attention(c, work)]
        if any(c.is_moe_layer(i) for i in range(c.num_layers)):
            stages.append(Stage("mixture of experts", outputs + _moe(c, B, k, expert)))
        if not all(c.is_moe_layer(i) for i in range(c.num_layers)):
            hidden = _act("MLP hidden", (B, c.intermediate_size), ("batch", "ffw"), k, 3)
            stages.append(Stage("dense MLP", outputs + (hidden,)))
        logits = _act("logits and log-probabilities", (B, c.vocab_size), ("batch", "vocab"), 4, LOGIT_COPIES)
        stages.append(Stage("output and sampling", outputs + (logits,)))
        return stages


# The planner evaluates many meshes (and, for its advice, other dtypes and sizes) of one model:
# the tensor lists are built once per distinct argument.
@functools.lru_cache(maxsize=32)
def _weight_tensors(config: ModelConfig, dtype: WeightDtype) -> tuple[Tensor, ...]:
    out = []
    for name, spec in named_leaves(abstract_weights(config)).items():
        quantized = (dtype is WeightDtype.FLOAT8 and len(spec.shape) >= 2
                     and not any(part in KEPT_BF16 for part in name.split("/")))
        itemsize = 1 if quantized else (2 if dtype is WeightDtype.FLOAT8 else ITEMSIZE[dtype.value])
        out.append(Tensor(name, spec.shape, spec.axes, itemsize, Component.WEIGHTS))
        if quantized:
            out.append(_block_scales(name, spec.shape, spec.axes))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _cache_tensors(config: ModelConfig, dtype: KVDtype, batch: int, context: int) -> tuple[Tensor, ...]:
    itemsize = ITEMSIZE[dtype.value]
    scaled = dtype in (KVDtype.FLOAT8, KVDtype.INT8)
    out = []
    for name, spec in named_leaves(cache_specs(config, batch, context)).items():
        if name in ("lengths", "rope_len"):
            out.append(Tensor(name, spec.shape, spec.axes, 4, Component.KV_CACHE))
            continue
        out.append(Tensor(name, spec.shape, spec.axes, itemsize, Component.KV_CACHE))
        if scaled:  # one scale per cached row: drop the per-row feature axis
            drop = spec.axes.index("head_dim") if "head_dim" in spec.axes else len(spec.shape) - 1
            keep = [i for i in range(len(spec.shape)) if i != drop]
            out.append(Tensor(name + ":scale", tuple(spec.shape[i] for i in keep),
                              tuple(spec.axes[i] for i in keep), SCALE_ITEMSIZE, Component.KV_SCALES))
    return tuple(out)


def _act(name: str, shape: tuple[int, ...], axes: tuple, itemsize: int, count: int = 1) -> Tensor:
    return Tensor(name, tuple(shape), tuple(axes), itemsize, Component.ACTIVATIONS, count)


def _block_scales(name: str, shape: tuple[int, ...], axes: tuple) -> Tensor:
    """One fp32 scale per 128x128 block of a matrix as HF stores it: head-split leaves flatten
    their heads (q [D,N,H] is [D, N*H]; o [N,V,D] is [N*V, D]); stacked experts are E matrices."""
    dims = [i for i, a in enumerate(axes) if a != "experts"]
    if axes[dims[-1]] == "embed":
        groups = (tuple(dims[:-1]), (dims[-1],))
    else:
        groups = ((dims[0],), tuple(dims[1:]))
    return Tensor(name + ":scale", shape, axes, SCALE_ITEMSIZE, Component.WEIGHT_SCALES,
                  block_groups=groups, block=FP8_BLOCK)


def _outputs(c: ModelConfig, B: int, k: int) -> tuple[Tensor, ...]:
    """What the step returns: every layer's new cache rows (and a token and log-probability per row)."""
    if c.mla is not None:
        width = c.mla.kv_lora_rank + c.mla.rope_dim + (c.dsa.head_dim if c.dsa else 0)
        rows = _act("new cache rows", (B, width), ("batch", None), k, count=c.num_layers)
    else:
        rows = _act("new keys and values", (B, 2, c.num_kv_heads, c.head_dim), ("batch", None, "kv_heads", "head_dim"),
                    k, count=c.num_layers)
    return (_act("sampled tokens and log-probabilities", (B, 2), ("batch", None), 4), rows)


def _dispatch_rows(c: ModelConfig, B: int, expert: int) -> int:
    """Rows of one device's expert-parallel buffers: ep destinations x the no-drop capacity
    (its ceil(B/ep) tokens x C experts each, ``Parallel.capacity``)."""
    return expert * math.ceil(B / expert) * c.moe.experts_per_token


def _held(c: ModelConfig, B: int, k: int, expert: int) -> tuple[Tensor, ...]:
    """Buffers of every layer that XLA creates at the start of the step and holds to their use
    (they depend on the weights or on nothing, so nothing orders them later): per MLA layer
    ``k_up`` and ``v_up`` relaid out for the absorbed products, per MoE layer the expert loop's
    zeroed output rows [B*C, D] (with ``expert`` > 1: three zeroed dispatch buffers)."""
    out = []
    if c.mla is not None:
        m, N = c.mla, c.num_heads
        axes = ("latent", "q_heads", "head_dim")
        out += [_act("k_up relaid out, every layer", (m.kv_lora_rank, N, m.nope_dim), axes, k, c.num_layers),
                _act("v_up relaid out, every layer", (m.kv_lora_rank, N, m.v_head_dim), axes, k, c.num_layers)]
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    if moe_layers and expert == 1:
        rows = (B * c.moe.experts_per_token, c.hidden_size)
        out.append(_act("expert-loop output rows, every MoE layer", rows, (None, None), k, moe_layers))
    elif moe_layers:
        rows = (_dispatch_rows(c, B, expert), c.hidden_size)
        out.append(_act("zeroed dispatch buffers, every MoE layer", rows, (None, None), k,
                        HELD_DISPATCH_BUFFERS * moe_layers))
    return tuple(out)


def _converted(work: Workload) -> bool:
    """Whether the cache is read in another dtype than it is stored in (a converted copy)."""
    return ITEMSIZE[work.kv_dtype.value] != work.compute_itemsize


def _gqa_attention(c: ModelConfig, work: Workload, tensor: int) -> tuple[Tensor, ...]:
    """Grouped-query attention (``transformer.attend``): scores [B,K,G,S] split by kv head.

    When ``tensor`` does not divide the kv heads, the kv projections and cache stay whole and
    XLA runs the whole attention on every device: the concatenated, masked and normalised
    scores then all materialise (four copies, measured) instead of two.
    """
    B, S, k = work.batch, work.context, work.compute_itemsize
    K, G, H = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    axes = ("batch", "kv_heads", None, "cache_seq")
    copies = SCORE_COPIES if K % tensor == 0 else REPLICATED_GQA_SCORE_COPIES
    out = [_act("scores over cached positions", (B, K, G, S), axes, 4, copies),
           _act("visibility mask", (B, 1, S), ("batch", None, "cache_seq"), 1)]
    if _converted(work):
        out.append(_act("cache in compute dtype", (B, K, H, S), ("batch", "kv_heads", "head_dim", "cache_seq"), k, 2))
    return tuple(out)


def _latent_attention(c: ModelConfig, work: Workload) -> tuple[Tensor, ...]:
    """Latent attention over every cached row (``mla.attend_latent``, module docstring)."""
    B, S, k = work.batch, work.context, work.compute_itemsize
    N, C = c.num_heads, c.mla.kv_lora_rank + c.mla.rope_dim
    axes = ("batch", None, "latent_seq")
    out = [_act("scores over cached positions", (B, N, S), axes, 4, SCORE_COPIES),
           _act("visibility mask", (B, 1, S), axes, 1)]
    if _converted(work):
        out.append(_act("cache in compute dtype", (B, S, C), ("batch", "latent_seq", None), k))
    return tuple(out)


def _latent_queries(c: ModelConfig, work: Workload) -> tuple[Tensor, ...]:
    """The absorbed queries gathered whole (all heads) and the fp32 attention output."""
    B, N, C = work.batch, c.num_heads, c.mla.kv_lora_rank + c.mla.rope_dim
    return (_act("queries, all heads", (B, N, C), ("batch", None, None), work.compute_itemsize),
            _act("attention output, all heads", (B, N, C), ("batch", None, None), 4))


def _sparse_attention(c: ModelConfig, work: Workload) -> list[tuple[str, tuple[Tensor, ...]]]:
    """DeepSeek-V3.2 decode (``dsa.select`` then ``mla.attend_gathered``), in three stages.

    The indexer scores every cached position per index head (split like the cache); the
    head-summed scores are gathered whole on every device for the top-k, where they are
    concatenated with the new token's column (two copies) under a whole visibility mask; then
    the k picked latent rows are gathered whole on every device (each device takes the picks in
    its shard, then the pieces are summed: two copies) while that mask is still live.
    """
    B, S, k = work.batch, work.context, work.compute_itemsize
    I, J, C = c.dsa.heads, c.dsa.head_dim, c.mla.kv_lora_rank + c.mla.rope_dim
    mask = _act("index visibility mask, whole", (B, 1, S), ("batch", None, None), 1)
    scoring = [_act("index scores per head", (B, I, S), ("batch", None, "latent_seq"), 4)]
    if _converted(work):
        scoring.append(_act("index keys in compute dtype", (B, S, J), ("batch", "latent_seq", None), k))
    top_k = (_act("index scores, whole for the top-k", (B, 1, S), ("batch", None, None), 4, 2), mask)
    picked = (_act("picked latent rows", (B, min(c.dsa.topk, S + 1), C), ("batch", None, None), k, 2), mask)
    return [("sparse-attention indexer", tuple(scoring)), ("top-k over the index scores", top_k),
            ("attention over the picked rows", picked)]


def _moe(c: ModelConfig, B: int, k: int, expert: int) -> tuple[Tensor, ...]:
    """One MoE layer: routed rows, the expert being run, and (expert-parallel) dispatch buffers."""
    m, D = c.moe, c.hidden_size
    E, C, F = m.num_experts, m.experts_per_token, m.intermediate_size
    out = [_act("router scores", (B, E), ("batch", None), 4, 3),
           _act("expert weights in use", (3, D, F), (None, "embed", "ffw"), k)]
    if expert == 1:
        out.append(_act("routed rows", (B * C, D), (None, None), k, ROUTED_ROW_COPIES))
    else:  # the all_to_all buffers of expert-parallel dispatch in flight (the held ones: ``_held``)
        out.append(_act("dispatch buffers", (_dispatch_rows(c, B, expert), D), (None, None), k,
                        DISPATCH_BUFFERS_IN_FLIGHT))
    return tuple(out)
