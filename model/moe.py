"""The Mixture-of-Experts feed-forward block: route each token to C of E experts, run only those.

``moe`` takes a layer's :class:`MoEWeights` and hidden states [B,T,D]:

1. Route: the router scores every token against every expert and keeps C experts per token,
   with their weights (:func:`route`; the scheme is set by :class:`MoEConfig`). A hash-routed
   layer (DeepSeek-V4's first ones) takes the C experts from a token-id table instead, so
   :func:`moe` then needs the token ids.
2. Dispatch: the B*T*C (token, expert) pairs are sorted by expert, so that each expert's rows
   are contiguous, and a histogram of the choices gives each expert's group size
   (:func:`sort_by_expert`).
3. Grouped SwiGLU: each group of rows goes through its own expert (:func:`grouped_swiglu`, in
   one of two ways, :class:`GroupedMatmul`). Quantized expert stacks are dequantized piecewise,
   never whole: one expert at a time in the expert loop, one tile of every expert at a time
   on the ``ragged_dot`` path (:func:`ragged_matmul`, :data:`TILE_BYTES`). The gating is
   silu(gate) * up, or the block's variant (:func:`gated`: gpt-oss's clamped SwiGLU), and
   experts with biases (gpt-oss) add them after each projection, on every path.
4. Combine: the rows are put back in pair order and summed per token with the routing weights;
   shared experts (DeepSeek-V3), if any, run on every token and are added.

Work is O(B*T*C*D*F) for the experts plus O(B*T*E*D) for the router and O(E) for the histogram,
so it grows with the experts per token, not with the number of experts. A decode step reads
only the weights of the experts its tokens chose.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp

from dayzero.model.config import MoEConfig, RouterScore
from dayzero.model.quant import QuantizedArray, dequantized
from dayzero.model.quant_matmul import linear
from dayzero.model.weights import MoEWeights


class GroupedMatmul(enum.Enum):
    """How the grouped SwiGLU runs each expert over its rows.

    ``EXPERT_LOOP`` loops over the experts that received rows, and runs each one's rows in
    fixed-size chunks: only chosen experts are computed, on every platform. ``RAGGED_DOT`` uses
    ``jax.lax.ragged_dot``, which TPUs run as a grouped matmul; XLA:CPU expands it into a product
    with every expert for every row (measured here: 512 rows x [E,256,256] take 15 ms at E=8 and
    690 ms at E=256), and jaxlib 0.10's XLA:GPU is reported to do the same.

    ``ragged_dot`` takes every expert's matrix at once, in the compute dtype. A float stack is
    passed whole; a quantized one is dequantized and multiplied in tiles of every expert, cut
    along the model width D, of at most :data:`TILE_BYTES` (:func:`ragged_swiglu`), so no
    temporary holds the dequantized stack. On XLA:CPU each step still pays the expansion above
    (measured, 256 rows x int8 [64,512,512] on 2 shared cores: 0.8-1.1 s whole or in 2 or 4 tiles,
    float 0.6-0.9 s, the expert loop 0.03 s; temporaries 232 MiB whole, 80 MiB in 4 tiles, most
    of it the expansion's masked copies of the rows).
    """

    EXPERT_LOOP = "expert_loop"
    RAGGED_DOT = "ragged_dot"


# Per-platform default (jax.default_backend() names); see GroupedMatmul for why.
DEFAULT_GROUPED_MATMUL = {
    "cpu": GroupedMatmul.EXPERT_LOOP, "gpu": GroupedMatmul.EXPERT_LOOP, "tpu": GroupedMatmul.RAGGED_DOT,
}

# Rows per matmul in the expert loop, largest first: a group of g rows runs as g // 64 chunks of
# 64, then up to 7 of 8, then up to 7 single rows, so no padding row is ever computed. Chunk
# size barely matters on CPU (measured: within noise for 64/16/4/1, 128/32/8/1 and 32/8/1);
# what costs is reading each active expert's weights, once per expert.
CHUNKS = (64, 8, 1)

# Most bytes of dequantized weights (counted in fp32) that one step of the ragged_dot path makes
# from a quantized expert stack. ragged_dot needs every expert's matrix in the compute dtype at
# once, and dequantizing a whole stack would be a temporary the size of the float layer: 7.5 GB
# in bf16 for one DeepSeek-V3 matrix [256, 7168, 2048], nearly half a 16 GiB accelerator. 64 MiB
# is under 0.5% of the smallest accelerator memory targeted, yet still a tile of 16M weights, so
# the per-step cost (loop, re-reading the rows, the fp32 partial sums) stays small beside the
# weight read at decode sizes. A tile is at least 128 rows of D by all of F (see ragged_swiglu),
# so the budget holds while a device's E x F <= 128K (Mixtral 8 x 14336, Qwen3-30B-A3B 128 x 768;
# DeepSeek-V3 256 x 2048 from 4 devices on); one device of DeepSeek-V3 gets 256 MiB tiles, still
# 1/56 of the whole stack.
TILE_BYTES = 64 * 2**20
# Tiles are whole multiples of this many rows / columns (and of the scale block): MXU-shaped.
TILE_ALIGN = 128


def router_logits(router: jax.Array, x: jax.Array) -> jax.Array:
    """Router logits [N,E] in fp32 of tokens ``x`` [N,D] (router [D,E])."""
    return jnp.einsum("nd,de->ne", x, router, preferred_element_type=jnp.float32)


def _best_groups_only(choice: jax.Array, config: MoEConfig) -> jax.Array:
    """``choice`` [N,E] with every expert outside the token's best groups set to -inf.

    A group's rank is the sum of its two best choice scores (DeepSeek-V3's group-limited routing).
    """
    N, E = choice.shape
    G = config.num_groups
    grouped = choice.reshape(N, G, E // G)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N,G]
    _, best = jax.lax.top_k(group_scores, config.groups_per_token)
    keep = jnp.any(jax.nn.one_hot(best, G, dtype=jnp.bool_), axis=1)  # [N,G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(N, E)


def router_scores(logits: jax.Array, score: RouterScore) -> jax.Array:
    """Per-expert scores [N,E] fp32 from router ``logits`` [N,E] (see :class:`RouterScore`)."""
    if score is RouterScore.SOFTMAX:
        return jax.nn.softmax(logits, axis=-1)
    if score is RouterScore.SIGMOID:
        return jax.nn.sigmoid(logits)
    # DeepSeek-V4 (HF SqrtSoftplusActivation). torch's softplus returns x itself above 20, jax's
    # log(1 + e^x) differs from x there by < e^-20: below fp32 rounding.
    return jnp.sqrt(jax.nn.softplus(logits))


def _hashed_experts(tid2eid: jax.Array, tokens: jax.Array | None, n: int, c: int) -> jax.Array:
    """The experts [n,C] of a hash-routed layer: row ``tokens[i]`` of the table ``tid2eid`` [V,C]."""
    if tokens is None:
        raise ValueError("this MoE layer routes by token id (its weights have tid2eid): pass tokens, "
                         "the token ids of the hidden states")
    if tokens.size != n or tid2eid.shape[-1] != c:
        raise ValueError(f"hash routing: {tokens.size} token ids for {n} hidden states, tid2eid {tid2eid.shape} "
                         f"for {c} experts per token; pass the ids of the same tokens, [B,T] like x's [B,T,D]")
    # Clipped, not filled: an out-of-range id (a padding token) must still give valid expert ids.
    return jnp.take(tid2eid, tokens.reshape(-1), axis=0, mode="clip")


def route(router: jax.Array, config: MoEConfig, x: jax.Array, score_bias: jax.Array | None = None,
          router_bias: jax.Array | None = None, tokens: jax.Array | None = None,
          tid2eid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Each token's C experts [N,C] (int32, best first) and their fp32 weights [N,C]; ``x`` is [N,D].

    See :class:`MoEConfig` for the scheme; ``score_bias`` [E] is required iff ``config.score_bias``
    (and the layer is not hash-routed), ``router_bias`` [E] (added to the logits) iff
    ``config.router_bias``. ``tid2eid`` [V,C] (a hash-routed layer, DeepSeek-V4): the experts are
    the table's row for each token id of ``tokens`` [N] (required then; ignored otherwise), in the
    table's order, and weighted by their scores as chosen ones are.
    """
    hashed = tid2eid is not None
    if (score_bias is not None) != (config.score_bias and not hashed):
        raise ValueError(f"score_bias given: {score_bias is not None}, config.score_bias: {config.score_bias}"
                         + (" (a hash-routed layer has none)" if hashed else ""))
    if (router_bias is not None) != config.router_bias:
        raise ValueError(f"router_bias given: {router_bias is not None}, config.router_bias: {config.router_bias}")
    logits = router_logits(router, x)
    if router_bias is not None:  # gpt-oss: a biased linear router, so the weights move with the choice
        logits = logits + router_bias.astype(jnp.float32)
    scores = router_scores(logits, config.score)
    if hashed:
        experts = _hashed_experts(tid2eid, tokens, x.shape[0], config.experts_per_token)
    else:
        choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
        if config.num_groups > 1:
            choice = _best_groups_only(choice, config)
        _, experts = jax.lax.top_k(choice, config.experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.renormalize:
        # HF's DeepSeek-V4 routers divide by sum + 1e-20; the others by the sum alone.
        tiny = 1e-20 if config.score is RouterScore.SQRTSOFTPLUS else 0.0
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + tiny)
    return weights * config.routed_scaling, experts.astype(jnp.int32)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """The pair order that groups rows by expert, and the group sizes [E] (a histogram).

    ``experts`` [N,C]: pair ``p`` is token ``p // C``'s ``p % C``-th choice. Returns ``order`` [N*C]
    (sorted position -> pair, stable so a token's rows keep their order within an expert) and
    ``group_sizes`` [E] with ``sum(group_sizes) == N*C``.
    """
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def active_experts(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The experts that received rows, padded to [E] with zeros, and how many there are."""
    has_rows = group_sizes > 0
    ids = jnp.nonzero(has_rows, size=group_sizes.shape[0], fill_value=0)[0]
    return ids, jnp.sum(has_rows)


def gated(g: jax.Array, u: jax.Array, act: MoEConfig | None = None) -> jax.Array:
    """SwiGLU's gating of the gate projection ``g`` by the up projection ``u``: silu(g) * u, or
    the variant ``act`` sets (gpt-oss: g clamped above and u on both sides at ``swiglu_limit``,
    then g * sigmoid(``swiglu_alpha`` g) * (u + ``swiglu_up_shift``), as HF's ``_apply_gate``;
    DeepSeek-V4: the clamp, then silu(g) * u, for its routed and shared experts alike)."""
    if act is None:
        return jax.nn.silu(g) * u
    if act.swiglu_limit is not None:
        g = jnp.minimum(g, act.swiglu_limit)
        u = jnp.clip(u, -act.swiglu_limit, act.swiglu_limit)
    glu = jax.nn.silu(g) if act.swiglu_alpha == 1.0 else g * jax.nn.sigmoid(act.swiglu_alpha * g)
    return glu * (u + act.swiglu_up_shift if act.swiglu_up_shift else u)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, act: MoEConfig | None = None,
           biases: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """The SwiGLU feed-forward down(silu(x gate) * x up) on ``x`` [..., D], gate/up [D,F], down [F,D].

    One implementation for the dense MLP, each routed expert and the shared experts. ``act``:
    the MoE block's config, whose gating variant (:func:`gated`) its experts use; ``biases``:
    (gate [F], up [F], down [D]) added after each projection (gpt-oss's experts).
    """
    g, u = linear(x, gate), linear(x, up)
    if biases is not None:
        g, u = g + biases[0], u + biases[1]
    y = linear(gated(g, u, act), down)
    return y if biases is None else y + biases[2]


def _expert_biases(w: MoEWeights, e, dtype) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """Expert ``e``'s (gate, up, down) biases in ``dtype`` (None: the experts have none)."""
    if w.gate_bias is None:
        return None
    return tuple(b[e].astype(dtype) for b in (w.gate_bias, w.up_bias, w.down_bias))


def _expert_loop_swiglu(w: MoEWeights, xs: jax.Array, group_sizes: jax.Array,
                        act: MoEConfig | None = None) -> jax.Array:
    """Grouped SwiGLU as a loop over the active experts only, each over its rows in chunks."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    ids, count = active_experts(group_sizes)

    def one_expert(j, out):
        e = ids[j]
        # read (and dequantized) once per expert, then reused by every chunk
        gate, up, down = (dequantized(m[e], xs.dtype) for m in (w.gate, w.up, w.down))
        biases = _expert_biases(w, e, xs.dtype)

        def chunk(size):
            def run(_, carry):
                out, row = carry
                y = swiglu(jax.lax.dynamic_slice_in_dim(xs, row, size), gate, up, down, act, biases)
                return jax.lax.dynamic_update_slice_in_dim(out, y, row, axis=0), row + size
            return run

        row = starts[e]
        for size in (s for s in CHUNKS if s <= xs.shape[0]):  # a chunk can't exceed all rows
            out, row = jax.lax.fori_loop(0, (ends[e] - row) // size, chunk(size), (out, row))
        return out

    out = jnp.zeros((xs.shape[0], w.down.shape[-1]), xs.dtype)
    return jax.lax.fori_loop(0, count, one_expert, out)


def ragged_tile(w: QuantizedArray, axis: int, tile_bytes: int = TILE_BYTES) -> int:
    """How much of ``axis`` (1: contracted rows, 2: output columns) of a quantized expert stack
    ``w`` [E, In, Out] one step of :func:`ragged_matmul` dequantizes, the other axis whole.

    As much as keeps the tile's fp32 values [E, rows, Out] or [E, In, columns] within
    ``tile_bytes``, in whole granules: the scale block along ``axis`` (so a tile's scales are
    whole blocks; the last tile may end in a partial one) rounded up to :data:`TILE_ALIGN`, or the
    whole axis if that is shorter. A tile is never below one granule, so the budget holds while
    E x granule x (the other axis) x 4 <= ``tile_bytes``.
    """
    E, n = w.shape[0], w.shape[axis]
    granule = min(n, math.lcm((w.block or (1, 1))[axis - 1], TILE_ALIGN))
    fit = tile_bytes // (E * w.shape[3 - axis] * 4)
    return min(n, max(granule, fit // granule * granule))


def _tile(w: QuantizedArray, axis: int, start, size: int) -> QuantizedArray:
    """Positions [start, start+size) of ``axis`` (1 or 2) of every expert of ``w``, still quantized.

    ``start`` (an int or traced) is a multiple of the scale block along ``axis``, so the tile's
    scales are the blocks from ``start // block`` on (a partial last one included).
    """
    values = jax.lax.dynamic_slice_in_dim(w.values, start, size, axis)
    if w.block is not None:
        b = w.block[axis - 1]
        scale = jax.lax.dynamic_slice_in_dim(w.scale, start // b, -(-size // b), axis)
    elif axis == 2:  # one scale per (expert, output column)
        scale = jax.lax.dynamic_slice_in_dim(w.scale, start, size, axis)
    else:
        scale = w.scale
    return w.replace(values=values, scale=scale)


def _over_tiles(n: int, size: int, step, carry):
    """``carry`` through ``step(start, width, carry)`` for the tiles of ``size`` that cover
    ``range(n)``: the whole ones in a loop (``start`` traced), then the remainder (static)."""
    count, rest = divmod(n, size)
    if count == 1:
        carry = step(0, size, carry)
    elif count > 1:
        carry = jax.lax.fori_loop(0, count, lambda k, c: step(k * size, size, c), carry)
    if rest:
        carry = step(count * size, rest, carry)
    return carry


def ragged_matmul(x: jax.Array, w, group_sizes: jax.Array, axis: int, tile_bytes: int = TILE_BYTES) -> jax.Array:
    """Rows ``x`` [R,In] sorted by expert times their expert's matrix of ``w`` [E,In,Out] -> [R,Out].

    A float ``w`` is one ``jax.lax.ragged_dot``. A quantized one is dequantized tile by tile along
    ``axis`` (:func:`ragged_tile`), never whole: tiles of contracted rows (1) each give a partial
    product, summed in fp32; tiles of output columns (2) each give their columns of the result.
    """
    if not isinstance(w, QuantizedArray):
        return jax.lax.ragged_dot(x, dequantized(w, x.dtype), group_sizes)
    if w.ndim != 3 or w.in_axes != (1,) or axis not in (1, 2):
        raise ValueError(f"ragged_matmul takes a quantized stack [E, In, Out] contracting axis 1, tiled along "
                         f"axis 1 or 2; got shape {w.shape}, in_axes {w.in_axes}, axis {axis}")
    R, n_out = x.shape[0], w.shape[2]
    size = ragged_tile(w, axis, tile_bytes)

    def product(tile: QuantizedArray, rows: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(rows, dequantized(tile, x.dtype), group_sizes, preferred_element_type=jnp.float32)

    if axis == 1:
        def add(start, width, acc):
            return acc + product(_tile(w, 1, start, width), jax.lax.dynamic_slice_in_dim(x, start, width, axis=1))
        return _over_tiles(w.shape[1], size, add, jnp.zeros((R, n_out), jnp.float32)).astype(x.dtype)

    def put(start, width, out):
        columns = product(_tile(w, 2, start, width), x).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, columns, start, axis=1)
    return _over_tiles(n_out, size, put, jnp.zeros((R, n_out), x.dtype))


def _row_biases(bias: jax.Array | None, group_sizes: jax.Array, rows: int, dtype) -> jax.Array | int:
    """Each of ``rows`` rows sorted by expert gets its expert's row of ``bias`` [E,W] -> [rows,W]
    (rows past the groups get zeros, as ``ragged_dot`` gives them); 0 where there is no bias."""
    if bias is None:
        return 0
    ends = jnp.cumsum(group_sizes)
    expert = jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right")
    return jnp.take(bias.astype(dtype), expert, axis=0, mode="fill", fill_value=0)


def ragged_swiglu(w: MoEWeights, xs: jax.Array, group_sizes: jax.Array, tile_bytes: int = TILE_BYTES,
                  act: MoEConfig | None = None) -> jax.Array:
    """Grouped SwiGLU as three :func:`ragged_matmul` calls (``act``, the biases: as :func:`swiglu`).

    Quantized stacks are tiled along D, the model width (gate/up's contracted rows, down's output
    columns), and F stays whole: no mesh splits D (the rules keep ``embed`` replicated), while a
    tensor mesh splits F, and slicing a split axis inside one program makes XLA move the stored
    stacks between devices (measured on faked CPU devices: tiles cut through gate/up's F gave 10
    all-gathers of the int8 stacks on 2 devices; through down's F, 14 collective-permutes on 8).
    """
    bias = lambda b: _row_biases(b, group_sizes, xs.shape[0], xs.dtype)  # noqa: E731
    gate = ragged_matmul(xs, w.gate, group_sizes, 1, tile_bytes) + bias(w.gate_bias)
    up = ragged_matmul(xs, w.up, group_sizes, 1, tile_bytes) + bias(w.up_bias)
    return ragged_matmul(gated(gate, up, act), w.down, group_sizes, 2, tile_bytes) + bias(w.down_bias)


def grouped_swiglu(w: MoEWeights, xs: jax.Array, group_sizes: jax.Array,
                   impl: GroupedMatmul | None = None, act: MoEConfig | None = None) -> jax.Array:
    """Rows ``xs`` [R,D] sorted by expert, ``group_sizes`` [E] -> each row through its expert [R,D].

    ``impl`` None picks the platform's default from :data:`DEFAULT_GROUPED_MATMUL`; ``act``: the
    block's config, for its gating variant (:func:`gated`). Expert biases are read from ``w``.
    """
    if impl is None:
        impl = DEFAULT_GROUPED_MATMUL.get(jax.default_backend(), GroupedMatmul.EXPERT_LOOP)
    if impl is GroupedMatmul.RAGGED_DOT:
        return ragged_swiglu(w, xs, group_sizes, act=act)
    return _expert_loop_swiglu(w, xs, group_sizes, act)


def moe(w: MoEWeights, config: MoEConfig, x: jax.Array, impl: GroupedMatmul | None = None,
        tokens: jax.Array | None = None) -> jax.Array:
    """The MoE block on hidden states ``x`` [B,T,D] (already normed) -> [B,T,D].

    ``tokens`` [B,T]: the token ids of ``x``'s positions, required when the layer is hash-routed
    (``w.tid2eid``, DeepSeek-V4), ignored otherwise.
    """
    B, T, D = x.shape
    C = config.experts_per_token
    ids = None if tokens is None else tokens.reshape(-1)
    rows = x.reshape(B * T, D)
    weights, experts = route(w.router, config, rows, w.score_bias, w.router_bias, ids, w.tid2eid)
    order, group_sizes = sort_by_expert(experts, config.num_experts)
    ys = grouped_swiglu(w, rows[order // C], group_sizes, impl, config)
    # Back to pair order: pair order[j] produced row j.
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    per_pair = ys[unsort].reshape(B * T, C, D)
    out = jnp.einsum("ncd,nc->nd", per_pair, weights.astype(x.dtype))
    if w.shared is not None:
        out = out + shared_experts(w, config, rows)
    return out.reshape(B, T, D)


def shared_experts(w: MoEWeights, config: MoEConfig, rows: jax.Array) -> jax.Array:
    """The always-on experts' output on ``rows`` [N,D]: one SwiGLU with the block's gating
    (DeepSeek-V4's shared expert is clamped as the routed ones), scaled per row by
    sigmoid(rows . shared_gate) where the model has that gate (Qwen3-Next)."""
    out = swiglu(rows, w.shared.gate, w.shared.up, w.shared.down, config)
    if w.shared_gate is not None:
        out = out * jax.nn.sigmoid(rows @ w.shared_gate.astype(rows.dtype))[:, None]
    return out
