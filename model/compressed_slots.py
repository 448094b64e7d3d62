"""DeepSeek-V4's serving cache: one contiguous cache row per serving slot (a "slot cache").

V4's per-sequence state is not paged: per layer a window ring, the compressed entries and the
compressors' states (``dayzero.model.compressed_cache``). The serving engine
(``dayzero.engine.serving``) therefore keeps one :class:`~dayzero.model.compressed_cache.CompressedCache`
row per slot, sized for ``max_context`` tokens, and each step names its rows' slots instead of
block tables:

- :class:`SlotCache` is that pool ([slots, ...] per leaf) together with one step's ``slots`` [B],
  ``lengths`` [B] and ``rope_len``. It is the cache view ``transformer.forward`` reads:
  ``layer(i)`` gathers the step's rows from their slots;
- :func:`append_to_slots` writes what ``forward`` returned into those slots with
  ``compressed_cache.append`` itself (the one implementation of the writes): the step's new rows,
  entries and states are spread over every slot, slots outside the step getting no token (their
  rings and entries are left as they are, their states carried over), so each slot is written in
  place and nothing else of the pool moves.

A slot needs no reset between sequences: a sequence that starts at length 0 reads no stale data
(ring slots are read only for positions below its length, entries only below length // ratio,
compressor ring slots only for positions in [length - m*r, length)), and its first call runs
without a cache (fresh compressor states). A row with no real token (``num_new`` 0: a padding row
of a decode batch, a warm-up call) writes nothing, whichever slot it names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model import compressed_cache
from dayzero.model.compressed import CompressedLayer, NewCompressedLayer
from dayzero.model.compressed_cache import CompressedCache, NewCompressed
from dayzero.model.config import ModelConfig
from dayzero.model.cache import empty_from_specs
from dayzero.model.paged_cache import after_input
from dayzero.model.quant import KVQuant
from dayzero.model.weights import Init, ParamSpec

__all__ = ["SlotCache", "slot_cache_specs", "init_slot_cache", "append_to_slots"]


@struct.dataclass
class SlotCache:
    """Per layer a :class:`~dayzero.model.compressed.CompressedLayer` whose leaves are [slots, ...]
    (the pool), and one step's rows: their ``slots`` [B] (int32), ``lengths`` [B] and ``rope_len``.
    ``max_len`` (static): the positions a slot holds (the serving ``max_context``)."""

    layers: tuple[CompressedLayer, ...]
    slots: jax.Array
    lengths: jax.Array
    rope_len: jax.Array
    max_len: int = struct.field(pytree_node=False, default=0)

    keys_token_major = False  # no per-head keys (see ``transformer.forward``)

    @property
    def num_slots(self) -> int:
        """Slots in the pool."""
        return self.layers[0].window.shape[0]

    def layer(self, i: int, after: jax.Array | None = None) -> CompressedLayer:
        """Layer ``i``'s cached arrays of the step's rows, gathered from their slots once ``after``
        (the layer's input) is computed (see ``paged_cache.after_input``)."""
        slots = after_input(self.slots, after)
        return jax.tree.map(lambda leaf: jnp.take(leaf, slots, axis=0, mode="clip"), self.layers[i])


def slot_cache_specs(config: ModelConfig, slots: int, max_len: int, batch: int = 1,
                     kv_quant: KVQuant = KVQuant.NONE) -> SlotCache:
    """The slot cache declared abstractly: ``compressed_cache.cache_specs`` for ``slots`` rows of
    ``max_len`` positions (with ``kv_quant``, quantized as the contiguous cache), and ``batch``
    step rows (slot indices and lengths, replaced by each step)."""
    rows = compressed_cache.cache_specs(config, slots, max_len, kv_quant)
    step = ParamSpec((batch,), ("batch",), Init.ZEROS, jnp.dtype(jnp.int32))
    return SlotCache(layers=rows.layers, slots=step, lengths=step, rope_len=rows.rope_len, max_len=max_len)


def init_slot_cache(config: ModelConfig, slots: int, max_len: int, dtype=jnp.float32,
                    kv_quant: KVQuant = KVQuant.NONE, shardings=None) -> SlotCache:
    """A zeroed slot cache (:func:`slot_cache_specs`, one step row), placed by ``shardings`` when
    given (a matching tree of shardings)."""
    return empty_from_specs(slot_cache_specs, config, slots, max_len, 1, kv_quant, jnp.dtype(dtype),
                            shardings=shardings)


def append_to_slots(cache: SlotCache, new: NewCompressed) -> SlotCache:
    """Write one ``forward`` call's rows, entries and compressor states into the step's slots and
    advance the step's lengths (jit it with the cache donated, apart from ``forward``, as
    ``cache.append_to_cache``). The step's slots must be distinct among rows with a real token."""
    S = cache.num_slots
    # Rows without a real token write nothing: out of range, so every scatter drops them.
    target = jnp.where(new.num_new > 0, cache.slots, S)

    def spread(x: jax.Array, fill) -> jax.Array:  # [B, ...] -> [S, ...], ``fill`` off the step
        return jnp.full((S, *x.shape[1:]), fill, x.dtype).at[target].set(x, mode="drop")

    def carried(new_state, old_state):  # the step's new states over every slot's own
        return jax.tree.map(lambda n, o: o.at[target].set(n.astype(o.dtype), mode="drop"), new_state, old_state)

    layers = []
    for c, n in zip(cache.layers, new.layers):
        spread_n = NewCompressedLayer(rows=spread(n.rows, 0))
        if n.entries is not None:
            spread_n = spread_n.replace(entries=spread(n.entries, 0), entry_ids=spread(n.entry_ids, -1),
                                        state=carried(n.state, c.state))
        if n.index_keys is not None:
            spread_n = spread_n.replace(index_keys=spread(n.index_keys, 0), index_ids=spread(n.index_ids, -1),
                                        index_state=carried(n.index_state, c.index_state))
        layers.append(spread_n)
    starts = jnp.zeros((S,), jnp.int32).at[target].set(cache.lengths, mode="drop")
    rows = CompressedCache(layers=cache.layers, lengths=starts, rope_len=cache.rope_len, max_len=cache.max_len)
    written = compressed_cache.append(rows, NewCompressed(layers=tuple(layers), num_new=spread(new.num_new, 0),
                                                          rope_len=new.rope_len))
    return cache.replace(layers=written.layers, lengths=cache.lengths + new.num_new, rope_len=new.rope_len)
