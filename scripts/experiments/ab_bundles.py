"""Decode speed of bundles of one model side by side: each bundle's plain decoding and its
default (lookup+model, auto K), greedy, on the first shipped prompts, the bundles taking turns
in alternating order round by round; each configuration's median tok/s and its ratio to the
first bundle's plain decoding (median and 95% interval over rounds, bench/intervals.py).

    python scripts/experiments/ab_bundles.py BUNDLE [BUNDLE ...] [--rounds 5] [--prompts 4]
        [--max-new-tokens 64] [--threads 2] [--json F]

e.g. an int4 bundle exported with `--int4-grid exact` against one with `--int4-grid search`.
About rounds x bundles x 2 x prompts generations.
"""

from __future__ import annotations

import argparse
import json
import statistics

from specedge.bench.intervals import ratio_ci
from specedge.prompts import load_prompts
from specedge.runtime import Generator

MODES = {"plain": {"use_draft": False}, "default": {}}


def decode_speed(gen: Generator, prompts: list[str], max_new_tokens: int, mode: dict) -> float:
    """Tokens after the first over decode seconds, summed over the prompts."""
    tokens = seconds = 0.0
    for prompt in prompts:
        stats = gen.generate(prompt, max_new_tokens=max_new_tokens, **mode).stats
        tokens += stats["tokens_generated"] - 1
        seconds += stats["time_total_s"] - stats["time_prefill_s"]
    return tokens / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json")
    args = p.parse_args()
    gens = {b: Generator.from_bundle(b, threads=args.threads) for b in args.bundles}
    prompts = [x["prompt"] for x in load_prompts()[:args.prompts]]
    for gen in gens.values():  # warm up: first sessions' runs are slower
        gen.generate(prompts[0], max_new_tokens=8)
    speeds = {(b, m): [] for b in args.bundles for m in MODES}
    for r in range(args.rounds):
        for b in args.bundles if r % 2 == 0 else args.bundles[::-1]:
            for m, mode in MODES.items():
                speeds[(b, m)].append(decode_speed(gens[b], prompts, args.max_new_tokens, mode))
    base = speeds[(args.bundles[0], "plain")]
    rows = []
    for (b, m), v in speeds.items():
        ci = ratio_ci([x / y for x, y in zip(v, base)])
        rows.append({"bundle": b, "mode": m, "tok_s_median": statistics.median(v),
                     "tok_s": v, "ratio": ci})
        low, high = ci["ci95"] or (None, None)
        print(f"{b}  {m:8s} {statistics.median(v):7.1f} tok/s  x{ci['median']:.3f}"
              + (f" [{low:.3f}-{high:.3f}]" if low else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
