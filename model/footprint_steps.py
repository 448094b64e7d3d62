"""The transient buffers and collectives of one step of the forward pass, for the planner.

A :class:`Step` is one serving replica's B rows of T new tokens, each reading the S positions of
its block table's pages: the decode step (B = the replica's rows, T = 1, S = the widest table
bucket for the context) and a prefill chunk (B = 1, T = the chunk). Both are the serving
engine's forward call on the reference path (``paged_steps._forward_logits`` with the replica's
``Parallel``: each layer's pages gathered after its input, one layer's at a time); they return
the logits of the last position only. With ``data`` > 1 the replicas are independent
(``engine.replicas``): nothing splits or joins a step's rows, so no buffer here has a ``batch``
axis. ``Engine``'s contiguous decode is not planned: a deployment serves from the pages.
DeepSeek-V4 (entry pages beside per-slot rings and compressor states) is counted in ``footprint_v4``.

Buffers (:func:`step_stages`): a stage is a point of the step with the buffers live there
together; every stage includes the step's outputs (each layer's new cache rows) and the
per-layer buffers XLA holds for the whole step (``_held``). The copy counts are what XLA
materialised in ``Engine``'s decode step (fitted, ``tools/plan_check.py``); the page gathers
below were read off the serving steps' structure (no count fitted):

- the pages (``_gathered_pages``): one layer's gathered as stored (a quantized pool's one-byte
  values and fp32 scales). Per-head pools split by kv head are gathered as rows of all kv heads
  (``kernels.paged_attention.gather_pages``), which XLA partitions as a masked local gather of
  every kv head's view [B,K,S,H] and an all-reduce of it (two whole copies each of keys and
  values), then each device's kv heads sliced out; latent and index-key pools are whole on every
  device, so their views [B,S,C] / [B,S,J] are whole, except one row's latent view split over
  ``tensor`` by latent attention: XLA gathers only each device's contiguous run of positions;
- latent attention (``mla_parallel.attend_latent_split``): each device's positions sliced out
  of the whole view (a copy [B,S/tp,C], or of a quantized pool its dequantized copy), the scores
  over them [B, T*N, S/tp] and their exponentials, two fp32 arrays; at another point the
  queries and the fp32 output of all heads; a chunk adds its own rows' block [B, T*N, T];
- sparse attention (DeepSeek-V3.2): the indexer's per-head scores [B, T*I, S]: where gathering
  beats scanning (T*k < S+T: decode past k tokens) whole, else split like the dense attention's
  scores; the head-summed scores gathered whole for the
  top-k [B, T, S+T] (two copies) with a whole mask; then, gathering, the k picked latent rows
  per query, whole on every device (two copies: XLA takes them from the pages directly, no
  whole latent view), else the dense latent attention with the narrowed masks (a chunk);
- grouped-query attention: two fp32 score arrays [B, K, G*T, S+T] split by kv head; where
  ``tensor`` does not divide the kv heads (pools whole on every device) XLA splits them by
  query head instead (the query projection's split), so [B, K*G, T, S+T] / tensor;
- a quantized pool: each layer's gathered view read through a compute-dtype copy, one layer's
  at a time;
- MoE (``moe.moe``): the routed rows [B*T*C, D] for the whole batch, three copies, beside the
  expert loop's output held from the start; the current expert's three matrices; router
  scores. With ``expert`` > 1 (``moe_parallel``), [ep * ceil(B*T/ep) * C, D] dispatch buffers
  per device: three held per MoE layer, two in flight (no-drop capacity; on GPU/TPU the ragged
  all-to-all sends fewer rows but receives into buffers of this worst case);
- dense MLP: three [B, T, F] arrays; output: the fp32 logits [B, V] and their log-softmax.

Collectives (:func:`step_collectives`), each the op the code path implies, per device:

- tensor parallelism: the embedding lookup of the vocabulary-split table, each attention output
  projection (heads split), each dense MLP and shared-expert down projection (width split) and
  the routed rows through width-split experts (inside the expert loop): all-reduce of partial
  sums; the expert-parallel block's width ``psum``;
- latent attention over each device's positions of the gathered view: the queries all-gathered
  whole (all heads), then ``pmax`` of the score maxima and ``psum`` of the sums and weighted
  rows (all-reduce);
- sparse attention: scanning densely (a chunk), the head-summed index scores all-gathered whole
  for the top-k; gathering the picked rows (decode), nothing (pools and scores whole);
- grouped-query attention: with pools split by kv head, the page gather's all-reduce of each
  layer's whole view of keys and values (and of a quantized pool's scales); with kv heads
  ``tensor`` does not divide, the new keys and values gathered;
- expert parallelism: dispatch and return of the routed rows (all-to-all; on GPU/TPU the ragged
  all-to-all sends only routed rows, expected (ep-1)/ep of them off-device under uniform
  routing, both ways), and the block's output joined over ``expert`` (all-gather);
- the logits all-gathered over the vocabulary split for sampling (filtered sampling sorts a
  whole row; greedy and plain sampling reduce per-device maxima, O(B x tensor)).

Checked against the collectives in XLA's compiled HLO of tiny models on 2 and 4 faked devices
(tensor, data x tensor, tensor x expert, expert; ``Engine``'s decode and prefill chunks), and
of the serving decode on 8 (the page gather's all-reduce, the latent-attention gather/pmax/psum,
none for sparse attention's picked rows): the tensor-parallel
all-reduces, the latent-attention gather/pmax/psum, the loop's routed-row reductions and the
filtered sampler's logits gather appear with these buffers. Not counted: small collectives (masks,
indices, scalars, the distributed sort of filtered sampling). Where XLA places rows otherwise:
with ``expert`` > 1 it kept rows split over ``expert`` after the MoE block (no join; with latent
attention it then all-gathered the queries over ``expert`` too, and with ``tensor`` = 1 it ran
attention on rows split over ``expert``, copying each device's rows of every layer's cache). On
CPU the dispatch is dense (``moe_parallel``: ep x capacity rows each way), twice the ragged
figure (ep times it).
"""

