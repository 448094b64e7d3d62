"""DeepSeek-V4 on a mesh of 8 faked CPU devices, run in a fresh interpreter by
tests/test_v4_mesh.py through this module's :func:`run_part` (``tests.mesh_checks.run_part`` with
``module="tests.v4_mesh_checks"``: the device count is fixed when jax starts).

``python -m tests.v4_mesh_checks PART [ARGS]`` prints one JSON object:

- ``deepseek_v4 MODEL_DIR``: the converted tiny model on each of :data:`V4_MESHES` against one
  device (generation, serving, all-position logits, cache layout, decode all-gathers);
- ``deepseek_v4_attention CONFIG_JSON``: the CSA attention block through its cache on
  data=4 x tensor=2 against one device.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.generate import Engine
from dayzero.engine.sampling import SamplingParams
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.model.config import CompressKind
from dayzero.model.moe import router_logits
from dayzero.model.parallel import Parallel
from dayzero.model.transformer import forward
from dayzero.model.weights import abstract_weights
from dayzero.sharding.placement import placement_for
from dayzero.tools.measure import CompileCounter
from tests import mesh_checks
from tests.mesh_checks import compare, gathered_shapes, rel_err

MODULE = "tests.v4_mesh_checks"


def run_part(part: str, *args: str, **options) -> dict:
    """:func:`tests.mesh_checks.run_part` for a part of this module (same options)."""
    return mesh_checks.run_part(part, *args, module=MODULE, **options)


# tensor=2 x expert=4: heads and o_a groups over tensor, experts (hash-routed and top-k) over expert;
# data=4 x tensor=2: rows over data. (data=2 x tensor=4 is refused: tensor=4 does not divide the
# tiny model's 2 output groups, model.mesh_check.compressed_split_refusal.)
V4_MESHES = {"tp2ep4": {"tensor": 2, "expert": 4}, "dp4tp2": {"data": 4, "tensor": 2}}
V4_PROMPTS = (37, 21, 30, 9)  # prompt lengths: past the 16-token window, HCA (16) and CSA (4) windows
V4_NEW = 8
# Served on the mesh: 2 slots per replica, pages of 16 (the tiny model's ratios 4 and 16), chunks of 16.
V4_SERVING = ServingConfig(slots=2, max_context=64, max_chunk=16, min_chunk=16)


def generation_of(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """As :func:`tests.mesh_checks.generation`, for ``prompts`` and ``new`` tokens."""
    stream = engine.stream_ids(prompts, new, [SamplingParams()] * len(prompts))
    steps = [next(stream), next(stream)]
    with CompileCounter() as counter:
        steps += list(stream)
    return {"tokens": np.stack([t for t, _ in steps], axis=1).tolist(),
            "logprobs": np.stack([lp for _, lp in steps], axis=1).tolist(), "decode_compiles": counter.count}


def v4_logits_and_gaps(config, weights, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, dict]:
    """One-device all-position logits of ``tokens`` [B,T] (row b real up to ``lengths[b]``) and the
    smallest margins, over the real tokens, at the choices fp32 rounding could flip: each top-k
    router's C-th vs (C+1)-th biased score, each CSA indexer's k-th vs (k+1)-th visible score
    relative to the query's largest |score| (only queries seeing more than k entries choose)."""
    import dayzero.model.transformer as transformer
    from dayzero.model import compressor
    from dayzero.model.moe import router_scores

    def run(w, t, n):
        routers, scores = [], []  # filled while tracing
        real_moe, real_scores = transformer.moe, compressor.index_scores

        def moe_tap(mw, c, h, **kw):
            if mw.tid2eid is None:  # a hash-routed layer chooses by table: nothing to flip
                logits = router_logits(mw.router, h.reshape(-1, h.shape[-1])).reshape(*h.shape[:2], -1)
                routers.append(router_scores(logits, c.score) + mw.score_bias)
            return real_moe(mw, c, h, **kw)

        def scores_tap(*args, **kw):
            scores.append(real_scores(*args, **kw))
            return scores[-1]

        transformer.moe, compressor.index_scores = moe_tap, scores_tap
        try:
            logits = forward(w, config, t, num_new=n, all_logits=True)[0]
        finally:
            transformer.moe, compressor.index_scores = real_moe, real_scores
        return logits, routers, scores

    logits, routers, scores = jax.jit(run)(weights, tokens, lengths)
    real = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
    C, k = config.moe.experts_per_token, config.compressed.index_topk
    router_gap = min(float(np.min(np.diff(np.sort(np.asarray(r)[real], -1)[:, -C - 1:-C + 1], axis=-1)))
                     for r in routers)
    index_gaps = []
    for s in scores:
        for row in np.asarray(s)[real]:
            row = np.sort(row[np.isfinite(row)])[::-1]
            if row.size > k:
                index_gaps.append((row[k - 1] - row[k]) / np.abs(row).max())
    return np.asarray(logits), {"router": router_gap, "indexer": float(min(index_gaps))}


def v4_cache_specs(engine: Engine, batch: int, max_len: int) -> dict:
    """The mesh specs of a CSA layer's cache leaves (window ring, entries, index keys, compressor
    state) and the row lengths, as the engine lays its cache out."""
    layer = engine._cache_shardings(batch, max_len)
    csa = layer.layers[engine.config.compressed.kinds.index(CompressKind.CSA)]
    spec = lambda s: [str(a) for a in s.spec]  # noqa: E731
    return {"window": spec(csa.window), "entries": spec(csa.entries), "index_keys": spec(csa.index_keys),
            "state": spec(csa.state.kv), "lengths": spec(layer.lengths)}


