"""DeepSeek-V4 for the deployment planner, in one place: its cache, its steps' buffers, collectives.

``footprint`` and ``footprint_steps`` hand V4 here; everything V4-specific the planner counts is in
this module. Letters: B rows, T new tokens, W window, H head width, N query heads, r a layer's
ratio (CSA 4, HCA 128), m = 2 for CSA's overlapping windows (1 for HCA), I x J index heads and
width, n hyper-connection streams of D.

Cache (:func:`slot_cache_specs`). The serving engine holds V4's caches as a slot cache: one row of
``compressed_cache.cache_specs`` per serving slot, sized for ``work.context`` positions (no
pages). A replica's ``ceil(batch / data)`` rows hold, per layer, the window ring [rows, W, H]; on
CSA/HCA layers the entries [rows, ceil(context / r), H] and the compressor's state (kv and gate
[rows, m*r, m*H]); on CSA layers the index keys [rows, ceil(context / r), J] and the indexer
compressor's state [rows, 2r, 2J] twice. Window rows, entries and index keys are KV rows
(quantized with the KV cache, one fp32 scale per row); the states stay in the compute dtype.
They are laid out by their own logical axes on the replica's devices (:func:`on_replica`: the
rows are the replica's own, so ``batch`` does not split again over ``data``): entries and index
keys split by position over ``tensor`` (``latent_seq``), the rest whole. ``Engine.generate``'s
contiguous cache is the same tree over its whole batch, ``batch`` split over ``data``: the same
bytes per device. Lengths and ``rope_len`` are not counted (small host inputs, as for the pages).

Steps (:func:`steps`): a replica's decode step (its rows, one token each) and prefill chunks (one
row of each chunk size ``Workload.prefill_shapes`` gives), each over the cache of ``context``
positions. The reference path (``compressed.compressed_block``) attends over the whole buffers
whatever the row's length: [window ring | new rows | every cached entry | the call's window grid],
so a chunk's buffers depend on T and on the context, not on how far the prompt has got.

Buffers (:func:`step_stages`), what the reference path materialises, per layer kind; each stage
also holds the step's outputs (every layer's new rows, entries and compressor states, which the
cache write reads after the forward), the MoE output rows XLA holds for every layer
(``footprint_steps._held``) and the residual streams [B, T, n, D]:

- attention: the keys [B, S_k, H] (S_k = W + T, plus ceil(context / r) + T // r + 1 on CSA/HCA
  layers) gathered whole on every device (their cached entries are split by position; XLA
  gathers the concatenation and relays it out: :data:`KEY_COPIES` copies), the mask [B, T, S_k]
  and two fp32 score arrays [B, N, T, S_k] split by query head. HCA reads every visible entry, and
  CSA too: its indexer's picks only narrow the mask of the same dense softmax;
- the CSA indexer (``compressor.index_select``): its keys [B, E + M, J] whole (the cached ones
  dequantized and concatenated with the call's), the per-head scores [B, T*I, E + M] in fp32
  (two: the product and its relu-weighted copy), split by position like the cached keys (XLA pads
  E + M to a multiple of ``tensor``), then the head-summed scores [B, T, E + M] whole for the
  top-k (two fp32) with the visibility and chosen masks;
- a compressor (``compressor.compress``; the main one of a CSA or HCA layer, C = H): the
  projections [B, T, m*C] (kv and gate) and the window grid of the call, M = T // r + 1 windows of
  m*r slots [B, M, m*r, C]: the gathered rows and their softmax weights in the compute dtype, the
  gates and their exponentials in fp32. The indexer's own compressor is the same at width J < H;
- a hyper-connection mix (``hyper.mix``/``merge``): the streams in and out [B, T, n, D] and the
  fp32 flattened input [B, T, n*D] with its RMS-normed copy;
- a quantized cache: the ring, the cached entries and index keys read through compute-dtype
  copies, one layer's at a time;
- MoE and the output as for the other families (``footprint_steps``).

Collectives (:func:`step_collectives`): as the other families' tensor-parallel ones (embedding,
attention output projection, MoE, logits), plus per CSA/HCA layer the keys gathered whole over the
position split of the entries (all-gather) and per CSA layer the index keys and the head-summed
index scores gathered whole. The all-to-alls XLA adds to relay out the gathered keys are not
counted. Checked against XLA's compiled memory analysis and HLO of ``Engine``'s contiguous step
on tiny V4 models (``tools/plan_check.V4_CASES``), which has the slot cache's layout.
"""

