"""Kernel modes, validators, GPU lowering (checked on CPU) and, on a GPU, the compiled kernels.

The kernels' numerics in interpret mode are in test_kernels_attention.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.kernels import (KernelError, KernelMode, describe, flash_attention, flash_attention_pallas,
                             flash_attention_reference, paged_attention, paged_attention_pallas,
                             paged_attention_reference, paged_latent_attention, paged_latent_attention_pallas,
                             paged_latent_attention_reference, resolve_mode, sparse_attention,
                             sparse_attention_pallas, sparse_attention_reference)
from dayzero.kernels.check import triton_calls
from dayzero.kernels.mode import AUTO_DEFAULTS, current_platform
from dayzero.kernels.tiles import pow2_parts

SDS = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
ON_GPU = jax.default_backend() == "gpu"

# --- modes ---


@pytest.mark.parametrize("platform, expected", [("cpu", KernelMode.REFERENCE), ("gpu", KernelMode.PALLAS),
                                                ("cuda", KernelMode.PALLAS), ("tpu", KernelMode.REFERENCE)])
def test_auto_resolves_per_platform(platform, expected):
    assert resolve_mode("auto", platform) is expected
    assert resolve_mode(KernelMode.AUTO, platform) is expected


def test_auto_without_platform_uses_the_default_backend():
    assert resolve_mode(KernelMode.AUTO) is AUTO_DEFAULTS[current_platform()]


def test_pallas_on_cpu_is_an_error_naming_the_alternatives():
    with pytest.raises(KernelError, match="pallas_interpret.*reference"):
        resolve_mode(KernelMode.PALLAS, "cpu")
    assert issubclass(KernelError, ValueError)


@pytest.mark.parametrize("mode", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_explicit_modes_that_run_anywhere(mode, platform):
    assert resolve_mode(mode, platform) is KernelMode(mode)


def test_pallas_on_gpu_and_unknown_names():
    assert resolve_mode("pallas", "gpu") is KernelMode.PALLAS
    with pytest.raises(KernelError, match="'fast'.*auto\\|reference\\|pallas\\|pallas_interpret"):
        resolve_mode("fast", "cpu")
    with pytest.raises(KernelError, match="unknown platform 'abacus'"):
        resolve_mode("auto", "abacus")


def test_describe_says_what_runs():
    assert describe("auto", "cpu") == {"requested": "auto", "resolved": "reference", "platform": "cpu",
                                       "backend": "xla"}
    assert describe("auto", "cuda")["backend"] == "pallas_triton"
    assert describe("pallas_interpret", "cpu")["resolved"] == "pallas_interpret"


@pytest.mark.skipif(ON_GPU, reason="checks the CPU refusal")
def test_ops_refuse_pallas_on_cpu_without_fallback():
    q = jnp.zeros((1, 2, 2, 16))
    with pytest.raises(KernelError, match="cannot run on cpu"):
        flash_attention(q, q, q, mode="pallas")


def test_pow2_parts():
    assert pow2_parts(576) == ((0, 512), (512, 64))
    assert pow2_parts(24) == ((0, 16), (16, 8))
    assert pow2_parts(64, offset=512) == ((512, 64),)
    assert pow2_parts(1) == ((0, 1),)


# --- validators: one per op, called by both paths ---

FLASH = dict(q=SDS((2, 5, 4, 16), F32), k=SDS((2, 7, 2, 16), F32), v=SDS((2, 7, 2, 16), F32))
PAGED = dict(q=SDS((2, 3, 4, 16), F32), k_pages=SDS((2, 9, 8, 16), F32), v_pages=SDS((2, 9, 8, 16), F32),
             block_tables=SDS((2, 3), I32), kv_lengths=SDS((2,), I32))
LATENT = dict(q=SDS((2, 3, 4, 40), F32), latent_pages=SDS((9, 8, 40), F32), block_tables=SDS((2, 3), I32),
              kv_lengths=SDS((2,), I32))
SPARSE = dict(q=SDS((2, 3, 4, 40), F32), kv=SDS((2, 30, 40), F32), indices=SDS((2, 3, 6), I32))


def _with(base, **changes):
    return {**base, **changes}


BAD_CALLS = {
    "flash q rank": ((flash_attention_reference, flash_attention_pallas),
                     _with(FLASH, q=SDS((2, 5, 16), F32)), {}, r"q must be \[B,T,N,H\], got shape \(2, 5, 16\)"),
    "flash k head dim": ((flash_attention_reference, flash_attention_pallas),
                         _with(FLASH, k=SDS((2, 7, 2, 8), F32)), {}, r"k has shape \(2, 7, 2, 8\)"),
    "flash v shape": ((flash_attention_reference, flash_attention_pallas),
                      _with(FLASH, v=SDS((2, 6, 2, 16), F32)), {}, r"v has shape \(2, 6, 2, 16\)"),
    "flash heads": ((flash_attention_reference, flash_attention_pallas),
                    _with(FLASH, k=SDS((2, 7, 3, 16), F32), v=SDS((2, 7, 3, 16), F32)), {},
                    "4 query heads are not a multiple of 3 kv heads"),
    "flash dtype": ((flash_attention_reference, flash_attention_pallas),
                    _with(FLASH, k=SDS((2, 7, 2, 16), BF16)), {}, "k has dtype bfloat16 but q has float32"),
    "flash int q": ((flash_attention_reference, flash_attention_pallas),
                    _with(FLASH, q=SDS((2, 5, 4, 16), I32)), {}, "q must be float32, bfloat16 or float16"),
    "flash lengths": ((flash_attention_reference, flash_attention_pallas), FLASH,
                      dict(kv_lengths=SDS((3,), I32)), r"kv_lengths must be int32 \[B=2\]"),
    "flash offsets dtype": ((flash_attention_reference, flash_attention_pallas), FLASH,
                            dict(q_offsets=SDS((2,), F32)), r"q_offsets must be int32 \[B=2\], got float32"),
    "flash scale": ((flash_attention_reference, flash_attention_pallas), FLASH, dict(sm_scale=-1.0),
                    "sm_scale must be a positive number, got -1.0"),
    "flash window": ((flash_attention_reference, flash_attention_pallas), FLASH, dict(window=0),
                     "window must be None or a positive int, got 0"),
    "paged decode q without T": ((paged_attention_reference, paged_attention_pallas),
                                 _with(PAGED, q=SDS((2, 4, 16), F32)), {},
                                 r"q must be \[B,T,N,H\], got shape \(2, 4, 16\)"),
    "paged no queries": ((paged_attention_reference, paged_attention_pallas),
                         _with(PAGED, q=SDS((2, 0, 4, 16), F32)), {}, r"q has shape \(2, 0, 4, 16\).*T >= 1"),
    "paged offsets dtype": ((paged_attention_reference, paged_attention_pallas), PAGED,
                            dict(q_offsets=SDS((2,), F32)), r"q_offsets must be int32 \[B=2\], got float32\[2\]"),
    "paged offsets shape": ((paged_attention_reference, paged_attention_pallas), PAGED,
                            dict(q_offsets=SDS((2, 3), I32)), r"q_offsets must be int32 \[B=2\], got int32\[2, 3\]"),
    "paged pages rank": ((paged_attention_reference, paged_attention_pallas),
                         _with(PAGED, k_pages=SDS((9, 8, 16), F32)), {}, r"k_pages must be \[K,P,page_size,H\]"),
    "paged v pages": ((paged_attention_reference, paged_attention_pallas),
                      _with(PAGED, v_pages=SDS((2, 9, 4, 16), F32)), {}, r"v_pages has shape \(2, 9, 4, 16\)"),
    "paged tables": ((paged_attention_reference, paged_attention_pallas),
                     _with(PAGED, block_tables=SDS((3, 3), I32)), {}, r"block_tables must be int32 \[B=2"),
    "paged lengths": ((paged_attention_reference, paged_attention_pallas),
                      _with(PAGED, kv_lengths=SDS((2,), jnp.int64 if jax.config.read("jax_enable_x64") else F32)),
                      {}, r"kv_lengths must be int32 \[B=2\]"),
    "latent width": ((paged_latent_attention_reference, paged_latent_attention_pallas),
                     _with(LATENT, latent_pages=SDS((9, 8, 32), F32)), dict(value_dim=32, sm_scale=0.1),
                     r"latent_pages has shape \(9, 8, 32\)"),
    "latent decode q without T": ((paged_latent_attention_reference, paged_latent_attention_pallas),
                                  _with(LATENT, q=SDS((2, 4, 40), F32)), dict(value_dim=32, sm_scale=0.1),
                                  r"q must be \[B,T,N,C\], got shape \(2, 4, 40\)"),
    "latent offsets": ((paged_latent_attention_reference, paged_latent_attention_pallas), LATENT,
                       dict(q_offsets=SDS((3,), I32), value_dim=32, sm_scale=0.1),
                       r"q_offsets must be int32 \[B=2\], got int32\[3\]"),
    "latent value dim": ((paged_latent_attention_reference, paged_latent_attention_pallas), LATENT,
                         dict(value_dim=41, sm_scale=0.1), r"value_dim must be an int in \[1, C=40\], got 41"),
    "sparse kv": ((sparse_attention_reference, sparse_attention_pallas), _with(SPARSE, kv=SDS((2, 30, 32), F32)),
                  dict(value_dim=32, sm_scale=1.0), r"kv has shape \(2, 30, 32\)"),
    "sparse kv batch": ((sparse_attention_reference, sparse_attention_pallas), _with(SPARSE, kv=SDS((3, 30, 40), F32)),
                        dict(value_dim=32, sm_scale=1.0), r"kv has shape \(3, 30, 40\), expected \[B=2.*or \[S>=1"),
    "sparse shared kv width": ((sparse_attention_reference, sparse_attention_pallas),
                               _with(SPARSE, kv=SDS((30, 32), F32)), dict(value_dim=32, sm_scale=1.0),
                               r"kv has shape \(30, 32\)"),
    "sparse kv rank": ((sparse_attention_reference, sparse_attention_pallas), _with(SPARSE, kv=SDS((40,), F32)),
                       dict(value_dim=32, sm_scale=1.0), r"kv has shape \(40,\)"),
    "sparse indices": ((sparse_attention_reference, sparse_attention_pallas),
                       _with(SPARSE, indices=SDS((2, 3, 6), F32)), dict(value_dim=32, sm_scale=1.0),
                       r"indices must be int32 \[B=2, T=3, k>=1\], got float32"),
    "sparse scale": ((sparse_attention_reference, sparse_attention_pallas), SPARSE,
                     dict(value_dim=32, sm_scale=None), "sm_scale must be a positive number, got None"),
}


@pytest.mark.parametrize("case", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_validators_name_the_bad_input(case):
    """Both the reference and the kernel wrapper reject the input, before any work."""
    (reference, pallas), arrays, kwargs, message = case
    with pytest.raises(KernelError, match=message):
        reference(*arrays.values(), **kwargs)
    with pytest.raises(KernelError, match=message):
        pallas(*arrays.values(), interpret=True, **kwargs)


def test_pallas_paged_kernels_need_power_of_two_pages():
    q, k = jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 3, 12, 16))
    tables, lengths = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(KernelError, match="page_size 12 is not a power of two.*--kernels reference"):
        paged_attention_pallas(q, k, k, tables, lengths, interpret=True)
    assert paged_attention_reference(q, k, k, tables, lengths).shape == (1, 1, 2, 16)


# --- GPU lowering, checked without a GPU (the Python half of Pallas Triton compilation) ---

LOWERING_CASES = {
    "flash h128 bf16": (lambda q, k, v, o, n: flash_attention_pallas(q, k, v, q_offsets=o, kv_lengths=n),
                        SDS((2, 1000, 32, 128), BF16), SDS((2, 1000, 8, 128), BF16), SDS((2, 1000, 8, 128), BF16),
                        SDS((2,), I32), SDS((2,), I32)),
    "flash h96 window fp32": (lambda q, k, v: flash_attention_pallas(q, k, v, window=256),
                              SDS((1, 300, 4, 96), F32), SDS((1, 300, 4, 96), F32), SDS((1, 300, 4, 96), F32)),
    "paged h128 page16": (lambda q, k, v, t, n: paged_attention_pallas(q, k, v, t, n),
                          SDS((8, 1, 32, 128), BF16), SDS((8, 600, 16, 128), BF16), SDS((8, 600, 16, 128), BF16),
                          SDS((8, 70), I32), SDS((8,), I32)),
    "paged chunk T256 h128 page16": (lambda q, k, v, t, n, o: paged_attention_pallas(q, k, v, t, n, q_offsets=o),
                                     SDS((2, 256, 32, 128), BF16), SDS((8, 600, 16, 128), BF16),
                                     SDS((8, 600, 16, 128), BF16), SDS((2, 256), I32), SDS((2,), I32), SDS((2,), I32)),
    "paged h64 page32 window": (lambda q, k, v, t, n: paged_attention_pallas(q, k, v, t, n, window=100),
                                SDS((2, 3, 9, 64), F32), SDS((1, 50, 32, 64), F32), SDS((1, 50, 32, 64), F32),
                                SDS((2, 10), I32), SDS((2,), I32)),
    "latent 512+64": (lambda q, p, t, n: paged_latent_attention_pallas(q, p, t, n, value_dim=512, sm_scale=0.1),
                      SDS((4, 1, 128, 576), BF16), SDS((300, 16, 576), BF16), SDS((4, 70), I32), SDS((4,), I32)),
    "latent chunk T64 512+64": (lambda q, p, t, n, o: paged_latent_attention_pallas(q, p, t, n, q_offsets=o,
                                                                                      value_dim=512, sm_scale=0.1),
                                SDS((1, 64, 128, 576), BF16), SDS((300, 16, 576), BF16), SDS((1, 70), I32),
                                SDS((1,), I32), SDS((1,), I32)),
    "sparse 512+64 topk2048": (lambda q, kv, i: sparse_attention_pallas(q, kv, i, value_dim=512, sm_scale=0.1),
                               SDS((1, 4, 128, 576), BF16), SDS((1, 5000, 576), BF16), SDS((1, 4, 2048), I32)),
    "sparse shared pool": (lambda q, kv, i: sparse_attention_pallas(q, kv, i, value_dim=512, sm_scale=0.1),
                           SDS((4, 1, 128, 576), BF16), SDS((300 * 16, 576), BF16), SDS((4, 1, 2048), I32)),
    "sparse narrow parts": (lambda q, kv, i: sparse_attention_pallas(q, kv, i, value_dim=32, sm_scale=0.1),
                            SDS((1, 2, 4, 40), F32), SDS((1, 30, 40), F32), SDS((1, 2, 20), I32)),
}


@pytest.mark.parametrize("case", LOWERING_CASES.values(), ids=LOWERING_CASES.keys())
def test_kernels_lower_for_gpu(case):
    """Each kernel, at GPU-table tile sizes, lowers to exactly one Pallas Triton call."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    fn, *avals = case
    assert triton_calls(fn, *avals) == 1


