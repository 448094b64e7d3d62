"""DeepSeek-V4 for the deployment planner, in one place: its cache, its steps' buffers, collectives.

``footprint`` and ``footprint_steps`` hand V4 here; everything V4-specific the planner counts is in
this module. Letters: B rows, T new tokens, W window, H head width, N query heads, r a layer's
ratio (CSA 4, HCA 128), m = 2 for CSA's overlapping windows (1 for HCA), I x J index heads and
width, k = index_topk, n hyper-connection streams of D.

Cache (:func:`pool_specs`). The serving engine holds V4's cache as a paged pool
(``compressed_paged.PagedCompressedCache``, declared by ``paged_cache.paged_cache_specs``): the
compressed entries, which grow with the sequence, in pages; the window rings and compressor
states, a fixed size per sequence, in one row per serving slot. A page covers ``page`` positions
(:func:`page_size`: ``work.page_size`` rounded up to a multiple of every ratio, the serving
engine's default, ``paged_steps.default_page_size``: 128 for the published ratios 4 and 128), so
it holds page / r entries of a layer. A replica's ``ceil(batch / data)`` rows hold
``ceil(context / page)`` pages each: per CSA/HCA layer the entry pages [pages, page / r, H], per
CSA layer the index-key pages [pages, page / r, J]; and a slot per row: per layer the window ring
[slots, W, H], on CSA/HCA layers the compressor's state (kv and gate [slots, m*r, m*H]), on CSA
layers the indexer compressor's [slots, 2r, 2J] twice. Rings, entries and index keys are KV rows
(quantized with the KV cache, one fp32 scale per row); the states stay in the compute dtype. The
pages lie on ``latent_pages``, which every strategy keeps whole (``sharding.rules`` says why), so
each device of a replica holds them whole, as it holds the replica's slots (the rows are the
replica's own, so ``batch`` does not split again over ``data``: ``footprint._replica_pool``). The step's block
tables, slots, lengths and ``rope_len`` are not counted (small host inputs, as for every pool).
The prefix cache's snapshots of the slot rows (rings and states, 4 per slot by default) are
counted beside the pool, as for a hybrid's states (``footprint._snapshot_tensors``).
``Engine.generate``'s contiguous cache holds the same bytes per device where ``context`` is a
whole number of pages (its rows split over ``data``; ``tools/plan_measure`` compares both).

Steps (:func:`steps`), as the serving engine runs them: a replica's decode step (its rows, one
token each, over the widest table for the context: ``ServingConfig.max_table_pages`` pages, a
power of two and at least ``MIN_TABLE_PAGES``, so S = W_t x page positions, :func:`decode_positions`)
and a ``context``-long prompt's prefill chunks (:func:`chunk_shapes`): the first, which reads no
cache, and the later chunk shapes of ``ServingConfig.chunk_shape`` (T halved until T x W_t x page
is within the chunk budget) that no other one exceeds in both T and S: at 1M positions with pages
of 128, 512 tokens over 32 pages, 256 over 64, ..., 16 over 8192. A step reads its table's pages
whatever the row's length (``PagedCompressedCache.layer``: the entries [B, S / r, C]), so its
buffers depend on T and S, not on how far the prompt has got.

Buffers (:func:`step_stages`), what the reference path (``compressed.compressed_block``)
materialises, per layer kind; each stage also holds the step's outputs (every layer's new rows,
entries and compressor states, which the page and slot writes read after the forward), the MoE
output rows XLA holds for every layer (``footprint_steps._held``) and the residual streams
[B, T, n, D]. The pages and slots gathered for a layer (after its input, one layer's at a time)
are not a buffer of their own: XLA fuses the gathers into their readers (seen in the tiny V4
decode: the concatenations of the HCA keys and of the indexer's keys read the pages directly).

- attention: the keys [B, S_k, H] (S_k = W + T, the ring none for a chunk reading no cache, plus
  E + M = S / r + T // r + 1 cached and new entries where the layer reads them densely) whole on
  every device, the mask [B, T, S_k] and two fp32 score arrays [B, N, T, S_k] split by query
  head. HCA reads every visible entry densely, and so does CSA where that is cheaper (a prefill
  chunk: its indexer's picks only narrow the mask of the same dense softmax). Where gathering
  reads fewer rows (``compressed._gathers``: T x k < E + M, every decode step once more than k
  entries are addressed, short chunks over wide tables) CSA gathers each query's k picked rows
  [B, T, k, H] instead, and its scores and mask cover S_k + k keys;
- the CSA indexer (``compressor.index_select``), at two points: its keys [B, E + M, J] (the
  cached ones dequantized and concatenated with the call's) with the per-head scores
  [B, T*I, E + M] in fp32 (a chunk's two: the product and its relu-weighted copy, made in place
  for one token), whole on every device, then the head-summed scores [B, T, E + M] for the top-k
  (two fp32) with the visibility and chosen masks; the layer's attention keys are live beside the
  per-head scores' last copy and the top-k (XLA concatenates them once the indexer's keys are
  consumed). The indexer reads every index key the table addresses: at long contexts it is the
  decode step's peak;
- a compressor (``compressor.compress``; the main one of a CSA or HCA layer, C = H): the
  projections [B, T, m*C] (kv and gate) and the window grid of the call, M = T // r + 1 windows of
  m*r slots [B, M, m*r, C]: the gathered rows and their softmax weights in the compute dtype, the
  gates and their exponentials in fp32. The indexer's own compressor is the same at width J < H;
- a hyper-connection mix (``hyper.mix``/``merge``): the streams in and out [B, T, n, D] and the
  fp32 flattened input [B, T, n*D] with its RMS-normed copy;
- MoE and the output as for the other families (``footprint_steps``).

With ``expert`` > 1 XLA splits the step's tokens over the expert devices on the attention path
(the rows B where the expert size divides them, else the tokens T): the buffers above carry that
split (:func:`_rows`), the keys gathered whole included (their rows).

Collectives (:func:`step_collectives`): the tensor-parallel ones of the other families (embedding,
attention output projection, MoE, logits). The pages and slots are whole on every device of a
replica, so reading them moves nothing. Checked against XLA's compiled memory analysis of the
serving engine's forward over the paged pool on tiny V4 models (``tools/plan_check.V4_CASES``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from dayzero.model.compressed import _gathers
from dayzero.model.compressed_paged import page_multiple
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.paged_cache import paged_cache_specs
from dayzero.model.quant import KVQuant
from dayzero.sharding.planner import Collective, Op, Stage, Tensor, Workload

# Copies XLA materialised on tiny V4 models (module docstring; tools/plan_check.V4_CASES).
SCORE_COPIES = 2
INDEX_SCORE_COPIES = 2
F32, I32, BOOL = 4, 4, 1
# The serving engine's narrowest block table (``ServingConfig.min_table_pages``'s default, kept
# equal by a test): a step reads at least this many pages.
MIN_TABLE_PAGES = 4


# ---- the cache ------------------------------------------------------------------------------------


def page_size(config: ModelConfig, work: Workload) -> int:
    """Positions a page of V4's pool covers: ``work.page_size`` rounded up to a multiple of every
    compression ratio (``compressed_paged.page_multiple``), as the serving engine's default
    (``paged_steps.default_page_size``: 128 for the published ratios 4 and 128)."""
    return math.lcm(work.page_size, page_multiple(config))


def pool_specs(config: ModelConfig, rows: int, context: int, page: int, kv: KVQuant):
    """The spec tree of a replica's pool (module docstring), the serving engine's own declaration
    (``paged_cache_specs``: ``ceil(context / page)`` pages of ``page`` positions for each of
    ``rows`` rows, and ``rows`` slots of rings and compressor states), without the step's block
    tables, slots, lengths and ``rope_len`` (host inputs)."""
    per_row = -(-context // page)
    specs = paged_cache_specs(config, rows * per_row, page, batch=rows, table_width=per_row, kv_quant=kv,
                              state_slots=rows)
    return specs.replace(block_tables=None, slots=None, lengths=None, rope_len=None)


# ---- the steps ------------------------------------------------------------------------------------


def _bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum) (``engine.generate.bucket``)."""
    return 1 << max(n - 1, minimum - 1).bit_length()