from __future__ import annotations

import dataclasses
import math

from dayzero.model.cache import KEY_BLOCK
from dayzero.model.config import ModelConfig
from dayzero.sharding.planner import Collective, Component, Op, Stage, Tensor

# Copies XLA materialised (module docstring).
SCORE_COPIES = 2
ROUTED_ROW_COPIES = 3
HELD_DISPATCH_BUFFERS = 3
DISPATCH_BUFFERS_IN_FLIGHT = 2
LOGIT_COPIES = 2
F32 = 4


@dataclasses.dataclass(frozen=True)
class Step:
    """One replica's B rows of T new tokens, each reading S cached positions (its block table's
    pages); ``k`` bytes per compute element; the replica's ``expert`` and ``tensor`` sizes;
    ``converted``: the pages are quantized, read through a compute-dtype copy."""

    B: int
    T: int
    S: int
    k: int
    expert: int = 1
    tensor: int = 1
    converted: bool = False

    @property
    def tokens(self) -> int:
        """Tokens computed: B x T."""
        return self.B * self.T


def _act(name: str, shape: tuple[int, ...], axes: tuple, itemsize: int, count: int = 1) -> Tensor:
    return Tensor(name, tuple(shape), tuple(axes), itemsize, Component.ACTIVATIONS, count)


def _moe_layers(c: ModelConfig) -> int:
    return sum(c.is_moe_layer(i) for i in range(c.num_layers))


def step_stages(c: ModelConfig, st: Step) -> list[Stage]:
    """The stages of one step (module docstring); each includes the step's outputs. DeepSeek-V4's
    are ``footprint_v4``'s."""
    if c.compressed is not None:
        from dayzero.model import footprint_v4  # it builds on this module's helpers

        return footprint_v4.step_stages(c, st)
    base = _outputs(c, st) + _held(c, st)
    if c.mla is None:
        attention = [("a layer's pages gathered", _kv_pages_whole(c, st)),
                     ("attention over the cache", _gqa_attention(c, st))]
    elif c.dsa is None:
        attention = _latent_attention(c, st)
    else:
        attention = _sparse_attention(c, st)
    stages = [Stage(name, base + tuple(tensors)) for name, tensors in attention]
    if _moe_layers(c):
        stages.append(Stage("mixture of experts", base + _moe(c, st)))
    if _moe_layers(c) < c.num_layers:
        hidden = _act("MLP hidden", (st.B, st.T, c.intermediate_size), (None, None, "ffw"), st.k, 3)
        stages.append(Stage("dense MLP", base + (hidden,)))
    logits = _act("logits and log-probabilities", (st.B, c.vocab_size), (None, "vocab"), F32, LOGIT_COPIES)
    stages.append(Stage("output and sampling", base + (logits,)))
    return stages


