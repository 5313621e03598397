"""What a target call of B rows of T tokens costs, the unit of batched decoding's price of a
K (runtime/drafting/batch_costs.py): milliseconds per call over (B, T), each row at its own
cache length, as `BatchSession` runs them (`OrtCpuBackend.forward_slots`), against a
one-row call of T = 2 (a single sequence's one-token step), the (B, T) taking turns round
by round. Prints a table and writes JSON.

    python scripts/experiments/bench_batch_calls.py --bundle B [--shapes 1x2 4x1 4x2 ...]
        [--rounds 5] [--calls 20] [--threads 2] [--out bench_results/batch_calls.json]

A one-row call of one token runs as two (ort_cpu.py); a batched graph's calls of several
rows of one token each run unpadded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.kv_cache import MAX_BATCHED_TOKENS, SlotCaches

SHAPES = ["1x2", "2x1", "2x2", "4x1", "4x2", "4x3", "4x4", "8x1", "8x2", "8x3"]
PAST = 100  # cache rows of every slot before the calls


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="BxT, e.g. 4x2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="calls a shape a round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_results/batch_calls.json"))
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    spec = load_bundle(args.bundle).target
    backend = OrtCpuBackend(spec, threads=args.threads)
    rows = max(b for b, _ in shapes)
    caches = SlotCaches(spec.num_layers, spec.num_kv_heads, spec.head_dim, 256, rows,
                        spare=MAX_BATCHED_TOKENS)
    rng = np.random.default_rng(0)
    for slot in range(rows):
        backend.forward(caches.slots[slot], rng.integers(3, spec.vocab_size, PAST).tolist(), 1)
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for r in range(args.rounds):
        order = shapes[r % len(shapes):] + shapes[:r % len(shapes)]
        for b, t in order:
            calls = {s: rng.integers(3, spec.vocab_size, t).tolist() for s in range(b)}
            samples = []
            for _ in range(args.calls + 1):  # the first binds the shape: not timed
                for s in range(b):
                    caches.slots[s].rollback(PAST)
                start = time.perf_counter()
                backend.forward_slots(caches, 0, calls)
                samples.append(time.perf_counter() - start)
            times[b, t].append(statistics.median(samples[1:]) * 1e3)
    base = shapes[0]
    report = {"bundle": str(args.bundle), "threads": args.threads, "rounds": args.rounds,
              "past": PAST, "base": f"{base[0]}x{base[1]}", "shapes": []}
    print(f"| B x T | ms a call | / {base[0]}x{base[1]} (median of rounds) |\n|---|---|---|")
    for b, t in shapes:
        ms = statistics.median(times[b, t])
        ratio = statistics.median(x / y for x, y in zip(times[b, t], times[base]))
        report["shapes"].append({"rows": b, "tokens": t, "ms": ms, "ratio": ratio,
                                 "rounds_ms": times[b, t]})
        print(f"| {b} x {t} | {ms:.2f} | {ratio:.2f} |")
    atomic_write(args.out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