def _table_width(work: Workload, page: int, pages: int) -> int:
    """The bucketed table width addressing ``pages`` pages (``ServingConfig.table_width``): a
    power of two, at least ``MIN_TABLE_PAGES``, at most the widest (for ``work.context``)."""
    widest = max(_bucket(-(-work.context // page), 1), MIN_TABLE_PAGES)
    return min(max(_bucket(pages, 1), MIN_TABLE_PAGES), widest)


def decode_positions(work: Workload, page: int) -> int:
    """Positions a decode step's table addresses per row: the widest table for ``work.context``
    (``ServingConfig.max_table_pages``) times the page."""
    return _table_width(work, page, -(-work.context // page)) * page


def _chunk(work: Workload, page: int, start: int, remaining: int) -> tuple[int, int | None]:
    """(T, W) of the next prefill chunk of a prompt with ``start`` positions cached and
    ``remaining`` to go, as ``ServingConfig.chunk_shape`` shapes it: W None for the first chunk
    (it reads no cache), else T halved until T x W x page is within the chunk budget (or T is
    ``min_chunk``)."""
    T = min(work.prefill_chunk, _bucket(remaining, work.min_chunk))
    if start == 0:
        return T, None
    while True:
        W = _table_width(work, page, -(-(start + min(T, remaining)) // page))
        if T <= work.min_chunk or T * W * page <= work.chunk_budget:
            return T, W
        T //= 2


@functools.lru_cache(maxsize=64)
def prompt_chunks(work: Workload, page: int) -> tuple[tuple[int, int | None], ...]:
    """Every distinct (T, W) of a ``work.context``-long prompt's chunks, in order. A run of equal
    chunks is stepped over at once: the shape stays while a whole chunk remains and the next one
    still ends inside the table (T and W depend on nothing else)."""
    start, shapes = 0, {}
    while start < work.context:
        remaining = work.context - start
        T, W = _chunk(work, page, start, remaining)
        shapes[(T, W)] = None
        run = 1 if W is None else max(1, min((W * page - start) // T, remaining // T))
        start += run * T
    return tuple(shapes)


def chunk_shapes(work: Workload, page: int) -> tuple[tuple[int, int], ...]:
    """(T, S) of the prefill chunks the planner sizes: the prompt's first chunk (S = 0: it reads
    no cache) and each later chunk shape that no other one exceeds in both its tokens T and the
    positions S = W x page its table addresses (:func:`prompt_chunks`). A step's buffers grow
    with T, with S and with T x S; along that front the serving engine trades one for the other
    within the chunk budget (a full chunk over a narrow table, ..., ``min_chunk`` tokens over the
    widest)."""
    (first, _), *later = prompt_chunks(work, page)
    cached = [(T, W * page) for T, W in later]
    front = [(T, S) for T, S in cached if not any(t >= T and s >= S and (t, s) != (T, S) for t, s in cached)]
    return ((first, 0), *sorted(front, reverse=True))


def steps(config: ModelConfig, work: Workload, rows: int, sizes: dict) -> dict:
    """The decode step (``rows`` rows of one token over the widest table, :func:`decode_positions`)
    and the prefill chunks of :func:`chunk_shapes` (one row; S = 0: no cache read)."""
    from dayzero.model.footprint_steps import Step

    page = page_size(config, work)
    return {"decode": [Step(B=rows, T=1, S=decode_positions(work, page), **sizes)],
            "prefill": [Step(B=1, T=T, S=S, **sizes) for T, S in chunk_shapes(work, page)]}


def _act(name: str, shape: tuple[int, ...], axes: tuple, itemsize: int, count: int = 1) -> Tensor:
    from dayzero.model.footprint_steps import _act as act

    return act(name, shape, axes, itemsize, count)


def _kinds(c: ModelConfig) -> list[CompressKind]:
    """The layer kinds present, in the order of their first layer."""
    return list(dict.fromkeys(c.compressed.kinds))


def _entries(c: ModelConfig, st, kind: CompressKind) -> tuple[int, int]:
    """(E, M) of a layer of ``kind``: the entries the step's table addresses, S / r (a page holds
    a whole number of them), and the call's window grid T // r + 1 (both 0 on a sliding layer)."""
    r = c.compressed.ratio_of(kind)
    return (0, 0) if r is None else (-(-st.S // r), st.T // r + 1)


def _picks(c: ModelConfig, st, kind: CompressKind) -> int:
    """The entry rows each query of a CSA layer gathers (``compressed._gathers``: k =
    min(index_topk, E + M) where T x k is fewer rows than the E + M a dense pass reads); 0 where
    the layer reads its entries densely (HCA, a CSA prefill chunk, a sliding layer)."""
    if kind is not CompressKind.CSA:
        return 0
    E, M = _entries(c, st, kind)
    k = min(c.compressed.index_topk, E + M)
    return k if _gathers(st.T, k, E + M) else 0


def _keys(c: ModelConfig, st, kind: CompressKind) -> int:
    """S_k: the keys a layer of ``kind`` concatenates for its queries (module docstring): the ring
    (none for a chunk reading no cache), the new rows, and the cached and new entries unless the
    layer gathers its picks (:func:`_picks`)."""
    E, M = _entries(c, st, kind)
    entries = 0 if _picks(c, st, kind) else E + M
    return (c.compressed.window if st.S else 0) + st.T + entries


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
        stages.append(Stage(f"{label} attention over window and entries", base + _attention(c, st, kind)))
        if kind is not CompressKind.SLIDING:
            stages.append(Stage(f"{label} compressor window grid", base + _compressor(c, st, kind)))
        if kind is CompressKind.CSA:
            # XLA concatenates the layer's keys (which need no picks) once the indexer's own keys
            # are consumed: they are live beside the per-head scores' last copy and the top-k
            # (seen in the tiny V4 steps' buffer assignments).
            keys = _act("attention keys", (st.B, _keys(c, st, kind), c.head_dim), (b, None, None), st.k)
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


def _attention(c: ModelConfig, st, kind: CompressKind) -> tuple[Tensor, ...]:
    """One layer's softmax over [ring | new rows | cached entries | new entries] (S_k keys), or on
    a CSA layer that gathers its picks, over [ring | new rows] and each query's k picked rows."""
    B, T, N, H, k, S = st.B, st.T, c.num_heads, c.head_dim, st.k, _keys(c, st, kind)
    b, t = _rows(st)
    heads = (b, t, "q_heads", None)
    picks = _picks(c, st, kind)
    out = [_act("queries", (B, T, N, H), heads, k),
           _act("keys and values", (B, S, H), (b, None, None), k),
           _act("visibility mask", (B, T, S + picks), (b, t, None), BOOL),
           _act("scores", (B, N, T, S + picks), (b, "q_heads", t, None), F32, SCORE_COPIES),
           _act("attention output", (B, T, N, H), heads, k)]
    if picks:
        out.append(_act("picked entry rows", (B, T, picks, H), (b, t, None, None), k))
    return tuple(out)


def _indexer(c: ModelConfig, st) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """CSA's indexer, two points: its per-head scores (with its keys), then the head-summed scores
    whole for the top-k (the per-head scores and the keys freed by then)."""
    cc, B, T, k = c.compressed, st.B, st.T, st.k
    E, M = _entries(c, st, CompressKind.CSA)
    I, J = cc.index_heads, cc.index_head_dim
    b, t = _rows(st)
    keys = _act("index keys", (B, E + M, J), (b, None, None), k)
    copies = INDEX_SCORE_COPIES if T > 1 else 1  # one token's relu-weighted copy is made in place
    scores = (keys, _act("index scores per head", (B, T * I, E + M), (b, t, None), F32, copies))
    top_k = (_act("index scores for the top-k", (B, T, E + M), (b, t, None), F32, 2),
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

    B, T, D, k, L = st.B, st.T, c.hidden_size, st.k, c.num_layers
    rows = ((B, T, D), (None, None, None))
    out = [Collective("embedding lookup: partial rows of the vocabulary-split table", Op.ALL_REDUCE, "vocab",
                      c.vocab_size, *rows, k),
           Collective("attention output projection (o_b): partial sums over the group split", Op.ALL_REDUCE,
                      "q_heads", c.num_heads, *rows, k, L)]
    if _moe_layers(c):
        out += _moe_collectives(c, st)
    out.append(Collective("logits gathered over the vocabulary split for sampling", Op.ALL_GATHER, "vocab",
                          c.vocab_size, (B, c.vocab_size), (None, None), F32))
    return out
