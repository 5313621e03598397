"""The target's one-token step, the unit of plain decoding, for bundles and runtime settings
side by side: milliseconds a step and the speed ratio to the first variant (median and 95%
interval over rounds, bench/intervals.py), the variants taking turns, in alternating order
round by round.

    python scripts/experiments/bench_steps.py NAME:BUNDLE[:OPTION...] [NAME:BUNDLE ...]
        [--rounds 7] [--steps 64] [--json F]

Options: `spin` (threads spin while they wait; default off), `t1` (one intra-op thread;
default one per core), `onerow` (a one-token step as one row, not two: what a Generator
runs where runtime/one_row.py finds a one-row call equal to a verification call's rows; on
other machines a bound, not a setting), `feat` (the graph computes its feature-draft
features, as it does while a feature draft drafts; plain decoding skips them) E.g.

    python scripts/experiments/bench_steps.py exact:bundles/a exact-spin:bundles/a:spin \\
        search:bundles/b search-bound:bundles/b:spin:onerow

Each round prefills the first shipped prompt, then runs `--steps` one-token steps fed the
tokens of another shipped prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specedge.bench.intervals import ratio_ci
from specedge.prompts import load_prompts
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.text import TextCodec

OPTIONS = ("spin", "t1", "onerow", "feat")


def backend_of(variant: str) -> tuple[str, str, OrtCpuBackend]:
    name, bundle, *options = variant.split(":")
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise SystemExit(f"unknown options {sorted(unknown)} in {variant!r}; known: {OPTIONS}")
    backend = OrtCpuBackend(load_bundle(bundle).target, threads=1 if "t1" in options else None,
                            one_token_as_two="onerow" not in options,
                            spinning="spin" in options)
    backend.keep_features = "feat" in options
    return name, bundle, backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="NAME:BUNDLE[:OPTION...], the base first")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--json", help="also write every round's figures here")
    args = p.parse_args()
    backends = {name: (bundle, b) for name, bundle, b in map(backend_of, args.variants)}
    codec = TextCodec(load_bundle(next(iter(backends.values()))[0]))
    prompts = load_prompts()
    prefill = codec.encode_chat([{"role": "user", "content": prompts[0]["prompt"]}])
    steps = codec.encode(prompts[10]["prompt"])[:args.steps]
    ms = {name: [] for name in backends}
    for r in range(args.rounds):
        for name in list(backends)[::1 if r % 2 == 0 else -1]:
            backend = backends[name][1]
            cache = backend.new_cache(len(prefill) + len(steps) + 2)
            backend.forward(cache, prefill, 1)
            t0 = time.perf_counter()
            for token in steps:
                backend.forward(cache, [token], 1)
            ms[name].append((time.perf_counter() - t0) / len(steps) * 1e3)
    base = next(iter(backends))
    rows = []
    print(f"| variant | ms a step | speed / {base} (median [95% CI]) |")
    print("|---|---|---|")
    for name in backends:
        ci = ratio_ci([b / x for b, x in zip(ms[base], ms[name])])
        band = "" if ci["ci95"] is None else f" [{ci['ci95'][0]:.2f}-{ci['ci95'][1]:.2f}]"
        print(f"| {name} | {statistics.median(ms[name]):.2f} | {ci['median']:.2f}x{band} |")
        rows.append({"variant": name, "ms": ms[name], "ratio": ci})
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": args.variants, "rows": rows},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