def _outputs(c: ModelConfig, st: Step) -> tuple[Tensor, ...]:
    """What the step returns: every layer's new cache rows (and a token and log-probability per row)."""
    B, T = st.B, st.T
    if c.mla is not None:
        width = c.mla.kv_lora_rank + c.mla.rope_dim + (c.dsa.head_dim if c.dsa else 0)
        rows = _act("new cache rows", (B, T, width), (None, None, None), st.k, count=c.num_layers)
    else:
        rows = _act("new keys and values", (B, T, 2, c.num_kv_heads, c.head_dim),
                    (None, None, None, "kv_heads", "head_dim"), st.k, count=c.num_layers)
    return (_act("sampled tokens and log-probabilities", (B, 2), (None, None), F32), rows)


def _dispatch_rows(c: ModelConfig, st: Step) -> int:
    """Rows of one device's expert-parallel buffers: ep destinations x the no-drop capacity
    (its ceil(B*T/ep) tokens x C experts each, ``Parallel.capacity``)."""
    return st.expert * math.ceil(st.tokens / st.expert) * c.moe.experts_per_token


def _held(c: ModelConfig, st: Step) -> tuple[Tensor, ...]:
    """Buffers of every layer that XLA creates at the start of the step and holds to their use
    (they depend on the weights or on nothing, so nothing orders them later): per MLA layer
    ``k_up`` and ``v_up`` relaid out for the absorbed products, per MoE layer the expert loop's
    zeroed output rows [B*T*C, D] (with ``expert`` > 1: three zeroed dispatch buffers). The
    pages are not among them: ``paged_cache._after`` orders each layer's gather after its input."""
    out = []
    if c.mla is not None:
        m, N = c.mla, c.num_heads
        axes = ("latent", "q_heads", "head_dim")
        out += [_act("k_up relaid out, every layer", (m.kv_lora_rank, N, m.nope_dim), axes, st.k, c.num_layers),
                _act("v_up relaid out, every layer", (m.kv_lora_rank, N, m.v_head_dim), axes, st.k, c.num_layers)]
    layers = _moe_layers(c)
    if layers and st.expert == 1:
        rows = (st.tokens * c.moe.experts_per_token, c.hidden_size)
        out.append(_act("expert-loop output rows, every MoE layer", rows, (None, None), st.k, layers))
    elif layers:
        out.append(_act("zeroed dispatch buffers, every MoE layer", (_dispatch_rows(c, st), c.hidden_size),
                        (None, None), st.k, HELD_DISPATCH_BUFFERS * layers))
    return tuple(out)


def _gqa_attention(c: ModelConfig, st: Step) -> tuple[Tensor, ...]:
    """Grouped-query attention (``transformer.attend``): scores [B,K,G*T,W+T] split by kv head, W
    the cached positions read at once (all S up to ``cache.KEY_BLOCK``, else one block);
    where ``tensor`` does not divide the kv heads (kept whole on every device), XLA splits the
    scores by query head instead ([B,K*G,T,S+T] over ``q_heads``, as the query projection is)."""
    B, T, S = st.B, st.T, st.S
    K, G = c.num_kv_heads, c.num_heads // c.num_kv_heads
    width = min(S, KEY_BLOCK) + T  # a cache longer than one block is read a block at a time
    if K % st.tensor == 0:
        scores = ((B, K, G * T, width), (None, "kv_heads", None, None))
    else:
        scores = ((B, K * G, T, width), (None, "q_heads", None, None))
    out = [_act("scores over cached and new positions", *scores, F32, SCORE_COPIES),
           _act("visibility mask", (B, T, S + T), (None, None, None), 1)]
    out += _gathered_pages(c, st)
    if st.converted:
        out += _converted_cache(c, st)
    return tuple(out)


def _kv_pages_whole(c: ModelConfig, st: Step) -> tuple[Tensor, ...]:
    """One layer's keys and values gathered from pools split by kv head: the gather reads the
    pool as rows of all kv heads' pages (``kernels.paged_attention.gather_pages``), which XLA
    partitions as each device gathering the rows it holds into a zeroed view of every kv head,
    then an all-reduce of that whole view [B,K,S,H] (two copies each, values and, quantized,
    scales); each device then slices out its kv heads (``_gathered_pages``). Where the pools
    are whole (one device, or ``tensor`` does not divide the kv heads) it gathers them in place."""
    split = _kv_split(c, st)
    whole = []
    for t in _gathered_pages(c, st):
        axes = tuple(None if a == "kv_heads" else a for a in t.axes)
        whole.append(dataclasses.replace(t, axes=axes, count=t.count * (2 if split else 1)))
    return tuple(whole)


