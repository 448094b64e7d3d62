"""Decoding with micro-batches in flight across steps through the pipeline stages of
``dayzero.model.pipeline`` (:func:`pipeline_decode`): the last stage picks each row's next token
and hands it back to stage 0, which starts that micro-batch's next step while the others are in
flight, so the pipeline drains once per call rather than once per step. It reads and writes the
contiguous staged cache (``Engine.generate``) or the staged page pool (the serving engine,
``engine.serving_inflight``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dayzero.model.config import ModelConfig
from dayzero.model.norm import rms_norm
from dayzero.model.parallel import Parallel
from dayzero.model.pipeline import (StagedKVCache, StagedNewKV, StagedWeights, StagePlan, _each, _put_rows, _rows,
                                    _stacks, _stage_slots, _Step, _written)
from dayzero.model.transformer import output_logits
from dayzero.model.weights import Weights


def greedy_pick(logits: jax.Array, m, n, mb) -> tuple[jax.Array, jax.Array]:
    """The default ``pick`` of :func:`pipeline_decode`: each row's most likely token and its
    log-probability."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.argmax(logprobs, axis=-1).astype(jnp.int32), jnp.max(logprobs, axis=-1)


def _pages_written(latent: bool, pools: tuple, rows: tuple, tables, starts, keep) -> tuple:
    """A stage's pools [slots, ...] with one micro-batch's new rows [slots, mb, 1, ...] written
    at ``starts`` through its ``tables``, for the rows where ``keep`` (``append_staged_pages`` of
    one stage)."""
    from dayzero.model.pipeline_paged import StagedPagedCache, append_staged_pages  # it imports this module

    none = jnp.zeros((), jnp.int32)
    cache = StagedPagedCache(pages=_each(lambda a: a[None], pools), block_tables=tables, lengths=starts,
                             rope_len=none, latent=latent)
    new = StagedNewKV(rows=tuple(_whole(r)[None] for r in rows), num_new=keep, rope_len=none)
    return _each(lambda a: a[0], append_staged_pages(cache, new).pages)


