"""DeepSeek-V4 compressors and indexer (``dayzero.model.compressor``) against HF's modules.

The oracle is the tiny randomised HF model of ``tests/v4_helpers.py`` in fp32 on CPU: its layer 1
(CSA, ratio 4, with the indexer) and layer 2 (HCA, ratio 16) ``self_attn.compressor`` modules,
called directly without a cache (prefill) and with a ``DynamicCache`` (chunked), whose running
compressed lists are what every chunked call of ours must add up to.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dayzero.model.compressor import (CompressorState, compress, empty_state, index_keys, index_scores,
                                      index_select, ring_positions, ring_write)
from dayzero.model.config import (AttentionKind, CompressedConfig, Family, ModelConfig, RopeConfig)
from dayzero.model.compressed_weights import CompressedIndexerWeights, CompressorWeights
from tests.v4_helpers import tiny_hf_model

SEQ = 150
CHUNKS = (37, 1, 1, 13, 50, 1, 2, 45)  # odd sizes, splitting windows of 4 and 16 anywhere
PAD_T = 64  # chunks longer than one token go through one padded, jitted shape
CSA_LAYER, HCA_LAYER = 1, 2
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def hf():
    import transformers.models.deepseek_v4.modeling_deepseek_v4  # noqa: F401  (registers the V4 cache layers)

    return tiny_hf_model(seed=0)


def dz_config(hf_config) -> ModelConfig:
    """The tiny HF config as dayzero's ModelConfig (only what the compressors read matters)."""
    rp = hf_config.rope_parameters
    compressed = CompressedConfig(
        kinds=tuple(hf_config.layer_types), window=hf_config.sliding_window,
        compress_rope=RopeConfig(theta=rp["compress"]["rope_theta"],
                                 partial_rotary_factor=rp["compress"]["partial_rotary_factor"]),
        q_lora_rank=hf_config.q_lora_rank, o_groups=hf_config.o_groups, o_lora_rank=hf_config.o_lora_rank,
        index_topk=hf_config.index_topk, index_heads=hf_config.index_n_heads,
        index_head_dim=hf_config.index_head_dim,
        csa_ratio=hf_config.compress_rates["compressed_sparse_attention"],
        hca_ratio=hf_config.compress_rates["heavily_compressed_attention"])
    return ModelConfig(
        family=Family.DEEPSEEK_V4, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.moe_intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads, num_kv_heads=1, head_dim=hf_config.head_dim,
        rms_norm_eps=hf_config.rms_norm_eps, max_position_embeddings=hf_config.max_position_embeddings,
        rope=RopeConfig(theta=rp["main"]["rope_theta"], partial_rotary_factor=rp["main"]["partial_rotary_factor"]),
        attention=AttentionKind.COMPRESSED, compressed=compressed)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def compressor_weights(module) -> CompressorWeights:
    """An HF compressor (or indexer, which holds its compressor's projections) as CompressorWeights."""
    return CompressorWeights(kv=_np(module.kv_proj.weight).T, gate=_np(module.gate_proj.weight).T,
                             position_bias=_np(module.position_bias), norm=_np(module.kv_norm.weight))


def indexer_weights(indexer, config: ModelConfig) -> CompressedIndexerWeights:
    cc = config.compressed
    q_b = _np(indexer.q_b_proj.weight).T.reshape(cc.q_lora_rank, cc.index_heads, cc.index_head_dim)
    return CompressedIndexerWeights(q_b=q_b, head_weights=_np(indexer.scorer.weights_proj.weight).T,
                                    compressor=compressor_weights(indexer))


def inputs(seed: int, T: int = SEQ, batch: int = 1):
    """Hidden states (scaled so gates matter beside the position bias) and q latents."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, T, 64, generator=g) * 2, torch.randn(batch, T, 32, generator=g)


def kind(layer: int):
    """(ratio, overlap) of the tiny model's compressor at ``layer``."""
    return (4, True) if layer == CSA_LAYER else (16, False)


def hf_compress_calls(hf, layer: int, x: torch.Tensor, q: torch.Tensor, chunks) -> list[np.ndarray]:
    """HF's running compressed list [n, H] after each chunk (one DynamicCache across them)."""
    from transformers import DynamicCache

    comp = hf.model.layers[layer].self_attn.compressor
    cache, out, s = DynamicCache(config=hf.config), [], 0
    with torch.no_grad():
        for n in chunks:
            pos = torch.arange(s, s + n)[None]
            kv, _ = comp(x[:, s:s + n], q[:, s:s + n], pos, cache, layer)
            out.append(_np(kv[0, 0]))
            s += n
    return out


