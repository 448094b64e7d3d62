"""Speculative decoding with the n-gram drafter: acceptance rate and decode speed against plain
decoding, side by side in one run.

    python bench/speculative.py [--model DIR] [--num-draft-tokens 2,4,8] [--ngram 2,4]
        [--new-tokens 128] [--repeats 2] [--prompt repeat|code|free] [--json]

Each configuration generates ``--new-tokens`` greedy tokens (EOS ignored, so every run emits
the same tokens, which is checked) for a chat prompt: ``repeat`` asks the model to repeat a
paragraph, ``code`` to rename a variable in a function, ``free`` is an open question (little to
copy: the drafter's worst case). A first run compiles; the best of ``--repeats`` timed runs is
reported. decode_tok_s = (new tokens - 1) / (time after the first token); time to the first
token is measured separately on a one-token run and subtracted. Default model: the embedded
SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import time

from dayzero.engine import Engine
from dayzero.engine.speculative import SpecConfig

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


def timed(engine: Engine, prompt: str, new: int, spec: SpecConfig | None, repeats: int):
    """(best seconds, completion) of ``repeats`` runs after a compiling one."""
    out = engine.generate(prompt, chat=True, max_new_tokens=new, ignore_eos=True, speculative=spec)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompt, chat=True, max_new_tokens=new, ignore_eos=True, speculative=spec)
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    """Run the comparison and print one line per configuration (or one JSON object)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--num-draft-tokens", default="2,4,8")
    p.add_argument("--ngram", default="2,4")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt", default="repeat,code,free")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    engine = Engine.load(args.model, progress=False)
    ngram = tuple(int(n) for n in args.ngram.split(","))
    results = []
    for name in args.prompt.split(","):
        prompt = PROMPTS[name]
        ttft, _ = timed(engine, prompt, 1, None, args.repeats)
        base_s, base = timed(engine, prompt, args.new_tokens, None, args.repeats)
        rows = [dict(prompt=name, num_draft_tokens=0, seconds=base_s, acceptance_rate=None, same_tokens=True)]
        for k in (int(k) for k in args.num_draft_tokens.split(",")):
            secs, out = timed(engine, prompt, args.new_tokens, SpecConfig(num_draft_tokens=k, ngram=ngram),
                              args.repeats)
            s = out.speculation.to_json()
            rows.append(dict(prompt=name, num_draft_tokens=k, seconds=secs, acceptance_rate=s["acceptance_rate"],
                             tokens_per_step=round((args.new_tokens - 1) / max(s["steps"], 1), 2),
                             same_tokens=out.token_ids == base.token_ids))
        for r in rows:
            r["decode_tok_s"] = round((args.new_tokens - 1) / (r["seconds"] - ttft), 1)
            r["speedup"] = round(base_s / r["seconds"], 2)
            r["seconds"] = round(r["seconds"], 3)
        results.extend(rows)
        if not args.json:
            for r in rows:
                print(f"{r['prompt']:6s} K={r['num_draft_tokens']}: {r['decode_tok_s']:7.1f} tok/s decode, "
                      f"x{r['speedup']:.2f} end to end, acceptance {r['acceptance_rate']}, "
                      f"tokens/step {r.get('tokens_per_step', 1.0)}, same tokens {r['same_tokens']}", flush=True)
    if args.json:
        print(json.dumps({"new_tokens": args.new_tokens, "ngram": list(ngram), "results": results}))


if __name__ == "__main__":
    main()
