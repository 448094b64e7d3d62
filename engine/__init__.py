"""The runtime: the run configuration, generation, paged serving, sampling, the Python API and the CLI
(the tools around it, verify, bench and plan, are ``dayzero.tools``).

Python API::

    from dayzero.engine import Engine, SamplingParams
    engine = Engine.load()                      # embedded SmolLM2-135M-Instruct, or a DST dir
    out = engine.generate("Hi", chat=True, max_new_tokens=32,
                          sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    print(out.text, out.finish_reason)

    # Many requests at once: continuous batching over a paged KV cache.
    from dayzero.engine import ServingConfig, ServingEngine
    server = ServingEngine(engine, ServingConfig(slots=8))
    outs = server.run(["Hi", "Hello there"], max_new_tokens=32)
"""

from dayzero.engine.generate import Completion, Engine, GenerationError
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.sampling import SamplingError, SamplingParams
from dayzero.engine.serving import Event, ServingEngine

__all__ = ["Completion", "Engine", "Event", "GenerationError", "SamplingError", "SamplingParams", "ServingConfig",
           "ServingEngine"]
