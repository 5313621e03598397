"""Which engine makes a distillation corpus fastest on this machine: torch's batched
`generate` (fp32, the target checkpoint) against the project's batched runtime (a bundle
exported with --attention batched, plain decoding, `answer_jobs` as `specedge corpus` runs
it), in answer tokens a second, over the bench prompts repeated.

    python scripts/experiments/bench_corpus_engines.py --bundle bundles/smollm2-int4-batched \\
        [--model smollm2-135m] [--torch-batches 32 64] [--rows 8 16 32 64] \\
        [--new-tokens 128] [--threads 2] [--out corpus_engines.json]

torch's rows run until the batch's longest answer ends, so its "slot" rate counts the
finished rows' padding and its "answer" rate only the answers' tokens (up to their EOS); the
runtime's slots take the next request as soon as one ends. Prints a table and writes JSON.
Needs the export extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specedge.prompts import load_prompts


def torch_rates(model: str, batch: int, new_tokens: int, threads: int) -> dict:
    import torch

    from specedge.export.sources import load_model

    torch.set_num_threads(threads)
    target, tok = load_model(model)
    tok.padding_side = "left"
    prompts = [p["prompt"] for p in load_prompts()]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                     add_generation_prompt=True, tokenize=False)
             for p in (prompts * (batch // len(prompts) + 1))[:batch]]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id or 0)
    seconds = time.perf_counter() - start
    answers = out[:, enc["input_ids"].shape[1]:]
    eos = tok.eos_token_id
    real = sum(int((row == eos).nonzero()[0].item()) + 1 if (row == eos).any() else len(row)
               for row in answers)
    return {"engine": f"torch fp32, batch {batch}", "seconds": round(seconds, 1),
            "slot_tokens_per_second": round(answers.numel() / seconds, 1),
            "answer_tokens_per_second": round(real / seconds, 1)}


def runtime_rates(bundle: str, rows: int, new_tokens: int, threads: int) -> dict:
    from specedge.export.distill.grow import answer_jobs
    from specedge.runtime import GenerationConfig, Generator
    from specedge.runtime.batch import BatchSession

    gen = Generator.from_bundle(bundle, threads=threads, spinning=False)
    session = BatchSession(gen, rows)
    prompts = [p["prompt"] for p in load_prompts()]
    jobs = [(gen.encode_prompt(p), GenerationConfig(max_new_tokens=new_tokens, use_draft=False))
            for p in (prompts * (3 * rows // len(prompts) + 1))[:3 * rows]]
    start = time.perf_counter()
    results = answer_jobs(session, jobs)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    precision = gen.bundle.manifest.get("precision")
    return {"engine": f"runtime {precision}, {rows} rows", "seconds": round(seconds, 1),
            "slot_tokens_per_second": round(tokens / seconds, 1),
            "answer_tokens_per_second": round(tokens / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, help="a bundle exported with --attention batched")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--torch-batches", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--rows", type=int, nargs="*", default=[8, 16, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("corpus_engines.json"))
    args = ap.parse_args()
    rows = [torch_rates(args.model, b, args.new_tokens, args.threads)
            for b in args.torch_batches]
    rows += [runtime_rates(args.bundle, r, args.new_tokens, args.threads) for r in args.rows]
    print("| engine | seconds | slot tok/s | answer tok/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['seconds']} | {r['slot_tokens_per_second']} | "
              f"{r['answer_tokens_per_second']} |")
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
