"""`specedge bench --bundle DIR`: run every configuration on the prompt set, compare with
the other systems, write bench.json, bench.md and PNG plots."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specedge.bench import baselines, report
from specedge.bench.configs import aggregate, configurations, run_ours
from specedge.prompts import load_prompts
from specedge.runtime import Generator
from specedge.runtime.backends import BACKENDS
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.stats import model_perplexity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="fixed K values to try, the first also when sampling (default 1 2 3 4)")
    p.add_argument("--systems-prompts", type=int, default=8,
                   help="prompts for the other systems, which are slow (default 8)")
    p.add_argument("--no-baselines", action="store_true", help="skip transformers, llama.cpp")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--backend", choices=BACKENDS, default="ort-cpu",
                   help="runtime backend of our configurations (default ort-cpu)")
    p.add_argument("--out", type=Path, default=Path("bench_results"))


def _gguf(bundle: Path) -> Path | None:
    source = json.loads((bundle / "manifest.json").read_text())["source"]["model"]
    if source.endswith(".gguf"):
        return Path(source)
    if source == "smollm2-135m":
        from specedge.export.sources import fetch_smollm2_gguf

        return fetch_smollm2_gguf()
    return None


def _ours(gen: Generator, kwargs: dict, max_new_tokens: int, quality: float) -> dict:
    """One of our configurations as a system for `baselines.time_systems`."""
    def generate(ids: list[int]) -> int:
        out = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, **kwargs)
        return out.stats["tokens_generated"]
    return {"generate": generate, "perplexity": quality}


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    gen = Generator.from_bundle(args.bundle, backend=args.backend, threads=args.threads)
    prompts = load_prompts(args.limit)
    configs = configurations(args.ks, gen.draft is not None)
    for _, kwargs in configs:  # warm up every code path once
        gen.generate(prompts[0]["prompt"], max_new_tokens=8, **kwargs)
    bar = tqdm(total=len(prompts) * len(configs), desc="bench", unit="run", file=sys.stderr)
    runs = run_ours(gen, prompts, configs, args.max_new_tokens, bar)
    bar.close()

    table = {}
    for name, stats in runs.items():
        row = aggregate(stats)
        plain = table[name.split("/")[0] + "/plain"] if not name.endswith("plain") else row
        row["speedup"] = row["tokens_per_second"] / plain["tokens_per_second"]
        row["measured_over_ideal"] = row["speedup"] / row["ideal_speedup"]
        row["by_category"] = {cat: aggregate([s for s in stats if s["category"] == cat])
                              ["tokens_per_second"] for cat in sorted({s["category"]
                                                                       for s in stats})}
        table[name] = row

    n = min(args.systems_prompts, len(prompts))
    end_to_end = {name: sum(s["tokens_generated"] for s in stats[:n]) /
                  sum(s["time_total_s"] for s in stats[:n]) for name, stats in runs.items()
                  if name.startswith("greedy/")}
    best = max(end_to_end, key=end_to_end.get)  # the fastest exact configuration
    text_ids = baselines.quality_text_ids(gen.codec, load_prompts())[:gen.max_context()]
    # on ONNX Runtime CPU whatever the bench's backend: a property of the graph
    ours = model_perplexity(OrtCpuBackend(gen.bundle.target, args.threads), text_ids)
    kwargs = dict(configs)
    systems = {"specedge plain": _ours(gen, kwargs["greedy/plain"], args.max_new_tokens, ours),
               "specedge best": {**_ours(gen, kwargs[best], args.max_new_tokens, ours),
                                 "configuration": best}}
    if not args.no_baselines:
        systems.update(baselines.transformers_systems(args.bundle, args.max_new_tokens,
                                                      text_ids))
        systems.update(baselines.llama_cpp_systems(_gguf(args.bundle), args.max_new_tokens,
                                                   args.threads or os.cpu_count() or 1,
                                                   text_ids))
    ids = [gen.codec.encode_chat([{"role": "user", "content": p["prompt"]}])
           for p in prompts[:n]]
    systems = baselines.time_systems(systems, ids, progress=True)
    return {"bundle": str(args.bundle), "backend": args.backend,
            "precision": gen.bundle.manifest.get("precision"),
            "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "systems_prompts": n, "quality_tokens": len(text_ids), "configurations": table,
            "systems": systems}


def main(args: argparse.Namespace) -> None:
    results = run(args)
    for path in report.write(results, args.out):
        print(f"wrote {path}", file=sys.stderr)
    print(report.markdown(results))
