"""Compiled steps kept on disk whole, so that a warm start neither traces nor lowers them.

JAX's persistent compilation cache (``dayzero.engine.compile_cache``) skips XLA's compile, but
it is keyed on the lowered program, so every start still traces the Python step and lowers it to
MLIR before it can look the entry up: measured on the embedded model, 4.5 s of a warm start's
7.3 s (NOTES.md). This cache sits in front of it. A step's executable is serialized
(``jax.experimental.serialize_executable``) with its argument and result tree structures, under a
key of everything the program depends on:

- the dayzero source (a hash of every module of the package: an edited model must never run an
  old executable, even at the same version number), jax and jaxlib versions, the backend, the
  devices and process layout, ``XLA_FLAGS`` and the jax settings that change programs;
- the engine's constants that the step closes over (its model config and run configuration,
  given by the caller as ``scope``), the step's name and static arguments;
- every argument leaf's shape, dtype, weak type and sharding, and the tree structure.

In memory, each executable is found again by a small signature the caller chooses (the step's
shape bucket), so a decode step costs one dict lookup, not a flatten of the weight tree. A file
that cannot be read back (truncated, another jax) is compiled again and replaced; the files are
written atomically, so a killed process leaves no half entry. Only executables compiled in this
process are stored (see ``_PERSISTENT_HIT`` for why). The directory is the persistent
cache's own (``<dir>/steps``): on and off with ``--compile-cache``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Callable, Hashable

import jax
from jax.experimental import serialize_executable

from dayzero.kernels import cpu_matvec
from dayzero.model.quant import NIBBLE_TYPES

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parent.parent
_source_digest: str | None = None
# Hits of JAX's persistent cache so far in this process. An executable that JAX read back from
# its cache serializes without its compiled functions (jaxlib 0.10, XLA:CPU: the copy loads, then
# fails with "Function ..._fusion not found" when run), so only fresh compiles are stored here.
_PERSISTENT_HIT = "/jax/compilation_cache/cache_hits"
_persistent_hits = 0
_listening = False


def _count_persistent_hit(event: str, **_) -> None:
    global _persistent_hits
    if event == _PERSISTENT_HIT:
        _persistent_hits += 1


def _listen_for_persistent_hits() -> None:
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_count_persistent_hit)
        _listening = True


def _package_modules() -> list[Path]:
    """The package's own modules: its top-level files and subpackages (not the tests, benchmark
    scripts or a virtual environment that a source checkout holds beside them)."""
    modules = []
    for top in sorted(_PACKAGE.iterdir()):
        if top.name in ("tests", "bench") or top.name.startswith("."):
            continue
        if top.suffix == ".py":
            modules.append(top)
        elif (top / "__init__.py").exists():
            modules += sorted(top.rglob("*.py"))
    return modules


def source_digest() -> str:
    """A hash of every Python module of the dayzero package (computed once per process)."""
    global _source_digest
    if _source_digest is None:
        h = hashlib.sha256()
        for path in _package_modules():
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
        _source_digest = h.hexdigest()
    return _source_digest


def _environment() -> str:
    """What, besides the program's own inputs, makes XLA build a different executable."""
    import jaxlib

    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    settings = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
    return repr((source_digest(), jax.__version__, jaxlib.__version__, jax.default_backend(), devices,
                 jax.process_index(), jax.process_count(), os.environ.get("XLA_FLAGS", ""), settings,
                 cpu_matvec.fingerprint()))


def _leaf_signature(leaf: Any) -> tuple:
    sharding = getattr(leaf, "sharding", None)
    devices = None if sharding is None else tuple(d.id for d in sharding._device_assignment)
    return (tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", type(leaf).__name__)),
            bool(getattr(leaf, "weak_type", False)), repr(sharding), devices)


def directory_in_use() -> Path | None:
    """``<persistent cache>/steps`` while ``--compile-cache`` is on in this process, else None."""
    base = jax.config.jax_compilation_cache_dir
    return None if not base else Path(base) / "steps"


