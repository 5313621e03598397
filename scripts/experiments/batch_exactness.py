"""Greedy output of sequences decoded together against each one's plain decoding alone, on
a real bundle: the shipped prompts (chat template) decoded `--max-batch` at a time, each with
its own drafter and K (plain, prompt lookup, the model draft, both, auto), so that rows of
different lengths and numbers of drafted tokens share every call. Prints, per prompt,
whether the token ids are the same and from which token they part, and writes JSON. First,
on a batched graph, a prompt of 300 random tokens run in one call and in the chunks a
batch runs it in (runtime/batch.py `prefill_chunks`): whether the last logits and the cache
rows are the same bit for bit.

    python scripts/experiments/batch_exactness.py --bundle B [--prompts 8] [--tokens 96]
        [--max-batch 4] [--threads 2] [--out bench_results/batch_exactness.json]

The tests check the same on tiny models (tests/runtime/test_batch.py); this is the check on
the weights users run, which is too slow for CI.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specedge.prompts import load_prompts
from specedge.runtime import Generator
from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.batch import BatchGenerator, BatchRequest, prefill_chunks
from specedge.runtime.config import GenerationConfig

# Each sequence's drafter and K, in turn.
SETTINGS = [dict(use_draft=False), dict(drafter="prompt-lookup", draft_tokens=3),
            dict(drafter="model", draft_tokens=2), dict(drafter="lookup+model"),
            dict(drafter="model", draft_tokens=4)]


def chunked_prefill_same(gen: Generator, n: int = 300) -> bool | None:
    """Whether n prompt tokens in `prefill_chunks`' calls leave the last logits and the
    cache rows that one call leaves, bit for bit (None: the graph does not run prompts in
    chunks)."""
    target = gen.target
    if target.spec.attention != "batched":
        return None
    ids = np.random.default_rng(0).integers(3, target.spec.vocab_size, n).tolist()
    whole = target.new_cache(n + 1)
    want = target.forward(whole, ids, 1).copy()
    chunked, start = target.new_cache(n + 1), 0
    for size in prefill_chunks(n, 1, chunked=True):
        got = target.forward(chunked, ids[start:start + size], 1)
        start += size
    return bool(np.array_equal(want, got) and np.array_equal(
        whole.planes[..., :n, :], chunked.planes[..., :n, :]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_results/batch_exactness.json"))
    args = ap.parse_args(argv)
    gen = Generator.from_bundle(args.bundle, threads=args.threads)
    chunks_same = chunked_prefill_same(gen)
    print(f"a 300-token prompt in chunks {prefill_chunks(300, 1, True)} against one call: "
          f"{'n/a' if chunks_same is None else 'same' if chunks_same else 'DIFFERENT'}")
    prompts = [p["prompt"] for p in load_prompts()][:args.prompts]
    alone = [gen.generate(p, max_new_tokens=args.tokens, use_draft=False) for p in prompts]
    requests = [BatchRequest(prompt=p, config=GenerationConfig(
        max_new_tokens=args.tokens, **SETTINGS[i % len(SETTINGS)]))
        for i, p in enumerate(prompts)]
    batcher, batched = BatchGenerator(gen, args.max_batch), []
    for i in range(0, len(requests), args.max_batch):
        batched += batcher.generate(requests[i:i + args.max_batch])
    rows = []
    for i, (a, b) in enumerate(zip(alone, batched)):
        parted = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                      None if len(a.token_ids) == len(b.token_ids) else
                      min(len(a.token_ids), len(b.token_ids)))
        rows.append({"prompt": i, "settings": SETTINGS[i % len(SETTINGS)],
                     "tokens": len(a.token_ids), "same": parted is None, "parts_at": parted,
                     "drafted": b.stats["drafted_tokens"],
                     "accepted": b.stats["accepted_tokens"]})
        print(f"prompt {i}: {len(a.token_ids)} tokens, "
              f"{'same' if parted is None else f'parts at token {parted}'} "
              f"({rows[-1]['settings']}, drafted {rows[-1]['drafted']})")
    report = {"bundle": str(args.bundle), "max_batch": args.max_batch, "rows": rows,
              "all_same": all(r["same"] for r in rows), "chunked_prefill_same": chunks_same}
    atomic_write(args.out, json.dumps(report, indent=2) + "\n")
    print(f"{sum(r['same'] for r in rows)} of {len(rows)} the same; wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
