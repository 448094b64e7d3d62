"""Expert parallelism: the MoE block with its experts split over the ``expert`` mesh axis.

Each device of the ``expert`` axis owns E / ep whole experts (``tensor_expert_parallel`` rules:
their gate/up/down split over ``experts``, and their width over ``tensor`` when that axis is
there). ``moe_expert_parallel`` runs the block inside ``jax.shard_map``, with the collectives
written out:

1. The B*T tokens are split over ``expert`` (padded to a multiple of ep; padding rows are
   marked invalid and never sent). Each device routes its own tokens with the whole router.
2. Dispatch: each (token, expert) pair goes to the device owning that expert. Pairs are packed
   into a fixed-size send buffer [ep, capacity, D] (one slot row per destination) and exchanged
   with one ``jax.lax.all_to_all``, with the local expert id of every slot beside them.
3. Each device runs only its own experts over the rows it received (the same grouped SwiGLU as
   the one-device path, ``dayzero.model.moe.grouped_swiglu``: active experts only, no padding
   row computed); with ``tensor`` > 1 each computes a slice of the expert width.
4. Return: a second ``all_to_all`` sends every result back to the slot it came from; each
   device combines its tokens' C results with the routing weights (and sums the width slices
   over ``tensor``). The output leaves ``shard_map`` split over ``expert`` and is joined by
   XLA into the replicated hidden state.

Quantized experts (``dayzero.model.quant.QuantizedArray`` stacks) enter ``shard_map`` as they are,
values and scale each with its own PartitionSpec: the scale is split along the experts always and
along the width wherever its values are, so each device dequantizes its slice with its own
scales. A block scale whose blocks a width shard would cut is re-blocked first (exactly; the
engine's weights arrive already re-blocked by ``dayzero.model.weights.mesh_aligned_specs``).

Capacity policy (``Parallel.capacity_factor``): the send buffer holds ``capacity`` rows
per destination. The default (None) is the no-drop worst case, every pair of a device's tokens
going to one destination: capacity = tokens per device x C. Nothing is ever dropped, and the
results equal the one-device block's; the buffers and the all_to_all carry ep x that many rows,
but the expert matmuls run only over rows actually received. A factor f sets
capacity = ceil(f x tokens per device x C / ep) (at most the no-drop size): smaller buffers, but
a pair beyond its destination's capacity is dropped -- it contributes zero, so that token is
served by its other experts only, and the output differs from the one-device block's.

The one-device ``dayzero.model.moe.moe`` stays the reference; this module reuses its routing
and grouped SwiGLU and adds only the dispatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dayzero.model.config import MoEConfig
from dayzero.model.moe import GroupedMatmul, grouped_swiglu, route, sort_by_expert, swiglu
from dayzero.model.parallel import Parallel
from dayzero.model.quant import QuantError, QuantizedArray, reblocked
from dayzero.model.weights import MoEWeights, aligned_block

def check_expert_parallel(num_experts: int, ep: int) -> None:
    """Raise ValueError unless ``num_experts`` splits evenly over ``ep`` devices."""
    if num_experts % ep:
        raise ValueError(
            f"{num_experts} experts do not split evenly over expert={ep} devices; use an expert "
            f"axis size that divides {num_experts}"
        )


# The logical axes of the routed-expert stacks (as declared in dayzero.model.weights._moe_specs).
_EXPERT_AXES = {"gate": ("experts", "embed", "ffw"), "up": ("experts", "embed", "ffw"),
                "down": ("experts", "ffw", "embed")}


def _aligned_experts(w: MoEWeights, par: Parallel) -> MoEWeights:
    """``w`` with each block-scaled expert stack re-blocked (exactly, ``quant.reblocked``) where a
    shard of its width would start inside a block; a no-op for weights laid out by
    ``weights.mesh_aligned_specs`` (the engine's), a small repeat of the scales otherwise."""
    def one(name):
        x = getattr(w, name)
        if not isinstance(x, QuantizedArray) or x.block is None:
            return x
        return reblocked(x, aligned_block(x.shape, _EXPERT_AXES[name], x.in_axes, x.block, par.size)[0])
    return w.replace(gate=one("gate"), up=one("up"), down=one("down"))


def _scale_axes(x: QuantizedArray, axes: tuple[str, ...], par: Parallel) -> tuple[str | None, ...]:
    """The logical axes of ``x``'s scale that split it with its values (``x`` already aligned)."""
    if x.block is None:  # one scale per output channel: the values' axes, size 1 on the contracted ones
        return tuple(None if i in x.in_axes else a for i, a in enumerate(axes))
    _, (in_axis, out_axis) = aligned_block(x.shape, axes, x.in_axes, x.block, par.size)
    return (*axes[: x.in_axes[0]], in_axis, out_axis)


def _check_scale_follows(name: str, x: QuantizedArray, values: P, scale: P) -> None:
    """Raise QuantError unless every split of a block-scaled stack's In / Out group is matched
    by the same split of its scale (else a device would read its values with others' scales)."""
    if x.block is None:
        return  # the scale has the values' axes (size 1, hence whole, on the contracted ones)
    first, last = x.in_axes[0], x.in_axes[-1]
    values = tuple(values) + (None,) * (x.ndim - len(values))
    scale = tuple(scale) + (None,) * (x.scale.ndim - len(scale))
    for g, dims in enumerate((range(first, last + 1), range(last + 1, x.ndim))):
        split = [values[d] for d in dims]
        if any(split) and (any(split[1:]) or scale[first + g] != split[0]):
            raise QuantError(
                f"routed experts' {name} {x.shape} with {x.fmt.value} blocks {x.block} is split as {values}, "
                f"which its block scales cannot follow inside the expert-parallel block; use a mesh with "
                f"{next(a for a in split if a)}=1")


def _expert_specs(w: MoEWeights, par: Parallel) -> tuple[MoEWeights, str | None]:
    """The shard_map in_specs of the routed-expert weights, and the mesh axis splitting their width.

    A quantized stack gets a QuantizedArray of two specs: its values split like a float stack's,
    its scale along the expert axis always, and along the width where the values are (a block
    scale of ``w`` as aligned by ``_aligned_experts``), so that each device's local QuantizedArray
    is self-consistent.
    """
    def spec(name):
        x, axes = getattr(w, name), _EXPERT_AXES[name]
        values = par.placement.sharding(axes, x.shape).spec
        if not isinstance(x, QuantizedArray):
            return values
        scale = par.placement.sharding(_scale_axes(x, axes, par), x.scale.shape).spec
        _check_scale_follows(name, x, values, scale)
        return x.replace(values=values, scale=scale)

    gate, up, down = spec("gate"), spec("up"), spec("down")
    gate_values = gate.values if isinstance(gate, QuantizedArray) else gate
    if gate_values[0] != par.mesh_axis("experts"):
        raise ValueError(f"experts {w.gate.shape[0]} are not split over the mesh by rules {par.placement.rules.name!r}")
    specs = MoEWeights(
        router=P(), gate=gate, up=up, down=down,
        score_bias=None if w.score_bias is None else P(), shared=None,
    )
    return specs, gate_values[2]


def _slots(dest: jax.Array, sent: jax.Array, ep: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Each pair's row in its destination's buffer, and whether it fits (``sent`` and < capacity).

    A pair's row is how many pairs before it go to the same destination: a running count.
    """
    to = (dest[:, None] == jnp.arange(ep)[None, :]) & sent[:, None]
    rank = jnp.take_along_axis(jnp.cumsum(to, axis=0), dest[:, None], axis=1)[:, 0] - 1
    keep = sent & (rank < capacity)
    return jnp.where(keep, rank, capacity), keep  # ``capacity`` is out of range: scatters drop it


def _own_experts(w: MoEWeights, rows: jax.Array, ids: jax.Array, impl: GroupedMatmul | None) -> jax.Array:
    """Rows [R,D] through this device's experts (``ids`` [R] local, num_local = empty slot) -> [R,D]."""
    num_local = w.gate.shape[0]
    order, group_sizes = sort_by_expert(ids, num_local)  # empty slots sort last, uncounted
    ys = grouped_swiglu(w, rows[order], group_sizes, impl)
    return jnp.zeros_like(ys).at[order].set(ys)


def _dispatch_local(tokens, valid, w: MoEWeights, *, config: MoEConfig, axis: str, ep: int, capacity: int,
                    width_axis: str | None, impl: GroupedMatmul | None):
    """The shard_map body: route local tokens [n,D], send, compute own experts, return, combine."""
    n, D = tokens.shape
    C = config.experts_per_token
    num_local = w.gate.shape[0]
    probs, experts = route(w.router, config, tokens, w.score_bias)  # [n,C] each
    flat = experts.reshape(-1)
    dest, local_id = flat // num_local, flat % num_local
    slot, keep = _slots(dest, jnp.repeat(valid, C), ep, capacity)
    rows = jnp.repeat(tokens, C, axis=0)  # pair p is token p // C
    send = jnp.zeros((ep, capacity, D), tokens.dtype).at[dest, slot].set(rows, mode="drop")
    send_ids = jnp.full((ep, capacity), num_local, jnp.int32).at[dest, slot].set(local_id, mode="drop")
    # recv[j] holds what device j sent here; the second all_to_all returns recv's rows to them.
    recv = jax.lax.all_to_all(send, axis, 0, 0)
    recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0)
    ys = _own_experts(w, recv.reshape(ep * capacity, D), recv_ids.reshape(-1), impl)
    back = jax.lax.all_to_all(ys.reshape(ep, capacity, D), axis, 0, 0)
    per_pair = back[dest, jnp.minimum(slot, capacity - 1)] * keep[:, None].astype(back.dtype)
    out = jnp.einsum("ncd,nc->nd", per_pair.reshape(n, C, D), probs.astype(tokens.dtype))
    # Each device of the width axis summed over its slice of the expert width: add the slices up.
    return out if width_axis is None else jax.lax.psum(out, width_axis)


def moe_expert_parallel(w: MoEWeights, config: MoEConfig, x: jax.Array, par: Parallel) -> jax.Array:
    """The MoE block on hidden states ``x`` [B,T,D] with experts split over ``expert`` -> [B,T,D].

    Same result as ``dayzero.model.moe.moe`` (exactly the same pairs computed, up to summation
    order) when nothing is dropped; see the module docstring for the dispatch and capacity.
    """
    B, T, D = x.shape
    axis, ep = par.mesh_axis("experts"), par.size("experts")
    check_expert_parallel(config.num_experts, ep)
    N = B * T
    n = -(-N // ep)  # tokens per device
    tokens = jnp.pad(x.reshape(N, D), ((0, n * ep - N), (0, 0)))
    valid = jnp.arange(n * ep) < N
    routed = _aligned_experts(
        MoEWeights(router=w.router, gate=w.gate, up=w.up, down=w.down, score_bias=w.score_bias), par)
    specs, width_axis = _expert_specs(routed, par)
    body = functools.partial(
        _dispatch_local, config=config, axis=axis, ep=ep, capacity=par.capacity(n, config.experts_per_token),
        width_axis=width_axis, impl=par.impl,
    )
    out = jax.shard_map(
        body, mesh=par.placement.mesh,
        in_specs=(P(axis), P(axis), specs), out_specs=P(axis),
        # The shared grouped SwiGLU starts its loops from fresh zeros, which the varying-axes
        # type check rejects inside shard_map; the body's own psum makes the output the same
        # on every tensor device, as out_specs says.
        check_vma=False,
    )(tokens, valid, routed)[:N]
    if w.shared is not None:  # always-on experts: the plain SwiGLU, split like a dense MLP
        out = out + swiglu(x.reshape(N, D), w.shared.gate, w.shared.up, w.shared.down)
    return out.reshape(B, T, D)
