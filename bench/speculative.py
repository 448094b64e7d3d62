"""Speculative decoding with the n-gram drafter and with draft models: acceptance rate and decode
speed against plain decoding, side by side in one run.

    python bench/speculative.py [--model DIR] [--num-draft-tokens 2,4,8] [--ngram 2,4]
        [--draft DIR[,DIR...]] [--mtp] [--new-tokens 128] [--repeats 2] [--prompt repeat|code|free] [--json]

Each configuration generates ``--new-tokens`` greedy tokens (EOS ignored, so every run emits
the same tokens, which is checked) for a chat prompt: ``repeat`` asks the model to repeat a
paragraph, ``code`` to rename a variable in a function, ``free`` is an open question (little to
copy: the n-gram drafter's worst case). Rows per prompt: plain decoding, the n-gram drafter at
each K, and each ``--draft`` model at each K. A draft is a converted model directory sharing the
target's tokenizer (e.g. the target converted with ``--quantize int8``), or ``self``: the target
drafting for itself, which accepts every draft and so shows the best acceptance can buy and
what drafting costs. A draft row also reports the draft model's own plain decode rate.

``--mtp`` adds rows drafted by the model's own multi-token-prediction layers (a DeepSeek-V3
checkpoint converted with them).

A first run compiles; the best of ``--repeats`` timed runs is reported. Each configuration's
time to the first token (prefill, and the drafter's own prefill for a draft or MTP row) is measured on
a one-token run and subtracted: decode_tok_s = (new tokens - 1) / (time after the first token).
acceptance_rate = accepted / drafted over the run (0.0 when nothing was drafted: see
``drafted``); tokens_per_step = (new tokens - 1) / decode steps. ``speedup`` is end to end
(plain seconds / seconds), ``decode_speedup`` the ratio of the decode rates. The measuring
itself is ``dayzero.tools.bench_spec`` (which ``dayzero bench --speculative`` runs too).
Every model runs on the reference (XLA) path, the only one the verify step has, so the plain row
is the same path too. Default model: the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dayzero.engine import Engine
from dayzero.engine.speculative import SpecConfig
from dayzero.model.quant import describe_weights
from dayzero.tools.bench_spec import decode_rate, measure, timed

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens, and wound the clockwork that turned the beam across the dark water. Ships far out at "
    "sea watched for the light and steered away from the rocks that lay hidden beneath the waves."
)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
PROMPTS = {
    "repeat": f"Repeat the following text exactly, twice:\n\n{PARAGRAPH}",
    "code": f"Rename the variable `subtotal` to `net` in this function and show the whole function:\n\n{CODE}",
    "free": "Why is the sky blue? Explain in a few paragraphs.",
}
SELF = "self"  # --draft self: the target model drafts for itself


def load_drafts(text: str | None, target: Engine) -> dict[str, Engine]:
    """The ``--draft`` models by label (their directory as given, or ``self``: ``target``),
    each loaded on the reference path as the ``generate --speculative draft:DIR`` CLI loads it."""
    drafts = {}
    for name in [d.strip() for d in (text or "").split(",") if d.strip()]:
        if name == SELF:
            drafts[name] = target
            continue
        if not (Path(name) / "config.json").exists():
            sys.exit(f"--draft {name!r} is not a converted model directory (no config.json); convert one with "
                     "`dayzero convert SRC DIR` or pass --draft self")
        drafts[name] = Engine.load(name, progress=False, kernels="reference")
    return drafts


def spec_row(engine: Engine, name: str, prompt: str, spec: SpecConfig | None, base, args) -> dict:
    """One configuration's measurements on ``prompt`` (``spec`` None: plain decoding; ``base``:
    plain decoding's row, whose tokens it must reproduce, None for the plain row itself)."""
    m = measure(engine, prompt, args.new_tokens, spec, args.repeats, chat=True)
    same = base is None or m["token_ids"] == base["token_ids"]
    return dict(prompt=name, drafter="plain" if spec is None else spec.kind.value,
                num_draft_tokens=0 if spec is None else spec.num_draft_tokens, same_tokens=same,
                **{k: m[k] for k in ("seconds", "ttft_s", "drafted", "accepted", "acceptance_rate", "tokens_per_step",
                                     "token_ids")})


