"""Batched decoding in process, without the server: tokens a second, inter-token latency
(pooled, and the worst request's own p99) and time to first token (p50, p90) of a
`BatchSession` serving the shipped prompts at a concurrency (a thread a slot takes the next
prompt when its sequence ends), for settings of the session taken in turns round by
round: the prompt chunk (`PREFILL_CHUNK`), the slots' growth step (`SlotCaches.step`), or,
with --base REV, the session of runtime/batch.py as it was at
git revision REV (its module loaded beside this one, on the same models). Prints a table
with each arm's ratios to the first (median of rounds and the 95% interval of their
geometric mean, bench/intervals.py), and writes JSON.

    python scripts/experiments/bench_batch_session.py --bundle B [--concurrency 4]
        [--chunks 16 32] [--growth-steps 64 256] [--base REV] [--prompts 8] [--tokens 64]
        [--rounds 3] [--distinct] [--threads 2] [--plain]
        [--out bench_results/batch_session.json]

--distinct marks each round's prompts apart (as bench_serve.py's --unique-prompts), so that
no prompt finds its rows in a slot or in the prompt store; by default one session per arm
serves every round, and a prompt asked again finds them, as a server's would.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from specedge.bench.intervals import ratio_ci
from specedge.runtime import Generator, batch
from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.config import GenerationConfig
from specedge.runtime.kv_cache import SlotCaches

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import select_prompts  # noqa: E402


def batch_module_at(rev: str) -> ModuleType:
    """runtime/batch.py as it was at git revision `rev`, loaded as a module of its own (its
    imports are this tree's runtime)."""
    root = Path(__file__).resolve().parents[2]
    source = subprocess.run(["git", "show", f"{rev}:runtime/batch.py"], cwd=root,
                            capture_output=True, text=True)
    if source.returncode != 0:
        raise SystemExit(f"no runtime/batch.py at {rev}: {source.stderr.strip()}")
    module = ModuleType(f"batch_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source.stdout, f"{rev}:runtime/batch.py", "exec"), module.__dict__)
    return module


def serve_once(session, gen: Generator, prompts: list[str], concurrency: int,
               config: GenerationConfig) -> dict:
    """The prompts through `session`, `concurrency` at a time: tokens, seconds, every
    sequence's gaps between two pieces, each sequence's own p99 of them (those with two
    gaps or more) and each one's time to its first piece (seconds)."""
    jobs: queue.Queue = queue.Queue()
    for p in prompts:
        jobs.put(p)
    gaps: list[float] = []
    own_p99: list[float] = []
    firsts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                prompt = jobs.get_nowait()
            except queue.Empty:
                return
            asked = time.perf_counter()
            ids = gen.encode_prompt(messages=[{"role": "user", "content": prompt}])
            pieces, last, mine = session.run(ids, config), None, []
            try:
                while True:
                    next(pieces)
                    now = time.perf_counter()
                    if last is not None:
                        mine.append(now - last)
                    else:
                        first = now - asked
                    last = now
            except StopIteration as done:
                with lock:
                    gaps.extend(mine)
                    if len(mine) > 1:
                        own_p99.append(float(np.percentile(mine, 99)))
                    firsts.append(first)
                    tokens[0] += len(done.value.token_ids)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"tokens": tokens[0], "seconds": time.perf_counter() - start, "gaps": gaps,
            "own_p99": own_p99, "firsts": firsts}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--chunks", type=int, nargs="+", default=[batch.PREFILL_CHUNK])
    ap.add_argument("--growth-steps", type=int, nargs="+", default=[SlotCaches.step])
    ap.add_argument("--base", metavar="REV", help="also run runtime/batch.py of this git "
                    "revision (the first arm)")
    ap.add_argument("--prompts", type=int, default=8,
                    help="prompts of the shipped set, spread over it as bench_serve.py "
                    "takes them (chat questions, passages to summarise, code)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--distinct", action="store_true",
                    help="mark each round's prompts apart: nothing of them is kept")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--plain", action="store_true", help="no draft (default: auto K)")
    ap.add_argument("--out", type=Path, default=Path("bench_results/batch_session.json"))
    args = ap.parse_args(argv)
    gen = Generator.from_bundle(args.bundle, threads=args.threads)
    prompts = [p["prompt"] for p in select_prompts(args.prompts)]
    config = GenerationConfig(max_new_tokens=args.tokens, use_draft=not args.plain,
                              draft_tokens="auto")
    modules = {"work": batch} | ({args.base: batch_module_at(args.base)} if args.base else {})
    arms = [(name, chunk, step) for name in reversed(modules)
            for chunk, step in itertools.product(args.chunks, args.growth_steps)]
    runs: dict[tuple, list[dict]] = {arm: [] for arm in arms}
    defaults = {name: m.PREFILL_CHUNK for name, m in modules.items()}, SlotCaches.step
    try:
        # A session takes its models' chunk sizes from PREFILL_CHUNK when it is made.
        sessions = {}
        for arm in arms:
            modules[arm[0]].PREFILL_CHUNK = arm[1]
            sessions[arm] = modules[arm[0]].BatchSession(gen, args.concurrency)
        # A warm-up round for each arm, then the rounds, the arms in turns.
        for r in range(-1, args.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                name, chunk, step = arm
                modules[name].PREFILL_CHUNK, SlotCaches.step = chunk, step
                mine = [f"[{r}.{i}] {p}" if args.distinct else p
                        for i, p in enumerate(prompts)]
                run = serve_once(sessions[arm], gen, mine, args.concurrency, config)
                if r >= 0:
                    runs[arm].append(run)
    finally:
        for name, chunk in defaults[0].items():
            modules[name].PREFILL_CHUNK = chunk
        SlotCaches.step = defaults[1]
    base = arms[0]
    report = {"bundle": str(args.bundle), "concurrency": args.concurrency,
              "rounds": args.rounds, "tokens": args.tokens, "plain": args.plain,
              "distinct": args.distinct, "base": args.base, "arms": []}
    # Per round: tokens a second, the pooled inter-token p99, the worst request's own p99
    # (the largest of the round's), time to first token p50 and p90.
    keys = ("tokens_per_second", "itl_p99", "worst_request_itl_p99", "ttft_p50", "ttft_p90")
    print(f"| batch.py | chunk | growth step | tok/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms "
          f"| / {' '.join(map(str, base))}: {', '.join(keys)} (median of rounds [95% "
          "CI]) |\n|---|---|---|---|---|---|---|---|")
    for arm in arms:
        def per_round(run: dict) -> tuple[float, ...]:
            pooled = float(np.percentile(run["gaps"], 99))
            return (run["tokens"] / run["seconds"], pooled, max(run["own_p99"], default=pooled),
                    float(np.median(run["firsts"])), float(np.percentile(run["firsts"], 90)))

        ratios = [[a / b for a, b in zip(per_round(x), per_round(y))]
                  for x, y in zip(runs[arm], runs[base])]
        intervals = [ratio_ci([r[i] for r in ratios]) for i in range(len(keys))]
        gaps = np.array([g for run in runs[arm] for g in run["gaps"]]) * 1e3
        p50, p99 = (float(np.percentile(gaps, q)) for q in (50, 99)) if gaps.size else (0, 0)
        rates = [run["tokens"] / run["seconds"] for run in runs[arm]]
        ttft = 1e3 * statistics.median(f for run in runs[arm] for f in run["firsts"])
        report["arms"].append({"batch": arm[0], "chunk": arm[1], "growth_step": arm[2],
                               "target_chunk": getattr(sessions[arm].models[0],
                                                       "chunk_tokens", arm[1]),
                               "tokens_per_second": rates, "ratio": intervals[0]["median"],
                               "ratios": dict(zip(keys, intervals)),
                               "itl_p50_ms": p50, "itl_p99_ms": p99, "ttft_p50_ms": ttft})
        cells = ", ".join(f"{c['median']:.2f}" + (f" [{c['ci95'][0]:.2f}-{c['ci95'][1]:.2f}]"
                                                    if c["ci95"] else "") for c in intervals)
        print(f"| {arm[0]} | {arm[1]} | {arm[2]} | {statistics.median(rates):.1f} | "
              f"{p50:.1f} | {p99:.1f} | {ttft:.1f} | {cells} |")
    atomic_write(args.out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