from __future__ import annotations

import dataclasses

from dayzero.model import compressed_cache
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.quant import KVQuant
from dayzero.sharding.planner import Collective, Op, Stage, Tensor, Workload

# Copies XLA materialised on tiny V4 models (module docstring; tools/plan_check.V4_CASES).
KEY_COPIES = 3  # the keys gathered whole and relaid out
SCORE_COPIES = 2
INDEX_SCORE_COPIES = 2
F32, I32, BOOL = 4, 4, 1


# ---- the cache ------------------------------------------------------------------------------------


def slot_cache_specs(config: ModelConfig, rows: int, context: int, kv: KVQuant):
    """The spec tree of a replica's slot cache (module docstring): ``rows`` rows of
    ``compressed_cache.cache_specs`` for ``context`` positions, without the lengths and
    ``rope_len`` (host inputs)."""
    return compressed_cache.cache_specs(config, rows, context, kv).replace(lengths=None, rope_len=None)


def on_replica(t: Tensor) -> Tensor:
    """A cache tensor of a replica's own rows: its ``batch`` axis is whole on the replica's
    devices (a replica is its ``tensor`` x ``expert`` devices; ``data`` splits the replicas)."""
    return dataclasses.replace(t, axes=tuple(None if a == "batch" else a for a in t.axes))


# ---- the steps ------------------------------------------------------------------------------------


def steps(work: Workload, rows: int, sizes: dict) -> dict:
    """The decode step (``rows`` rows of one token) and one prefill chunk per chunk size of
    ``work.prefill_shapes()`` (one row), each over the cache of ``work.context`` positions."""
    from dayzero.model.footprint_steps import Step

    chunks = sorted({T for T, _ in work.prefill_shapes()}, reverse=True)
    return {"decode": [Step(B=rows, T=1, S=work.context, **sizes)],
            "prefill": [Step(B=1, T=T, S=work.context, **sizes) for T in chunks]}


def _act(name: str, shape: tuple[int, ...], axes: tuple, itemsize: int, count: int = 1) -> Tensor:
    from dayzero.model.footprint_steps import _act as act

    return act(name, shape, axes, itemsize, count)


def _kinds(c: ModelConfig) -> list[CompressKind]:
    """The layer kinds present, in the order of their first layer."""
    return list(dict.fromkeys(c.compressed.kinds))


