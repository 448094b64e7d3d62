"""The ``ragged_dot`` grouped SwiGLU (``GroupedMatmul.RAGGED_DOT``, the TPU default) on CPU.

tests/test_moe.py runs both grouped matmuls on float weights against HF's MoE blocks. Here the
ragged path is forced where that file does not reach it: quantized expert stacks of every scheme
(int8, fp8, fp8-block with partial blocks, int4), dequantized tile by tile (two whole tiles and
a partial one along D), against the expert loop and a float64 oracle built from the whole-stack
dequantization of ``model.quant``; the compiled temporary memory of the quantized path, which
would hold the whole dequantized stack if it were not tiled; and a whole tiny MoE model with the
ragged path as the platform default, against HF's logits. Slow: on a faked tensor=8 mesh the
tiles move no weights between devices; the int4 model's logits equal the expert loop's.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dayzero.convert import convert_checkpoint, load_checkpoint
from dayzero.model import moe as moe_module
from dayzero.model.moe import GroupedMatmul, grouped_swiglu, ragged_swiglu, ragged_tile
from dayzero.model.quant import FP8_BLOCK, INT4_GROUP, QuantConfig, ValueFormat, WeightQuant, dequantized, quantize
from dayzero.model.transformer import forward
from dayzero.model.weights import MoEWeights, abstract_weights, quantize_weights
from dayzero.sharding.placement import placement_for
from tests.hf_helpers import MIN_ROUTER_GAP, REL_TOL, assert_logits_match, random_ids
from tests.mesh_checks import run_part
from tests.test_moe import _random_moe, _router_gap

# The expert stacks' layouts, as model.weights quantizes routed experts under each scheme.
SCHEMES = {
    "int8": (ValueFormat.INT8, None),
    "fp8": (ValueFormat.FP8, None),
    "fp8-block": (ValueFormat.FP8, FP8_BLOCK),
    "int4": (ValueFormat.INT4, (INT4_GROUP, 1)),
}
# D = 2.5 and F = 1.5625 blocks of 128: partial blocks on both axes of every stack.
E, D, F = 8, 320, 200
SIZES = [3, 0, 5, 1, 0, 7, 2, 4]  # empty groups among them
# Budget for 128 rows of D by all of F of 8 experts: every stack runs 2 whole tiles along D,
# then one of 64 (gate/up: contracted rows; down: output columns).
SMALL_TILE = E * 128 * F * 4


def _spread(n: int) -> np.ndarray:
    """Factors 1/4, 1, 4, ... per 128 positions of an axis of ``n``."""
    return 2.0 ** (np.arange(n) // 128 * 2 - 2)


def _quantized_moe(scheme: str) -> MoEWeights:
    """``_random_moe``'s stacks with magnitudes that differ up to 16x between 128-blocks of rows
    and of columns (so a tile read with another tile's scales is far off), quantized as
    ``scheme`` stores experts."""
    fmt, block = SCHEMES[scheme]
    w = _random_moe(E, D, F, seed=4)
    scaled = lambda m: m * jnp.asarray(np.outer(_spread(m.shape[1]), _spread(m.shape[2])), jnp.float32)  # noqa: E731
    return w.replace(**{k: quantize(scaled(getattr(w, k)), fmt, (1,), block) for k in ("gate", "up", "down")})


def _oracle(w: MoEWeights, xs: np.ndarray) -> np.ndarray:
    """Each row through its expert, in float64, on the whole-stack dequantized weights."""
    gate, up, down = (np.asarray(dequantized(m, jnp.float32), np.float64) for m in (w.gate, w.up, w.down))
    owner = np.repeat(np.arange(E), SIZES)
    out = []
    for x, e in zip(np.asarray(xs, np.float64), owner):
        g = x @ gate[e]
        out.append((g / (1 + np.exp(-g)) * (x @ up[e])) @ down[e])
    return np.stack(out)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_ragged_matches_expert_loop_and_oracle(scheme):
    """Tiled (3 tiles per stack), untiled (one tile) and the expert loop all equal the oracle."""
    w = _quantized_moe(scheme)
    assert ragged_tile(w.gate, 1, SMALL_TILE) == ragged_tile(w.down, 2, SMALL_TILE) == 128
    assert ragged_tile(w.gate, 1) == ragged_tile(w.down, 2) == D  # the default budget: one tile
    xs = jax.random.normal(jax.random.key(5), (sum(SIZES), D))
    sizes = jnp.asarray(SIZES, jnp.int32)
    ref = _oracle(w, xs)
    atol = 1e-5 * np.abs(ref).max()
    runs = {"tiled": jax.jit(ragged_swiglu, static_argnums=3)(w, xs, sizes, SMALL_TILE)}
    for impl in GroupedMatmul:
        runs[impl.value] = jax.jit(grouped_swiglu, static_argnums=3)(w, xs, sizes, impl)
    for name, out in runs.items():
        np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=atol, err_msg=name)


def _loops(jaxpr: str) -> bool:
    return "scan[" in jaxpr or "while[" in jaxpr  # fori_loop with static bounds is a scan


def test_float_stack_is_one_ragged_dot_and_quantized_is_tiled():
    """Float stacks go straight to one ragged_dot each (no loop); quantized ones loop over tiles."""
    xs, sizes = jnp.zeros((sum(SIZES), D)), jnp.asarray(SIZES, jnp.int32)
    float_jaxpr = str(jax.make_jaxpr(ragged_swiglu, static_argnums=3)(_random_moe(E, D, F), xs, sizes, SMALL_TILE))
    assert float_jaxpr.count("ragged_dot_general[") == 3 and not _loops(float_jaxpr)
    quant_jaxpr = str(jax.make_jaxpr(ragged_swiglu, static_argnums=3)(_quantized_moe("int8"), xs, sizes, SMALL_TILE))
    assert _loops(quant_jaxpr)


# XLA:CPU (jaxlib 0.10) turns fp8 and int4 arrays that a loop reads into f16 / s8 copies of the
# whole array before the loop (measured: 2 and 1 bytes per element; the expert loop gets them
# too). Those copies hold the stored values, not a dequantization; GPU/TPU read fp8 and int4.
CPU_LOOP_COPY_BYTES = {"int8": 0, "fp8": 2, "fp8-block": 2, "int4": 1}


@pytest.mark.parametrize("scheme", ["int8", "fp8-block", "int4"])
def test_quantized_ragged_temp_memory_is_per_tile(scheme):
    """Compiled temporary bytes of the quantized ragged SwiGLU on [16, 2112, 256] stacks (a full
    fp32 dequantization is 33 MiB per stack) with a 2 MiB tile budget (128 rows of D): within two
    tiles (the dequantized tile and XLA:CPU's ragged_dot copy of it) plus XLA:CPU's loop copies of
    the stored values. The same program with a budget that fits a whole stack is above that bound."""
    fmt, block = SCHEMES[scheme]
    e, d, f, r, budget = 16, 2112, 256, 8, 2 * 2**20
    spec = lambda shape: jax.eval_shape(lambda: quantize(jnp.zeros(shape), fmt, (1,), block))  # noqa: E731
    w = MoEWeights(router=jax.ShapeDtypeStruct((d, e), jnp.float32), gate=spec((e, d, f)), up=spec((e, d, f)),
                   down=spec((e, f, d)))
    args = (w, jax.ShapeDtypeStruct((r, d), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.int32))

    def temp_bytes(tile_bytes):
        compiled = jax.jit(ragged_swiglu, static_argnums=3).lower(*args, tile_bytes).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full_stack = e * d * f * 4
    rows = 16 * r * (d + f) * 4  # the rows' activations, partial sums and XLA:CPU's masked copies of them
    bound = 2 * budget + 3 * e * d * f * CPU_LOOP_COPY_BYTES[scheme] + rows
    assert temp_bytes(budget) <= bound
    assert temp_bytes(2 * full_stack) > bound  # whole-stack dequantization: the bound catches it


# Collectives that move weight shards between devices (a tensor-parallel SwiGLU needs only the
# all-reduce of down's partial sums).
MOVES = ("all-gather", "collective-permute", "all-to-all", "reduce-scatter")


def part_tensor_mesh() -> dict:
    """(Run by the test below with 8 faked devices.) The tiled int8 ragged SwiGLU with the stacks
    laid out as the tensor=8 rules place them (F split, D whole): its error against the oracle and
    the collectives of :data:`MOVES` in its compiled program."""
    placement = placement_for({"tensor": 8})

    def place(q, axes):
        scale_axes = tuple(None if i == 1 else a for i, a in enumerate(axes))  # size 1 or blocks on axis 1
        return q.replace(values=jax.device_put(q.values, placement.sharding(axes, q.shape)),
                         scale=jax.device_put(q.scale, placement.sharding(scale_axes, q.scale.shape)))

    w = _quantized_moe("int8")
    placed = w.replace(gate=place(w.gate, ("experts", "embed", "ffw")), up=place(w.up, ("experts", "embed", "ffw")),
                       down=place(w.down, ("experts", "ffw", "embed")))
    xs = jax.random.normal(jax.random.key(5), (sum(SIZES), D))
    compiled = jax.jit(ragged_swiglu, static_argnums=3).lower(placed, xs, jnp.asarray(SIZES, jnp.int32),
                                                              SMALL_TILE).compile()
    ref = _oracle(w, xs)
    out = np.asarray(compiled(placed, xs, jnp.asarray(SIZES, jnp.int32)))
    return {"err": float(np.abs(out - ref).max() / np.abs(ref).max()),
            "weight_moves": {op: len(re.findall(op + r"(-start)?\(", compiled.as_text())) for op in MOVES},
            "split": [list(placed.gate.values.sharding.spec), list(placed.down.values.sharding.spec)]}


@pytest.mark.slow
def test_tiles_never_cut_the_tensor_split_axis():
    """On tensor=8 (F split over tensor, D whole), the tiles along D run without moving the
    stored stacks between devices (tiling down's F instead gave 14 collective-permutes, and
    cutting gate/up's F on 2 devices 10 all-gathers of the int8 stacks)."""
    result = run_part("tensor_mesh", module="tests.test_moe_ragged")
    assert result["split"] == [[None, None, "tensor"], [None, "tensor", None]]
    assert not any(result["weight_moves"].values()), result["weight_moves"]
    assert result["err"] < 1e-5


# ---- a whole tiny MoE model with the ragged path as the platform's default ------------------------


LONG = 500


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_hf, tmp_path_factory):
    """conftest's tiny Qwen3-MoE converted (fp32), a 500-token prompt and HF's logits of it."""
    dz = convert_checkpoint(tiny_moe_hf, tmp_path_factory.mktemp("moe_ragged") / "dz", progress=False)
    config, weights = load_checkpoint(dz, dtype=jnp.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_hf, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    ids = random_ids(LONG, config.vocab_size, seed=1)
    with torch.no_grad():
        out = hf(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    for layer_logits in out.router_logits:  # a clear top-2 everywhere, else parity tests rounding
        assert _router_gap(layer_logits.float().numpy(), 2) > MIN_ROUTER_GAP
    return config, weights, ids, out.logits.float().numpy()


def _logits(monkeypatch, config, weights, ids, impl: GroupedMatmul) -> np.ndarray:
    """Logits [1, T, V] of one forward pass with ``impl`` as the platform's grouped matmul."""
    with monkeypatch.context() as m:
        m.setitem(moe_module.DEFAULT_GROUPED_MATMUL, jax.default_backend(), impl)
        # A fresh function each time: jit's trace cache would otherwise reuse the other impl.
        run = jax.jit(lambda w, t: forward(w, config, t, None, all_logits=True)[0])
        assert ("ragged_dot_general[" in str(run.trace(weights, jnp.asarray(ids)).jaxpr)) == \
            (impl is GroupedMatmul.RAGGED_DOT)
        return np.asarray(run(weights, jnp.asarray(ids)))


def test_model_with_ragged_default_matches_hf(tiny_moe, monkeypatch):
    """Every MoE layer through ragged_dot: logits of a 500-token prompt within tests.hf_helpers'
    REL_TOL of HF's."""
    config, weights, ids, hf_logits = tiny_moe
    assert_logits_match(_logits(monkeypatch, config, weights, ids, GroupedMatmul.RAGGED_DOT), hf_logits,
                        "ragged_dot")


@pytest.mark.slow
def test_int4_model_with_ragged_default_matches_expert_loop(tiny_moe, monkeypatch):
    """int4 experts (64-row stacks: one partial 128-row group) through the real weight specs: the
    ragged path's logits equal the expert loop's to fp32 rounding, and differ from the float
    model's (the comparison sees the quantization)."""
    config, weights, ids, hf_logits = tiny_moe
    quantized = quantize_weights(weights, abstract_weights(config, QuantConfig(WeightQuant.INT4)))
    ragged = _logits(monkeypatch, config, quantized, ids, GroupedMatmul.RAGGED_DOT)
    loop = _logits(monkeypatch, config, quantized, ids, GroupedMatmul.EXPERT_LOOP)
    scale = np.abs(loop).max()
    assert np.abs(ragged - loop).max() <= 1e-5 * scale
    assert np.abs(loop - hf_logits).max() > 100 * REL_TOL * scale


if __name__ == "__main__":  # the parts above that run in a fresh interpreter (tests.mesh_checks.run_part)
    print(json.dumps({"tensor_mesh": part_tensor_mesh}[sys.argv[1]]()))
