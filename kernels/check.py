"""GPU lowering checks that run without a GPU.

Compiling a Pallas Triton kernel has two halves: JAX lowers the kernel body to Triton IR in
Python (where power-of-two tile sizes, supported primitives, matmul shapes and indexing are
checked), then XLA's GPU compiler turns that IR into PTX. The first half runs on any machine by
exporting for the "cuda" platform, which is how tests and ``bench/kernels.py`` check on CPU that
every kernel still lowers for GPU at realistic sizes. The second half needs a GPU.

:func:`triton_modules` also returns each kernel's Triton IR with its operands, and
:func:`offset_types` / :func:`offset_overflows` read the address arithmetic out of it: which
integer type each operand's pointer offsets have, and whether an int32 one can exceed 2^31 - 1
(how tests check, without allocating it, that a pool larger than 2^31 elements is addressed
safely).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Callable

import jax
from jax import export

# Pallas Triton kernels appear as this custom call in the lowered module.
TRITON_CALL = "__gpu$xla.gpu.triton"


def triton_calls(fn: Callable, *avals: jax.ShapeDtypeStruct) -> int:
    """Lower ``fn`` (jitted) for CUDA from abstract inputs ``avals`` and return how many
    Pallas Triton kernels it contains. Raises whatever the Triton lowering raises (e.g. a
    non-power-of-two load)."""
    return len(_triton_call_params(_lowered_text(fn, *avals)))


def _lowered_text(fn: Callable, *avals: jax.ShapeDtypeStruct) -> str:
    """The StableHLO text of ``fn`` (jitted) exported for CUDA from ``avals``."""
    # Triton calls carry no serialization-compatibility guarantee; this export is never saved.
    exported = export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*avals)
    return exported.mlir_module()


# Each Triton custom call's backend config carries the launch parameters Pallas chose; its
# serialized IR (a quoted string with escapes) is dropped first so nothing inside it can match.
_CALL_IR = re.compile(r'\bir = "(?:[^"\\]|\\.)*"')
_CALL_PARAM = re.compile(r"\b(grid_[xyz]|num_stages|num_warps) = (\d+) : i32")


def _triton_call_params(text: str) -> list[dict[str, int]]:
    """``num_warps``, ``num_stages`` and ``grid_x/y/z`` of each Triton call in lowered text."""
    return [{key: int(value) for key, value in _CALL_PARAM.findall(_CALL_IR.sub("", line))}
            for line in text.splitlines() if f"@{TRITON_CALL}(" in line]


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Pallas Triton kernel as lowered: its Triton IR (MLIR text), its operands in the
    order of the kernel function's pointer arguments ``%arg0, %arg1, ...`` (the pallas_call's
    inputs, then its outputs), and the launch parameters Pallas gave XLA for it (warps per
    block, software-pipelining stages, grid)."""

    ir: str
    operands: tuple[jax.ShapeDtypeStruct, ...]
    num_warps: int = 4
    num_stages: int = 3
    grid: tuple[int, int, int] = (1, 1, 1)


@contextlib.contextmanager
def _capture_triton_modules(captured: list[TritonModule]):
    # Pallas has no public hook for the Triton IR it builds (pallas_call(debug=True) prints it),
    # so this wraps its private lowering entry point for the duration of one lowering.
    from jax._src.pallas.triton import lowering

    original = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, grid_mapping, *args, **kwargs):
        result = original(jaxpr, grid_mapping, *args, **kwargs)
        operands = tuple(jax.ShapeDtypeStruct(bm.array_aval.shape, bm.array_aval.dtype)
                         for bm in grid_mapping.block_mappings)
        captured.append(TritonModule(result.module.operation.get_asm(), operands))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def triton_modules(fn: Callable, *avals: jax.ShapeDtypeStruct) -> list[TritonModule]:
    """Lower ``fn`` for CUDA as :func:`triton_calls` does and return every Pallas Triton
    kernel it contains, with its IR and operands (relies on a private JAX function; raises if
    it captured nothing)."""
    captured: list[TritonModule] = []
    with _capture_triton_modules(captured):
        params = _triton_call_params(_lowered_text(fn, *avals))
    if len(captured) != len(params):
        raise RuntimeError(f"lowered {len(params)} Triton calls but captured {len(captured)} modules")
    # Modules are captured in lowering order, which is the order of the calls in the text.
    return [dataclasses.replace(module, num_warps=p["num_warps"], num_stages=p["num_stages"],
                                grid=(p["grid_x"], p["grid_y"], p["grid_z"]))
            for module, p in zip(captured, params)]


_SPLAT = re.compile(r"^\s*(%[\w.#]+) = tt\.splat (%[\w.#]+) : !tt\.ptr<")
_ADDPTR = re.compile(r"^\s*(?:%[\w.#]+ = )?tt\.addptr (%[\w.#]+), %[\w.#]+ : .*?(i\d+)>?\s*$")
_ARG = re.compile(r"^%arg(\d+)$")


def offset_types(module: TritonModule) -> dict[int, set[str]]:
    """For each operand index, the integer types (``"i32"``, ``"i64"``) of the offsets added to
    its pointer (``tt.addptr`` of the argument, directly or splatted to a tensor of pointers).
    Raises if an ``addptr`` starts from anything else, so a change in how Pallas builds
    addresses is noticed rather than missed."""
    sources: dict[str, int] = {}
    types: dict[int, set[str]] = {}
    for line in module.ir.splitlines():
        if m := _SPLAT.match(line):
            arg = _ARG.match(m.group(2))
            if arg and int(arg.group(1)) < len(module.operands):
                sources[m.group(1)] = int(arg.group(1))
        elif m := _ADDPTR.match(line):
            base, offset = m.group(1), m.group(2)
            arg = _ARG.match(base)
            if arg and int(arg.group(1)) < len(module.operands):
                index = int(arg.group(1))
            elif base in sources:
                index = sources[base]
            else:
                raise ValueError(f"tt.addptr from a pointer not traced to an operand: {line.strip()}")
            types.setdefault(index, set()).add(offset)
    return types


def offset_overflows(module: TritonModule) -> list[str]:
    """The operands addressed with int32 offsets although they hold more than 2^31 elements
    (an offset past 2^31 - 1 wraps negative; Triton's addptr sign-extends it), one line each."""
    problems = []
    for index, types in sorted(offset_types(module).items()):
        operand = module.operands[index]
        elements = math.prod(operand.shape)
        if "i32" in types and elements > 2**31:
            problems.append(f"operand {index} {operand.dtype}{list(operand.shape)}: {elements} elements "
                            f"addressed with i32 offsets")
    return problems
