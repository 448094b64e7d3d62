"""DeepSeek-V4 for the deployment planner, in one place: its cache, its steps' buffers, collectives.

``footprint`` and ``footprint_steps`` hand V4 here; everything V4-specific the planner counts is in
this module. Letters: B rows, T new tokens, W window, H head width, N query heads, r a layer's
ratio (CSA 4, HCA 128), m = 2 for CSA's overlapping windows (1 for HCA), I x J index heads and
width, n hyper-connection streams of D.

Cache (:func:`slot_cache_specs`). The serving engine holds V4's caches as a slot cache
(``compressed_slots``): one row of ``compressed_cache.cache_specs`` per serving slot, sized for
``work.context`` positions (no pages). A replica's ``ceil(batch / data)`` rows hold, per layer,
the window ring [rows, W, H]; on CSA/HCA layers the entries [rows, ceil(context / r), H] and the
compressor's state (kv and gate [rows, m*r, m*H]); on CSA layers the index keys [rows,
ceil(context / r), J] and the indexer compressor's state [rows, 2r, 2J] twice. Window rows,
entries and index keys are KV rows (quantized with the KV cache, one fp32 scale per row); the
states stay in the compute dtype. They are laid out by their own logical axes on the replica's
devices (:func:`on_replica`: the rows are the replica's own, so ``batch`` does not split again
over ``data``), as ``compressed_cache.cache_specs`` declares them: today by row only, every leaf
whole on each ``tensor`` device (a declared position split, ``latent_seq``, is followed too:
:func:`_position_axis`). ``Engine.generate``'s contiguous cache is the same tree over its whole
batch, ``batch`` split over ``data``: the same bytes per device. The step's slot indices, lengths
and ``rope_len`` are not counted (small host inputs, as the page pools' tables).

Steps (:func:`steps`), as the serving engine runs them with a slot cache: a replica's decode step
(its rows, one token each, over their slots' rows of ``context`` positions) and a
``context``-long prompt's prefill chunks (:func:`chunk_shapes`): the first, which reads no cache,
and the chunks after it, which read the slot's whole row and which the serving engine shrinks so
that T x context stays within its chunk budget (16 tokens at 1M positions). The reference path
(``compressed.compressed_block``) attends over the whole buffers whatever the row's length:
[window ring | new rows | every cached entry | the call's window grid], so a chunk's buffers
depend on T and on the context, not on how far the prompt has got.

Buffers (:func:`step_stages`), what the reference path materialises, per layer kind; each stage
also holds the step's outputs (every layer's new rows, entries and compressor states, which the
slot write reads after the forward), the MoE output rows XLA holds for every layer
(``footprint_steps._held``) and the residual streams [B, T, n, D]:

- the layer's rows gathered from the step's slots (``SlotCache.layer``, one layer's at a time, as
  stored): materialised where the cached entries are split by position (XLA relays them out
  before concatenating); elsewhere the gather fuses into the keys' concatenation;

- attention: the keys [B, S_k, H] (S_k = W + T, plus ceil(context / r) + T // r + 1 on CSA/HCA
  layers) whole on every device, concatenated (one copy; where the cached entries are split by
  position XLA gathers the concatenation and relays it out: :data:`KEY_COPIES`), the mask
  [B, T, S_k] and two fp32 score arrays [B, N, T, S_k] split by query head. HCA reads every
  visible entry, and CSA too: its indexer's picks only narrow the mask of the same dense softmax;
- the CSA indexer (``compressor.index_select``), at two points: its keys [B, E + M, J] (the cached
  ones dequantized and concatenated with the call's) with the per-head scores [B, T*I, E + M] in
  fp32 (a chunk's two: the product and its relu-weighted copy, made in place for one token; the
  index heads whole on every device, the positions split where the cached keys are, E + M padded
  to a multiple of ``tensor``), then
  the head-summed scores [B, T, E + M] whole for the top-k (two fp32) with the visibility and
  chosen masks; the layer's attention keys are live beside the per-head scores' last copy and the
  top-k (XLA concatenates them once the indexer's keys are consumed);
- a compressor (``compressor.compress``; the main one of a CSA or HCA layer, C = H): the
  projections [B, T, m*C] (kv and gate) and the window grid of the call, M = T // r + 1 windows of
  m*r slots [B, M, m*r, C]: the gathered rows and their softmax weights in the compute dtype, the
  gates and their exponentials in fp32. The indexer's own compressor is the same at width J < H;
- a hyper-connection mix (``hyper.mix``/``merge``): the streams in and out [B, T, n, D] and the
  fp32 flattened input [B, T, n*D] with its RMS-normed copy;
- a quantized cache: the gathered ring, entries and index keys read through compute-dtype
  copies, one layer's at a time (counted with the gathered rows);
- MoE and the output as for the other families (``footprint_steps``).

With ``expert`` > 1 XLA splits the step's tokens over the expert devices on the attention path
(the rows B where the expert size divides them, else the tokens T): the buffers above carry that
split (:func:`_rows`), the keys gathered "whole" included (their rows).

Collectives (:func:`step_collectives`): as the other families' tensor-parallel ones (embedding,
attention output projection, MoE, logits), plus, where the cached entries are split by position,
per CSA/HCA layer the keys gathered whole (all-gather) and per CSA layer the index keys and the
head-summed index scores gathered whole. The all-to-alls XLA adds to relay out the gathered keys
are not counted. Checked against XLA's compiled memory analysis and HLO of the serving engine's
forward over a slot cache on tiny V4 models (``tools/plan_check.V4_CASES``).
"""

