"""DeepSeek-V4's CSA layers read only their indexer's picks when gathering is cheaper.

``compressed.compressed_block`` reads a CSA layer's compressed entries either densely (every
cached and new entry, the mask narrowed to the picks) or by gathering each query's k picked rows
(``compressed._gathers``: T*k < E + M, every decode step past k entries). Checked on the tiny
config of tests/v4_helpers.py (CSA ratio 4, index_topk 8, window 16) with random block weights:

- (1) fp32 and (2) an int8 cache: both paths forced on the same calls give the same outputs
  (1e-6 relative: the same softmax over the same keys, summed in another order), on two ragged
  rows through prefill chunks of 16 (the first sees only entries closed in its own call, the
  later ones cached and new entries both) then one-token decode steps with 10 to 13 visible
  entries, more than k = 8, windows closing inside the steps;
- (3) the whole model's decode step takes the gather path: its jaxpr holds each CSA layer's
  softmax over [window | new row | k picks] and none over [window | new row | every entry].
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.model.cache import cache_specs
from dayzero.model.config import CompressKind
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import KVQuant
from dayzero.model.transformer import forward
from dayzero.model.weights import abstract_weights, shape_structs
from tests.v4_helpers import block_step, one_layer_cache, random_attn_weights, tiny_hf_config

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

MAX_LEN = 128  # E = 32 cached entry rows on a CSA layer
CHUNKS = [[16, 16, 16], [16, 11, 16]]  # per row: three prefill chunks (row 1 ends at 43, row 0 at 48)
DECODE = 6  # one-token steps after them: row 0 at 48..53 (window 12 closes at 51), row 1 at 43..48


@pytest.fixture(scope="module")
def config():
    """The tiny model's config (no weights)."""
    return parse_hf_config(tiny_hf_config().to_dict())


_step = jax.jit(block_step, static_argnums=(1, 2), static_argnames=("gather",))


def _both_paths(config, kv: KVQuant) -> float:
    """Largest relative difference between the gathered and dense CSA outputs over the calls of
    the module docstring, each call run both ways on the same cache."""
    w = random_attn_weights(config, CompressKind.CSA)
    rng = np.random.default_rng(1)
    cache = one_layer_cache(config, CompressKind.CSA, 2, MAX_LEN, kv)
    calls = [(16, np.asarray(sizes, np.int32)) for sizes in zip(*CHUNKS)] + [(1, np.ones(2, np.int32))] * DECODE
    worst = 0.0
    for T, sizes in calls:
        x = jnp.asarray(rng.standard_normal((2, T, config.hidden_size)), jnp.float32)
        gathered, after = _step(w, config, CompressKind.CSA, x, cache, jnp.asarray(sizes), gather=True)
        dense, _ = _step(w, config, CompressKind.CSA, x, cache, jnp.asarray(sizes), gather=False)
        real = np.arange(T)[None, :] < sizes[:, None]
        gathered, dense = np.asarray(gathered)[real], np.asarray(dense)[real]
        worst = max(worst, float(np.abs(gathered - dense).max() / np.abs(dense).max()))
        cache = after
    ratio = config.compressed.ratio_of(CompressKind.CSA)
    assert min(np.asarray(cache.lengths)) // ratio > config.compressed.index_topk  # the picks were a real choice
    return worst


# int8 (~6 s) under -m slow; the default suite keeps a quantized pick read:
# tests/test_v4_serving.py::test_paged_rows_take_reads_the_rows_the_gather_holds[True].
@pytest.mark.parametrize("kv", [KVQuant.NONE, pytest.param(KVQuant.INT8, marks=pytest.mark.slow)])
def test_gathered_picks_equal_the_dense_pass(config, kv):
    """(1)/(2) The CSA block's outputs through the gathered picks equal the dense masked pass's
    (an int8 cache gathers its stored rows, then dequantizes them: the same values)."""
    assert _both_paths(config, kv) <= 1e-6


def _softmax_widths(jaxpr) -> list[int]:
    """The last-axis sizes of every ``exp`` in ``jaxpr`` and its sub-jaxprs (the attention's
    softmax is an exp over [B,N,T,S])."""
    widths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "exp":
            widths.append(eqn.invars[0].aval.shape[-1])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            widths += _softmax_widths(sub)
    return widths


def test_decode_step_softmax_spans_the_picks_not_the_entries(config):
    """(3) The jaxpr of the whole model's one-token step over a 256-position cache: both CSA
    layers' softmaxes span W + 1 + k = 25 keys, none the dense W + 1 + E + M = 82 (E = 64
    entries, M = 1), which the dense path would build. HCA (16 + 1 + 16 + 1 = 34) and sliding
    (17) layers keep theirs."""
    cc = config.compressed
    max_len = 256
    weights = shape_structs(abstract_weights(config), jnp.float32)
    cache = shape_structs(cache_specs(config, 1, max_len), jnp.float32)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(forward, static_argnums=(1,))(weights, config, tokens, cache).jaxpr
    widths = _softmax_widths(jaxpr)
    csa = [k for k in cc.kinds if k is CompressKind.CSA]
    gathered = cc.window + 1 + cc.index_topk
    dense = cc.window + 1 + max_len // cc.ratio_of(CompressKind.CSA) + 1
    assert widths.count(gathered) == len(csa) and dense not in widths, widths
