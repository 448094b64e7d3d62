"""Quantized weights on every mesh strategy: the same logits as one device.

int8 and fp8 keep one scale per output channel, which carries its values' logical axes and so
splits with them; fp8-block and int4 keep one scale per [bi, bo] block, which a tensor split can
cut through (DeepSeek-V3's expert width 2048 over tensor=32 gives 64-wide shards of 128-wide
blocks). ``mesh_aligned_specs`` re-blocks such scales exactly (``reblocked``: each finer block lies
inside one coarse block) so that they split with their values; the expert-parallel MoE passes
values and scales into its ``shard_map`` with matching specs.

Unit tests here (one device); the mesh checks run in two subprocesses with 8 faked CPU devices
(tests/mesh_quant_checks.py), started together so that they share the machine's two cores:

- ``qwen``: a Qwen3-MoE-like layer (8 experts of width 256 over a 128-wide residual) in int8 and
  in int4 (routed experts in groups of 128 inputs, the rest int8) on tensor=2 x expert=4,
  data=2 x tensor=4 and tensor=4 x expert=2;
- ``latent``: a DeepSeek-V3-like model (MLA, a dense layer of width 80, 8 routed experts of
  width 64 and a shared one) in fp8 with 32 x 32 blocks on the same meshes and tensor=8, where
  the shards of 16 and 8 (20 and 10 for the dense layer, 2.5 blocks wide) cut through blocks.

With ``-m slow`` (~40 s here, one more subprocess): ``gpt_oss_mxfp4``, gpt-oss with MXFP4 experts
(e2m1 values, one e8m0 scale per 32 inputs) on tensor=2 x expert=4: greedy tokens as on one
device, and ``Engine.generate`` there (which fails today on XLA:CPU, see
:func:`test_mxfp4_engine_on_a_mesh`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import (
    QuantConfig, QuantError, QuantizedArray, ValueFormat, WeightQuant, dequantized, quantize, reblocked,
)
from dayzero.model.weights import (
    abstract_weights, aligned_block, aligned_weights, axis_sizes, is_spec, is_spec_node, mesh_aligned_specs,
    named_leaves,
)
from dayzero.sharding import rules as R
from tests.mesh_checks import result_of, start_part
from tests.mesh_quant_checks import BLOCK, LATENT, QWEN, quantized_weights
from tests.test_sharding import FakeMesh

FP32_ROUNDING = 1e-5  # relative to the largest |logit|: same maths, summed in another order
MIN_ROUTER_GAP = 1e-4  # the C-th vs (C+1)-th router logit; a near-tie would test rounding only


@pytest.fixture(scope="module")
def meshes():
    procs = {part: start_part(part, module="tests.mesh_quant_checks", fast_compile=True)  # both at once: two cores
             for part in ("qwen", "latent")}
    try:
        return {part: result_of(proc) for part, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # the other part, when one failed or timed out
                proc.kill()
                proc.communicate()


# ---- reblocked -----------------------------------------------------------------------------------


_quantize = jax.jit(quantize, static_argnums=(1, 2, 3))  # one compile per shape, not one per op
_dequantize = jax.jit(lambda q: dequantized(q, jnp.float32))


def _dense(q: QuantizedArray) -> np.ndarray:
    return np.asarray(_dequantize(q))


def _spread(shape, seed=0) -> np.ndarray:
    """Values whose blocks have very different scales (so a wrong scale shows)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.logspace(-2, 2, shape[-1])).astype(np.float32)