def _narrowed(st: Step) -> bool:
    """Whether XLA gathers only each device's positions of the latent pages: one row (B = 1)
    whose positions ``attend_latent_split`` splits over ``tensor``. With several rows each
    device's positions are B separate runs, and XLA gathers the whole view, then slices it."""
    return st.B == 1 and _position_split(st)


def _position_split(st: Step) -> bool:
    """Whether latent attention splits the gathered positions over ``tensor``."""
    return st.tensor > 1 and st.S % st.tensor == 0


def _kv_split(c: ModelConfig, st: Step) -> bool:
    """Whether the per-head pools are split by kv head (``tensor`` > 1 divides them)."""
    return st.tensor > 1 and c.num_kv_heads % st.tensor == 0


def _gathered_pages(c: ModelConfig, st: Step, which: tuple[str, ...] = ("latent", "index")) -> list[Tensor]:
    """One layer's pages gathered into the contiguous view the attention reads
    (``paged_cache.*.layer``, after the layer's input: one layer's live at a time), as stored:
    keys and values [B,K,S,H] split by kv head, or (``which``) the latent rows [B,S,C] and the
    indexer keys [B,S,J] whole, like their pools; a quantized pool's values (one byte) and
    float32 scales. Where sparse attention gathers the picked rows, XLA takes them from the
    pages directly (the page gather fuses into the pick): no whole latent view."""
    B, S = st.B, st.S
    item = 1 if st.converted else st.k
    if c.mla is None:
        parts = [("keys and values", (B, c.num_kv_heads, S, c.head_dim), (None, "kv_heads", None, "head_dim"), 2)]
    else:
        parts = []
        if "latent" in which and (c.dsa is None or not _gathers(c, st)):
            # One row's positions split over ``tensor`` are a contiguous run of its table's pages:
            # XLA narrows the gather to the device's run (the slice ``attend_latent_split`` takes).
            seq = "latent_seq" if _narrowed(st) else None
            parts.append(("latent rows", (B, S, c.mla.kv_lora_rank + c.mla.rope_dim), (None, seq, None), 1))
        if "index" in which and c.dsa is not None:
            parts.append(("indexer keys", (B, S, c.dsa.head_dim), (None, None, None), 1))
    out = [_act(f"{name}: one layer's pages gathered", shape, axes, item, n) for name, shape, axes, n in parts]
    if st.converted:
        out += [_act(f"{name}: gathered scales", shape[:-1], axes[:-1], F32, n) for name, shape, axes, n in parts]
    return out


def _converted_cache(c: ModelConfig, st: Step, parts: tuple[str, ...] = ("latent", "index")) -> list[Tensor]:
    """One layer's gathered pages in the compute dtype, as the attention reads a quantized cache:
    keys and values [B,K,H,S]; of a latent cache (``parts``) the latent rows [B,S,C] (not where
    sparse attention gathers the picked rows: it converts those only) and the indexer keys."""
    B, S, k = st.B, st.S, st.k
    if c.mla is None:
        axes = (None, "kv_heads", "head_dim", "cache_seq")
        return [_act("cache in compute dtype", (B, c.num_kv_heads, c.head_dim, S), axes, k, 2)]
    out = []
    if "latent" in parts and (c.dsa is None or not _gathers(c, st)):
        out.append(_act("cache in compute dtype", (B, S, c.mla.kv_lora_rank + c.mla.rope_dim),
                        (None, "latent_seq", None), k))
    if "index" in parts and c.dsa is not None:
        out.append(_act("index keys in compute dtype", (B, S, c.dsa.head_dim), (None, "latent_seq", None), k))
    return out


