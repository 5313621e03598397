"""Batched decoding in process, without the server: tokens a second and inter-token latency
of a `BatchSession` serving the shipped prompts at a concurrency (a thread a slot takes
the next prompt when its sequence ends), for settings of the session taken in turns round
by round: the prompt chunk (`PREFILL_CHUNK`) and the slots' growth step (`GROWTH_STEP`).
Prints a table and writes JSON.

    python scripts/experiments/bench_batch_session.py --bundle B [--concurrency 4]
        [--chunks 16 32] [--growth-steps 64 256] [--prompts 8] [--tokens 64]
        [--rounds 3] [--threads 2] [--plain] [--out bench_results/batch_session.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from specedge.prompts import load_prompts
from specedge.runtime import Generator, batch
from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.batch import BatchSession
from specedge.runtime.config import GenerationConfig


def serve_once(gen: Generator, prompts: list[str], concurrency: int, config: GenerationConfig
               ) -> dict:
    """The prompts through one session, `concurrency` at a time: tokens, seconds and each
    sequence's gaps between two pieces (seconds)."""
    session = BatchSession(gen, concurrency)
    jobs: queue.Queue = queue.Queue()
    for p in prompts:
        jobs.put(p)
    gaps: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                prompt = jobs.get_nowait()
            except queue.Empty:
                return
            ids = gen.encode_prompt(messages=[{"role": "user", "content": prompt}])
            pieces, last, mine = session.run(ids, config), None, []
            try:
                while True:
                    next(pieces)
                    now = time.perf_counter()
                    if last is not None:
                        mine.append(now - last)
                    last = now
            except StopIteration as done:
                with lock:
                    gaps.extend(mine)
                    tokens[0] += len(done.value.token_ids)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"tokens": tokens[0], "seconds": time.perf_counter() - start, "gaps": gaps}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--chunks", type=int, nargs="+", default=[batch.PREFILL_CHUNK])
    ap.add_argument("--growth-steps", type=int, nargs="+", default=[batch.GROWTH_STEP])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--plain", action="store_true", help="no draft (default: auto K)")
    ap.add_argument("--out", type=Path, default=Path("bench_results/batch_session.json"))
    args = ap.parse_args(argv)
    gen = Generator.from_bundle(args.bundle, threads=args.threads)
    prompts = [p["prompt"] for p in load_prompts(args.prompts)]
    config = GenerationConfig(max_new_tokens=args.tokens, use_draft=not args.plain,
                              draft_tokens="auto")
    arms = list(itertools.product(args.chunks, args.growth_steps))
    runs: dict[tuple[int, int], list[dict]] = {arm: [] for arm in arms}
    defaults = batch.PREFILL_CHUNK, batch.GROWTH_STEP, batch.SHRINK_SLACK
    try:
        for r in range(args.rounds):
            for chunk, step in arms[r % len(arms):] + arms[:r % len(arms)]:
                batch.PREFILL_CHUNK, batch.GROWTH_STEP, batch.SHRINK_SLACK = chunk, step, 2 * step
                runs[chunk, step].append(serve_once(gen, prompts, args.concurrency, config))
    finally:
        batch.PREFILL_CHUNK, batch.GROWTH_STEP, batch.SHRINK_SLACK = defaults
    base = arms[0]
    report = {"bundle": str(args.bundle), "concurrency": args.concurrency,
              "rounds": args.rounds, "tokens": args.tokens, "plain": args.plain, "arms": []}
    print(f"| chunk | growth step | tok/s | / {base[0]}, {base[1]} (median of rounds) | "
          "ITL p50 ms | ITL p99 ms |\n|---|---|---|---|---|---|")
    for arm in arms:
        rates = [run["tokens"] / run["seconds"] for run in runs[arm]]
        ratio = statistics.median(a["tokens"] / a["seconds"] / (b["tokens"] / b["seconds"])
                                  for a, b in zip(runs[arm], runs[base]))
        gaps = np.array([g for run in runs[arm] for g in run["gaps"]]) * 1e3
        p50, p99 = (float(np.percentile(gaps, q)) for q in (50, 99)) if gaps.size else (0, 0)
        report["arms"].append({"chunk": arm[0], "growth_step": arm[1],
                               "tokens_per_second": rates, "ratio": ratio,
                               "itl_p50_ms": p50, "itl_p99_ms": p99})
        print(f"| {arm[0]} | {arm[1]} | {statistics.median(rates):.1f} | {ratio:.2f} | "
              f"{p50:.1f} | {p99:.1f} |")
    atomic_write(args.out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
