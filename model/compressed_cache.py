"""DeepSeek-V4's contiguous cache: per layer a window ring, compressed entries and compressor states.

What a row holds per layer (``compressed.CompressedLayer``), sized by the layer's kind:

- ``window`` [B,W,H]: the key rows of the last W positions, slot = position % W. A row's window
  costs the same at any context length;
- CSA/HCA layers: ``entries`` [B, ceil(max_len/ratio), H], entry w at row w, and the compressor's
  ``state`` (its ring of the last m*ratio projected rows, ``compressor.CompressorState``);
- CSA layers also the indexer's keys [B, ceil(max_len/ratio), J] and its compressor's state.

So a sequence costs per token sum over CSA layers of (H + J) / 4 plus over HCA layers H / 128
values, not H per layer. On a mesh every leaf splits by row (``batch``) only: entries and index
keys are whole on each ``tensor`` device. Split by position (``latent_seq``, as the MLA latent
cache) they were all-gathered in every decode step, since the attention reads all of them; a
position split needs an attention that merges per-device partial softmaxes (``mla_parallel``'s
form), not written yet. Window rows, entries and index keys are KV rows: with a quantized KV
cache they are stored quantized (one scale per row, ``cache.buffer_spec``). The compressor states
are the running sums' inputs, kept in the model's float dtype whatever the KV format.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from dayzero.model import compressor
from dayzero.model.cache import buffer_spec, write_quantized
from dayzero.model.compressed import CompressedLayer, NewCompressedLayer
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.quant import KVQuant
from dayzero.model.weights import Init, ParamSpec


@struct.dataclass
class CompressedCache:
    """DeepSeek-V4's cache: per-layer :class:`~dayzero.model.compressed.CompressedLayer`, per-row
    lengths [B] and ``rope_len``; ``max_len`` (static) is the positions each row can hold."""

    layers: tuple[CompressedLayer, ...]
    lengths: jax.Array
    rope_len: jax.Array
    max_len: int = struct.field(pytree_node=False, default=0)

    keys_token_major = False

    def layer(self, i: int, after: jax.Array | None = None) -> CompressedLayer:
        """Layer ``i``'s cached arrays (``after`` as ``cache.KVCache.layer``'s, ignored here)."""
        return self.layers[i]


@struct.dataclass
class NewCompressed:
    """What one ``forward`` call adds to a :class:`CompressedCache`, per layer."""

    layers: tuple[NewCompressedLayer, ...]
    num_new: jax.Array  # [B] real tokens per row
    rope_len: jax.Array  # the cache's new ``rope_len``


def layer_spec(config: ModelConfig, kind: CompressKind, batch: int, max_len: int,
               kv_quant: KVQuant) -> CompressedLayer:
    """One layer's cache declared for ``batch`` rows of ``max_len`` positions (see the module docstring)."""
    cc, H = config.compressed, config.head_dim
    window = buffer_spec((batch, cc.window, H), ("batch", None, None), 2, kv_quant)
    if kind is CompressKind.SLIDING:
        return CompressedLayer(window=window)
    ratio = cc.ratio_of(kind)
    rows = math.ceil(max_len / ratio)
    layer = CompressedLayer(
        window=window,
        entries=buffer_spec((batch, rows, H), ("batch", None, None), 2, kv_quant),
        state=compressor.state_spec(batch, H, ratio, kind is CompressKind.CSA),
    )
    if kind is CompressKind.CSA:
        J = cc.index_head_dim
        layer = layer.replace(index_keys=buffer_spec((batch, rows, J), ("batch", None, None), 2, kv_quant),
                              index_state=compressor.state_spec(batch, J, ratio, True))
    return layer


def cache_specs(config: ModelConfig, batch: int, max_len: int, kv_quant: KVQuant = KVQuant.NONE) -> CompressedCache:
    """The cache declared abstractly (as ``cache.cache_specs`` for the other attentions)."""
    lengths = ParamSpec((batch,), ("batch",), Init.ZEROS, jnp.dtype(jnp.int32))
    rope_len = ParamSpec((), (), Init.ZEROS, jnp.dtype(jnp.int32))
    layers = tuple(layer_spec(config, kind, batch, max_len, kv_quant) for kind in config.compressed.kinds)
    return CompressedCache(layers=layers, lengths=lengths, rope_len=rope_len, max_len=max_len)


def _write_entries(buffer, rows: jax.Array, ids: jax.Array):
    """Entries [B,M,C] written at their entry indices [B,M]; -1 (no entry) is dropped."""
    ids = jnp.where(ids < 0, buffer.shape[1], ids)  # out of range: mode="drop" skips it
    batch = jnp.arange(ids.shape[0])[:, None]
    return write_quantized(buffer, rows, lambda buf, r: buf.at[batch, ids].set(r, mode="drop"))


def _append_layer(c: CompressedLayer, n: NewCompressedLayer, starts: jax.Array, num_new: jax.Array) -> CompressedLayer:
    window = compressor.ring_write(c.window, n.rows, starts, num_new)
    c = c.replace(window=window)
    if n.entries is not None:
        c = c.replace(entries=_write_entries(c.entries, n.entries, n.entry_ids), state=_cast_state(n.state, c.state))
    if n.index_keys is not None:
        c = c.replace(index_keys=_write_entries(c.index_keys, n.index_keys, n.index_ids),
                      index_state=_cast_state(n.index_state, c.index_state))
    return c


def _cast_state(new: compressor.CompressorState, old: compressor.CompressorState) -> compressor.CompressorState:
    return jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)


def append(cache: CompressedCache, new: NewCompressed) -> CompressedCache:
    """Write one ``forward`` call's rows, entries and states and advance the lengths (jit it with
    the cache donated, as ``cache.append_to_cache``)."""
    starts = cache.lengths
    layers = tuple(_append_layer(c, n, starts, new.num_new) for c, n in zip(cache.layers, new.layers))
    return cache.replace(layers=layers, lengths=starts + new.num_new, rope_len=new.rope_len)
