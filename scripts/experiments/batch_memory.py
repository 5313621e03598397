"""Resident memory of batched decoding: a BatchGenerator at --max-batch N serving waves of
N requests at once, each wave's prompts and answer lengths other than the last's (so that
the calls take new shapes: rows, tokens, capacity), the process' resident set size (RSS)
after loading and after each wave (several --max-batch run one after another in one
process: each starts from what the last one left). What grows from wave to wave is what
the session keeps: ONNX Runtime's IO bindings per call shape (bounded by
ort_cpu.SLOT_BINDING_BYTES), the slots' caches (cut back when the sequences that needed
them leave), the prompt store (bounded by batch.PREFIX_STORE_BYTES). Prints a table and
writes JSON.

    python scripts/experiments/batch_memory.py --bundle B [--max-batch 8 16] [--waves 4]
        [--tokens 96] [--threads 2] [--out bench_results/batch_memory.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from specedge.runtime import Generator
from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.backends.ort_cpu import SLOT_BINDING_BYTES
from specedge.runtime.batch import PREFIX_STORE_BYTES, BatchGenerator, BatchRequest
from specedge.runtime.config import GenerationConfig

WORDS = ("river", "planet", "garden", "engine", "violin", "harbor", "desert", "market",
         "glacier", "lantern", "orchard", "compass")


def rss_mb() -> float:
    """This process' resident set size in MiB (Linux /proc; elsewhere the peak, from
    resource)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def wave_requests(wave: int, n: int, tokens: int) -> list[BatchRequest]:
    """n requests of wave `wave`: prompts of 1 to 4 sentences, answers of tokens / 2 to
    `tokens` new tokens, both shifting from wave to wave; greedy, with the default drafting."""
    out = []
    for i in range(n):
        k = (wave + i) % len(WORDS)
        sentences = 1 + (wave * 3 + i) % 4
        prompt = " ".join(f"Tell me about the {WORDS[(k + s) % len(WORDS)]}." for s in
                          range(sentences))
        new = tokens // 2 + ((wave * 7 + i * 5) % (tokens // 2 + 1))
        out.append(BatchRequest(messages=[{"role": "user", "content": prompt}],
                                config=GenerationConfig(max_new_tokens=new)))
    return out


def measure(bundle: Path, max_batch: int, waves: int, tokens: int,
            threads: int | None) -> dict:
    before = rss_mb()
    gen = Generator.from_bundle(bundle, threads=threads)
    batch = BatchGenerator(gen, max_batch)
    rows = [{"after": "load", "rss_mb": round(rss_mb(), 1), "seconds": 0.0, "tokens": 0}]
    for w in range(waves):
        t0 = time.perf_counter()
        results = batch.generate(wave_requests(w, max_batch, tokens))
        rows.append({"after": f"wave {w + 1}", "rss_mb": round(rss_mb(), 1),
                     "seconds": round(time.perf_counter() - t0, 2),
                     "tokens": sum(len(r.token_ids) for r in results)})
    growth = np.diff([r["rss_mb"] for r in rows[1:]]) if waves > 1 else np.array([])
    return {"max_batch": max_batch, "rss_before_load_mb": round(before, 1), "waves": rows,
            "last_wave_growth_mb": float(growth[-1]) if growth.size else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--max-batch", type=int, nargs="+", default=[8, 16])
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("bench_results/batch_memory.json"))
    args = p.parse_args(argv)
    runs = [measure(args.bundle, n, args.waves, args.tokens, args.threads)
            for n in args.max_batch]
    print(f"Resident set size of the process (MiB), runs one after another in it; bindings "
          f"bounded at "
          f"{SLOT_BINDING_BYTES >> 20} MiB, the prompt store at {PREFIX_STORE_BYTES >> 20} MiB")
    print("| --max-batch | " + " | ".join(r["after"] for r in runs[0]["waves"]) + " |")
    print("|---" * (len(runs[0]["waves"]) + 1) + "|")
    for run in runs:
        print(f"| {run['max_batch']} | " + " | ".join(f"{r['rss_mb']:.0f}"
                                                     for r in run["waves"]) + " |")
    out = {"bundle": str(args.bundle), "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