from __future__ import annotations

import dataclasses
import functools

from dayzero.model import compressed_slots
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.quant import KVQuant
from dayzero.sharding.planner import Collective, Op, Stage, Tensor, Workload

# Copies XLA materialised on tiny V4 models (module docstring; tools/plan_check.V4_CASES).
KEY_COPIES = 2  # the keys gathered whole and relaid out (where the entries are split by position)
SCORE_COPIES = 2
INDEX_SCORE_COPIES = 2
F32, I32, BOOL = 4, 4, 1


# ---- the cache ------------------------------------------------------------------------------------


def slot_cache_specs(config: ModelConfig, rows: int, context: int, kv: KVQuant):
    """The spec tree of a replica's slot cache (module docstring), the serving engine's own
    declaration (``compressed_slots.slot_cache_specs``: ``rows`` slots of ``context`` positions),
    without the step's slot indices, lengths and ``rope_len`` (host inputs)."""
    return compressed_slots.slot_cache_specs(config, rows, context, kv_quant=kv).replace(
        slots=None, lengths=None, rope_len=None)


def on_replica(t: Tensor) -> Tensor:
    """A cache tensor of a replica's own rows: its ``batch`` axis is whole on the replica's
    devices (a replica is its ``tensor`` x ``expert`` devices; ``data`` splits the replicas)."""
    return dataclasses.replace(t, axes=tuple(None if a == "batch" else a for a in t.axes))


# ---- the steps ------------------------------------------------------------------------------------