@functools.partial(jax.jit, static_argnames=("config", "ratio", "width", "overlap"))
def _compress(w, config, x, state, starts, num_new, ratio, width, overlap):
    return compress(w, config, x, state, starts, num_new, ratio, width, overlap)


_index_keys = jax.jit(index_keys, static_argnames=("config", "ratio"))
_index_select = jax.jit(index_select, static_argnames=("config", "ratio"))
_index_scores = jax.jit(index_scores, static_argnames=("config", "ratio"))


@pytest.mark.parametrize("layer", [HCA_LAYER, CSA_LAYER], ids=["hca", "csa"])
def test_prefill_without_cache_matches_hf(hf, layer):
    config, (ratio, overlap) = dz_config(hf.config), kind(layer)
    x, q = inputs(layer)
    comp = hf.model.layers[layer].self_attn.compressor
    with torch.no_grad():
        want = _np(comp(x, q, torch.arange(SEQ)[None], None, layer)[0][0, 0])
    entries, ids, state = _compress(compressor_weights(comp), config, jnp.asarray(x.numpy()), None,
                                    jnp.zeros(1, jnp.int32), jnp.full(1, SEQ, jnp.int32), ratio, 64, overlap)
    n = SEQ // ratio
    assert want.shape == (n, 64)
    np.testing.assert_array_equal(np.asarray(ids[0]), np.r_[np.arange(n), [-1] * (ids.shape[1] - n)])
    np.testing.assert_allclose(np.asarray(entries[0, :n]), want, **TOL)
    m = 2 if overlap else 1
    assert isinstance(state, CompressorState) and state.kv.shape == (1, m * ratio, m * 64)


def run_chunks(w, config, x: np.ndarray, chunks, ratio, width, overlap, seed=0):
    """Our compress over ``chunks`` of one row, carrying the state; chunks of more than one token
    are padded to PAD_T with random rows (they must not leak). Returns {window id: entry} after each chunk."""
    rng = np.random.default_rng(seed)
    state, s, seen, after = None, 0, {}, []
    for n in chunks:
        T = 1 if n == 1 else PAD_T
        xc = rng.standard_normal((1, T, x.shape[-1]), np.float32) * 3
        xc[0, :n] = x[0, s:s + n]
        entries, ids, state = _compress(w, config, jnp.asarray(xc), state, jnp.full(1, s, jnp.int32),
                                        jnp.full(1, n, jnp.int32), ratio, width, overlap)
        for k, i in enumerate(np.asarray(ids[0])):
            if i >= 0:
                assert i not in seen, f"window {i} emitted twice"
                seen[int(i)] = np.asarray(entries[0, k])
        after.append(dict(seen))
        s += n
    return after


@pytest.mark.parametrize("layer", [HCA_LAYER, CSA_LAYER], ids=["hca", "csa"])
def test_chunked_with_state_matches_hf_cache(hf, layer):
    config, (ratio, overlap) = dz_config(hf.config), kind(layer)
    x, q = inputs(10 + layer)
    want = hf_compress_calls(hf, layer, x, q, CHUNKS)
    comp = hf.model.layers[layer].self_attn.compressor
    got = run_chunks(compressor_weights(comp), config, x.numpy(), CHUNKS, ratio, 64, overlap)
    for step, (w_list, g) in enumerate(zip(want, got)):
        assert sorted(g) == list(range(len(w_list))), f"chunk {step}: windows {sorted(g)}"
        if g:
            np.testing.assert_allclose(np.stack([g[i] for i in range(len(w_list))]), w_list, **TOL)


