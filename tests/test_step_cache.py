"""Compiled steps on disk (engine/step_cache.py): a second engine over the same model reads its
prefill, decode and cache-write executables whole (no trace, no lowering, no compile) and gives the
same tokens; anything the programs depend on changes the key; a damaged entry is rebuilt; an
executable JAX read back from its own cache is never stored.

The oracle for "read, not built" is the cache's own count of traced-and-compiled steps, checked
against the directory: a build writes one file per step, a read writes none.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from dayzero.engine import Engine, step_cache
from dayzero.kernels import cpu_matvec

PROMPT, NEW = [5, 6, 7, 8, 9], 6
# Prefill, its cache write, decode, its cache write; on single-device CPU with the native kernels
# the float32 decode writes the cache itself (``Engine._writes_in_place``): one step fewer.
APPENDED_STEPS = 4


def steps() -> int:
    """The steps a float32 generation builds here."""
    return 3 if cpu_matvec.single_device_cpu() and cpu_matvec.available() else APPENDED_STEPS


@pytest.fixture
def steps_dir(tmp_path, monkeypatch):
    """Step caches of engines made in the test use ``tmp_path/steps``."""
    directory = tmp_path / "steps"
    monkeypatch.setattr(step_cache, "directory_in_use", lambda: directory)
    return directory


def _run(model_dir, **load) -> tuple[list[int], step_cache.StepCache]:
    engine = Engine.load(model_dir, progress=False, **load)
    out = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
    return out.token_ids, engine._steps


def test_second_engine_reads_every_step(tiny_model, steps_dir):
    tokens, cold = _run(tiny_model.dir)
    assert (cold.built, cold.loaded) == (steps(), 0)
    assert len(list(steps_dir.glob("*.xla"))) == steps()
    again, warm = _run(tiny_model.dir)
    assert (warm.built, warm.loaded) == (0, steps())
    assert again == tokens
    assert len(list(steps_dir.glob("*.xla"))) == steps()  # nothing rewritten or added


def test_what_the_programs_depend_on_is_in_the_key(tiny_model, steps_dir, monkeypatch):
    tokens, _ = _run(tiny_model.dir)
    _, other_run = _run(tiny_model.dir, kv_cache="int8")  # another run configuration: other programs
    assert other_run.built == APPENDED_STEPS  # an int8 cache is appended to
    monkeypatch.setattr(step_cache, "_source_digest", "an edited dayzero")  # same version, other code
    again, edited = _run(tiny_model.dir)
    assert (edited.built, edited.loaded) == (steps(), 0) and again == tokens


def test_damaged_entry_is_rebuilt(tiny_model, steps_dir, caplog):
    tokens, _ = _run(tiny_model.dir)
    for path in steps_dir.glob("*.xla"):
        path.write_bytes(path.read_bytes()[:100])  # a truncated write of another process
    with caplog.at_level(logging.WARNING, logger=step_cache.__name__):
        again, rebuilt = _run(tiny_model.dir)
    assert (rebuilt.built, rebuilt.loaded) == (steps(), 0) and again == tokens
    assert "compiling it again" in caplog.text
    _, healed = _run(tiny_model.dir)
    assert healed.loaded == steps()


class _HitOnCompile:
    """A jitted function whose compile reports a hit of JAX's persistent cache."""

    def __init__(self, fn):
        self._fn, self.__name__ = jax.jit(fn), "hit_on_compile"

    def lower(self, *args, **kwargs):
        lowered = self._fn.lower(*args, **kwargs)

        class _Lowered:
            @staticmethod
            def compile():
                step_cache._count_persistent_hit(step_cache._PERSISTENT_HIT)
                return lowered.compile()
        return _Lowered()


def test_executable_read_from_jax_cache_is_not_stored(tmp_path):
    """Such an executable serializes without its compiled functions (jaxlib 0.10 XLA:CPU), so a
    stored copy would fail when run; a fresh compile is stored."""
    x = jnp.arange(4.0)
    cache = step_cache.StepCache("scope", tmp_path)
    assert float(cache.call(_HitOnCompile(lambda v: v * 2), "hit", x).sum()) == 12.0
    assert not list(tmp_path.glob("*.xla"))
    assert float(cache.call(jax.jit(lambda v: v * 3), "fresh", x).sum()) == 18.0
    assert len(list(tmp_path.glob("*.xla"))) == 1


def test_serving_warm_start_reads_every_step(tiny_model, steps_dir, monkeypatch):
    """A serving engine's warm-up on a fresh process state (a new in-memory cache) reads every
    step its first warm-up built and stored, and serves the same tokens. (Steps XLA cannot
    serialize are compiled again, and counted: seen once in a CI worker, two sampling-sized steps
    "`LessThan` is not serializable", not reproduced alone.)"""
    from dayzero.engine import ServingConfig, ServingEngine, paged_steps

    engine = Engine.load(tiny_model.dir, progress=False)
    serving = ServingConfig(slots=2, page_size=8, num_pages=16, max_context=64, max_chunk=16, min_chunk=16)

    def start() -> tuple[list[int], step_cache.StepCache]:
        monkeypatch.setattr(paged_steps, "_STEPS", step_cache.StepCache("paged_steps"))
        server = ServingEngine(engine, serving)
        server.warmup()
        out = server.run([PROMPT], max_new_tokens=NEW, ignore_eos=True)[0]
        return out.token_ids, paged_steps._STEPS

    tokens, cold = start()
    assert cold.built > 0  # (a few signatures are one program: their later calls read its file)
    again, warm = start()
    assert cold.unstored <= 2 and warm.unstored == cold.unstored
    assert (warm.built, warm.loaded) == (cold.unstored, cold.built + cold.loaded - cold.unstored)
    assert again == tokens


def test_source_digest_covers_the_package_modules_only():
    """Every module of the package (an edit to any misses the cache), not the tests or a
    virtual environment beside them in a source checkout."""
    names = {str(p.relative_to(step_cache._PACKAGE)) for p in step_cache._package_modules()}
    assert {"model/transformer.py", "engine/step_cache.py", "kernels/flash_attention.py"} <= names
    assert not any(n.startswith(("tests/", ".venv/", "bench/")) for n in names)


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.float4_e2m1fn])
def test_committed_four_bit_arguments_run(tmp_path, dtype):
    """A step with a committed 4-bit argument (a restored int4 or MXFP4 weight) runs and is not
    stored: XLA:CPU's ahead-of-time executables refuse such arrays (they report a sub-byte size of
    0 against the executable's 4), so the cache hands them to jit's own dispatch."""
    cache = step_cache.StepCache(directory=tmp_path, scope="four_bit")
    weight = jax.device_put(jnp.ones((4, 8), dtype), jax.devices()[0])
    step = jax.jit(lambda w, x: x @ w.astype(jnp.float32))
    out = cache.call(step, ("four_bit", dtype), weight, jnp.ones((2, 4), jnp.float32))
    assert float(out.sum()) == 2 * 8 * 4 and not list(tmp_path.iterdir())
