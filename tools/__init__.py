"""The tools around the runtime (``dayzero.tools``): what a team runs to trust a model on new
hardware and to size a deployment, apart from what serves it (``dayzero.engine``).

- ``verify``: layer-by-layer numerical alignment against HF transformers (``dayzero verify``);
- ``bench``, ``measure``, ``peers``, ``soak``, ``plot``: time to first token, throughput, memory,
  the same prompts through HF and llama.cpp side by side, long-context stability, plots
  (``dayzero bench``);
- ``plan``, ``plan_check``, ``plan_measure``: the deployment planner's command, its activations
  against XLA's memory analysis of the engine's own steps, and its weight and KV bytes against
  arrays the engine places (reduced models on faked devices) (``dayzero plan``);
- ``quality``: KL and top-1 agreement of a quantized model against its float original.

The checkpoint check (``dayzero check``) lives with the converter, ``dayzero.convert.check``.
"""