def _bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum) (``engine.generate.bucket``)."""
    return 1 << max(n - 1, minimum - 1).bit_length()


def chunk_shapes(work: Workload) -> tuple[tuple[int, bool], ...]:
    """(T, reads the cache) of a ``work.context``-long prompt's prefill chunks with the largest
    buffers, as the serving engine shapes them with a slot cache (``ServingConfig.chunk_shape``):
    the first chunk, ``min(prefill_chunk, bucket(context))`` tokens reading no cache, and, if the
    prompt is longer, a chunk after it reading the slot's whole row, shrunk to the largest chunk
    size T with T x context within the chunk budget (``ServingConfig.slot_chunk``, at least
    ``min_chunk``)."""
    first = min(work.prefill_chunk, _bucket(work.context, work.min_chunk))
    if work.context <= first:
        return ((first, False),)
    sizes = [1 << e for e in range(work.min_chunk.bit_length() - 1, work.prefill_chunk.bit_length())]
    slot = max((T for T in sizes if T * work.context <= work.chunk_budget), default=work.min_chunk)
    return (first, False), (min(first, slot, _bucket(work.context - first, work.min_chunk)), True)


def steps(work: Workload, rows: int, sizes: dict) -> dict:
    """The decode step (``rows`` rows of one token over the slot cache of ``work.context``
    positions) and the prefill chunks of :func:`chunk_shapes` (one row; S = 0: no cache read)."""
    from dayzero.model.footprint_steps import Step

    return {"decode": [Step(B=rows, T=1, S=work.context, **sizes)],
            "prefill": [Step(B=1, T=T, S=work.context if cached else 0, **sizes) for T, cached in chunk_shapes(work)]}


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
    """S_k: the keys a query of a layer of ``kind`` is scored against (module docstring); a chunk
    reading no cache (S = 0) has no ring and no cached entries."""
    E, M = _entries(c, st, kind)
    return (c.compressed.window if st.S else 0) + st.T + E + M


def _rows(st) -> tuple[str | None, str | None]:
    """Logical axes of the B and T dims of the attention path's buffers. With ``expert`` > 1 XLA
    splits the step's tokens over the expert devices there (seen in the compiled HLO: B where the
    expert size divides it, else T), so they carry ``experts``, the logical axis the rules put on
    the ``expert`` mesh axis; else they are whole."""
    if st.expert > 1 and st.B % st.expert == 0:
        return "experts", None
    if st.expert > 1 and st.T % st.expert == 0:
        return None, "experts"
    return None, None


@functools.lru_cache(maxsize=64)
def _position_axis(c: ModelConfig) -> str | None:
    """The logical axis the cache declares for the positions of the entries and index keys
    (``compressed_cache.cache_specs``): ``latent_seq`` if they split by position over
    ``tensor``, None if each device holds them whole (the declaration as it stands: by row only)."""
    kind = next((k for k in c.compressed.kinds if k is not CompressKind.SLIDING), None)
    if kind is None:
        return None
    layer = compressed_slots.slot_cache_specs(c, 1, 1).layers[c.compressed.kinds.index(kind)]
    entries = getattr(layer.entries, "values", layer.entries)
    return entries.axes[1]


def _split(c: ModelConfig, st, E: int) -> bool:
    """Whether a layer's E cached entries (and index keys) are split by position on this step's
    devices: declared so (:func:`_position_axis`) and ``tensor`` divides them (``spec_for``)."""
    return bool(st.S and E and _position_axis(c) and st.tensor > 1 and E % st.tensor == 0)


def _padded(n: int, ways: int) -> int:
    """``n`` rounded up to a multiple of ``ways`` (XLA pads a dimension it splits unevenly)."""
    return -(-n // ways) * ways


def step_stages(c: ModelConfig, st) -> list[Stage]:
    """The stages of one V4 step (module docstring); each includes the step's outputs, the held
    MoE rows and the residual streams."""
    from dayzero.model.footprint_steps import LOGIT_COPIES, _held, _moe, _moe_layers

    n, D = c.hyper.mult if c.hyper else 1, c.hidden_size
    b, t = _rows(st)
    base = _outputs(c, st) + _held(c, st) + (_act("residual streams", (st.B, st.T, n, D), (b, t, None, None), st.k),)
    stages = []
    for kind in _kinds(c):
        label = {CompressKind.SLIDING: "sliding", CompressKind.CSA: "CSA", CompressKind.HCA: "HCA"}[kind]
        if st.S:
            stages.append(Stage(f"{label} layer's rows gathered from their slots", base + _gathered(c, st, kind)))
        stages.append(Stage(f"{label} attention over window and entries", base + _attention(c, st, kind)))
        if kind is not CompressKind.SLIDING:
            stages.append(Stage(f"{label} compressor window grid", base + _compressor(c, st, kind)))
        if kind is CompressKind.CSA:
            # XLA concatenates the layer's keys (which need no picks) once the indexer's own keys
            # are consumed: they are live beside the per-head scores' last copy and the top-k
            # (seen in the tiny V4 steps' buffer assignments).
            keys = _act("attention keys, whole", (st.B, _keys(c, st, kind), c.head_dim), (_rows(st)[0], None, None),
                        st.k)
            scores, top_k = _indexer(c, st)
            last = dataclasses.replace(scores[-1], count=1)
            stages += [Stage("CSA indexer scores per head", base + scores),
                       Stage("CSA indexer scores beside the attention keys", base + (last, keys)),
                       Stage("CSA indexer top-k", base + top_k + (keys,))]
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
    b, t = _rows(st)  # split like the attention path that makes them
    per_kind = {kind: cc.kinds.count(kind) for kind in _kinds(c)}
    out = [_act("sampled tokens and log-probabilities", (B, 2), (None, None), F32),
           _act("new key rows", (B, T, H), (b, t, None), k, c.num_layers)]
    for kind, layers in per_kind.items():
        r = cc.ratio_of(kind)
        if r is None:
            continue
        m, (_, M) = (2 if kind is CompressKind.CSA else 1), _entries(c, st, kind)
        out += [_act("new entries", (B, M, H), (b, None, None), k, layers),
                _act("new entry ids", (B, M), (b, None), I32, layers),
                _act("compressor state (kv and gate)", (B, m * r, m * H), (b, None, None), k, 2 * layers)]
        if kind is CompressKind.CSA:
            J = cc.index_head_dim
            out += [_act("new index keys", (B, M, J), (b, None, None), k, layers),
                    _act("new index key ids", (B, M), (b, None), I32, layers),
                    _act("indexer compressor state", (B, 2 * r, 2 * J), (b, None, None), k, 2 * layers)]
    return tuple(out)


def _gathered(c: ModelConfig, st, kind: CompressKind) -> tuple[Tensor, ...]:
    """One layer's cache rows gathered from the step's slots (``SlotCache.layer``, after the
    layer's input: one layer's at a time), as stored and laid out like the slot cache (module
    docstring): ring, entries, index keys (a quantized cache's one-byte values and fp32 scales,
    and their compute-dtype copies) and the compressor states. Materialised where the entries are
    split by position (XLA relays the gathered rows out before it concatenates them); elsewhere
    the gather fuses into the keys' concatenation, and a chunk with S = 0 reads no cache."""
    cc, B, H, k = c.compressed, st.B, c.head_dim, st.k
    E, _ = _entries(c, st, kind)
    if not _split(c, st, E):  # XLA fuses the gather into the keys' concatenation (S = 0: reads none)
        return ()
    r = cc.ratio_of(kind)
    b, _ = _rows(st)
    rows = [("window ring", (B, cc.window, H), (b, None, None))]
    states = []
    if r is not None:
        m = 2 if kind is CompressKind.CSA else 1
        rows.append(("entries", (B, E, H), (b, _position_axis(c), None)))
        states.append(("compressor state", (B, m * r, m * H)))
    if kind is CompressKind.CSA:
        J = cc.index_head_dim
        rows.append(("index keys", (B, E, J), (b, _position_axis(c), None)))
        states.append(("indexer compressor state", (B, 2 * r, 2 * J)))
    item = 1 if st.converted else k
    out = [_act(f"{name}: a layer's rows gathered from their slots", shape, axes, item) for name, shape, axes in rows]
    if st.converted:  # read through compute-dtype copies (one layer's), which the keys concatenate
        out += [_act(f"{name}: gathered scales", shape[:-1], axes[:-1], F32) for name, shape, axes in rows]
        out += [_act(f"{name} in compute dtype", shape, axes, k) for name, shape, axes in rows]
    out += [_act(f"{name}: gathered (kv and gate)", shape, (b, None, None), k, 2) for name, shape in states]
    return tuple(out)


