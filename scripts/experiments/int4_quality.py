"""What a quantized bundle costs in quality against a reference bundle of the same model:
perplexity on the bench's quality text (the shipped summaries' passages, up to 2048 tokens)
and teacher-forced greedy agreement with the reference on the first 12 shipped prompts
(32 steps each), every bundle's target on ort-cpu. Longer than the export's own quality
report (one paragraph), so that a grid's cost is not lost in the noise of a short text.

    python scripts/experiments/int4_quality.py REFERENCE_BUNDLE BUNDLE [BUNDLE ...] [--json F]
        [--prompts docs/examples/prompts.jsonl]

The shipped prompts are also what the searched int4 grids calibrate on (their first 512
tokens), so a grid fitted to them is also measured on a prompt file that it never saw
(`--prompts`, e.g. docs/examples/prompts.jsonl: the same categories, other texts).

e.g. an fp32 bundle with fused attention as the reference (`specedge export smollm2-135m
--precision fp32 --attention fused --out REF`) against int4 bundles with each --int4-grid.
"""

from __future__ import annotations

import argparse
import json

from specedge.bench import baselines
from specedge.export.quantize import _agreement, _greedy_path, chunked_perplexity
from specedge.prompts import load_prompts, read_prompt_file
from specedge.runtime.backends import load_backend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.text import TextCodec

TEXT_TOKENS = 2048
PROMPTS, STEPS = 12, 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+", help="the reference bundle first")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--prompts", help="a prompt file (JSON Lines, with summarize prompts) to "
                   "measure on instead of the shipped prompts")
    args = p.parse_args()
    codec = TextCodec(load_bundle(args.bundles[0]))
    baselines.QUALITY_TOKENS = TEXT_TOKENS
    prompt_set = read_prompt_file(args.prompts) if args.prompts else load_prompts()
    text = baselines.quality_text_ids(codec, prompt_set)
    prompts = [codec.encode_chat([{"role": "user", "content": p["prompt"]}])
               for p in prompt_set[:PROMPTS]]
    rows, paths = [], None
    for bundle in args.bundles:
        backend = load_backend("ort-cpu", load_bundle(bundle), "target", args.threads)
        ppl = chunked_perplexity(backend, text)
        if paths is None:
            paths = [_greedy_path(backend, ids, STEPS) for ids in prompts]
        agree = sum(_agreement(backend, ids, path) for ids, path in zip(prompts, paths))
        rows.append({"bundle": bundle, "text_tokens": len(text), "perplexity": ppl,
                     "perplexity_change": ppl / rows[0]["perplexity"] - 1 if rows else 0.0,
                     "greedy_agreement": agree / sum(map(len, paths))})
        r = rows[-1]
        print(f"{bundle}: perplexity {ppl:.3f} ({r['perplexity_change']:+.2%}) over "
              f"{len(text)} tokens, greedy agreement {r['greedy_agreement']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
