"""GPU lowering checks that run without a GPU.

Compiling a Pallas Triton kernel has two halves: JAX lowers the kernel body to Triton IR in
Python (where power-of-two tile sizes, supported primitives, matmul shapes and indexing are
checked), then XLA's GPU compiler turns that IR into PTX. The first half runs on any machine by
exporting for the "cuda" platform, which is how tests and ``bench/kernels.py`` check on CPU that
every kernel still lowers for GPU at realistic sizes. The second half needs a GPU.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax import export

# Pallas Triton kernels appear as this custom call in the lowered module.
TRITON_CALL = "__gpu$xla.gpu.triton"


def triton_calls(fn: Callable, *avals: jax.ShapeDtypeStruct) -> int:
    """Lower ``fn`` (jitted) for CUDA from abstract inputs ``avals`` and return how many
    Pallas Triton kernels it contains. Raises whatever the Triton lowering raises (e.g. a
    non-power-of-two load)."""
    # Triton calls carry no serialization-compatibility guarantee; this export is never saved.
    exported = export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*avals)
    return exported.mlir_module().count(f"@{TRITON_CALL}")