def _latent_attention(c: ModelConfig, st: Step, mask: tuple[Tensor, ...] = ()) -> list[tuple[str, tuple]]:
    """Latent attention over every cached row (``mla.attend_latent``): the cached block's
    scores, then the queries and output of all heads; ``mask``: extra masks live throughout."""
    B, T, S, k = st.B, st.T, st.S, st.k
    N, C = c.num_heads, c.mla.kv_lora_rank + c.mla.rope_dim
    cached = [_act("scores over cached positions", (B, T * N, S), (None, None, "latent_seq"), F32, SCORE_COPIES),
              _act("visibility mask", (B, T, S), (None, None, "latent_seq"), 1)]
    if T > 1:
        cached.append(_act("scores over the chunk's own rows", (B, T * N, T), (None, None, None), F32, SCORE_COPIES))
    cached += _gathered_pages(c, st, ("latent",))
    if st.converted:  # the device's positions of the gathered view, dequantized
        cached += _converted_cache(c, st, parts=("latent",))
    elif _position_split(st) and not _narrowed(st):  # ``attend_latent_split`` slices them out (a copy)
        cached.append(_act("latent rows, the device's positions", (B, S, C), (None, "latent_seq", None), k))
    queries = (_act("queries, all heads", (B, T * N, C), (None, None, None), k),
               _act("attention output, all heads", (B, T * N, C), (None, None, None), F32))
    return [("attention over the cache", tuple(cached) + mask), ("attention queries and output", queries + mask)]


def _gathers(c: ModelConfig, st: Step) -> bool:
    """Whether sparse attention gathers the picked rows (T*k < S+T) rather than scanning densely
    (``mla._sparse_attention``)."""
    return st.T * min(c.dsa.topk, st.S + st.T) < st.S + st.T


def _sparse_attention(c: ModelConfig, st: Step) -> list[tuple[str, tuple]]:
    """DeepSeek-V3.2 (``dsa.select``, then ``mla.attend_gathered`` or the dense latent attention
    under narrowed masks): indexer, top-k, attention (module docstring)."""
    B, T, S, k = st.B, st.T, st.S, st.k
    I, C = c.dsa.heads, c.mla.kv_lora_rank + c.mla.rope_dim
    mask = _act("index visibility mask, whole", (B, T, S + T), (None, None, None), 1)
    # Over the whole gathered keys where the picked rows are gathered; else split by position, as
    # the dense latent attention that follows splits its scores.
    seq = None if _gathers(c, st) else "latent_seq"
    scoring = [_act("index scores per head", (B, T * I, S), (None, None, seq), F32)]
    scoring += _gathered_pages(c, st)
    pages = tuple(_gathered_pages(c, st, ("latent",)))
    if st.converted:
        scoring += _converted_cache(c, st, parts=("index",))
    top_k = (_act("index scores, whole for the top-k", (B, T, S + T), (None, None, None), F32, 2), mask) + pages
    stages = [("sparse-attention indexer", tuple(scoring)), ("top-k over the index scores", top_k)]
    if _gathers(c, st):
        picked = _act("picked latent rows", (B, T, min(c.dsa.topk, S + T), C), (None, None, None, None), k, 2)
        return stages + [("attention over the picked rows", (picked, mask) + pages)]
    chosen = _act("chosen positions, whole", (B, T, S + T), (None, None, None), 1)
    return stages + _latent_attention(c, st, (mask, chosen))


def _moe(c: ModelConfig, st: Step) -> tuple[Tensor, ...]:
    """One MoE layer: routed rows, the expert being run, and (expert-parallel) dispatch buffers."""
    m, D = c.moe, c.hidden_size
    E, C, F = m.num_experts, m.experts_per_token, m.intermediate_size
    out = [_act("router scores", (st.B, st.T, E), (None, None, None), F32, 3),
           _act("expert weights in use", (3, D, F), (None, "embed", "ffw"), st.k)]
    if st.expert == 1:
        out.append(_act("routed rows", (st.tokens * C, D), (None, None), st.k, ROUTED_ROW_COPIES))
    else:  # the all_to_all buffers of expert-parallel dispatch in flight (the held ones: ``_held``)
        out.append(_act("dispatch buffers", (_dispatch_rows(c, st), D), (None, None), st.k, DISPATCH_BUFFERS_IN_FLIGHT))
    return tuple(out)


# ---- collectives ------------------------------------------------------------------------------


def step_collectives(c: ModelConfig, st: Step) -> list[Collective]:
    """The collectives of one step (module docstring), per device, by the op each stands for
    (DeepSeek-V4's: ``footprint_v4``)."""
    if c.compressed is not None:
        from dayzero.model import footprint_v4

        return footprint_v4.step_collectives(c, st)
    B, T, D, k, L = st.B, st.T, c.hidden_size, st.k, c.num_layers
    rows = ((B, T, D), (None, None, None))
    out = [Collective("embedding lookup: partial rows of the vocabulary-split table", Op.ALL_REDUCE, "vocab",
                      c.vocab_size, *rows, k),
           Collective("attention output projection: partial sums over the head split", Op.ALL_REDUCE, "q_heads",
                      c.num_heads, *rows, k, L)]
    out += _attention_collectives(c, st)
    dense = L - _moe_layers(c)
    if dense:
        out.append(Collective("dense MLP down projection: partial sums over the width split", Op.ALL_REDUCE, "ffw",
                              c.intermediate_size, *rows, k, dense))
    if _moe_layers(c):
        out += _moe_collectives(c, st)
    out.append(Collective("logits gathered over the vocabulary split for sampling", Op.ALL_GATHER, "vocab",
                          c.vocab_size, (B, c.vocab_size), (None, None), F32))
    return out