# --- compiled on a GPU (skipped elsewhere) ---


def _gpu_cases(rng, dtype):
    """(name, op, arrays, kwargs) at moderate sizes with ragged lengths including 0, decode and
    chunks of T > 1 queries."""
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

    P, page, pps = 200, 16, 40
    tables = jnp.asarray(rng.permutation(P)[:3 * pps].reshape(3, pps), I32)
    lengths = jnp.array([0, page, 517], I32)
    offsets = jnp.array([0, 0, 477], I32)  # chunks: nothing to see, 16 keys for 40 queries, the last 40 keys
    picks = jnp.asarray(np.where(rng.random((1, 8, 100)) < 0.9, rng.integers(0, 500, (1, 8, 100)), -1), I32)
    return [
        ("flash", flash_attention, (normal(2, 300, 8, 128), normal(2, 333, 2, 128), normal(2, 333, 2, 128)),
         dict(q_offsets=jnp.array([0, 33], I32), kv_lengths=jnp.array([0, 333], I32))),
        ("flash h96", flash_attention, (normal(1, 200, 4, 96), normal(1, 200, 4, 96), normal(1, 200, 4, 96)),
         dict(window=50)),
        ("paged", paged_attention, (normal(3, 1, 16, 128), normal(4, P, page, 128), normal(4, P, page, 128),
                                    tables, lengths), {}),
        ("paged chunk", paged_attention, (normal(3, 40, 16, 128), normal(4, P, page, 128),
                                          normal(4, P, page, 128), tables, lengths), dict(q_offsets=offsets)),
        ("paged chunk window", paged_attention, (normal(3, 40, 16, 128), normal(4, P, page, 128),
                                                 normal(4, P, page, 128), tables, lengths),
         dict(q_offsets=offsets, window=100)),
        ("latent", paged_latent_attention, (normal(3, 1, 16, 576), normal(P, page, 576), tables, lengths),
         dict(value_dim=512, sm_scale=0.05)),
        ("latent chunk", paged_latent_attention, (normal(3, 24, 16, 576), normal(P, page, 576), tables, lengths),
         dict(q_offsets=offsets, value_dim=512, sm_scale=0.05)),
        ("sparse", sparse_attention, (normal(1, 8, 16, 576), normal(1, 500, 576), picks),
         dict(value_dim=512, sm_scale=0.05)),
        ("sparse shared", sparse_attention, (normal(1, 8, 16, 576), normal(500, 576), picks),
         dict(value_dim=512, sm_scale=0.05)),
    ]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to compile the Pallas kernels")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_compiled_kernels_match_reference_on_gpu(dtype):
    tol = 1e-4 if dtype == F32 else 2**-6
    for name, op, arrays, kwargs in _gpu_cases(np.random.default_rng(0), dtype):
        with jax.default_matmul_precision("float32"):  # the reference in full fp32, not TF32
            expected = jax.jit(lambda *a: op(*a, mode="reference", **kwargs))(*arrays)
        actual = jax.jit(lambda *a: op(*a, mode="pallas", **kwargs))(*arrays)
        np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                                   rtol=tol, atol=tol, err_msg=name)