@pytest.mark.parametrize("fine", [(16, 8), (64, 128), (128, 1), (1, 64), (2, 2)])
def test_reblocked_is_exact_with_partial_blocks(fine):
    """576 x 200 in 128 x 128 blocks: 4.5 x 1.5625 blocks, the last row and column partial."""
    q = _quantize(_spread((3, 576, 200)), ValueFormat.FP8, (1,), (128, 128))
    r = reblocked(q, fine)
    assert r.block == fine and r.scale.shape == (3, -(-576 // fine[0]), -(-200 // fine[1]))
    assert r.values is q.values
    np.testing.assert_array_equal(_dense(r), _dense(q))
    np.testing.assert_array_equal(_dense(r[1]), _dense(q[1]))  # one expert of the stack


def test_reblocked_int4_groups_and_host_scales():
    q = _quantize(_spread((256, 48), 1), ValueFormat.INT4, (0,), (128, 1))
    host = q.replace(scale=np.asarray(q.scale))
    r = reblocked(host, (64, 1))
    assert isinstance(r.scale, np.ndarray) and r.scale.shape == (4, 48)
    np.testing.assert_array_equal(_dense(r), _dense(q))
    assert reblocked(q, (128, 1)) is q


def test_reblocked_refuses_what_is_not_exact():
    q = _quantize(_spread((96, 64)), ValueFormat.FP8, (0,), (32, 32))
    with pytest.raises(QuantError, match=r"block \(32, 32\) cannot be re-blocked exactly to \(24, 32\)"):
        reblocked(q, (24, 32))
    with pytest.raises(QuantError, match="channel-layout"):
        reblocked(_quantize(_spread((96, 64)), ValueFormat.INT8, (0,), None), (8, 8))


@pytest.mark.parametrize("n, b, t", [(576, 128, 4), (80, 32, 8), (192, 128, 2), (96, 32, 3)])
@pytest.mark.parametrize("split", ["in", "out"])
def test_each_shard_dequantizes_with_its_own_scales(n, b, t, split):
    """The alignment argument of ``aligned_block``, checked: cut the re-blocked values and scales
    into t contiguous shards as a mesh would; each shard, dequantized alone, is its slice of the
    whole."""
    other = 48
    shape, axes = ((n, other), ("ffw", None)) if split == "in" else ((other, n), (None, "ffw"))
    q = _quantize(_spread(shape, n + t), ValueFormat.FP8, (0,), (b, b))
    block, scale_axes = aligned_block(shape, axes, (0,), (b, b), {"ffw": t})
    assert scale_axes == (("ffw", None) if split == "in" else (None, "ffw"))
    r = reblocked(q, block)
    dim = 0 if split == "in" else 1
    whole = _dense(q)
    for values, scale, expect in zip(np.split(np.asarray(r.values), t, axis=dim),
                                     np.split(np.asarray(r.scale), t, axis=dim), np.split(whole, t, axis=dim)):
        np.testing.assert_array_equal(_dense(QuantizedArray(values, scale, r.fmt, r.in_axes, block)), expect)


# ---- mesh_aligned_specs --------------------------------------------------------------------------


def _latent_specs(block=BLOCK):
    return abstract_weights(parse_hf_config(LATENT), QuantConfig(WeightQuant.FP8_BLOCK, block))


def _quantized_nodes(tree) -> list[QuantizedArray]:
    return [x for x in jax.tree.leaves(tree, is_leaf=is_spec_node) if isinstance(x, QuantizedArray)]


def _scale(specs, name):
    q = named_leaves(specs)  # stops at ParamSpecs: values and scale of each quantized leaf
    return q[f"{name}/scale"].shape, q[f"{name}/scale"].axes


def test_uncut_blocks_keep_their_size_and_split_with_their_values():
    """tensor=2: expert width 64 -> shards of 32, whole blocks."""
    specs = mesh_aligned_specs(_latent_specs(), {"ffw": 2, "q_heads": 2, "experts": 4, "vocab": 2})
    experts = specs.layers[1].mlp
    assert experts.gate.block == experts.down.block == BLOCK
    assert _scale(specs, "layers/1/mlp/gate") == ((8, 2, 2), ("experts", None, "ffw"))
    assert _scale(specs, "layers/1/mlp/down") == ((8, 2, 2), ("experts", "ffw", None))
    # q_b [Q, N, P+R]: its Out group (N, P+R) is split on its major axis N
    assert specs.layers[1].attn.q_b.block == BLOCK
    assert _scale(specs, "layers/1/attn/q_b") == ((1, 4), (None, "q_heads"))
    assert _scale(specs, "layers/1/attn/o") == ((2, 2), ("q_heads", None))
    # kv_a [D, L+R] (48 = 1.5 blocks) is not split: whole scale, block kept
    assert specs.layers[1].attn.kv_a.block == BLOCK and _scale(specs, "layers/1/attn/kv_a") == ((2, 2), (None, None))
    # the dense width 80 (2.5 blocks) over 2: shards of 40 start inside a block
    assert specs.layers[0].mlp.gate.block == (32, 8)
    assert _scale(specs, "layers/0/mlp/gate") == ((2, 10), (None, "ffw"))


def test_cut_blocks_are_reduced_to_the_shard_width():
    """tensor=4: expert width 64 -> shards of 16 (half a block), dense 80 -> 20; tensor=8: heads 4
    are not split (spec_for replicates what its axis does not divide), so their blocks stay."""
    specs = _latent_specs()
    tp4 = mesh_aligned_specs(specs, {"ffw": 4, "q_heads": 4, "vocab": 4})
    assert tp4.layers[1].mlp.gate.block == (32, 16) and tp4.layers[1].mlp.down.block == (16, 32)
    assert _scale(tp4, "layers/1/mlp/gate") == ((8, 2, 4), ("experts", None, "ffw"))
    assert _scale(tp4, "layers/1/mlp/down") == ((8, 4, 2), ("experts", "ffw", None))
    assert tp4.layers[0].mlp.down.block == (4, 32) and _scale(tp4, "layers/0/mlp/down") == ((20, 2), ("ffw", None))
    assert tp4.layers[1].attn.k_up.block == (32, 16)  # Out N x P = 64 over 4
    tp8 = mesh_aligned_specs(specs, lambda a: 8 if a in ("ffw", "q_heads", "vocab") else 1)
    assert tp8.layers[1].mlp.gate.block == (32, 8) and tp8.layers[0].mlp.gate.block == (32, 2)
    assert tp8.layers[1].attn.q_b.block == BLOCK and _scale(tp8, "layers/1/attn/q_b") == ((1, 4), (None, None))
    assert mesh_aligned_specs(tp4, {"ffw": 4, "q_heads": 4, "vocab": 4}) == tp4  # idempotent
    assert mesh_aligned_specs(specs, {}) == specs  # one device: nothing changes


def test_a_split_minor_axis_leaves_the_scale_whole():
    """Out group (heads, head_dim) split on head_dim: a shard's columns are strided, no split of
    the scale matches them (GSPMD, with the scale whole, is still right)."""
    assert aligned_block((64, 4, 16), ("embed", None, "ffw"), (0,), (32, 32), {"ffw": 2}) == ((32, 32), (None, None))
    assert aligned_block((64, 4, 16), ("embed", "ffw", None), (0,), (32, 32), {"ffw": 2}) == ((32, 32), (None, "ffw"))


@pytest.mark.parametrize("scheme", [WeightQuant.INT8, WeightQuant.FP8, WeightQuant.INT4])
def test_channel_scales_split_with_their_values(scheme):
    """A channel-layout scale has its values' axes (size 1 on the contracted ones): its spec on
    every mesh is the values' spec with the contracted dimensions whole."""
    specs = abstract_weights(parse_hf_config(QWEN), QuantConfig(scheme))
    aligned = mesh_aligned_specs(specs, {"ffw": 4, "q_heads": 4, "kv_heads": 4, "experts": 2, "vocab": 4})
    mesh = FakeMesh(tensor=4, expert=2)
    channel = [s for s in _quantized_nodes(aligned) if s.block is None]
    assert channel
    for s in channel:
        values = R.spec_for(s.values.axes, R.tensor_expert_parallel(), mesh, s.values.shape)
        scale = R.spec_for(s.scale.axes, R.tensor_expert_parallel(), mesh, s.scale.shape)
        assert tuple(scale) == tuple(None if i in s.in_axes else a for i, a in enumerate(values))


def test_axis_sizes_of_a_placement():
    from dayzero.sharding.placement import Placement

    sizes = axis_sizes(Placement(FakeMesh(tensor=4, expert=2), R.tensor_expert_parallel()))
    assert sizes["ffw"] == sizes["q_heads"] == 4 and sizes["experts"] == 2 and sizes["embed"] == 1
    assert axis_sizes(None) == {}


def test_aligned_weights_reblock_exactly_and_name_a_mismatch():
    weights = quantized_weights(parse_hf_config(LATENT), QuantConfig(WeightQuant.FP8_BLOCK, BLOCK), 0)
    specs = mesh_aligned_specs(_latent_specs(), {"ffw": 4, "q_heads": 4})
    aligned = aligned_weights(weights, specs)
    assert aligned.layers[1].mlp.down.block == (16, 32) and aligned.layers[1].attn.kv_a is weights.layers[1].attn.kv_a
    for a, w in zip(_quantized_nodes(aligned), _quantized_nodes(weights)):
        assert a.values is w.values
        if a.block != w.block:
            np.testing.assert_array_equal(_dense(a), _dense(w))
    # leaf for leaf, the shapes the aligned specs declare (so placement.shardings(specs) fits)
    shapes = lambda tree: {k: v.shape for k, v in named_leaves(tree).items()}  # noqa: E731
    assert shapes(aligned) == shapes(specs)
    assert all(is_spec(s.scale) and s.scale.dtype == jnp.float32 for s in _quantized_nodes(specs))
    other = mesh_aligned_specs(_latent_specs((48, 48)), {"ffw": 4})
    with pytest.raises(QuantError, match=r"layers/0/attn/kv_a: scales of block \(32, 32\) cannot be re-blocked"):
        aligned_weights(weights, other)


# ---- on meshes of 8 devices ----------------------------------------------------------------------

CASES = [("qwen", "int8", m) for m in ("tp2ep4", "dp2tp4", "tp4ep2")] + \
        [("qwen", "int4", m) for m in ("tp2ep4", "dp2tp4", "tp4ep2")] + [("qwen", "int4-all", "tp4ep2")] + \
        [("latent", None, m) for m in ("tp2ep4", "dp2tp4", "tp4ep2", "tp8")]


def _case(meshes, part, scheme):
    return meshes[part] if scheme is None else meshes[part][scheme]


@pytest.mark.parametrize("part, scheme", [("qwen", "int8"), ("qwen", "int4"), ("latent", None)])
def test_router_has_clear_choices(meshes, part, scheme):
    case = _case(meshes, part, scheme)
    assert case["router_gap"] > MIN_ROUTER_GAP
    assert case["max_logit"] > 1  # O(1) logits: agreement means something


@pytest.mark.parametrize("part, scheme, mesh", CASES)
def test_quantized_logits_match_one_device(meshes, part, scheme, mesh):
    assert _case(meshes, part, scheme)[mesh]["err"] < FP32_ROUNDING


def test_the_schemes_are_what_they_say(meshes):
    assert meshes["qwen"]["int8"]["stored"] == "int8"
    assert meshes["qwen"]["int4"]["stored"] == "int4/128x1+int8"
    assert meshes["qwen"]["int4-all"]["stored"] == meshes["qwen"]["int4-all"]["tp4ep2"]["stored"] == "int4/32x1"
    assert meshes["latent"]["stored"] == "float8_e4m3fn/32x32"


def test_int4_groups_follow_a_cut_of_the_expert_width(meshes):
    """tensor=4 x expert=2: the down projections' 256 inputs in shards of 64, so their groups of
    128 become 64 (exactly); gate/up keep theirs (their inputs are the unsplit residual)."""
    tp4ep2 = meshes["qwen"]["int4"]["tp4ep2"]
    assert tp4ep2["blocks"] == {"layers/0/mlp/gate": [128, 1], "layers/0/mlp/up": [128, 1],
                                "layers/0/mlp/down": [64, 1]}
    assert meshes["qwen"]["int4"]["tp2ep4"]["blocks"]["layers/0/mlp/down"] == [128, 1]  # shards of 128
    down = tp4ep2["layout"]["layers/0/mlp/down"]
    assert down["values"]["spec"] == down["scale"]["spec"] == ["expert", "tensor", "None"]
    # What one device of the expert-parallel shard_map sees: tokens, valid, router, then values and
    # scale of gate, up, down: 4 experts of width 64, each with its own scales.
    assert tp4ep2["local"][3:] == [[4, 128, 64], [4, 1, 64], [4, 128, 64], [4, 1, 64], [4, 64, 128], [4, 1, 128]]
    # int8 per channel: the down scale is size 1 on its (split) inputs, whole there.
    int8 = meshes["qwen"]["int8"]["tp4ep2"]
    assert int8["layout"]["layers/0/mlp/down"]["scale"]["spec"] == ["expert", "None", "None"]
    assert int8["local"][3:] == [[4, 128, 64], [4, 1, 64], [4, 128, 64], [4, 1, 64], [4, 64, 128], [4, 1, 128]]


def test_block_scales_split_with_their_values_where_tensor_cuts_blocks(meshes):
    lat = meshes["latent"]
    for mesh, width in (("tp4ep2", 16), ("dp2tp4", 16), ("tp8", 8)):
        blocks, layout = lat[mesh]["blocks"], lat[mesh]["layout"]
        assert blocks["layers/1/mlp/gate"] == [32, width] and blocks["layers/1/mlp/down"] == [width, 32]
        assert blocks["layers/1/mlp/shared/down"] == [width, 32]
        for name in ("layers/0/mlp/gate", "layers/0/mlp/down", "layers/1/mlp/gate", "layers/1/mlp/down"):
            values, scale = layout[name]["values"]["spec"], layout[name]["scale"]["spec"]
            assert scale == values, (mesh, name)  # one axis per In / Out group: the scale splits alike
    # the dense width 80 = 2.5 blocks: shards of 20 / 10 give blocks of 4 / 2
    assert lat["tp4ep2"]["blocks"]["layers/0/mlp/gate"] == [32, 4]
    assert lat["tp8"]["blocks"]["layers/0/mlp/gate"] == [32, 2]
    assert lat["tp4ep2"]["layout"]["layers/1/mlp/gate"]["scale"] == {"shape": [8, 2, 4],
                                                                       "spec": ["expert", "None", "tensor"]}
    # tensor=2 cuts no expert block
    assert lat["tp2ep4"]["blocks"]["layers/1/mlp/gate"] == [32, 32]
    # one device of tensor=4 x expert=2: 4 experts of width 16, one 32 x 16 block per 32 inputs
    local = lat["tp4ep2"]["local"]
    assert local[3:9] == [[4, 64, 16], [4, 2, 1], [4, 64, 16], [4, 2, 1], [4, 16, 64], [4, 1, 2]]


def test_expert_parallel_reblocks_unaligned_weights_itself(meshes):
    """Weights laid out without ``aligned_weights`` (block scales whole): the expert-parallel block
    re-blocks its experts before its shard_map, and matches one device."""
    assert meshes["latent"]["moe_block"]["unaligned"] < FP32_ROUNDING


def test_a_scale_split_against_its_values_is_refused_and_would_be_wrong(meshes):
    """Negative control: expert scales handed to shard_map whole along the width while their
    values are split. The guard refuses it in one line; with the guard off the logits move by far
    more than rounding, so the equality tests above do see a scale split inconsistently."""
    block = meshes["latent"]["moe_block"]
    assert block["guard"] and "gate (8, 64, 64)" in block["guard"] and "(32, 16)" in block["guard"]
    assert "tensor=1" in block["guard"] and "\n" not in block["guard"]
    assert block["wrong_err"] > 1e-2


# ---- MXFP4 experts (gpt-oss) on tensor=2 x expert=4 ------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_mxfp4():
    return result_of(start_part("gpt_oss_mxfp4", module="tests.mesh_quant_checks", fast_compile=True))


@pytest.mark.slow  # ~40 s here: four forward compiles and the engine's, in a subprocess
def test_mxfp4_experts_on_a_mesh_generate_as_one_device(gpt_oss_mxfp4):
    """gpt-oss's MXFP4 experts laid out as the engine lays them on tensor=2 x expert=4: the same
    greedy tokens and first-step logits as one device. Each expert's width 32 is split over
    tensor (16 per device), so down's inputs are cut inside a 32-input MXFP4 block: its scales
    are re-blocked to 16 inputs (exactly: each half-block keeps the block's power of two) and
    split over tensor with the values; gate/up keep their blocks (inputs whole, outputs split)."""
    out = gpt_oss_mxfp4
    assert out["stored"] == "mxfp4/32x1" and out["dtypes"] == ["float4_e2m1fn", "float8_e8m0fnu"]
    assert out["router_gap"] > MIN_ROUTER_GAP and out["max_logit"] > 1
    assert out["mesh_tokens"] == out["tokens"]
    assert out["err"] < FP32_ROUNDING
    assert out["blocks"]["layers/0/mlp/down"] == [16, 1] and out["blocks"]["layers/0/mlp/gate"] == [32, 1]
    down, gate = out["layout"]["layers/0/mlp/down"], out["layout"]["layers/0/mlp/gate"]
    assert down["values"] == {"shape": [8, 32, 64], "spec": ["expert", "tensor", "None"]}
    assert down["scale"] == {"shape": [8, 2, 64], "spec": ["expert", "tensor", "None"]}
    assert gate["values"]["spec"] == gate["scale"]["spec"] == ["expert", "None", "tensor"]


@pytest.mark.slow
def test_mxfp4_engine_on_a_mesh(gpt_oss_mxfp4):
    """``Engine.generate`` with MXFP4 experts on tensor=2 x expert=4 equals one device's."""
    engine = gpt_oss_mxfp4["engine"]
    assert engine.get("same_tokens"), engine
    assert engine["logprob_diff"] < 1e-4
