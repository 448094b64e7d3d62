"""The decoder forward pass: pure functions over (weights, tokens, cache).

One implementation serves prefill and decode. ``forward`` runs ``tokens`` [B, T] as the
continuation of each row of the KV cache (at that row's current length): the new queries attend
to the cached keys plus the new keys, and it returns logits and the new keys/values.
``dayzero.model.cache.append_to_cache`` then writes those into the cache, in a jit of its own
(the caches, their specs and writes live in ``dayzero.model.cache``). Rows may have different
lengths (``num_new`` says how many of the T tokens of each row are real; the rest is bucket
padding, written past the row's length and never attended to).

Multi-head latent attention (``config.attention`` MLA, ``dayzero.model.mla``) caches one latent
row per token instead (``LatentCache``); ``forward`` then returns ``NewLatent``. With sparse
attention (``config.dsa``) each token also caches its indexer key beside the latent row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dayzero.model import hyper
from dayzero.model.cache import CacheView, InPlaceKVCache, InPlaceLayer, NewKV, NewLatent, fold_blocks, read_block
from dayzero.model.compressed import CompressedFrame, compressed_block
from dayzero.model.compressed_cache import NewCompressed
from dayzero.model.config import AttentionKind, CompressKind, ModelConfig
from dayzero.model.linear_attn import LinearFrame, linear_attn_block
from dayzero.model.linear_cache import HybridCache, NewHybrid
from dayzero.model.mla import attend_latent, mla_block
from dayzero.model.mla_parallel import attend_latent_split
from dayzero.model.moe import moe, swiglu
from dayzero.model.moe_parallel import moe_expert_parallel
from dayzero.model.mrope import ImageInput
from dayzero.model.parallel import Parallel
from dayzero.model.norm import rms_norm
from dayzero.model.offload import stream_layer
from dayzero.kernels import KernelMode, cpu_attention, cpu_layer
from dayzero.kernels.tiles import Stats, finish_stats, masked_stats, merge_stats
from dayzero.model.kernel_attention import HeadSplit, KernelLayer, NewTokensLayer, PagedKernelCache
from dayzero.model.quant import QuantizedArray, as_stored, dequantized
from dayzero.model.quant_matmul import linear
from dayzero.model.rope import apply_rope, rope_cos_sin
from dayzero.model.compressed_weights import HyperWeights
from dayzero.model.weights import AttentionWeights, LayerWeights, MLPWeights, MoEWeights, Weights


def mlp(w: MLPWeights, x: jax.Array) -> jax.Array:
    """The dense SwiGLU MLP: down(silu(gate x) * up x)."""
    return swiglu(x, w.gate, w.up, w.down)


def attention_masks(
    starts: jax.Array, num_new: jax.Array, T: int, max_len: int | None, window: int | None
) -> tuple[jax.Array | None, jax.Array]:
    """Visibility of cached keys [B,T,S] and of the T new keys [B,T,T] to each new query.

    With ``max_len`` None there is no cache to read and the first mask is None.

    A cached slot is visible if it was written before this call (slot < start); a new key j is
    visible to new query i if it is real (j < num_new) and causal (j <= i). Sliding-window
    layers also require query position - key position < window.
    """
    B = starts.shape[0]
    i = jnp.arange(T)[None, :, None]
    j = jnp.arange(T)[None, None, :]
    new = (j <= i) & (j < num_new[:, None, None])
    if window is not None:
        new &= i - j < window
    new = jnp.broadcast_to(new, (B, T, T))
    if max_len is None:
        return None, new
    slots = jnp.arange(max_len)[None, None, :]
    cached = slots < starts[:, None, None]
    if window is not None:
        cached &= starts[:, None, None] + i - slots < window
    return jnp.broadcast_to(cached, (B, T, max_len)), new


def attend(
    q: jax.Array,
    k_cache: jax.Array | QuantizedArray | None,
    v_cache: jax.Array | QuantizedArray | None,
    k_new: jax.Array,
    v_new: jax.Array,
    masks: tuple[jax.Array | None, jax.Array],
    keys_token_major: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query softmax attention of the new queries over cached and new keys -> [B,T,N,H].

    q, k_new, v_new [B,T,*,H]; k_cache [B,K,H,S], v_cache [B,K,S,H] (the cache layouts, plain or
    quantized): the cache as it was before this call (None: nothing cached), the new keys and
    values beside it. ``keys_token_major``: k_cache is [B,K,S,H] instead (a paged cache's
    gathered view, where transposing each step's gathered keys would cost more than the slower
    score product). ``sinks`` [N] (gpt-oss): one more logit per query head in the softmax's
    denominator, a key whose value is zero (as the kernels' references take it).

    The cache is read in blocks (``cache.fold_blocks``), only from the first to the last
    position any query may see, each block dequantized as it is read, with an online softmax
    (``dayzero.kernels.tiles.Stats``) merging the blocks and the new keys: a decode step's work
    follows the positions written so far, not the positions allocated. On single-device CPU a
    float32 contiguous cache under a few query tokens is read by the native kernel instead
    (``dayzero.kernels.cpu_attention``: same statistics, no block copies).
    """
    B, T, N, H = q.shape
    K = k_new.shape[2]
    G = N // K
    # Queries as [B, K, G*T, H]: the cache matmuls then have the canonical batched form
    # (batch B,K; rows G*T), which XLA:CPU runs without relayouting the cache.
    qg = (q * (H**-0.5)).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    mask_cached, mask_new = masks  # [B, T, S], [B, T, T]
    stats = _key_stats(qg, k_new, v_new, mask_new, "bskh", "bskh")
    if k_cache is not None and cpu_attention.applies(q, k_cache, v_cache, keys_token_major):
        # Single-device CPU decode over a float32 cache: read where it lies, no block copies.
        stats = merge_stats(cpu_attention.cached_stats(qg, k_cache, v_cache, mask_cached), stats)
    elif k_cache is not None:
        keys = "bksh" if keys_token_major else "bkhs"

        def cached_block(start, size, mask):  # positions [start, start + size) and their mask
            k = dequantized(read_block(k_cache, start, size, 2 if keys_token_major else 3), q.dtype)
            v = dequantized(read_block(v_cache, start, size, 2), q.dtype)
            # Positions no query sees get weight 0, but 0 * NaN is NaN: zero whatever they hold.
            v = jnp.where(jnp.any(mask, axis=1)[:, None, :, None], v, 0)
            return _key_stats(qg, k, v, mask, keys, "bksh")

        empty = (jnp.full(qg.shape[:3], -jnp.inf), jnp.zeros(qg.shape[:3]), jnp.zeros(qg.shape, jnp.float32))
        stats = merge_stats(fold_blocks(mask_cached, cached_block, empty), stats)
    if sinks is not None:  # [N] -> [1, K, G*T], each query row its head's sink
        sinks = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(K, G, 1), (K, G, T)).reshape(1, K, G * T)
    # A query with no visible key (padding of an empty row) gets zeros, not NaN.
    out = finish_stats(stats, sinks).astype(v_new.dtype)
    return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _key_stats(qg: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, key_spec: str,
               value_spec: str) -> Stats:
    """Softmax statistics of queries ``qg`` [B,K,G*T,H] over one block of keys and values (laid
    out as the einsum specs ``key_spec``/``value_spec`` over b,k,s,h say) under ``mask`` [B,T,S]."""
    B, K, M, _ = qg.shape
    T = mask.shape[1]
    scores = jnp.einsum(f"bkmh,{key_spec}->bkms", qg, keys, preferred_element_type=jnp.float32)
    # Broadcast the [B, T, keys] mask over K and G, in the [B, K, G*T, keys] order of scores.
    mask = jnp.broadcast_to(mask[:, None, None], (B, 1, M // T) + mask.shape[1:]).reshape(B, 1, M, -1)

    def value_product(p):
        return jnp.einsum(f"bkms,{value_spec}->bkmh", p.astype(values.dtype), values,
                          preferred_element_type=jnp.float32)

    return masked_stats(scores, mask, value_product)


def attention_block(
    w: AttentionWeights,
    config: ModelConfig,
    x: jax.Array,
    cos_sin: tuple[jax.Array, jax.Array],
    layer_cache: tuple[jax.Array, jax.Array] | KernelLayer | None,
    masks: tuple[jax.Array | None, jax.Array],
    keys_token_major: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Self-attention of ``x`` [B,T,D] over the layer's cache: (keys, values) in the cache
    layouts (``keys_token_major`` as :func:`attend`), or None. Returns the output and the new
    (keys, values) [B,T,K,H]. Attention sinks (``w.sinks``, gpt-oss) join every softmax, on
    either path.

    A kernel layer (``dayzero.model.kernel_attention``) attends on the kernels instead: over the
    new keys only (a first prefill), or over its pages, written first, whose written (key pages,
    value pages) are then returned in place of the new keys/values. So does an
    :class:`~dayzero.model.cache.InPlaceLayer` (a contiguous float32 cache on single-device CPU,
    written and read in one native call)."""
    q, k, v = linear(x, w.q), linear(x, w.k), linear(x, w.v)
    if w.q_bias is not None:
        q, k, v = q + w.q_bias, k + w.k_bias, v + w.v_bias
    if w.q_norm is not None:
        # One RMS per head, or per token over all its heads (weights [N,H] / [K,H]).
        axes = (-2, -1) if config.qk_norm_all_heads else -1
        q = rms_norm(q, w.q_norm, config.rms_norm_eps, axes, config.norm_weight_offset)
        k = rms_norm(k, w.k_norm, config.rms_norm_eps, axes, config.norm_weight_offset)
    cos, sin = cos_sin
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if isinstance(layer_cache, KernelLayer) or isinstance(layer_cache, InPlaceLayer):
        out, new = layer_cache.attend(q, k, v, w.sinks)
    else:
        k_cache, v_cache = (None, None) if layer_cache is None else layer_cache
        # The new keys/values as the cache will hold them (quantized round trip), read beside it.
        k_read, v_read = as_stored(k, k_cache), as_stored(v, v_cache)
        # A quantized cache goes in as stored: attend dequantizes each block it reads.
        out, new = attend(q, k_cache, v_cache, k_read, v_read, masks, keys_token_major, w.sinks), (k, v)
    # Contract over the flattened N*H axis: a reshape of w.o is free, an einsum over (n, h)
    # makes XLA:CPU transpose w.o on every call.
    B, T, N, H = out.shape
    if w.gate is not None:  # Qwen3-Next's output gate, per head and dim
        out = out * jax.nn.sigmoid(linear(x, w.gate))
    out = linear(out.reshape(B, T, N * H), w.o, n_in=2)
    if w.o_bias is not None:
        out = out + w.o_bias
    return out, new


def _enter(hc: HyperWeights | None, norm: jax.Array, config: ModelConfig, x: jax.Array):
    """A block's normed input from the residual ``x``, and what :func:`_leave` needs: with
    hyper-connections, ``x`` is the streams [B,T,n,D] and their mix gives the input."""
    if hc is None:
        return rms_norm(x, norm, config.rms_norm_eps, offset=config.norm_weight_offset), None
    block_in, post, comb = hyper.mix(hc, config.hyper, x, config.rms_norm_eps)
    return rms_norm(block_in, norm, config.rms_norm_eps), (post, comb)


def _leave(x: jax.Array, out: jax.Array, mixing) -> jax.Array:
    """The residual after a block: ``x + out``, or the streams merged with ``out``."""
    return x + out if mixing is None else hyper.merge(x, out, *mixing)


def decoder_layer(
    w: LayerWeights,
    config: ModelConfig,
    x: jax.Array,
    cos_sin: tuple[jax.Array, jax.Array],
    layer_cache: tuple[jax.Array, ...] | None,
    masks: tuple[jax.Array | None, jax.Array],
    parallel: Parallel | None = None,
    keys_token_major: bool = False,
    picks: tuple[jax.Array, jax.Array] | None = None,
    tokens: jax.Array | None = None,
    frame: CompressedFrame | LinearFrame | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, jax.Array] | None]:
    """Pre-norm residual block: attention then SwiGLU MLP or MoE.

    ``layer_cache`` is the layer's cached arrays (``cache.layer(i)``, None when nothing is
    cached; ``keys_token_major`` as the cache's); also returns what the layer adds to the
    cache: (keys, values), or (latent rows,) for multi-head latent attention, (latent rows,
    indexer keys) with sparse attention.
    ``parallel``: the mesh, for the blocks that write their collectives by hand (see
    ``dayzero.model.parallel``).
    ``picks``: sparse attention's picks carried from layer to layer (``mla.mla_block``), returned
    updated as the third value.
    ``tokens`` [B,T]: the token ids (hash-routed MoE layers choose experts by them).
    ``frame``: DeepSeek-V4's attention needs the layer's kind and each row's start and real
    tokens (it builds its own masks), a hybrid's linear layer (a ``LinearFrame``) the rows' real
    tokens; with hyper-connections (``config.hyper``) ``x`` is the residual streams [B,T,n,D].
    A linear layer's ``layer_cache`` is its ``LinearState`` (None: a fresh sequence), and what it
    adds is its new state.

    A decode step over an :class:`~dayzero.model.cache.InPlaceLayer` of a plain Llama-family
    layer (``kernels.cpu_layer.applies``: single-device CPU, float32 activations, float32, int8 or
    int4 projections) runs the whole layer as one native call instead; these ops are its reference.
    """
    if frame is None and config.attention is AttentionKind.GQA and cpu_layer.applies(w, x, layer_cache, cos_sin[0]):
        out, new = cpu_layer.decoder_layer(w, x, cos_sin, layer_cache, config.rms_norm_eps, config.norm_weight_offset)
        return out, new, picks
    h, mixing = _enter(w.attn_hc, w.attn_norm, config, x)
    if isinstance(frame, LinearFrame):  # a hybrid's linear layer: its state in, its new state out
        attn_out, new = linear_attn_block(w.attn, config, h, layer_cache, frame.num_new, frame.kernels)
    elif config.attention is AttentionKind.MLA:
        latent_attend = attend_latent if parallel is None else functools.partial(attend_latent_split, parallel)
        attn_out, new, picks = mla_block(w.attn, config, h, cos_sin, layer_cache, masks, latent_attend, picks)
    elif config.attention is AttentionKind.COMPRESSED:
        attn_out, new = compressed_block(w.attn, config, frame.kind, h, cos_sin, layer_cache, frame.starts,
                                         frame.num_new)
    else:
        attn_out, new = attention_block(w.attn, config, h, cos_sin, layer_cache, masks, keys_token_major)
    x = _leave(x, attn_out, mixing)
    h, mixing = _enter(w.mlp_hc, w.mlp_norm, config, x)
    # The weight tree's type per layer follows config.moe.layers (see weights._layer_specs).
    if not isinstance(w.mlp, MoEWeights):
        out = mlp(w.mlp, h)
    elif parallel is None or parallel.size("experts") == 1:
        out = moe(w.mlp, config.moe, h, tokens=tokens)
    else:
        out = moe_expert_parallel(w.mlp, config.moe, h, parallel, tokens=tokens)
    return _leave(x, out, mixing), new, picks


def output_logits(weights: Weights, x: jax.Array) -> jax.Array:
    """Project hidden states [B,T,D] to fp32 vocabulary logits [B,T,V]."""
    if weights.lm_head is None:
        return jnp.einsum("btd,vd->btv", x, weights.embed, preferred_element_type=jnp.float32)
    return linear(x, weights.lm_head, out_dtype=jnp.float32)


def step_frame(B: int, T: int, cache, num_new: jax.Array | None) -> tuple:
    """Where a step of T new tokens per row sits after ``cache`` (None: from scratch):
    (num_new [B], default all T; starts [B]; the RoPE table length; the cache's max_len or None;
    positions [B,T])."""
    if num_new is None:
        num_new = jnp.full((B,), T, jnp.int32)
    if cache is None:
        starts, rope_len, max_len = jnp.zeros((B,), jnp.int32), jnp.max(num_new), None
    else:
        starts, max_len = cache.lengths, cache.max_len
        rope_len = jnp.maximum(cache.rope_len, jnp.max(starts + num_new))
    return num_new, starts, rope_len, max_len, starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


def forward(
    weights: Weights,
    config: ModelConfig,
    tokens: jax.Array,
    cache: CacheView | None = None,
    num_new: jax.Array | None = None,
    all_logits: bool = False,
    hidden_out: list | None = None,
    parallel: Parallel | None = None,
    kernels: KernelMode = KernelMode.REFERENCE,
    images: ImageInput | None = None,
) -> tuple[jax.Array, NewKV | NewLatent | PagedKernelCache]:
    """Run ``tokens`` [B,T] as the continuation of each cached row (from scratch if no cache).

    ``num_new`` [B] is how many of the T tokens of each row are real (default: all T).
    Returns fp32 logits [B,T,V] if ``all_logits`` else the logits of each row's last real token
    [B,V], and the new keys/values to pass to ``cache.append_to_cache``. ``hidden_out``, when
    given a list, receives each decoder layer's output (for layer-by-layer comparison).
    A first prefill should pass ``cache=None`` rather than an empty cache: reading an empty
    cache costs as much attention work as a full one. ``parallel`` (on a mesh): MoE blocks
    dispatch tokens to the devices owning their experts when the experts are split, latent
    attention works on each device's slice of a split latent cache (``dayzero.model.parallel``).
    ``kernels`` (a resolved mode): with ``cache`` None and a Pallas mode, the new tokens attend
    to each other on the kernels (``dayzero.model.kernel_attention``; on a mesh, per device
    inside ``shard_map`` over the head split). A
    :class:`~dayzero.model.kernel_attention.PagedKernelCache` (a step on the paged kernels,
    which carries its own mode) is returned written, in place of the new keys/values; so is an
    :class:`~dayzero.model.cache.InPlaceKVCache` (single-device CPU decode, as a ``KVCache``).
    ``images`` (Qwen3-VL, Qwen3.5, Kimi-K2.5; ``dayzero.model.mrope``): image embeddings written
    over their placeholders' token embeddings, DeepStack features added after the first layers, and
    the tokens' M-RoPE positions [3, B, T] used by every attention layer in place of the cache
    positions (also in text steps after an image prompt, shifted by the rope deltas); a model
    without M-RoPE (no ``rope.mrope_section``: Kimi-K2.5) reads the first axis as plain positions.
    """
    B, T = tokens.shape
    num_new, starts, rope_len, max_len, positions = step_frame(B, T, cache, num_new)
    if images is not None:
        # A model without M-RoPE (Kimi-K2.5) gets its images' positions equal on the three axes: plain RoPE.
        positions = images.position_ids if config.rope.mrope_section else images.position_ids[0]
    cos_sin = rope_cos_sin(config.rope, config.head_dim, config.max_position_embeddings, positions, rope_len)
    masks = {
        window: attention_masks(starts, num_new, T, max_len, window)
        for window in set(config.sliding_windows)
    }
    if config.compressed is not None:  # sliding layers rotate with the main RoPE, CSA/HCA ones with their own
        compress_cos_sin = rope_cos_sin(config.compressed.compress_rope, config.head_dim,
                                        config.max_position_embeddings, positions, rope_len)
    x = jnp.take(weights.embed, tokens, axis=0)
    if images is not None:
        x = images.scatter(x)
    if config.hyper is not None:
        x = hyper.expand(x, config.hyper)
    token_major = cache is not None and cache.keys_token_major
    # The linear layers' delta rule runs on the kernels as the attention does: ``kernels`` for a
    # first prefill, the mode a paged kernel view carries for a step over it.
    attn_view = cache.attn if isinstance(cache, HybridCache) else cache
    linear_kernels = kernels if cache is None else getattr(attn_view, "mode", KernelMode.REFERENCE)
    new = []  # per layer, what it adds to the cache
    picks = None  # sparse attention's last picks, which GLM-5's shared layers reuse
    ahead = None  # offloaded layers (dayzero.model.offload): the next layer's weights, in flight
    for i, layer in enumerate(weights.layers):
        layer, ahead = stream_layer(weights.layers, i, x, ahead)
        layer_masks = masks[config.sliding_windows[i]]
        linear = config.is_linear_layer(i)
        if cache is not None:
            layer_cache = cache.layer(i, after=x)
        elif kernels is not KernelMode.REFERENCE and not linear:
            layer_cache = NewTokensLayer(num_new, kernels, config.sliding_windows[i], HeadSplit.of(parallel))
        else:
            layer_cache = None
        layer_cos_sin, frame = cos_sin, None
        if config.compressed is not None:
            kind = config.compressed.kinds[i]
            layer_cos_sin = cos_sin if kind is CompressKind.SLIDING else compress_cos_sin
            frame = CompressedFrame(kind, starts, num_new)
        elif linear:
            frame = LinearFrame(num_new, linear_kernels)
        x, added, picks = decoder_layer(layer, config, x, layer_cos_sin, layer_cache, layer_masks, parallel,
                                        token_major, picks, tokens, frame)
        if images is not None:
            x = images.add_deepstack(x, i)
        new.append(added)
        if hidden_out is not None:
            hidden_out.append(x)
    if config.hyper is not None:
        x = hyper.head(weights.hc_head, config.hyper, x, config.rms_norm_eps)
    x = rms_norm(x, weights.final_norm, config.rms_norm_eps, offset=config.norm_weight_offset)
    if not all_logits:
        last = jnp.clip(num_new - 1, 0, T - 1)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)
    logits = output_logits(weights, x)
    if not all_logits:
        logits = logits[:, 0, :]
    if config.linear is None:
        return logits, _additions(config, cache, new, num_new, rope_len)
    states = tuple(n for i, n in enumerate(new) if config.is_linear_layer(i))
    attn_new = [n for i, n in enumerate(new) if not config.is_linear_layer(i)]
    return logits, NewHybrid(attn=_additions(config, attn_view, attn_new, num_new, rope_len), states=states,
                             num_new=num_new)


def _additions(config: ModelConfig, cache, new: list, num_new: jax.Array, rope_len: jax.Array):
    """What the attention layers' ``new`` (per layer, as ``decoder_layer`` returns it) add to
    ``cache``, in the cache's form (a kernel view: its pages, which the blocks wrote)."""
    if isinstance(cache, (PagedKernelCache, InPlaceKVCache)):  # the blocks wrote the cache themselves
        return cache.written(new, rope_len)
    if config.compressed is not None:
        return NewCompressed(layers=tuple(new), num_new=num_new, rope_len=rope_len)
    if config.mla is not None:
        keys = None if config.dsa is None else tuple(n[1] for n in new)
        return NewLatent(latent=tuple(n[0] for n in new), num_new=num_new, rope_len=rope_len, index_keys=keys)
    return NewKV(k=tuple(n[0] for n in new), v=tuple(n[1] for n in new), num_new=num_new, rope_len=rope_len)