def _attention(c: ModelConfig, st, kind: CompressKind) -> tuple[Tensor, ...]:
    """One layer's dense softmax over [ring | new rows | cached entries | new entries]."""
    B, T, N, H, k, S = st.B, st.T, c.num_heads, c.head_dim, st.k, _keys(c, st, kind)
    b, t = _rows(st)
    heads = (b, t, "q_heads", None)
    E, _ = _entries(c, st, kind)
    out = [_act("queries", (B, T, N, H), heads, k),
           _act("keys and values, whole", (B, S, H), (b, None, None), k, KEY_COPIES if _split(c, st, E) else 1),
           _act("visibility mask", (B, T, S), (b, t, None), BOOL),
           _act("scores", (B, N, T, S), (b, "q_heads", t, None), F32, SCORE_COPIES),
           _act("attention output", (B, T, N, H), heads, k)]
    return tuple(out)


def _indexer(c: ModelConfig, st) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """CSA's indexer, two points: its per-head scores (split by position, with its keys), then the
    head-summed scores whole for the top-k (the per-head scores and the keys freed by then)."""
    cc, B, T, k = c.compressed, st.B, st.T, st.k
    E, M = _entries(c, st, CompressKind.CSA)
    I, J = cc.index_heads, cc.index_head_dim
    b, t = _rows(st)
    keys = _act("index keys, whole", (B, E + M, J), (b, None, None), k)
    positions = (_padded(E + M, st.tensor), _position_axis(c)) if _split(c, st, E) else (E + M, None)
    copies = INDEX_SCORE_COPIES if T > 1 else 1  # one token's relu-weighted copy is made in place
    scores = (keys, _act("index scores per head", (B, T * I, positions[0]), (b, t, positions[1]), F32, copies))
    top_k = (_act("index scores, whole for the top-k", (B, T, E + M), (b, t, None), F32, 2),
             _act("visibility and chosen masks", (B, T, E + M), (b, t, None), BOOL, 2))
    return scores, top_k


