"""How a kernel runs: the ``--kernels`` choice, its per-platform default, and the one dispatch.

Every op in ``dayzero.kernels`` has two implementations with the same signature: a pure-jnp
reference (readable, runs anywhere) and a Pallas kernel. The kernels are written for Pallas
Triton, so they compile on NVIDIA GPUs only; anywhere else they can run in Pallas's interpret
mode, which executes the same kernel body as ordinary XLA ops (slowly: it is for tests).

``auto`` resolves per platform: GPU -> ``pallas``; CPU and TPU -> ``reference`` (Pallas only
interprets on CPU, and these kernels use Triton-style gathers that Mosaic TPU does not lower).
A mode that cannot run on the platform raises :class:`KernelError` saying what to use instead;
nothing falls back silently.
"""

from __future__ import annotations

import enum
from typing import Callable

import jax


class KernelError(ValueError):
    """A kernel was asked for something it cannot do: a bad shape or dtype, or a mode that
    cannot run on this platform. The message names the offending value and what to do."""


class KernelMode(enum.Enum):
    """Which implementation of each kernel op runs (the ``--kernels`` flag)."""

    AUTO = "auto"
    REFERENCE = "reference"
    PALLAS = "pallas"
    PALLAS_INTERPRET = "pallas_interpret"


# The concrete mode ``auto`` stands for on each platform (see the module docstring).
AUTO_DEFAULTS = {
    "gpu": KernelMode.PALLAS,
    "cpu": KernelMode.REFERENCE,
    "tpu": KernelMode.REFERENCE,
}

# jax.default_backend() and device.platform spell GPUs several ways.
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}


def current_platform() -> str:
    """The default JAX backend's platform, as ``AUTO_DEFAULTS`` names it ("cpu", "gpu", "tpu")."""
    return _normalize_platform(jax.default_backend())


def _normalize_platform(platform: str) -> str:
    try:
        return _PLATFORM_ALIASES[platform.lower()]
    except KeyError:
        raise KernelError(
            f"unknown platform {platform!r}; expected one of {sorted(_PLATFORM_ALIASES)}") from None


def parse_mode(mode: KernelMode | str) -> KernelMode:
    """``mode`` as a :class:`KernelMode`; strings are the ``--kernels`` spellings."""
    if isinstance(mode, KernelMode):
        return mode
    try:
        return KernelMode(mode)
    except ValueError:
        choices = "|".join(m.value for m in KernelMode)
        raise KernelError(f"unknown kernel mode {mode!r}; use one of {choices}") from None


def resolve_mode(mode: KernelMode | str, platform: str | None = None) -> KernelMode:
    """The concrete mode (never AUTO) that ``mode`` means on ``platform`` (default: JAX's
    default backend). Raises :class:`KernelError` if that mode cannot run there."""
    mode = parse_mode(mode)
    platform = current_platform() if platform is None else _normalize_platform(platform)
    if mode is KernelMode.AUTO:
        return AUTO_DEFAULTS[platform]
    if mode is KernelMode.PALLAS and platform != "gpu":
        raise KernelError(
            f"--kernels pallas cannot run on {platform}: the Pallas kernels compile for GPUs "
            "(Pallas Triton) only; use --kernels pallas_interpret (same kernels, interpreted, "
            "slow) or --kernels reference")
    return mode


def describe(mode: KernelMode | str, platform: str | None = None) -> dict[str, str]:
    """What ``mode`` runs on ``platform``, for ``--json`` output: the requested mode, the
    resolved one, the platform and the backend that executes the kernels."""
    platform = current_platform() if platform is None else _normalize_platform(platform)
    resolved = resolve_mode(mode, platform)
    backend = {
        KernelMode.REFERENCE: "xla",
        KernelMode.PALLAS: "pallas_triton",
        KernelMode.PALLAS_INTERPRET: "pallas_interpret",
    }[resolved]
    return {"requested": parse_mode(mode).value, "resolved": resolved.value,
            "platform": platform, "backend": backend}


def dispatch(mode: KernelMode | str, reference: Callable, pallas: Callable, *args, **kwargs):
    """Run an op's ``reference`` or its ``pallas`` wrapper (called with ``interpret=``) as
    ``mode`` resolves on the current platform. The one dispatch every op uses."""
    resolved = resolve_mode(mode)
    if resolved is KernelMode.REFERENCE:
        return reference(*args, **kwargs)
    return pallas(*args, interpret=resolved is KernelMode.PALLAS_INTERPRET, **kwargs)