def _entries(c: ModelConfig, st, kind: CompressKind) -> tuple[int, int]:
    """(E, M) of a layer of ``kind``: the cache's entry rows ceil(S / r) and the call's window
    grid T // r + 1 (both 0 on a sliding-only layer)."""
    r = c.compressed.ratio_of(kind)
    return (0, 0) if r is None else (-(-st.S // r), st.T // r + 1)


def _keys(c: ModelConfig, st, kind: CompressKind) -> int:
    """S_k: the keys a query of a layer of ``kind`` is scored against (module docstring)."""
    E, M = _entries(c, st, kind)
    return c.compressed.window + st.T + E + M


def _padded(n: int, ways: int) -> int:
    """``n`` rounded up to a multiple of ``ways`` (XLA pads a dimension it splits unevenly)."""
    return -(-n // ways) * ways


def step_stages(c: ModelConfig, st) -> list[Stage]:
    """The stages of one V4 step (module docstring); each includes the step's outputs, the held
    MoE rows and the residual streams."""
    from dayzero.model.footprint_steps import LOGIT_COPIES, _held, _moe, _moe_layers

    n, D = c.hyper.mult if c.hyper else 1, c.hidden_size
    base = _outputs(c, st) + _held(c, st) + (_act("residual streams", (st.B, st.T, n, D), (None,) * 4, st.k),)
    stages = []
    for kind in _kinds(c):
        label = {CompressKind.SLIDING: "sliding", CompressKind.CSA: "CSA", CompressKind.HCA: "HCA"}[kind]
        stages.append(Stage(f"{label} attention over window and entries", base + _attention(c, st, kind)))
        if kind is not CompressKind.SLIDING:
            stages.append(Stage(f"{label} compressor window grid", base + _compressor(c, st, kind)))
        if kind is CompressKind.CSA:
            stages.append(Stage("CSA indexer scores and top-k", base + _indexer(c, st)))
    stages.append(Stage("hyper-connection mix", base + _mix(c, st)))
    if _moe_layers(c):
        stages.append(Stage("mixture of experts", base + _moe(c, st)))
    if _moe_layers(c) < c.num_layers:
        hidden = _act("MLP hidden", (st.B, st.T, c.intermediate_size), (None, None, "ffw"), st.k, 3)
        stages.append(Stage("dense MLP", base + (hidden,)))
    logits = _act("logits and log-probabilities", (st.B, c.vocab_size), (None, "vocab"), F32, LOGIT_COPIES)
    stages.append(Stage("output and sampling", base + (logits,)))
    return stages


def _outputs(c: ModelConfig, st) -> tuple[Tensor, ...]:
    """What the step returns for the cache write: per layer the new key rows; per CSA/HCA layer
    the call's entries, their ids and the compressor's new state; per CSA layer the indexer's."""
    cc, B, T, H, k = c.compressed, st.B, st.T, c.head_dim, st.k
    per_kind = {kind: cc.kinds.count(kind) for kind in _kinds(c)}
    out = [_act("sampled tokens and log-probabilities", (B, 2), (None, None), F32),
           _act("new key rows", (B, T, H), (None, None, None), k, c.num_layers)]
    for kind, layers in per_kind.items():
        r = cc.ratio_of(kind)
        if r is None:
            continue
        m, (_, M) = (2 if kind is CompressKind.CSA else 1), _entries(c, st, kind)
        out += [_act("new entries", (B, M, H), (None, None, None), k, layers),
                _act("new entry ids", (B, M), (None, None), I32, layers),
                _act("compressor state (kv and gate)", (B, m * r, m * H), (None, None, None), k, 2 * layers)]
        if kind is CompressKind.CSA:
            J = cc.index_head_dim
            out += [_act("new index keys", (B, M, J), (None, None, None), k, layers),
                    _act("new index key ids", (B, M), (None, None), I32, layers),
                    _act("indexer compressor state", (B, 2 * r, 2 * J), (None, None, None), k, 2 * layers)]
    return tuple(out)


def _attention(c: ModelConfig, st, kind: CompressKind) -> tuple[Tensor, ...]:
    """One layer's dense softmax over [ring | new rows | cached entries | new entries]."""
    B, T, N, H, k, S = st.B, st.T, c.num_heads, c.head_dim, st.k, _keys(c, st, kind)
    heads = (None, None, "q_heads", None)
    out = [_act("queries", (B, T, N, H), heads, k),
           _act("keys and values, whole", (B, S, H), (None, None, None), k, KEY_COPIES),
           _act("visibility mask", (B, T, S), (None, None, None), BOOL),
           _act("scores", (B, N, T, S), (None, "q_heads", None, None), F32, SCORE_COPIES),
           _act("attention output", (B, T, N, H), heads, k)]
    if st.converted:  # the quantized ring and cached entries read through compute-dtype copies
        E, _ = _entries(c, st, kind)
        out.append(_act("window ring in compute dtype", (B, c.compressed.window, H), (None, None, None), k))
        if E:
            out.append(_act("cached entries in compute dtype", (B, E, H), (None, "latent_seq", None), k))
    return tuple(out)


def _indexer(c: ModelConfig, st) -> tuple[Tensor, ...]:
    """CSA's indexer: its keys whole, per-head scores split by position, summed scores whole."""
    cc, B, T, k = c.compressed, st.B, st.T, st.k
    E, M = _entries(c, st, CompressKind.CSA)
    I, J = cc.index_heads, cc.index_head_dim
    out = [_act("index keys, whole", (B, E + M, J), (None, None, None), k, 2),
           _act("index scores per head", (B, T * I, _padded(E + M, st.tensor)), (None, None, "latent_seq"), F32,
                INDEX_SCORE_COPIES),
           _act("index scores, whole for the top-k", (B, T, E + M), (None, None, None), F32, 2),
           _act("visibility and chosen masks", (B, T, E + M), (None, None, None), BOOL, 2)]
    if st.converted:
        out.append(_act("cached index keys in compute dtype", (B, E, J), (None, "latent_seq", None), k))
    return tuple(out)


def _compressor(c: ModelConfig, st, kind: CompressKind) -> tuple[Tensor, ...]:
    """A CSA/HCA layer's compressor at width H: projections and the call's window grid."""
    B, T, C, k = st.B, st.T, c.head_dim, st.k
    r, m = c.compressed.ratio_of(kind), 2 if kind is CompressKind.CSA else 1
    _, M = _entries(c, st, kind)
    grid = (B, M, m * r, C)
    return (_act("compressor projections (kv and gate)", (B, T, m * C), (None, None, None), k, 2),
            _act("window grid rows and weights", grid, (None,) * 4, k, 2),
            _act("window grid gates and exponentials", grid, (None,) * 4, F32, 2))


def _mix(c: ModelConfig, st) -> tuple[Tensor, ...]:
    """A hyper-connection mix and merge: streams in and out, the fp32 flattened input and its norm."""
    n, D = c.hyper.mult if c.hyper else 1, c.hidden_size
    return (_act("streams in and merged", (st.B, st.T, n, D), (None,) * 4, st.k, 2),
            _act("mix input, fp32, and its RMS norm", (st.B, st.T, n * D), (None,) * 3, F32, 2))


# ---- collectives ----------------------------------------------------------------------------------


def step_collectives(c: ModelConfig, st) -> list[Collective]:
    """The collectives of one V4 step per device (module docstring)."""
    from dayzero.model.footprint_steps import _moe_collectives, _moe_layers

    B, T, D, k, L, cc = st.B, st.T, c.hidden_size, st.k, c.num_layers, c.compressed
    rows = ((B, T, D), (None, None, None))
    out = [Collective("embedding lookup: partial rows of the vocabulary-split table", Op.ALL_REDUCE, "vocab",
                      c.vocab_size, *rows, k),
           Collective("attention output projection (o_b): partial sums over the group split", Op.ALL_REDUCE,
                      "q_heads", c.num_heads, *rows, k, L)]
    for kind in _kinds(c):
        E, M = _entries(c, st, kind)
        if not E:
            continue
        layers = cc.kinds.count(kind)
        out.append(Collective("keys gathered whole (cached entries split by position)", Op.ALL_GATHER, "latent_seq",
                              E, (B, _keys(c, st, kind), c.head_dim), (None, None, None), k, layers))
        if kind is CompressKind.CSA:
            out += [Collective("index keys gathered whole", Op.ALL_GATHER, "latent_seq", E,
                               (B, E + M, cc.index_head_dim), (None, None, None), k, layers),
                    Collective("index scores gathered whole for the top-k", Op.ALL_GATHER, "latent_seq", E,
                               (B, T, E + M), (None, None, None), F32, layers)]
    if _moe_layers(c):
        out += _moe_collectives(c, st)
    out.append(Collective("logits gathered over the vocabulary split for sampling", Op.ALL_GATHER, "vocab",
                          c.vocab_size, (B, c.vocab_size), (None, None), F32))
    return out