def _compressor(c: ModelConfig, st, kind: CompressKind) -> tuple[Tensor, ...]:
    """A CSA/HCA layer's compressor at width H: projections and the call's window grid."""
    B, T, C, k = st.B, st.T, c.head_dim, st.k
    r, m = c.compressed.ratio_of(kind), 2 if kind is CompressKind.CSA else 1
    _, M = _entries(c, st, kind)
    b, t = _rows(st)
    grid = (B, M, m * r, C)
    return (_act("compressor projections (kv and gate)", (B, T, m * C), (b, t, None), k, 2),
            _act("window grid rows and weights", grid, (b, None, None, None), k, 2),
            _act("window grid gates and exponentials", grid, (b, None, None, None), F32, 2))


def _mix(c: ModelConfig, st) -> tuple[Tensor, ...]:
    """A hyper-connection mix and merge: streams in and out, the fp32 flattened input and its norm."""
    n, D = c.hyper.mult if c.hyper else 1, c.hidden_size
    b, t = _rows(st)
    return (_act("streams in and merged", (st.B, st.T, n, D), (b, t, None, None), st.k, 2),
            _act("mix input, fp32, and its RMS norm", (st.B, st.T, n * D), (b, t, None), F32, 2))


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
    b, t = _rows(st)
    for kind in _kinds(c):
        E, M = _entries(c, st, kind)
        if not E:
            continue
        layers = cc.kinds.count(kind)
        if not _split(c, st, E):  # whole on every device: nothing to gather
            continue
        split = _position_axis(c)
        out.append(Collective("keys gathered whole (cached entries split by position)", Op.ALL_GATHER, split, E,
                              (B, _keys(c, st, kind), c.head_dim), (b, None, None), k, layers))
        if kind is CompressKind.CSA:
            out += [Collective("index keys gathered whole", Op.ALL_GATHER, split, E,
                               (B, E + M, cc.index_head_dim), (b, None, None), k, layers),
                    Collective("index scores gathered whole for the top-k", Op.ALL_GATHER, split, E,
                               (B, T, E + M), (b, t, None), F32, layers)]
    if _moe_layers(c):
        out += _moe_collectives(c, st)
    out.append(Collective("logits gathered over the vocabulary split for sampling", Op.ALL_GATHER, "vocab",
                          c.vocab_size, (B, c.vocab_size), (None, None), F32))
    return out
