"""Cost of one target call on T tokens relative to one token, for each bundle, in one run.

A speculative step costs one (K+1)-token call plus K draft steps, and the ideal speedup
formula of docs/design.md#expected-tokens-per-call-and-ideal-speedup assumes the call costs about
one step. When it costs r times more,
the measured speedup is about the ideal one divided by r: this script measures r.

    python scripts/experiments/bench_verify_cost.py --bundles B1 [B2 ...] [--tokens 1 2 3 5]
        [--runs 40]

For each bundle in turn, calls of every T are interleaved (T=1, 2, 3, ... T=1, 2, 3, ...),
each after the same 100-token prompt, and timed by their median; bundles are not
interleaved with each other, since a switch of model evicts the caches a real loop keeps.
Prints a table and writes bench_results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle

CONTEXT = 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundles", type=Path, nargs="+", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("bench_results/verify_cost.json"))
    args = ap.parse_args()
    if 1 not in args.tokens:
        args.tokens.insert(0, 1)

    backends = {str(b): OrtCpuBackend(load_bundle(b).target) for b in args.bundles}
    caches = {name: be.new_cache(CONTEXT + max(args.tokens)) for name, be in backends.items()}
    for name, be in backends.items():
        be.forward(caches[name], list(range(1, CONTEXT + 1)), 1)
    times: dict[str, dict[int, list[float]]] = {n: {t: [] for t in args.tokens}
                                                for n in backends}
    for name, be in backends.items():
        for _ in range(args.runs):
            for t in args.tokens:
                caches[name].rollback(CONTEXT)
                t0 = time.perf_counter()
                be.forward(caches[name], list(range(5, 5 + t)), t)
                times[name][t].append(time.perf_counter() - t0)

    rows = []
    print(f"| bundle | {' | '.join(f'T={t}' for t in args.tokens)} |")
    print(f"|---|{'---|' * len(args.tokens)}")
    for name in backends:
        ms = {t: 1000 * statistics.median(v) for t, v in times[name].items()}
        rows.append({"bundle": name, "median_ms": ms,
                     "ratio_to_one_token": {t: ms[t] / ms[1] for t in ms}})
        cells = " | ".join(f"{ms[t]:.1f} ms ({ms[t] / ms[1]:.2f}x)" for t in args.tokens)
        print(f"| {Path(name).name} | {cells} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"context": CONTEXT, "runs": args.runs, "rows": rows},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