def _whole(x: jax.Array) -> jax.Array:
    """``x`` constrained whole on every device of the stage (inside the stage ``shard_map``).

    XLA 0.10.2's SPMD partitioner aborts (a failed check in ``ExpandDeviceGroupsWithIota``) on
    some gathers and scatters over arrays split over part of a mesh with both ``tensor`` and
    ``expert`` axes inside the stage ``shard_map``: the in-flight decode's sampling over
    vocabulary-split logits, and its page writes of latent rows. Both are small ([mb, V] and
    [slots, mb, 1, C]): whole is cheap."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), P()))


def _decode_body(step: _Step, steps: int, pick, stacks, outer: Weights, caches, tables, first, lengths, rope_len,
                 active, pick_args):
    """The per-stage program of :func:`pipeline_decode`: ``steps`` decode steps of M
    micro-batches in flight, (steps * M + S - 1) ticks. Returns the tokens [steps, B] and their
    log-probabilities (summed over stages: zero but on the last) and the stage's cache buffers
    (or page pools)."""
    config, S, M = step.config, step.plan.num_stages, step.num_micro
    latent = config.mla is not None
    stacks = jax.tree.map(lambda a: a[0], stacks)
    caches = _each(lambda a: a[0], caches)
    me = jax.lax.axis_index("stage")
    B, D = first.shape[0], outer.embed.shape[1]
    mb, total = B // M, steps * M
    ring = [(s, (s + 1) % S) for s in range(S)]  # activations on to s + 1, sampled tokens back to stage 0

    def tick(carry, t):
        received, (back_tok, back_m, back_ok), tokens, caches, out, out_lp = carry
        # Stage 0 keeps the tokens the last stage sampled a tick ago: micro-batch back_m's next input.
        tokens = _put_rows(tokens, back_tok, back_m, back_ok & (me == 0))
        j = jnp.clip(t - me, 0, total - 1)
        valid = (t - me >= 0) & (t - me < total)
        m, n = j % M, j // M
        x = jnp.where(me == 0, jnp.take(outer.embed, _rows(tokens, m, mb), axis=0)[:, None, :], received)
        starts = _rows(lengths, m, mb) + n
        now_rope = jnp.maximum(rope_len, jnp.max(lengths) + n + 1)
        mine = caches if step.paged else _each(lambda a: _rows(a, m, mb, axis=1), caches)
        tab = _rows(tables, m, mb) if step.paged else None
        y, added = _stage_slots(step, stacks, mine, x, _rows(tokens, m, mb)[:, None], starts,
                                jnp.ones((mb,), jnp.int32), now_rope, tab)
        if step.paged:  # into the pages of the micro-batch's real rows, only where valid
            keep = (valid & (_rows(active, m, mb) > 0)).astype(jnp.int32)
            caches = _pages_written(latent, caches, added, tab, starts, keep)
        else:
            written = _written(latent, mine, added, starts)  # micro-batch m's rows, kept only where valid
            caches = _each(lambda c, w: _put_rows(c, w, m, valid, axis=1), caches, written)
        h = rms_norm(y[:, 0], outer.final_norm, config.rms_norm_eps, offset=config.norm_weight_offset)
        logits = _whole(output_logits(outer, h[:, None, :])[:, 0, :])  # (not split over the vocabulary)
        sampled, logprob = pick(logits, m, n, mb, *pick_args)
        last = valid & (me == S - 1)

        def record(buf, value):  # row n, micro-batch m of a [steps, B] buffer (last stage only)
            row = jax.lax.dynamic_slice_in_dim(buf, n, 1, axis=0)[0]
            return jax.lax.dynamic_update_slice_in_dim(buf, _put_rows(row, value, m, last)[None], n, axis=0)

        out = record(out, sampled)
        out_lp = record(out_lp, logprob)
        passed, back = jax.lax.ppermute((y, (sampled, m, last)), "stage", ring)
        return (passed, back, tokens, caches, out, out_lp), None

    init = (jnp.zeros((mb, 1, D), outer.embed.dtype), (jnp.zeros((mb,), jnp.int32), jnp.int32(0), jnp.bool_(False)),
            first, caches, jnp.zeros((steps, B), jnp.int32), jnp.zeros((steps, B), jnp.float32))
    (_, _, _, caches, out, out_lp), _ = jax.lax.scan(tick, init, jnp.arange(total + S - 1))
    return jax.lax.psum(out, "stage"), jax.lax.psum(out_lp, "stage"), _each(lambda a: a[None], caches)


def pipeline_decode(weights: StagedWeights, config: ModelConfig, plan: StagePlan, parallel: Parallel,
                    first: jax.Array, cache: StagedKVCache, steps: int, num_micro: int, pick=greedy_pick,
                    pick_args: tuple = (), active: jax.Array | None = None) -> tuple[jax.Array, jax.Array, StagedKVCache]:
    """``steps`` greedy decode steps with micro-batches in flight: the tokens [steps, B] that
    follow ``first`` [B] (each row's last sampled token, not yet in ``cache``), their
    log-probabilities [steps, B], and the cache holding every token but the last sampled ones.

    Unlike a step of :func:`pipeline_forward`, which drains the pipeline at the end of every
    step, this keeps it full: the last stage samples micro-batch m's next token and passes it
    round to stage 0, which starts that micro-batch's next step while the other micro-batches
    are still in flight. With M >= S micro-batches no stage waits for a token, and only the first
    S - 1 and last S - 1 ticks have idle stages: a bubble of (S - 1) / (steps * M + S - 1).
    The cache must have room for ``steps`` more positions per row; a staged page pool
    (``pipeline_paged.StagedPagedCache``) is read and written through its block tables, and only
    the rows ``active`` [B] marks (default all) write. The last stage picks each token with
    ``pick(logits [mb, V], m, n, mb, *pick_args)`` -> (tokens [mb], log-probabilities [mb]) for
    micro-batch m's n-th step (default :func:`greedy_pick`; the serving engine samples each row
    with its own parameters and key, ``engine.serving_inflight``); ``pick_args`` are arrays it
    reads, passed in whole.
    """
    B, S = first.shape[0], plan.num_stages
    if B % num_micro or num_micro < S:
        raise ValueError(f"{num_micro} micro-batches for {B} rows on {S} stages: need a divisor of the batch that is "
                         f">= the stage count, so each stage has a micro-batch in flight")
    paged = hasattr(cache, "block_tables")
    step = _Step(config, plan, parallel, num_micro, False, paged, max_len=cache.max_len)
    stage = P("stage")
    body = jax.shard_map(
        lambda *a: _decode_body(step, steps, pick, *a), mesh=parallel.placement.mesh,
        in_specs=(stage, P(), stage, P(), P(), P(), P(), P(), P()), out_specs=(P(), P(), stage),
        axis_names={"stage"}, check_vma=False,  # as in pipeline_forward
    )
    tables = cache.block_tables if paged else jnp.zeros((), jnp.int32)
    active = jnp.ones((B,), jnp.int32) if active is None else active
    tokens, logprobs, caches = body(_stacks(weights, plan, config), weights.outer, cache.pages if paged else cache.buffers,
                                    tables, first, cache.lengths, cache.rope_len, active, tuple(pick_args))
    grown = cache.lengths + steps
    rope_len = jnp.maximum(cache.rope_len, jnp.max(grown))
    if paged:
        return tokens, logprobs, cache.replace(pages=caches, lengths=grown, rope_len=rope_len)
    return tokens, logprobs, cache.replace(buffers=caches, lengths=grown, rope_len=rope_len)