def test_ragged_batch_equals_rows_alone(hf):
    """Two rows at different starts and counts in one padded call equal each row run alone."""
    config, (ratio, overlap) = dz_config(hf.config), kind(CSA_LAYER)
    w = compressor_weights(hf.model.layers[CSA_LAYER].self_attn.compressor)
    x, _ = inputs(3, T=80, batch=2)
    x = x.numpy()
    pre, new = (41, 7), (23, 5)  # row 0 continues mid-window at 41, row 1 at 7
    alone, states = [], []
    for b in range(2):  # each row alone, padded with zeros to the chunked test's compiled shape
        xb = np.zeros((2, 1, PAD_T, 64), np.float32)
        xb[0, 0, :pre[b]] = x[b, :pre[b]]
        xb[1, 0, :new[b]] = x[b, pre[b]:pre[b] + new[b]]
        _, _, st = _compress(w, config, jnp.asarray(xb[0]), None, jnp.zeros(1, jnp.int32),
                             jnp.full(1, pre[b], jnp.int32), ratio, 64, overlap)
        states.append(st)
        alone.append(_compress(w, config, jnp.asarray(xb[1]), st, jnp.full(1, pre[b], jnp.int32),
                               jnp.full(1, new[b], jnp.int32), ratio, 64, overlap))
    T = 30
    xs = np.random.default_rng(1).standard_normal((2, T, 64)).astype(np.float32) * 5  # padding rows
    for b in range(2):
        xs[b, :new[b]] = x[b, pre[b]:pre[b] + new[b]]
    state = jax.tree.map(lambda a, c: jnp.concatenate([a, c]), *states)
    entries, ids, new_state = _compress(w, config, jnp.asarray(xs), state, jnp.asarray(pre, jnp.int32),
                                       jnp.asarray(new, jnp.int32), ratio, 64, overlap)
    for b, (e1, i1, s1) in enumerate(alone):
        i1, ib = np.asarray(i1[0]), np.asarray(ids[b])
        real = ib[ib >= 0]
        assert real.tolist() == i1[i1 >= 0].tolist() and len(real) > 0
        np.testing.assert_allclose(np.asarray(entries[b])[ib >= 0], np.asarray(e1[0])[i1 >= 0], **TOL)
        np.testing.assert_allclose(np.asarray(new_state.kv[b]), np.asarray(s1.kv[0]), **TOL)
        np.testing.assert_allclose(np.asarray(new_state.gate[b]), np.asarray(s1.gate[0]), **TOL)


def hf_indexer_picks(hf, x, q, chunks):
    """HF's indexer picks [T, k] per chunk (entry ids, -1 invalid) and its final index keys."""
    from transformers import DynamicCache

    indexer = hf.model.layers[CSA_LAYER].self_attn.compressor.indexer
    cache, picks, s = DynamicCache(config=hf.config), [], 0
    with torch.no_grad():
        for n in chunks:
            picks.append(indexer(x[:, s:s + n], q[:, s:s + n], torch.arange(s, s + n)[None], cache,
                                 CSA_LAYER)[0].numpy())
            s += n
    return picks, _np(cache.layers[CSA_LAYER].compressed_kv["indexer"][0])


def assert_same_picks(got_ids: np.ndarray, valid: np.ndarray, want: np.ndarray):
    for t in range(want.shape[0]):
        ours = set(got_ids[t][valid[t]].tolist())
        theirs = set(want[t][want[t] >= 0].tolist())
        assert ours == theirs, f"query {t}: picks {sorted(ours)} != HF {sorted(theirs)}"


def assert_tie_gap(scores: np.ndarray, k: int, gap: float = 1e-4) -> int:
    """Where a query sees more than k entries, its k-th and (k+1)-th scores differ by > gap (so
    the top-k set is well defined); returns how many queries had to choose."""
    choosing = 0
    for row in scores:
        vis = np.sort(row[np.isfinite(row)])[::-1]
        if len(vis) > k:
            choosing += 1
            assert vis[k - 1] - vis[k] > gap, f"near tie {vis[k - 1]} vs {vis[k]}; pick another seed"
    return choosing


