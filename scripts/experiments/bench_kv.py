"""Per-token decode time at a short and a long context, side by side in one run.

With fixed-capacity KV buffers and rollback by length, a decode step does no O(context)
work outside attention, so the long/short ratio should stay near 1 (goal: <= 1.3).
Then a long generation (--long tokens after a 64-token prompt) with the host cache grown
as needed (kv_cache.py) against one sized for prompt + --long from the start: the graph
attends over the whole capacity, so the first way should be faster.

    python scripts/experiments/bench_kv.py [--bundle DIR] [--contexts 64 1536] [--tokens 32]
        [--repeats 3] [--long 512]

Prints a table and writes bench_results/bench_kv.json. Without --bundle it exports (once,
cached) the default SmolLM2 bundle, which needs the export extra.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from specedge.runtime import Generator
from specedge.runtime.backends.ort_cpu import OrtCpuBackend


def default_bundle() -> Path:
    from specedge.export.bundle_writer import export_bundle
    from specedge.export.sources import cache_dir

    out = cache_dir() / "bundles" / "smollm2-fp32"
    export_bundle("smollm2-135m", out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1536])
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=512, help="tokens of the long generation")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_kv.json"))
    args = ap.parse_args()

    gen = Generator.from_bundle(args.bundle or default_bundle())
    text_ids = gen.codec.encode(Path(__file__).read_text() * 20)
    ms = {c: [] for c in args.contexts}
    for _ in range(args.repeats):
        for c in args.contexts:  # interleaved, so machine noise hits every context alike
            prompt = (text_ids * (c // len(text_ids) + 1))[:c]
            out = gen.generate(prompt_ids=prompt, max_new_tokens=args.tokens + 1,
                               use_draft=False)
            ms[c].append(1000.0 / out.stats["decode_tokens_per_second"])
    base = statistics.median(ms[args.contexts[0]])
    rows = [{"context": c, "ms_per_token": statistics.median(v), "runs_ms": v,
             "ratio_to_shortest": statistics.median(v) / base} for c, v in ms.items()]
    print(f"{'context':>8} {'ms/token':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['context']:>8} {r['ms_per_token']:>9.2f} {r['ratio_to_shortest']:>6.2f}")

    growth = {False: [], True: []}
    prompt = text_ids[:64]
    for _ in range(args.repeats):
        for grows in growth:  # interleaved; greedy, so both ways decode the same tokens
            gen.target.grows_cache = grows and isinstance(gen.target, OrtCpuBackend)
            out = gen.generate(prompt_ids=prompt, max_new_tokens=args.long, use_draft=False)
            growth[grows].append(1000.0 / out.stats["decode_tokens_per_second"])
    sized, grown = (statistics.median(growth[g]) for g in (False, True))
    print(f"\n{len(out.token_ids)} tokens after 64: cache sized for all {sized:.2f} ms/token, "
          f"grown as needed {grown:.2f} ms/token ({grown / sized:.2f}x)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bundle": str(gen.bundle.root), "machine":
                                    platform.processor() or platform.machine(),
                                    "decode_tokens": args.tokens, "results": rows,
                                    "long_generation": {
                                        "tokens": len(out.token_ids),
                                        "ms_per_token_cache_sized_for_all": sized,
                                        "ms_per_token_cache_grown": grown}}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