def draft_decode_rate(draft: Engine, prompt: str, args) -> float:
    """The draft model's own plain greedy decode rate (tok/s) on ``prompt``."""
    ttft, _ = timed(draft, prompt, 1, None, args.repeats, chat=True)
    secs, _ = timed(draft, prompt, args.new_tokens, None, args.repeats, chat=True)
    return decode_rate(args.new_tokens, secs, ttft)


def prompt_rows(engine: Engine, name: str, drafts: dict[str, Engine], ks: list[int], ngram, args) -> list[dict]:
    """Every configuration's row for the prompt ``name``: plain first, then n-gram, then drafts."""
    prompt = PROMPTS[name]
    base = spec_row(engine, name, prompt, None, None, args)
    base_s, ttft = base["seconds"], base["ttft_s"]
    rows = [base] + [spec_row(engine, name, prompt, SpecConfig("ngram", num_draft_tokens=k, ngram=ngram), base, args)
                     for k in ks]
    for label, draft in drafts.items():
        own = decode_rate(args.new_tokens, base_s, ttft) if draft is engine else draft_decode_rate(draft, prompt, args)
        for k in ks:
            row = spec_row(engine, name, prompt, SpecConfig("draft", num_draft_tokens=k, draft=draft), base, args)
            row.update(draft=label, draft_quantize=describe_weights(draft.weights), draft_decode_tok_s=own)
            rows.append(row)
    if args.mtp:
        rows += [spec_row(engine, name, prompt, SpecConfig("mtp", num_draft_tokens=k), base, args) for k in ks]
    for r in rows:
        del r["token_ids"]
        r["decode_tok_s"] = decode_rate(args.new_tokens, r["seconds"], r["ttft_s"])
        r["speedup"] = round(base_s / r["seconds"], 2)
        r["decode_speedup"] = round(r["decode_tok_s"] / rows[0]["decode_tok_s"], 2)
        r["seconds"], r["ttft_s"] = round(r["seconds"], 3), round(r["ttft_s"], 3)
    return rows


def print_rows(rows: list[dict]) -> None:
    """One aligned line per row."""
    for r in rows:
        label = r["drafter"] if r["drafter"] != "draft" else f"draft {r['draft']}"
        extra = "" if r["drafter"] != "draft" else f", draft alone {r['draft_decode_tok_s']} tok/s"
        print(f"{r['prompt']:6s} {label:24s} K={r['num_draft_tokens']}: {r['decode_tok_s']:7.1f} tok/s decode "
              f"(x{r['decode_speedup']:.2f}), x{r['speedup']:.2f} end to end, acceptance {r['acceptance_rate']} "
              f"({r['accepted']}/{r['drafted']}), "
              f"tokens/step {r['tokens_per_step']}, same tokens {r['same_tokens']}{extra}", flush=True)


def main() -> None:
    """Run the comparison and print one line per configuration (or one JSON object)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--num-draft-tokens", default="2,4,8")
    p.add_argument("--ngram", default="2,4")
    p.add_argument("--draft", metavar="DIR[,DIR...]",
                   help="draft models (converted directories sharing the target's tokenizer; self: the target)")
    p.add_argument("--mtp", action="store_true",
                   help="also the model's own multi-token-prediction layers as drafter (DeepSeek-V3 with them)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt", default="repeat,code,free")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    unknown = [n for n in args.prompt.split(",") if n not in PROMPTS]
    if unknown:
        p.error(f"--prompt {unknown[0]!r} is unknown; choose from {', '.join(PROMPTS)}")
    engine = Engine.load(args.model, progress=False, kernels="reference")
    drafts = load_drafts(args.draft, engine)
    ngram = tuple(int(n) for n in args.ngram.split(","))
    ks = [int(k) for k in args.num_draft_tokens.split(",")]
    results, load_before = [], os.getloadavg()[0]  # the machine's load: shared hosts make timings noisy
    for name in args.prompt.split(","):
        rows = prompt_rows(engine, name, drafts, ks, ngram, args)
        results.extend(rows)
        if not args.json:
            print_rows(rows)
    if args.json:
        print(json.dumps({"new_tokens": args.new_tokens, "repeats": args.repeats, "ngram": list(ngram),
                          "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                          "model": args.model or "embedded SmolLM2-135M-Instruct",
                          "drafts": {k: describe_weights(d.weights) for k, d in drafts.items()},
                          "results": results}))


if __name__ == "__main__":
    main()
