"""JAX's persistent compilation cache, on by default for every dayzero command that compiles.

A second ``dayzero generate`` (or ``serve`` start) with the same model, options and mesh reads
its compiled executables from disk instead of compiling them again. JAX keys each entry on the
HLO module itself, the compile options, the device assignment and the jax/jaxlib and backend
versions, so a changed model, dtype, mesh or kernel choice is a different key. The directory is
also per dayzero and jax version (``<cache>/xla/dayzero-V-jax-V``): an upgrade starts a fresh
directory rather than relying on the key alone, and old ones can be deleted whole.

The setting: ``--compile-cache DIR|off``, else ``$DAYZERO_COMPILE_CACHE`` (the test suite sets it
to ``off``), else the default directory under the dayzero cache (``$DAYZERO_CACHE``, else
``~/.cache/dayzero``). Every compile is cached (no minimum compile time): serving's step shapes
take 0.1-2 s each on CPU, below JAX's default 1 s threshold.
"""

from __future__ import annotations

import os
from pathlib import Path

OFF = "off"
ENV = "DAYZERO_COMPILE_CACHE"


class CompileCacheError(ValueError):
    """A ``--compile-cache`` directory that cannot be used."""


def default_dir() -> Path:
    """``<dayzero cache>/xla/dayzero-<version>-jax-<version>``."""
    from importlib.metadata import PackageNotFoundError, version

    import jax

    from dayzero.engine.default_model import cache_root

    try:
        ours = version("dayzero")
    except PackageNotFoundError:  # running from a source tree that was never installed
        ours = "source"
    return cache_root() / "xla" / f"dayzero-{ours}-jax-{jax.__version__}"


def resolve(setting: str | None) -> Path | None:
    """The directory ``setting`` (the ``--compile-cache`` value, None if not given) selects;
    None when the cache is off."""
    chosen = setting if setting is not None else os.environ.get(ENV)
    if chosen is not None and chosen.strip().lower() == OFF:
        return None
    return Path(chosen).expanduser() if chosen else default_dir()


def enable(setting: str | None) -> Path | None:
    """Turn the persistent cache on for this process as ``setting`` says (before anything
    compiles); returns the directory in use, or None when off."""
    import jax

    directory = resolve(setting)
    if directory is None:
        jax.config.update("jax_compilation_cache_dir", None)  # also off where an earlier call turned it on
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompileCacheError(f"--compile-cache {directory}: cannot create it ({e.strerror}); "
                                f"pass a writable directory or --compile-cache {OFF}") from None
    if not os.access(directory, os.W_OK):
        raise CompileCacheError(f"--compile-cache {directory} is not writable; pass a writable directory "
                                f"or --compile-cache {OFF}")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
