"""A/B of the decode loop: the runtime of a git revision against the working tree's, in one run.

A change to the host side of a step moves it by a few percent, less than these machines
vary from run to run, so both runtimes run in one process, prompt by prompt, alternating
which goes first, on the same bundle:

    python scripts/experiments/ab_runtime.py --base REV [--bundle DIR] [--prompts 32]
        [--configs NAME ...]

Prints, per configuration, tokens per second of each and their ratio, the share of decode
time outside the backends (and its microseconds per target call), and in how many
generations both emitted the same tokens (all of them, sampled ones included, when the
change keeps the math and the random draws). The first prompt only warms up. Writes
bench_results/ab_runtime.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from specedge.bench.configs import configurations
from specedge.prompts import load_prompts
from specedge.runtime import Generator

# By default, the bench's own configurations (bench/configs.py) that a host-side change
# moves most.
DEFAULT_CONFIGS = ["greedy/plain", "sampled/plain", "greedy/lookup+model K=1",
                   "sampled/lookup+model K=1"]


def base_generator(rev: str, into: Path):
    """The Generator class of `rev`'s runtime, imported as the package `specedge_base`: its
    runtime folder (top-level `runtime/`, or `specedge/runtime/` in revisions that kept it
    there) with `specedge.` imports renamed."""
    root = Path(__file__).resolve().parents[2]
    package = into / "specedge_base"
    package.mkdir()
    (package / "__init__.py").touch()
    for folder in ("runtime", "specedge/runtime"):
        archive = subprocess.run(["git", "archive", rev, folder], cwd=root, capture_output=True)
        if archive.returncode == 0:
            break
    else:
        raise SystemExit(f"{rev} has neither runtime/ nor specedge/runtime/")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    shutil.move(into / folder, package / "runtime")
    for path in (package / "runtime").rglob("*.py"):
        path.write_text(re.sub(r"\bspecedge\.", "specedge_base.", path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module("specedge_base.runtime").Generator


def run(gens: dict, configs: list[tuple[str, dict]], prompts: list[dict],
        max_new_tokens: int) -> dict:
    """Decode-time totals per (configuration, runtime); the first prompt only warms up."""
    totals: dict[tuple[str, str], dict] = {}
    for i, prompt in enumerate(prompts):
        for name, kwargs in configs:
            for which in ("base", "work") if i % 2 else ("work", "base"):
                out = gens[which].generate(prompt["prompt"], seed=i,
                                           max_new_tokens=max_new_tokens, **kwargs)
                if i == 0:
                    continue
                s, t = out.stats, totals.setdefault((name, which), {
                    "decode_s": 0.0, "model_s": 0.0, "tokens": 0, "calls": 0, "ids": []})
                t["decode_s"] += s["time_total_s"] - s["time_prefill_s"]
                t["model_s"] += s["time_model_decode_s"]
                t["tokens"] += s["tokens_generated"] - 1  # the prefill's token is not decoded
                t["calls"] += s["target_calls"]
                t["ids"].append(out.token_ids)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision whose runtime/ is 'base'")
    ap.add_argument("--bundle", default="bundles/smollm2-feature-int8")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="NAME",
                    help="bench configurations to run, by name (`specedge bench` prints them)")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args()
    known = dict(configurations([1], has_draft=True))
    unknown = [name for name in args.configs if name not in known]
    if unknown:
        ap.error(f"unknown configuration {unknown}; known: {', '.join(known)}")
    configs = [(name, known[name]) for name in args.configs]

    with tempfile.TemporaryDirectory() as tmp:  # kept while base runs: it may import lazily
        gens = {"base": base_generator(args.base, Path(tmp)).from_bundle(args.bundle),
                "work": Generator.from_bundle(args.bundle)}
        totals = run(gens, configs, load_prompts(args.prompts), args.max_new_tokens)

    rows = []
    for name, _ in configs:
        row = {"configuration": name}
        for which in ("base", "work"):
            t = totals[name, which]
            outside = t["decode_s"] - t["model_s"]
            row[which] = {"tokens_per_second": t["tokens"] / t["decode_s"],
                          "outside_share": outside / t["decode_s"],
                          "outside_us_per_call": outside / t["calls"] * 1e6}
        b, w = totals[name, "base"]["ids"], totals[name, "work"]["ids"]
        row["ratio"] = row["work"]["tokens_per_second"] / row["base"]["tokens_per_second"]
        row["same_tokens"] = f"{sum(x == y for x, y in zip(b, w))}/{len(b)}"
        rows.append(row)
    print("| configuration | tok/s base | tok/s work | work / base | outside base | "
          "outside work | same tokens |\n|---|---|---|---|---|---|---|")
    for r in rows:
        b, w = r["base"], r["work"]
        print(f"| {r['configuration']} | {b['tokens_per_second']:.1f} | "
              f"{w['tokens_per_second']:.1f} | {r['ratio']:.3f}x | "
              f"{b['outside_share']:.2%} ({b['outside_us_per_call']:.0f} us) | "
              f"{w['outside_share']:.2%} ({w['outside_us_per_call']:.0f} us) | "
              f"{r['same_tokens']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_runtime.json").write_text(json.dumps(
        {"base": args.base, "bundle": args.bundle, "prompts": args.prompts, "rows": rows},
        indent=1))


if __name__ == "__main__":
    main()
