"""The Mixture-of-Experts feed-forward block: route each token to C of E experts, run only those.

``moe`` takes a layer's :class:`MoEWeights` and hidden states [B,T,D]:

1. Route: the router scores every token against every expert and keeps C experts per token,
   with their weights (:func:`route`; the scheme is set by :class:`MoEConfig`).
2. Dispatch: the B*T*C (token, expert) pairs are sorted by expert, so that each expert's rows
   are contiguous, and a histogram of the choices gives each expert's group size
   (:func:`sort_by_expert`).
3. Grouped SwiGLU: each group of rows goes through its own expert (:func:`grouped_swiglu`).
4. Combine: the rows are put back in pair order and summed per token with the routing weights;
   shared experts (DeepSeek-V3), if any, run on every token and are added.

Work is O(B*T*C*D*F) for the experts plus O(B*T*E*D) for the router and O(E) for the histogram,
so it grows with the experts per token, not with the number of experts. A decode step reads
only the weights of the experts its tokens chose.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from dayzero.model.config import MoEConfig, RouterScore
from dayzero.model.quant import dequantized
from dayzero.model.weights import MoEWeights


class GroupedMatmul(enum.Enum):
    """How the grouped SwiGLU runs each expert over its rows.

    ``EXPERT_LOOP`` loops over the experts that received rows, and runs each one's rows in
    fixed-size chunks: only chosen experts are computed, on every platform. ``RAGGED_DOT`` uses
    ``jax.lax.ragged_dot``, which TPUs run as a grouped matmul; XLA:CPU expands it into a product
    with every expert for every row (measured here: 512 rows x [E,256,256] take 15 ms at E=8 and
    690 ms at E=256), and jaxlib 0.10's XLA:GPU is reported to do the same.
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


def route(router: jax.Array, config: MoEConfig, x: jax.Array,
          score_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Each token's C experts [N,C] (int32, best first) and their fp32 weights [N,C]; ``x`` is [N,D].

    See :class:`MoEConfig` for the scheme; ``score_bias`` [E] is required iff ``config.score_bias``.
    """
    if (score_bias is not None) != config.score_bias:
        raise ValueError(f"score_bias given: {score_bias is not None}, config.score_bias: {config.score_bias}")
    logits = router_logits(router, x)
    scores = jax.nn.softmax(logits, axis=-1) if config.score is RouterScore.SOFTMAX else jax.nn.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if config.num_groups > 1:
        choice = _best_groups_only(choice, config)
    _, experts = jax.lax.top_k(choice, config.experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
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


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """The SwiGLU feed-forward down(silu(x gate) * x up) on ``x`` [..., D], gate/up [D,F], down [F,D].

    One implementation for the dense MLP, each routed expert and the shared experts.
    """
    gate, up, down = (dequantized(w, x.dtype) for w in (gate, up, down))
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def _expert_loop_swiglu(w: MoEWeights, xs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Grouped SwiGLU as a loop over the active experts only, each over its rows in chunks."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    ids, count = active_experts(group_sizes)

    def one_expert(j, out):
        e = ids[j]
        # read (and dequantized) once per expert, then reused by every chunk
        gate, up, down = (dequantized(m[e], xs.dtype) for m in (w.gate, w.up, w.down))

        def chunk(size):
            def run(_, carry):
                out, row = carry
                y = swiglu(jax.lax.dynamic_slice_in_dim(xs, row, size), gate, up, down)
                return jax.lax.dynamic_update_slice_in_dim(out, y, row, axis=0), row + size
            return run

        row = starts[e]
        for size in (s for s in CHUNKS if s <= xs.shape[0]):  # a chunk can't exceed all rows
            out, row = jax.lax.fori_loop(0, (ends[e] - row) // size, chunk(size), (out, row))
        return out

    out = jnp.zeros((xs.shape[0], w.down.shape[-1]), xs.dtype)
    return jax.lax.fori_loop(0, count, one_expert, out)


def _ragged_swiglu(w: MoEWeights, xs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Grouped SwiGLU as three ``jax.lax.ragged_dot`` calls."""
    gate = jax.lax.ragged_dot(xs, dequantized(w.gate, xs.dtype), group_sizes)
    up = jax.lax.ragged_dot(xs, dequantized(w.up, xs.dtype), group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, dequantized(w.down, xs.dtype), group_sizes)


def grouped_swiglu(w: MoEWeights, xs: jax.Array, group_sizes: jax.Array,
                   impl: GroupedMatmul | None = None) -> jax.Array:
    """Rows ``xs`` [R,D] sorted by expert, ``group_sizes`` [E] -> each row through its expert [R,D].

    ``impl`` None picks the platform's default from :data:`DEFAULT_GROUPED_MATMUL`.
    """
    if impl is None:
        impl = DEFAULT_GROUPED_MATMUL.get(jax.default_backend(), GroupedMatmul.EXPERT_LOOP)
    if impl is GroupedMatmul.RAGGED_DOT:
        return _ragged_swiglu(w, xs, group_sizes)
    return _expert_loop_swiglu(w, xs, group_sizes)


def moe(w: MoEWeights, config: MoEConfig, x: jax.Array, impl: GroupedMatmul | None = None) -> jax.Array:
    """The MoE block on hidden states ``x`` [B,T,D] (already normed) -> [B,T,D]."""
    B, T, D = x.shape
    C = config.experts_per_token
    tokens = x.reshape(B * T, D)
    weights, experts = route(w.router, config, tokens, w.score_bias)
    order, group_sizes = sort_by_expert(experts, config.num_experts)
    ys = grouped_swiglu(w, tokens[order // C], group_sizes, impl)
    # Back to pair order: pair order[j] produced row j.
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    per_pair = ys[unsort].reshape(B * T, C, D)
    out = jnp.einsum("ncd,nc->nd", per_pair, weights.astype(x.dtype))
    if w.shared is not None:
        out = out + swiglu(tokens, w.shared.gate, w.shared.up, w.shared.down)
    return out.reshape(B, T, D)
