"""Expert parallelism: the MoE block with its experts split over the ``expert`` mesh axis.

Each device of the ``expert`` axis owns E / ep whole experts (``tensor_expert_parallel`` rules:
their gate/up/down split over ``experts``, and their width over ``tensor`` when that axis is
there). ``moe_expert_parallel`` runs the block inside ``jax.shard_map``, with the collectives
written out:

1. The B*T tokens are split over ``expert`` (padded to a multiple of ep; padding rows are
   marked invalid and never sent). Each device routes its own tokens with the whole router
   (a hash-routed layer, DeepSeek-V4: with the whole token-id table, its tokens' ids split
   with them).
2. Plan: each device decides which of its (token, expert) pairs it keeps (all of them unless a
   capacity is set, below), sorts the kept ones by expert -- so by destination device, then by
   that device's local expert -- and counts them per expert. One ``all_gather`` of these counts
   ([E] int32 per device) gives every device the whole table, from which each derives, with
   the same function (:func:`exchange_plan`), the ``ragged_all_to_all`` arguments of both
   directions: where its rows for each peer start and how many there are, where they land on
   that peer, and how many arrive from each peer. A receiver's rows come packed by source
   device, each source's sorted by local expert, so the table also says which expert each
   received row is for: no expert ids travel.
3. Dispatch (:func:`exchange`): the rows go to the devices owning their experts.
4. Each device runs only its own experts over the rows it received (the same grouped SwiGLU as
   the one-device path, ``dayzero.model.moe.grouped_swiglu``: active experts only, no padding
   row computed); with ``tensor`` > 1 each computes a slice of the expert width. Expert biases
   (gpt-oss) split with their experts, gate/up's with the width too; the down bias joins on the
   first width device only, as the width slices' partial sums are added up.
5. Return: a second :func:`exchange`, with the plan transposed, sends every result back to the
   row it came from; each device combines its tokens' C results with the routing weights (and
   sums the width slices over ``tensor``). The output leaves ``shard_map`` split over
   ``expert`` and is joined by XLA into the replicated hidden state.

The exchange (:class:`Exchange`; one decision, :func:`resolve_exchange`, by
``jax.default_backend()`` unless ``Parallel.exchange`` names one): on GPU and TPU it is
``jax.lax.ragged_all_to_all``, which moves exactly the rows routed to other devices. XLA:CPU
cannot compile that op (jaxlib 0.10: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
ThunkEmitter"; it lowers), so CPU runs the same contract emulated with dense ``all_to_all``
calls on [ep, capacity, D] blocks: ep x capacity rows move per direction whatever the routing.
Both take the offsets and sizes from the same plan, so the CPU tests of the emulation test the
offsets the GPU path uses; the ragged path is lowered (type-checked) on CPU and run on one GPU by
``bench/gpu_check.sh``.

Capacity policy (``Parallel.capacity_factor``): ``capacity`` is the most rows one device sends
to one other (``Parallel.capacity``). The default (None) is the no-drop worst case, every pair of
a device's tokens going to one destination: capacity = tokens per device x C. Nothing is ever
dropped, and the results equal the one-device block's. A factor f sets
capacity = ceil(f x tokens per device x C / ep) (at most the no-drop size): a device's pairs
beyond the first ``capacity`` to one destination (in token order) are dropped -- each contributes
zero, so its token is served by its other experts only, and the output differs from the
one-device block's. ``moe_expert_parallel(..., with_stats=True)`` (or, from the routing alone,
:func:`dispatch_stats`) counts the pairs routed and dropped and the rows and bytes moved.

Receive buffer: ep x capacity rows on every device, whichever exchange runs, so the drops and
the receive memory (the planner's dispatch buffers) do not depend on the platform. With no drops
that is every pair of the step: a statically sized buffer must hold what the routing could send
one device, and it is memory, not traffic -- the ragged exchange moves only the rows routed. A
capacity factor bounds it to f x the average. (A token sends at most min(C, E/ep) rows to one
device, which would halve the no-drop buffers where E/ep < C, e.g. DeepSeek-V3 on ep=64; not
done, as the planner counts ep x tokens per device x C.)

Quantized experts (``dayzero.model.quant.QuantizedArray`` stacks) enter ``shard_map`` as they are,
values and scale each with its own PartitionSpec: the scale is split along the experts always and
along the width wherever its values are, so each device dequantizes its slice with its own
scales. A block scale whose blocks a width shard would cut is re-blocked first (exactly; the
engine's weights arrive already re-blocked by ``dayzero.model.weights.mesh_aligned_specs``).

The one-device ``dayzero.model.moe.moe`` stays the reference; this module reuses its routing,
sort and grouped SwiGLU and adds only the dispatch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dayzero.model.config import MoEConfig
from dayzero.model.moe import GroupedMatmul, grouped_swiglu, route, shared_experts, sort_by_expert
from dayzero.model.parallel import Parallel
from dayzero.model.quant import QuantError, QuantizedArray, reblocked
from dayzero.model.weights import MoEWeights, aligned_block


class Exchange(enum.Enum):
    """How the dispatch moves rows between the devices of the ``expert`` axis (module docstring).

    Both implement ``jax.lax.ragged_all_to_all``'s contract, with arguments from one
    :func:`exchange_plan`. ``RAGGED`` is that op: each device sends exactly its rows for each
    peer. ``DENSE`` emulates it with ``jax.lax.all_to_all`` of [ep, capacity] blocks (each
    destination's rows padded to capacity), for XLA:CPU, which cannot compile the ragged op.
    """

    RAGGED = "ragged"
    DENSE = "dense"


# Per-platform default (jax.default_backend() names): the one place the exchange is chosen.
DEFAULT_EXCHANGE = {"cpu": Exchange.DENSE, "gpu": Exchange.RAGGED, "tpu": Exchange.RAGGED}


def resolve_exchange(choice: Exchange | None) -> Exchange:
    """The exchange that runs: ``choice``, or the platform's default (:data:`DEFAULT_EXCHANGE`)."""
    if choice is None:
        return DEFAULT_EXCHANGE.get(jax.default_backend(), Exchange.DENSE)
    if not isinstance(choice, Exchange):
        raise ValueError(f"exchange {choice!r} is not one of {[e.value for e in Exchange]}; pass an Exchange")
    return choice


class Plan(NamedTuple):
    """One device's ``ragged_all_to_all`` arguments for one direction, each [ep] int32: where its
    rows for each peer start in its operand and how many, where they land in that peer's
    output, and how many rows arrive from each peer."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


def exchange_plan(sizes: jax.Array, me: jax.Array) -> Plan:
    """Device ``me``'s exchange arguments when each device i sends ``sizes[i, j]`` rows to device j.

    Every operand holds its rows packed by destination, in device order; every output receives
    them packed by source, in device order. So the rows i sends to j start at sum(sizes[i, :j]) in
    i's operand and land at sum(sizes[:i, j]) in j's output. The way back is
    ``exchange_plan(sizes.T, me)``.
    """
    in_starts = jnp.cumsum(sizes, axis=1) - sizes  # [i, j]: j's rows in i's operand
    out_starts = jnp.cumsum(sizes, axis=0) - sizes  # [i, j]: i's rows in j's output
    return Plan(in_starts[me], sizes[me], out_starts[me], sizes[:, me])


def exchange(operand: jax.Array, output: jax.Array, plan: Plan, *, axis: str, kind: Exchange,
             max_send: int) -> jax.Array:
    """``jax.lax.ragged_all_to_all(operand, output, *plan, axis_name=axis)``, run as ``kind``:
    ``output`` with the rows every peer sent here written at the offsets it gave.

    ``max_send``: a bound on every send size (the rows of each DENSE block).
    """
    if kind is Exchange.RAGGED:
        return jax.lax.ragged_all_to_all(operand, output, *plan, axis_name=axis)
    return _dense_ragged_all_to_all(operand, output, plan, axis=axis, max_send=max_send)


def _dense_ragged_all_to_all(operand: jax.Array, output: jax.Array, plan: Plan, *, axis: str,
                             max_send: int) -> jax.Array:
    """The ragged_all_to_all contract from dense all_to_alls: block j of [ep, max_send] rows holds
    this device's rows for device j (zeros after ``send_sizes[j]``); one all_to_all moves the
    blocks, a second the senders' ``output_offsets``, and each receiver writes the first
    ``recv_sizes[i]`` rows of block i at the offset sender i gave."""
    ep = plan.send_sizes.shape[0]
    r = jnp.arange(max_send, dtype=plan.send_sizes.dtype)
    src = jnp.where(r < plan.send_sizes[:, None], plan.input_offsets[:, None] + r, operand.shape[0])
    blocks = jnp.take(operand, src, axis=0, mode="fill", fill_value=0)  # [ep, max_send, ...]
    got = jax.lax.all_to_all(blocks, axis, 0, 0)  # got[i]: device i's rows for this device
    at = jax.lax.all_to_all(plan.output_offsets, axis, 0, 0)  # at[i]: where device i put them here
    dst = jnp.where(r < plan.recv_sizes[:, None], at[:, None] + r, output.shape[0])  # past the end: dropped
    return output.at[dst.reshape(-1)].set(got.reshape(ep * max_send, *operand.shape[1:]), mode="drop")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["pairs_routed", "pairs_dropped", "rows_off_device", "max_rows_sent",
                                "max_rows_received"],
                   meta_fields=["exchange", "ep", "capacity", "row_bytes", "num_experts"])
@dataclasses.dataclass(frozen=True)
class DispatchStats:
    """What one expert-parallel dispatch routed, dropped and moved, over the ep devices of one
    ``expert`` group (with ``tensor`` = t > 1, each of the t groups moves as much again).

    Counts (int32 scalars): ``pairs_routed``, the (token, expert) pairs of the real tokens;
    ``pairs_dropped``, those beyond capacity; ``rows_off_device``, kept rows whose expert is on
    another device (each travels out and its result back); ``max_rows_sent``, the most rows one
    device sends to others, its rows out and the results it returns together;
    ``max_rows_received``, the most rows one device receives, its own included (the receive
    buffer it needed). Static: the exchange that ran, ep, capacity, bytes per row, E.
    """

    pairs_routed: jax.Array
    pairs_dropped: jax.Array
    rows_off_device: jax.Array
    max_rows_sent: jax.Array
    max_rows_received: jax.Array
    exchange: str
    ep: int
    capacity: int
    row_bytes: int
    num_experts: int

    @property
    def drop_rate(self) -> float:
        """The fraction of routed pairs dropped."""
        return int(self.pairs_dropped) / max(1, int(self.pairs_routed))

    def bytes_moved(self, per_device: bool = False) -> int:
        """Bytes sent device to device by the dispatch's collectives, both directions: the count
        table's all_gather, then the rows out and back -- the routed rows off their device
        (ragged), or every block but a device's own, padded to capacity, plus the offsets'
        all_to_alls (dense). All ep devices together, or (``per_device``) the busiest sender."""
        ep = self.ep
        table = (ep - 1) * self.num_experts * 4
        if self.exchange == Exchange.RAGGED.value:
            rows = int(self.max_rows_sent) if per_device else 2 * int(self.rows_off_device)
            return rows * self.row_bytes + table * (1 if per_device else ep)
        one = 2 * (ep - 1) * (self.capacity * self.row_bytes + 4) + table
        return one if per_device else ep * one

    def as_dict(self) -> dict:
        """A JSON-ready dict of the counts, the drop rate and the bytes moved."""
        counts = {f.name: int(getattr(self, f.name)) for f in dataclasses.fields(self)
                  if f.name not in ("exchange",)}
        return {"exchange": self.exchange, **counts, "drop_rate": self.drop_rate,
                "bytes_moved": self.bytes_moved(), "bytes_moved_per_device": self.bytes_moved(per_device=True)}


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
# ... and of their biases (gpt-oss): split with the experts, and gate/up's with the width.
_BIAS_AXES = {"gate_bias": ("experts", "ffw"), "up_bias": ("experts", "ffw"), "down_bias": ("experts", "embed")}


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
    biases = {name: None if getattr(w, name) is None else par.placement.sharding(axes, getattr(w, name).shape).spec
              for name, axes in _BIAS_AXES.items()}
    specs = MoEWeights(
        router=P(), gate=gate, up=up, down=down,
        score_bias=None if w.score_bias is None else P(), shared=None,
        router_bias=None if w.router_bias is None else P(), **biases,
        # Whole on every device: a device's tokens may have any id. [V,C] int32, 3 MB for V4.
        tid2eid=None if w.tid2eid is None else P(),
    )
    return specs, gate_values[2]


def _kept(dest: jax.Array, sent: jax.Array, ep: int, capacity: int) -> jax.Array:
    """Which pairs keep their place: ``sent`` ones among the first ``capacity`` (in pair order,
    i.e. token order) of this device's pairs for their destination ``dest``."""
    if capacity >= dest.shape[0]:  # no destination can overflow: nothing to count
        return sent
    to = (dest[:, None] == jnp.arange(ep)[None, :]) & sent[:, None]
    rank = jnp.take_along_axis(jnp.cumsum(to, axis=0), dest[:, None], axis=1)[:, 0] - 1  # earlier pairs there
    return sent & (rank < capacity)


class _Routed(NamedTuple):
    """One device's routing (step 2 of the module docstring)."""

    probs: jax.Array  # [n,C] routing weights
    order: jax.Array  # [n*C] the pair of each sorted row: kept pairs by expert, then the rest
    sent: jax.Array  # [n*C] pairs of real tokens
    keep: jax.Array  # [n*C] pairs within capacity
    table: jax.Array  # [ep,E] kept pairs per (device, expert): the same on every device


def _route_local(tokens: jax.Array, valid: jax.Array, router: jax.Array, score_bias: jax.Array | None, *,
                 config: MoEConfig, axis: str, ep: int, capacity: int,
                 router_bias: jax.Array | None = None, ids: jax.Array | None = None,
                 tid2eid: jax.Array | None = None) -> _Routed:
    """Route this device's tokens [n,D], keep what fits, sort the kept pairs by expert and share
    the per-expert counts with every device of ``axis``. ``ids`` [n]: the tokens' ids, for a
    hash-routed layer's table ``tid2eid``."""
    E, C = config.num_experts, config.experts_per_token
    probs, experts = route(router, config, tokens, score_bias, router_bias, ids, tid2eid)  # [n,C] each
    flat = experts.reshape(-1)  # pair p is token p // C
    sent = jnp.repeat(valid, C)
    keep = _kept(flat // (E // ep), sent, ep, capacity)
    order, counts = sort_by_expert(jnp.where(keep, flat, E), E + 1)  # E: not sent, sorts last
    return _Routed(probs, order, sent, keep, jax.lax.all_gather(counts[:E], axis))


def _received_experts(table: jax.Array, me: jax.Array, num_local: int, rows: int) -> jax.Array:
    """The local expert of each of this device's ``rows`` receive-buffer rows (``num_local``:
    empty). Rows arrive packed by source device, each source's sorted by expert (the plan's
    layout), so the table's counts for this device's experts delimit them."""
    mine = jax.lax.dynamic_slice_in_dim(table, me * num_local, num_local, axis=1)  # [source, local expert]
    ends = jnp.cumsum(mine.reshape(-1))
    group = jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right")
    return jnp.where(group < ends.shape[0], group % num_local, num_local).astype(jnp.int32)


def _own_experts(w: MoEWeights, rows: jax.Array, ids: jax.Array, impl: GroupedMatmul | None,
                 act: MoEConfig | None = None) -> jax.Array:
    """Rows [R,D] through this device's experts (``ids`` [R] local, num_local = empty row) -> [R,D]."""
    num_local = w.gate.shape[0]
    order, group_sizes = sort_by_expert(ids, num_local)  # empty rows sort last, uncounted
    ys = grouped_swiglu(w, rows[order], group_sizes, impl, act)
    return jnp.zeros_like(ys).at[order].set(ys)


def _stats(routed: _Routed, sizes: jax.Array, *, axis: str, exchange_kind: Exchange, capacity: int,
           row_bytes: int) -> DispatchStats:
    """The dispatch's counts (:class:`DispatchStats`), the same on every device."""
    own = jnp.diagonal(sizes)
    sum_over = lambda x: jax.lax.psum(jnp.sum(x, dtype=jnp.int32), axis)  # noqa: E731
    out, back = jnp.sum(sizes, axis=1) - own, jnp.sum(sizes, axis=0) - own  # per device, to others
    return DispatchStats(
        pairs_routed=sum_over(routed.sent), pairs_dropped=sum_over(routed.sent & ~routed.keep),
        rows_off_device=jnp.sum(out), max_rows_sent=jnp.max(out + back),
        max_rows_received=jnp.max(jnp.sum(sizes, axis=0)),
        exchange=exchange_kind.value, ep=sizes.shape[0], capacity=capacity, row_bytes=row_bytes,
        num_experts=routed.table.shape[1])


def _dispatch_local(tokens, valid, ids, w: MoEWeights, *, config: MoEConfig, axis: str, ep: int, capacity: int,
                    width_axis: str | None, impl: GroupedMatmul | None, exchange_kind: Exchange, with_stats: bool):
    """The shard_map body: route local tokens [n,D] (ids [n] or None), send, compute own experts,
    return, combine."""
    n, D = tokens.shape
    C = config.experts_per_token
    num_local = w.gate.shape[0]
    routed = _route_local(tokens, valid, w.router, w.score_bias, config=config, axis=axis, ep=ep, capacity=capacity,
                          router_bias=w.router_bias, ids=ids, tid2eid=w.tid2eid)
    me = jax.lax.axis_index(axis)
    if width_axis is not None and w.down_bias is not None:
        # Each width device's down product is a partial sum, added up by the psum below: the down
        # bias joins on the first of them only, so it is counted once.
        w = w.replace(down_bias=jnp.where(jax.lax.axis_index(width_axis) == 0, w.down_bias, 0))
    sizes = routed.table.reshape(ep, ep, num_local).sum(axis=-1)  # [source, destination] rows
    move = functools.partial(exchange, axis=axis, kind=exchange_kind, max_send=capacity)
    rows = tokens[routed.order // C]  # [n*C,D]: the kept rows, packed by destination, first
    recv = move(rows, jnp.zeros((ep * capacity, D), tokens.dtype), exchange_plan(sizes, me))
    ys = _own_experts(w, recv, _received_experts(routed.table, me, num_local, ep * capacity), impl, config)
    back = move(ys, jnp.zeros_like(rows), exchange_plan(sizes.T, me))  # rows not kept get nothing: zero
    per_pair = jnp.zeros_like(back).at[routed.order].set(back)  # back in pair order
    out = jnp.einsum("ncd,nc->nd", per_pair.reshape(n, C, D), routed.probs.astype(tokens.dtype))
    # Each device of the width axis summed over its slice of the expert width: add the slices up.
    out = out if width_axis is None else jax.lax.psum(out, width_axis)
    if not with_stats:
        return out
    return out, _stats(routed, sizes, axis=axis, exchange_kind=exchange_kind, capacity=capacity,
                       row_bytes=D * tokens.dtype.itemsize)


def _split_ids(tokens: jax.Array | None, x: jax.Array, padded: int) -> jax.Array | None:
    """The token ids [B,T] of ``x`` [B,T,D] flattened and padded (with id 0) to ``padded``, as
    :func:`_split_tokens` pads the hidden states; None stays None."""
    if tokens is None:
        return None
    if tokens.shape != x.shape[:2]:
        raise ValueError(f"token ids {tokens.shape} do not match the hidden states {x.shape}; pass [B,T] ids")
    flat = tokens.reshape(-1)
    return jnp.pad(flat, (0, padded - flat.shape[0]))


def _split_tokens(config: MoEConfig, x: jax.Array, par: Parallel) -> tuple[str, int, jax.Array, jax.Array, int]:
    """(expert mesh axis, ep, tokens [n*ep,D] padded to a multiple of ep, their validity, capacity).

    The rules' expert axis is used even at size 1 (a one-device mesh still runs the dispatch).
    """
    axis = par.placement.rules.mesh_axis("experts")
    if axis is None or axis not in par.placement.mesh.shape:
        raise ValueError(f"rules {par.placement.rules.name!r} split no experts over the mesh; use an expert axis")
    ep = int(par.placement.mesh.shape[axis])
    check_expert_parallel(config.num_experts, ep)
    N, D = x.shape[0] * x.shape[1], x.shape[2]
    n = -(-N // ep)  # tokens per device
    tokens = jnp.pad(x.reshape(N, D), ((0, n * ep - N), (0, 0)))
    return axis, ep, tokens, jnp.arange(n * ep) < N, par.capacity(n, config.experts_per_token)


def moe_expert_parallel(w: MoEWeights, config: MoEConfig, x: jax.Array, par: Parallel, *,
                        with_stats: bool = False, tokens: jax.Array | None = None
                        ) -> jax.Array | tuple[jax.Array, DispatchStats]:
    """The MoE block on hidden states ``x`` [B,T,D] with experts split over ``expert`` -> [B,T,D].

    Same result as ``dayzero.model.moe.moe`` (exactly the same pairs computed, up to summation
    order) when nothing is dropped; see the module docstring for the dispatch and capacity.
    ``with_stats``: also return the dispatch's :class:`DispatchStats` (a few extra reductions;
    without it nothing is counted). ``tokens`` [B,T]: the token ids, required when the layer is
    hash-routed (``w.tid2eid``), ignored otherwise.
    """
    B, T, D = x.shape
    N = B * T
    axis, ep, rows, valid, capacity = _split_tokens(config, x, par)
    ids = _split_ids(tokens if w.tid2eid is not None else None, x, rows.shape[0])
    routed = _aligned_experts(w.replace(shared=None, shared_gate=None), par)  # the shared experts run outside, below
    specs, width_axis = _expert_specs(routed, par)
    body = functools.partial(
        _dispatch_local, config=config, axis=axis, ep=ep, capacity=capacity, width_axis=width_axis,
        impl=par.impl, exchange_kind=resolve_exchange(par.exchange), with_stats=with_stats,
    )
    result = jax.shard_map(
        body, mesh=par.shard_mesh(),
        in_specs=(P(axis), P(axis), None if ids is None else P(axis), specs),
        out_specs=(P(axis), P()) if with_stats else P(axis),
        # The shared grouped SwiGLU starts its loops from fresh zeros, which the varying-axes
        # type check rejects inside shard_map; the body's own psum makes the output the same
        # on every tensor device, as out_specs says.
        check_vma=False,
    )(rows, valid, ids, routed)
    out, stats = result if with_stats else (result, None)
    out = out[:N]
    if w.shared is not None:  # always-on experts: a SwiGLU (the block's gating too), split like a dense MLP
        out = out + shared_experts(w, config, x.reshape(N, D))
    out = out.reshape(B, T, D)
    return (out, stats) if with_stats else out


def dispatch_stats(router: jax.Array, score_bias: jax.Array | None, config: MoEConfig, x: jax.Array,
                   par: Parallel, router_bias: jax.Array | None = None, *, tokens: jax.Array | None = None,
                   tid2eid: jax.Array | None = None) -> DispatchStats:
    """The :class:`DispatchStats` of ``moe_expert_parallel(w, config, x, par)`` from its routing
    alone (the same routing, capacity and counts; no expert runs and no row moves), for
    measuring drop rates and traffic at sizes whose experts are not allocated. A hash-routed
    layer: its table ``tid2eid`` and the token ids ``tokens`` [B,T]."""
    D = x.shape[2]
    axis, ep, rows, valid, capacity = _split_tokens(config, x, par)
    ids = _split_ids(tokens if tid2eid is not None else None, x, rows.shape[0])
    kind = resolve_exchange(par.exchange)

    def body(rows, valid, ids, router, score_bias, router_bias, tid2eid):
        routed = _route_local(rows, valid, router, score_bias, config=config, axis=axis, ep=ep, capacity=capacity,
                              router_bias=router_bias, ids=ids, tid2eid=tid2eid)
        sizes = routed.table.reshape(ep, ep, -1).sum(axis=-1)
        return _stats(routed, sizes, axis=axis, exchange_kind=kind, capacity=capacity,
                      row_bytes=D * rows.dtype.itemsize)

    spec = lambda b: None if b is None else P()  # noqa: E731
    return jax.shard_map(body, mesh=par.shard_mesh(),
                         in_specs=(P(axis), P(axis), None if ids is None else P(axis), P(), spec(score_bias),
                                   spec(router_bias), spec(tid2eid)),
                         out_specs=P(), check_vma=False)(rows, valid, ids, router, score_bias, router_bias, tid2eid)
