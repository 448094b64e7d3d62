"""Speculative decoding measured beside plain decoding: acceptance rate, tokens per step, decode
speed and speed-up (``dayzero bench --speculative ngram|mtp|draft:DIR``; ``bench/speculative.py``
builds its comparison tables from the same pieces).

Every run generates the same number of greedy tokens with EOS ignored, so plain and speculative
runs emit the same tokens (checked: ``same_tokens``). A first run compiles; the best of
``repeats`` timed runs counts. The time to the first token (prefill, and the drafter's own
prefill: a draft model's, or the MTP drafter's pass for the prompt's hidden states) is stamped
inside each run (a one-token run's time is subtracted only for an engine without a tokenizer):
decode_tok_s = rows x (new tokens - 1) / (time after the first token). acceptance_rate = accepted / drafted over every row (0.0 when nothing was
drafted); tokens_per_step = tokens after the first / decode steps, over every row.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from dayzero.engine.speculative import SpecConfig

__all__ = ["bench_speculative", "decode_rate", "measure", "spec_line", "timed", "timed_split"]


def timed(engine, prompts: str | Sequence, new: int, spec: SpecConfig | None, repeats: int, chat: bool = False):
    """(best seconds, completion or completions) of ``repeats`` runs of ``engine.generate`` after
    a compiling one (``prompts``: one prompt or a batch, as ``generate`` takes them)."""
    best, _, _, out = timed_split(engine, prompts, new, spec, repeats, chat)
    return best, out


def timed_split(engine, prompts: str | Sequence, new: int, spec: SpecConfig | None, repeats: int,
                chat: bool = False):
    """:func:`timed` with the first token's time taken inside the same runs: (best seconds, best
    seconds to the first token, best seconds after it, completions); the two splits are None for
    an engine without a tokenizer (``generate``'s ``on_text``, which stamps them, needs one)."""
    run = dict(chat=chat, max_new_tokens=new, ignore_eos=True, speculative=spec)
    out = engine.generate(prompts, **run)
    best = to_first = after_first = float("inf")
    for _ in range(repeats):
        first: list[float] = []
        start = time.perf_counter()
        out = engine.generate(prompts, **run, on_text=lambda row, text: first or first.append(time.perf_counter()))
        end = time.perf_counter()
        best = min(best, end - start)
        if first:
            to_first, after_first = min(to_first, first[0] - start), min(after_first, end - first[0])
    if after_first == float("inf"):
        return best, None, None, out
    return best, to_first, after_first, out


def decode_rate(new_tokens: int, seconds: float, ttft: float, rows: int = 1) -> float:
    """Decode tokens per second: the tokens after each row's first over the time after the first."""
    return round(rows * (new_tokens - 1) / (seconds - ttft), 1)


def measure(engine, prompts: str | Sequence, new: int, spec: SpecConfig | None, repeats: int,
            chat: bool = False) -> dict[str, Any]:
    """One configuration (``spec`` None: plain decoding) on ``prompts``: its seconds, time to the
    first token, decode rate, the token ids it emitted, and with ``spec`` its draft counts,
    acceptance rate and tokens per step (summed over the rows).

    The time after the first token is measured inside the same runs where the engine has a
    tokenizer: subtracting a separate one-token run's time could come out negative where a few
    decode steps take less than the runs' noise (a tiny model). Without one, that subtraction."""
    secs, ttft, after_first, out = timed_split(engine, prompts, new, spec, repeats, chat)
    if after_first is None:
        ttft, _ = timed(engine, prompts, 1, spec, repeats, chat)
        after_first = secs - ttft
    outs = out if isinstance(out, list) else [out]
    row = dict(seconds=secs, ttft_s=ttft, decode_tok_s=decode_rate(new, after_first, 0.0, len(outs)),
               token_ids=[o.token_ids for o in outs])
    if spec is None:
        return dict(row, drafted=0, accepted=0, acceptance_rate=None, tokens_per_step=1.0)
    drafted, accepted = (sum(getattr(o.speculation, k) for o in outs) for k in ("drafted", "accepted"))
    steps = sum(o.speculation.steps for o in outs)
    return dict(row, drafted=drafted, accepted=accepted, acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
                tokens_per_step=round(len(outs) * (new - 1) / max(steps, 1), 2))


def bench_speculative(engine, prompts: list[list[int]], new_tokens: int, repeats: int,
                      spec: SpecConfig) -> dict[str, Any]:
    """Plain and speculative decoding of ``prompts`` (a batch of token-id prompts) side by side:
    ``{"drafter", "num_draft_tokens", "acceptance_rate", "tokens_per_step", "drafted", "accepted",
    "decode_tok_s", "plain_decode_tok_s", "decode_speedup", "speedup", "same_tokens"}``
    (``speedup``: end to end, plain seconds / speculative seconds; ``decode_speedup``: the ratio
    of the decode rates)."""
    plain = measure(engine, prompts, new_tokens, None, repeats)
    fast = measure(engine, prompts, new_tokens, spec, repeats)
    return {
        "drafter": spec.kind.value, "num_draft_tokens": spec.num_draft_tokens,
        "acceptance_rate": fast["acceptance_rate"], "tokens_per_step": fast["tokens_per_step"],
        "drafted": fast["drafted"], "accepted": fast["accepted"],
        "decode_tok_s": fast["decode_tok_s"], "plain_decode_tok_s": plain["decode_tok_s"],
        "decode_speedup": round(fast["decode_tok_s"] / plain["decode_tok_s"], 2),
        "speedup": round(plain["seconds"] / fast["seconds"], 2),
        "same_tokens": fast["token_ids"] == plain["token_ids"],
    }


def spec_line(s: dict[str, Any]) -> str:
    """One human-readable line of a :func:`bench_speculative` result."""
    return (f"speculative {s['drafter']} K={s['num_draft_tokens']}: acceptance {s['acceptance_rate']} "
            f"({s['accepted']}/{s['drafted']}), {s['tokens_per_step']} tokens/step, decode {s['decode_tok_s']:.1f} tok/s "
            f"against {s['plain_decode_tok_s']:.1f} plain (x{s['decode_speedup']:.2f}), x{s['speedup']:.2f} end to end, "
            f"same tokens {s['same_tokens']}")