def test_indexer_topk_matches_hf(hf):
    """Prefill (100 tokens), then a 50-token chunk read against the cached index keys. Both calls
    have one shape (T=100, 32 cache rows; the chunk padded), so each function compiles once."""
    config = dz_config(hf.config)
    cc, ratio, T, E = config.compressed, 4, 100, 32
    w = indexer_weights(hf.model.layers[CSA_LAYER].self_attn.compressor.indexer, config)
    x, q = inputs(7)
    q = q * 10  # scores of O(0.1), so that the top-k choices are well apart (assert_tie_gap)
    want, want_keys = hf_indexer_picks(hf, x, q, (100, 50))
    pad = np.random.default_rng(2).standard_normal((1, 150 + 50, 64 + 32)).astype(np.float32) * 3
    pad[0, :150] = np.concatenate([x[0].numpy(), q[0].numpy()], axis=-1)
    xj, qj = jnp.asarray(pad[..., :64]), jnp.asarray(pad[..., 64:])
    one = lambda n: jnp.full(1, n, jnp.int32)  # noqa: E731
    state = empty_state(1, cc.index_head_dim, ratio, True)
    keys0, ids0, state = _index_keys(w, config, xj[:, :T], state, one(0), one(100), ratio)
    keys1, ids1, _ = _index_keys(w, config, xj[:, 100:100 + T], state, one(100), one(50), ratio)
    np.testing.assert_array_equal(np.asarray(ids0[0]), np.r_[np.arange(25), [-1]])
    np.testing.assert_array_equal(np.asarray(ids1[0]), np.r_[np.arange(25, 37), [-1] * 14])
    np.testing.assert_allclose(np.concatenate([keys0[0, :25], keys1[0, :12]]), want_keys, **TOL)

    def check(xs, qs, positions, cached, count, keys, ids, want_picks, choosing):
        idx, valid = _index_select(w, config, xs, qs, positions, cached, one(count), keys, ids, ratio)
        assert idx.shape == (1, T, cc.index_topk)
        all_ids = np.r_[np.where(np.arange(E) < count, np.arange(E), -1), np.asarray(ids[0])]
        n = len(want_picks)  # the chunk's padding queries are not compared
        assert_same_picks(all_ids[np.asarray(idx[0])][:n], np.asarray(valid[0])[:n], want_picks)
        scores = _index_scores(w, config, xs, qs, positions, jnp.concatenate([cached, keys], axis=1),
                               jnp.asarray(all_ids[None], jnp.int32), ratio)
        assert assert_tie_gap(np.asarray(scores[0, :n]), cc.index_topk) >= choosing

    # Prefill: nothing cached (cached_count 0 over garbage rows).
    garbage = jnp.asarray(np.random.default_rng(3).standard_normal((1, E, cc.index_head_dim)), jnp.float32) * 9
    check(xj[:, :T], qj[:, :T], jnp.arange(T)[None], garbage, 0, keys0, ids0, want[0], 50)
    # Chunk: the 25 cached keys in a 32-row buffer (7 stale rows beyond cached_count) + new keys;
    # every one of its 50 queries sees >= 25 entries, so each chooses.
    cached = garbage.at[:, :25].set(keys0[:, :25])
    check(xj[:, 100:100 + T], qj[:, 100:100 + T], jnp.arange(100, 100 + T)[None], cached, 25, keys1, ids1,
          want[1], 50)


def test_ring_write_and_positions():
    S = 4
    starts, num_new = jnp.asarray([0, 6, 3]), jnp.asarray([3, 7, 0])
    np.testing.assert_array_equal(np.asarray(ring_positions(starts, S)),
                                  [[-4, -3, -2, -1], [4, 5, 2, 3], [0, 1, 2, -1]])
    ring = jnp.full((3, S, 2), -1.0)
    rows = jnp.asarray(np.arange(3 * 8 * 2, dtype=np.float32).reshape(3, 8, 2))
    out = np.asarray(ring_write(ring, rows, starts, num_new))[..., 0]
    r = np.asarray(rows)[..., 0]
    # Row 0: positions 0..2 -> slots 0..2, slot 3 untouched, padding t >= 3 dropped.
    np.testing.assert_array_equal(out[0], [r[0, 0], r[0, 1], r[0, 2], -1])
    # Row 1: positions 6..12 (T=7 > S): only the last four, 9..12, land; 12 % 4 = 0 wraps.
    np.testing.assert_array_equal(out[1], [r[1, 6], r[1, 3], r[1, 4], r[1, 5]])
    # Row 2: nothing new.
    np.testing.assert_array_equal(out[2], [-1] * 4)
    # After the write, the ring holds exactly the positions ring_positions names for the next call.
    after = np.asarray(ring_positions(starts + num_new, S))
    assert after[1].tolist() == [12, 9, 10, 11]


def test_bad_inputs_are_refused(hf):
    config = dz_config(hf.config)
    w = compressor_weights(hf.model.layers[HCA_LAYER].self_attn.compressor)
    x = jnp.zeros((1, 8, 64))
    with pytest.raises(ValueError, match="position_bias"):
        compress(w, config, x, None, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), 4, 64, False)
    with pytest.raises(ValueError, match="empty_state"):
        compress(w, config, x, empty_state(2, 64, 16, False), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                 16, 64, False)
