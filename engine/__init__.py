"""Generation: sampling, KV-cache management, the Python API, the CLI and benchmarks.

Python API::

    from dayzero.engine import Engine, SamplingParams
    engine = Engine.load()                      # embedded SmolLM2-135M-Instruct, or a DST dir
    out = engine.generate("Hi", chat=True, max_new_tokens=32,
                          sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    print(out.text, out.finish_reason)
"""

from dayzero.engine.generate import Completion, Engine, GenerationError
from dayzero.engine.sampling import SamplingError, SamplingParams

__all__ = ["Completion", "Engine", "GenerationError", "SamplingError", "SamplingParams"]