class StepCache:
    """Compiled executables of one engine's jitted steps: in memory by signature, on disk by key.

    ``scope``: a string naming the constants the steps close over (model and run configuration).
    ``directory`` None: :func:`directory_in_use` when a step is first needed (None there: memory
    only, and every first call traces as plain ``jax.jit`` would).
    """

    def __init__(self, scope: str, directory: Path | None = None):
        """A cache for steps that close over what ``scope`` names."""
        self._directory = directory
        self._scope = scope
        self._compiled: dict[Hashable, Callable] = {}
        self._lock = threading.Lock()  # prepare_all builds in threads
        self.loaded = 0  # executables read from disk
        self.built = 0  # executables traced and compiled here
        # Fresh compiles XLA could not serialize (they run, and the next start compiles them
        # again); seen on XLA:CPU once in a CI worker: "`LessThan` is not serializable".
        self.unstored = 0

    def __contains__(self, signature: Hashable) -> bool:
        """Whether the step of ``signature`` is ready in memory (its first call is over)."""
        return signature in self._compiled

    def signatures(self) -> list[Hashable]:
        """The signatures of the steps ready in memory, in first-call order."""
        return list(self._compiled)

    def call(self, fn: Any, signature: Hashable, *args, static: dict | None = None, **kwargs):
        """``fn(*args, **static, **kwargs)`` for a ``jax.jit``-wrapped ``fn`` whose static arguments
        are exactly ``static``; ``signature`` must tell apart every argument shape and static
        value this cache's caller passes to ``fn`` (it is the in-memory key)."""
        static = static or {}
        compiled = self._compiled.get(signature)
        if compiled is None:
            compiled = self._compiled[signature] = self._load_or_build(fn, static, args, kwargs)
        return compiled(*args, **kwargs)

    def prepare_all(self, calls: list[tuple], threads: int | None = None) -> None:
        """Compile (or read) the steps of ``calls`` without running them, several at once.

        Each call is ``(fn, signature, args, static)`` as :meth:`call` would get them (``args``
        may be ``jax.ShapeDtypeStruct`` with shardings). XLA compiles outside Python's lock, so
        threads overlap the compiles (the tracing before them stays serial); ``threads`` None:
        one per core, at most 8. Signatures already in memory are skipped.
        """
        todo = {sig: (fn, args, static) for fn, sig, args, static in calls if sig not in self._compiled}
        workers = max(1, min(threads or os.cpu_count() or 1, 8, len(todo)))

        def build(item):
            sig, (fn, args, static) = item
            compiled = self._load_or_build(fn, static, args, {})
            with self._lock:
                self._compiled.setdefault(sig, compiled)

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(build, todo.items()):  # re-raises the first failure
                pass

    def _key(self, fn: Any, static: dict, args: tuple, kwargs: dict) -> str:
        leaves, tree = jax.tree.flatten((args, kwargs))
        name = getattr(fn, "__name__", repr(fn))
        text = repr((_environment(), self._scope, name, sorted(static.items()), str(tree),
                     [_leaf_signature(x) for x in leaves]))
        return hashlib.sha256(text.encode()).hexdigest()

    def _load_or_build(self, fn: Any, static: dict, args: tuple, kwargs: dict) -> Callable:
        if any(getattr(x, "dtype", None) in NIBBLE_TYPES for x in jax.tree.leaves((args, kwargs))):
            # XLA:CPU (jaxlib 0.10) reports committed 4-bit arrays with a sub-byte element size of
            # 0 while an ahead-of-time executable asks for 4, so calling one refuses them ("compiled
            # for input layouts that disagree"). jit's own dispatch does not check: use it, unstored.
            return functools.partial(fn, **static)
        path, directory = None, self._directory or directory_in_use()
        if directory is not None:
            _listen_for_persistent_hits()
            path = directory / f"{self._key(fn, static, args, kwargs)}.xla"
            loaded = self._read(path)
            if loaded is not None:
                with self._lock:
                    self.loaded += 1
                return loaded
        hits = _persistent_hits
        compiled = fn.lower(*args, **static, **kwargs).compile()
        with self._lock:
            self.built += 1
        if path is not None and _persistent_hits == hits and not self._write(path, compiled):
            with self._lock:  # a fresh compile (see _PERSISTENT_HIT) that could not be stored
                self.unstored += 1
        return compiled

    @staticmethod
    def _read(path: Path) -> Callable | None:
        try:
            blob, in_tree, out_tree = pickle.loads(path.read_bytes())
            cpu_matvec.available(build=False)  # a stored step may call the native kernel: register it first
            return serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged or foreign entry is rebuilt, never fatal
            log.warning("compiled step %s could not be read (%s); compiling it again", path.name, e)
            return None

    @staticmethod
    def _write(path: Path, compiled: Any) -> bool:
        """Store ``compiled`` at ``path``; False (and a warning) where it cannot be serialized."""
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
            path.parent.mkdir(parents=True, exist_ok=True)
            # One name per writer: two threads may store the same program (two signatures, one key).
            partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.partial")
            partial.write_bytes(data)
            os.replace(partial, path)
            return True
        except Exception as e:  # a step that cannot be stored still runs; the next start compiles it
            log.warning("compiled step %s not stored (%s)", path.name, e)
            return False
