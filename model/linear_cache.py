"""The cache of a linear-attention hybrid: the attention layers' KV cache beside the linear
layers' states.

A hybrid's full-attention layers cache keys and values (or latent rows) per position, as any
model's do; its linear layers cache a fixed-size :class:`~dayzero.model.linear_attn.LinearState`
per sequence. :class:`HybridCache` holds both: ``attn``, any of the attention caches (contiguous
``KVCache``/``LatentCache``, paged ``PagedKVCache``/``PagedLatentCache``, or the kernels' paged
view), declared for the attention layers only (:func:`attention_config`: a KV row per attention
layer, none for the linear ones), and ``states``, one ``LinearState`` per linear layer. It has the
interface ``transformer.forward`` reads (``layer(i)`` maps decoder layer i to its attention-cache
layer or its state), and ``forward`` returns a :class:`NewHybrid` for it.

Two ways to hold the states:

- contiguous (``Engine.generate``): ``slots`` None, the states' rows are the cache's rows;
  :func:`append_states` replaces them (a row with no real token keeps its state: the block
  leaves it unchanged);
- serving (``dayzero.engine.serving``): the states are a pool of one row per serving slot beside
  the KV pages, and each step names its rows' ``slots`` [B]; ``layer(i)`` gathers the step's
  rows, :func:`append_states` scatters the new ones back (rows without a real token write
  nothing). A slot needs no reset: a sequence's first chunk reads no cache (fresh states).

A prefix-cache hit needs the states as they were at the reused prefix's end: serving copies a
slot's states (``slot_states``) into snapshot rows at page boundaries and back into the slot of
a request that reuses the prefix (``dayzero.engine.serving``); preemption recomputes a request,
states included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model.config import ModelConfig
from dayzero.model.linear_attn import LinearState, state_specs
from dayzero.model.paged_cache import after_input
from dayzero.model.weights import Init, ParamSpec


def attention_config(config: ModelConfig) -> ModelConfig:
    """``config`` cut to its attention layers, in order: what the attention cache is declared
    for (the attention caches read only ``num_layers``, the windows and the attention settings)."""
    keep = config.linear.attention_layers
    return dataclasses.replace(config, num_layers=len(keep), linear=None, moe=None,
                               sliding_windows=tuple(config.sliding_windows[i] for i in keep))


@struct.dataclass
class HybridCache:
    """The attention layers' cache ``attn`` and the linear layers' ``states`` (rows, or a pool
    indexed by ``slots`` [B]); ``linear`` (static): per decoder layer, whether it is linear."""

    attn: Any
    states: tuple[LinearState, ...]
    slots: jax.Array | None = None
    linear: tuple[bool, ...] = struct.field(pytree_node=False, default=())

    @property
    def lengths(self) -> jax.Array:
        """Each row's cached positions [B] (the attention cache's)."""
        return self.attn.lengths

    @property
    def rope_len(self) -> jax.Array:
        """The attention cache's ``rope_len``."""
        return self.attn.rope_len

    @property
    def max_len(self) -> int:
        """The positions each row can hold (the attention cache's)."""
        return self.attn.max_len

    @property
    def keys_token_major(self) -> bool:
        """Whether the attention layers' keys are token-major (see ``cache.CacheView``)."""
        return self.attn.keys_token_major

    def index(self, i: int) -> int:
        """Decoder layer ``i``'s index among the layers of its kind (attention or linear)."""
        return sum(1 for lin in self.linear[:i] if lin == self.linear[i])

    def layer(self, i: int, after: jax.Array | None = None):
        """Layer ``i``'s cache: its state (the step's rows, gathered from their slots once
        ``after``, the layer's input, exists) or its attention cache's layer."""
        if not self.linear[i]:
            return self.attn.layer(self.index(i), after)
        state = self.states[self.index(i)]
        if self.slots is None:
            return state
        slots = after_input(self.slots, after)
        return jax.tree.map(lambda leaf: jnp.take(leaf, slots, axis=0, mode="clip"), state)

    @property
    def slot_states(self) -> tuple[LinearState, ...]:
        """The states (with a pool: [slots, ...] per leaf): what a prefix-cache snapshot copies
        (``engine.paged_steps``)."""
        return self.states

    def with_slot_states(self, states: tuple[LinearState, ...]) -> "HybridCache":
        """The cache with ``states`` (as :attr:`slot_states` gives them)."""
        return self.replace(states=states)

    def with_rows(self, **rows) -> "HybridCache":
        """A step's rows: ``slots`` for the states, the rest (``block_tables``, ``lengths``) for
        the attention cache."""
        slots = rows.pop("slots", self.slots)
        return self.replace(attn=self.attn.replace(**rows), slots=slots)


@struct.dataclass
class NewHybrid:
    """What one ``forward`` call adds to a :class:`HybridCache`: the attention layers' additions
    ``attn`` (``NewKV``/``NewLatent``, or the kernels' written view), the linear layers' new states
    (the step's rows) and the rows' real tokens ``num_new`` [B]."""

    attn: Any
    states: tuple[LinearState, ...]
    num_new: jax.Array


def hybrid_specs(config: ModelConfig, attn_specs: Any, state_rows: int, step_rows: int | None = None) -> HybridCache:
    """The hybrid cache declared: ``attn_specs`` (declared for :func:`attention_config`) and one
    state per linear layer for ``state_rows`` rows; ``step_rows`` (serving): a pool, with that
    many step rows' slot indices."""
    states = tuple(state_specs(config, state_rows) for _ in config.linear.linear_layers)
    slots = None
    if step_rows is not None:
        slots = ParamSpec((step_rows,), ("batch",), Init.ZEROS, jnp.dtype(jnp.int32))
    return HybridCache(attn=attn_specs, states=states, slots=slots, linear=config.linear.layers)


def append_states(cache: HybridCache, new: NewHybrid, attn: Any) -> HybridCache:
    """``cache`` with its attention part ``attn`` (already written) and the step's new states:
    the rows replaced, or with a pool scattered into the step's slots (rows without a real
    token write nothing; the step's real rows must name distinct slots)."""
    if cache.slots is None:
        return cache.replace(attn=attn, states=new.states)
    S = cache.states[0].recurrent.shape[0]
    target = jnp.where(new.num_new > 0, cache.slots, S)

    def scatter(pool: jax.Array, rows: jax.Array) -> jax.Array:
        return pool.at[target].set(rows.astype(pool.dtype), mode="drop")

    states = tuple(jax.tree.map(scatter, pool, rows) for pool, rows in zip(cache.states, new.states))
    return cache.replace(attn=attn, states=states)
