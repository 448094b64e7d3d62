"""Accuracy of a quantized model against its unquantized self: per-token KL and greedy agreement.

Used by the accuracy gates (``tests/test_quant.py``) and ``bench/quant.py``.

- Both models read the same token sequence the way generation does: in chunks of ``CHUNK``
  tokens, each attending to the cache written by the chunks before it, keeping every position's
  logits. So a quantized KV cache is read as decode reads it (the chunk's own keys too, as the
  cache stores them: ``quant.as_stored``), which a single forward pass without a cache would not
  exercise.
- KL: per-token KL(reference || candidate) in nats over the text's positions, mean and max
  (``dayzero.tools.verify.logits_stats``).
- Greedy agreement (teacher-forced): the reference continues the text greedily by N tokens; the
  candidate reads the text plus that continuation, and the agreement is the fraction of the N
  positions where its argmax is the reference's token. Unlike the identical prefix of two
  free-running generations, one early near-tie flip does not decide all later positions; that
  prefix (as a fraction of N) is reported too when asked for (``free_running=True``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.engine.generate import Engine, bucket
from dayzero.tools.verify import logits_stats
from dayzero.model.transformer import forward
from dayzero.model.cache import append_to_cache, init_cache

CHUNK = 64

_forward = jax.jit(forward, static_argnums=(1,), static_argnames=("all_logits",))
_append = jax.jit(append_to_cache, donate_argnums=(0,))

# About 500 tokens of ordinary English (523 with SmolLM2's tokenizer), written for these gates.
QUALITY_TEXT = (
    "Every spring the river that runs through the valley rises with the melting snow, and every "
    "spring the people of the town prepare for it in the same unhurried way. The baker moves his "
    "flour sacks to the upper shelves, the schoolteacher takes the maps off the lower walls, and "
    "the ferryman checks the ropes that hold his flat wooden boat to the landing. Nobody in the "
    "town remembers a year when the water did not come, but most of them remember the year it "
    "came too far. That was the spring when the ice broke late and all at once, and the river "
    "carried whole trees down from the mountains. The old stone bridge held, though the water "
    "reached the top of its arches, and for three days the only way across was the ferry. The "
    "ferryman worked from dawn until long after dark, carrying doctors, grain, goats, and a piano "
    "that a family refused to leave behind. Children still ask him about the piano, and he still "
    "tells them that it played a little out of tune ever after, as if it had been frightened. "
    "After that spring the town council built a long earthen wall along the low fields and planted "
    "willows on top of it, because their roots bind the soil better than any fence. The willows "
    "are tall now, and in summer the wall is a shaded path where people walk their dogs in the "
    "evening and where the older men sit on benches to argue about the weather. An engineer from "
    "the city came to measure the wall some years later. She walked its whole length with a "
    "notebook, took samples of the soil, and asked questions about the height of the water in "
    "each of the last twenty floods. The town had kept those numbers carefully, painted on a post "
    "beside the bridge, each line marked with its year. She copied them all, and before she left "
    "she told the council that the wall was well made, but that the river was changing: the "
    "winters were shorter, the snow melted earlier, and the floods came in sudden pulses rather "
    "than one slow rise. She suggested a second line of defense, a set of gates that could be "
    "closed in an afternoon. The council thanked her, argued for two years about the cost, and "
    "finally built the gates. They have been closed only once so far, on a grey April night, "
    "and the water stopped a hand's width below their top. The next morning the baker brought "
    "bread to everyone who had stayed up to watch, and the ferryman, who was very old by then, "
    "said that he had always known the river would lose one day, though he had hoped to see it "
    "lose more gracefully."
)


def sequence_logits(engine: Engine, ids: list[int], chunk: int = CHUNK, cache_len: int | None = None) -> np.ndarray:
    """fp32 logits [n, V] of every position of ``ids``, run in chunks through ``engine``'s cache
    (its weights, dtype and KV-cache scheme). ``cache_len``: the cache's length (default: the
    next power of two); calls with one length share their compiled steps."""
    n = len(ids)
    padded = -(-n // chunk) * chunk
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, :n] = ids
    cache_len = cache_len or bucket(padded, 16)
    if cache_len < padded:
        raise ValueError(f"cache_len {cache_len} cannot hold {n} tokens in chunks of {chunk}")
    cache = init_cache(engine.config, 1, cache_len, engine.weights.embed.dtype, engine.kv_cache)
    out = []
    for start in range(0, padded, chunk):
        num_new = jnp.asarray([min(chunk, max(n - start, 0))], jnp.int32)
        logits, new = _forward(engine.weights, engine.config, jnp.asarray(tokens[:, start : start + chunk]),
                               cache, num_new, all_logits=True)
        cache = _append(cache, new)
        out.append(np.asarray(logits[0]))
    return np.concatenate(out)[:n]


def greedy_tokens(engine: Engine, ids: list[int], new_tokens: int) -> list[int]:
    """``engine``'s greedy continuation of ``ids`` (EOS ignored)."""
    return engine.generate(list(ids), max_new_tokens=new_tokens, ignore_eos=True).token_ids


def logits_agreement(reference: np.ndarray, candidate: np.ndarray, n: int, cont: list[int]) -> dict[str, float]:
    """``kl_mean``, ``kl_max`` of ``candidate``'s logits [n + len(cont), V] against ``reference``'s
    over the first ``n`` positions (the text), and ``greedy_agreement``: how often the candidate's
    top token at position n-1+i is continuation token ``cont[i]`` (teacher-forced)."""
    stats = logits_stats(reference[:n], candidate[:n])
    predicted = candidate[n - 1 : n - 1 + len(cont)].argmax(-1)
    return {"kl_mean": stats["kl_mean"], "kl_max": stats["kl_max"],
            "greedy_agreement": float(np.mean(predicted == np.asarray(cont)))}


def agreement(reference: Engine, candidate: Engine, ids: list[int], new_tokens: int = 128,
              free_running: bool = False, reference_tokens: list[int] | None = None) -> dict[str, float]:
    """KL of ``candidate`` against ``reference`` over ``ids`` and their greedy agreement over
    ``new_tokens`` generated tokens (see the module docstring).

    ``reference_tokens``: the reference's greedy continuation if already known (it is the same
    for every candidate). Returns ``kl_mean``, ``kl_max``, ``greedy_agreement`` and, with
    ``free_running``, ``greedy_prefix``.
    """
    cont = reference_tokens if reference_tokens is not None else greedy_tokens(reference, ids, new_tokens)
    sequence = list(ids) + list(cont)
    result = logits_agreement(sequence_logits(reference, sequence), sequence_logits(candidate, sequence), len(ids),
                              cont)
    if free_running:
        free = greedy_tokens(candidate, ids, len(cont))
        same = next((i for i, (a, b) in enumerate(zip(free, cont)) if a != b), len(cont))
        result["greedy_prefix"] = same / len(cont)
    return result