def part_deepseek_v4(model_dir: str) -> dict:
    """DeepSeek-V4 (the converted tiny model in ``model_dir``) on each of :data:`V4_MESHES`:
    ``Engine.generate``'s greedy tokens and logprobs for four ragged prompts, and the all-position
    logits of each prompt with its generated tokens, against one device; the cache's layout and
    the all-gathers of a decode step; the choice margins of the one-device run."""
    from dayzero.convert import load_checkpoint

    config, weights = load_checkpoint(model_dir, dtype=jnp.float32)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in V4_PROMPTS]
    ref = generation_of(Engine(config, weights), prompts, V4_NEW)
    # Each prompt with its greedy tokens, teacher-forced: what the decode steps computed.
    rows = [p + t for p, t in zip(prompts, ref["tokens"])]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    logits, gaps = v4_logits_and_gaps(config, weights, tokens, lengths)
    real = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    out = {"gaps": gaps}
    for name, axes in V4_MESHES.items():
        placement = placement_for(axes)
        par = Parallel(placement)
        sharded = jax.device_put(weights, placement.shardings(abstract_weights(config)))
        run = jax.jit(lambda w, t, n: forward(w, config, t, num_new=n, all_logits=True, parallel=par)[0])
        got = np.asarray(run(sharded, placement.replicate(tokens), placement.replicate(lengths)))
        engine = Engine(config, weights, placement=placement)
        server = ServingEngine(engine, V4_SERVING)
        served = server.run(prompts, max_new_tokens=V4_NEW, ignore_eos=True, logprobs=True)
        out[name] = {"err": rel_err(got[real], logits[real]), **compare(ref, generation_of(engine, prompts, V4_NEW)),
                     "served": [c.token_ids for c in served] == ref["tokens"],
                     "served_logprob_diff": max(float(np.max(np.abs(np.subtract(c.logprobs, lp))))
                                                for c, lp in zip(served, ref["logprobs"])),
                     "cache": v4_cache_specs(engine, len(prompts), 256),
                     "o_a_spec": [str(a) for a in engine.weights.layers[0].attn.o_a.sharding.spec],
                     "kv_spec": [str(a) for a in engine.weights.layers[0].attn.kv.sharding.spec],
                     "decode_all_gathers": gathered_shapes(engine, len(prompts), 256)}
    return out


def part_deepseek_v4_attention(config_json: str) -> dict:
    """DeepSeek-V4's CSA attention block (tiny config, numpy-drawn weights, randomised sinks and
    position biases) through its cache on data=4 x tensor=2 against one device: a ragged first
    chunk into an empty cache, then a ragged second chunk reading the window ring, entries and
    index keys it wrote (one compiled step of 20 tokens, padding behind). The cheap default-suite
    check (CSA only, one mesh: each compile costs seconds); ``part_deepseek_v4`` runs the whole
    model on both meshes. ``config_json``: the tiny config's ``ModelConfig.to_json`` (the test
    parses tests/v4_helpers.py's HF config, so that this process need not import torch)."""
    from dayzero.model import compressed, compressed_cache
    from dayzero.model.cache import cache_specs, init_cache
    from dayzero.model.config import ModelConfig
    from dayzero.model.rope import rope_cos_sin
    from dayzero.model.weights import ParamSpec

    jax.config.update("jax_disable_most_optimizations", True)  # tiny programs: compile time dominates
    config = ModelConfig.from_json(json.loads(config_json))
    layer = config.compressed.kinds.index(CompressKind.CSA)
    B, T, max_len = 4, 20, 64
    rng = np.random.default_rng(0)
    spec = abstract_weights(config).layers[layer].attn
    weights = jax.tree.map(lambda p: (0.3 * rng.standard_normal(p.shape) + (p.init.value == "ones")).astype(np.float32),
                           spec, is_leaf=lambda p: isinstance(p, ParamSpec))
    x = rng.standard_normal((2, B, T, config.hidden_size)).astype(np.float32)
    chunks = [np.asarray([20, 13, 17, 20], np.int32), np.asarray([4, 1, 3, 2], np.int32)]

    def block(w, x, cache, num_new):
        starts, rope_len = cache.lengths, jnp.max(cache.lengths + num_new)
        positions = starts[:, None] + jnp.arange(T)[None, :]
        cos_sin = rope_cos_sin(config.compressed.compress_rope, config.head_dim, config.max_position_embeddings,
                               positions, rope_len)
        out, new = compressed.compressed_block(w, config, CompressKind.CSA, x, cos_sin, cache.layers[0], starts,
                                               num_new)
        return out, compressed_cache.append(cache, compressed_cache.NewCompressed((new,), num_new, rope_len))

    def run(w, cache, put=lambda a: a):
        step = jax.jit(block)
        outs = []
        for xs, n in zip(x, chunks):
            out, cache = step(w, put(xs), cache, put(n))
            outs.append(np.asarray(out))
        return outs

    def csa_only(cache):  # the cache of the one block run here
        return cache.replace(layers=(cache.layers[layer],))

    ref = run(weights, csa_only(init_cache(config, B, max_len, jnp.float32)))
    placement = placement_for(V4_MESHES["dp4tp2"])
    shardings = placement.shardings(cache_specs(config, B, max_len))
    got = run(jax.device_put(weights, placement.shardings(spec)),
              csa_only(init_cache(config, B, max_len, jnp.float32, shardings=shardings)), placement.replicate)
    return {"dp4tp2": {"err": max(rel_err(g, r) for g, r in zip(got, ref)),
                       "entries_spec": [str(a) for a in shardings.layers[layer].entries.spec]}}


PARTS = {"deepseek_v4": part_deepseek_v4, "deepseek_v4_attention": part_deepseek_v4_attention}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