def _attention_collectives(c: ModelConfig, st: Step) -> list[Collective]:
    B, T, S, k, L = st.B, st.T, st.S, st.k, c.num_layers
    if c.mla is None:
        if _kv_split(c, st):
            item = 1 if st.converted else k
            shape, axes = (B, c.num_kv_heads, S, c.head_dim), (None, None, None, None)
            out = [Collective("a layer's gathered keys and values joined whole (all-reduce of the page gather)",
                              Op.ALL_REDUCE, "kv_heads", c.num_kv_heads, shape, axes, item, 2 * L)]
            if st.converted:
                out.append(Collective("their gathered scales joined whole", Op.ALL_REDUCE, "kv_heads",
                                      c.num_kv_heads, shape[:-1], axes[:-1], F32, 2 * L))
            return out
        if c.num_kv_heads % st.tensor == 0:
            return []
        return [Collective("new keys and values gathered (kv heads whole, query heads split)", Op.ALL_GATHER,
                           "q_heads", c.num_heads, (B, T, 2, c.num_kv_heads, c.head_dim),
                           (None, None, None, None, None), k, L)]
    N, C = c.num_heads, c.mla.kv_lora_rank + c.mla.rope_dim
    if S % st.tensor or (c.dsa is not None and _gathers(c, st)):
        # Nothing split by position: the whole view (or the picked rows, taken from whole pools)
        # is attended per head on every device; nothing merges.
        return []
    out = [Collective("latent-attention queries gathered whole (all heads)", Op.ALL_GATHER, "q_heads", N,
                      (B, T * N, C), (None, None, None), k, L),
           Collective("softmax maxima over the position-split cache (pmax)", Op.ALL_REDUCE, "latent_seq", S,
                      (B, T * N), (None, None), F32, L),
           Collective("softmax sums and weighted latent rows over the position split (psum)", Op.ALL_REDUCE,
                      "latent_seq", S, (B, T * N, C + 1), (None, None, None), F32, L)]
    if c.dsa is not None:  # scanning densely: the index scores were split like the attention's
        out.append(Collective("index scores gathered whole for the top-k", Op.ALL_GATHER, "latent_seq", S,
                              (B, T, S), (None, None, None), F32, L))
    return out


def _moe_collectives(c: ModelConfig, st: Step) -> list[Collective]:
    m, D, k, layers = c.moe, c.hidden_size, st.k, _moe_layers(c)
    C, F = m.experts_per_token, m.intermediate_size
    out = []
    if m.shared_width:
        out.append(Collective("shared experts' down projection: partial sums over the width split", Op.ALL_REDUCE,
                              "ffw", m.shared_width, (st.B, st.T, D), (None, None, None), k, layers))
    if st.expert == 1:
        routed = ((st.tokens * C, D), (None, None))
        out.append(Collective("routed rows through width-split experts: partial sums (expert loop)", Op.ALL_REDUCE,
                              "ffw", F, *routed, k, layers))
        return out
    ep, n = st.expert, math.ceil(st.tokens / st.expert)
    out += [Collective("expert counts gathered for the exchange plan", Op.ALL_GATHER, "experts", m.num_experts,
                       (ep, m.num_experts), (None, None), 4, layers),
            Collective("expert dispatch and return (ragged all-to-all: routed rows off-device, both ways)",
                       Op.ALL_TO_ALL, "experts", m.num_experts, (n * C, D), (None, None), k, 2 * layers,
                       share=(ep - 1) / ep),
            Collective("expert outputs summed over the width split (psum)", Op.ALL_REDUCE, "ffw", F, (n, D),
                       (None, None), k, layers),
            Collective("expert-parallel output rows joined over the expert split", Op.ALL_GATHER, "experts",
                       m.num_experts, (ep * n, D), (None, None), k, layers)]
    return out
