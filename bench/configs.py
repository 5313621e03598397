"""Our configurations, run prompt by prompt (interleaved, so machine noise hits all alike),
and their aggregate figures."""

from __future__ import annotations

import math

from specedge.prompts import prompt_input
from specedge.runtime import Generator
from specedge.runtime.stats import TOTALS, rates

GREEDY = {}
SAMPLED = {"temperature": 0.7, "top_p": 0.9}


def configurations(ks: list[int], has_draft: bool) -> list[tuple[str, dict]]:
    """(name, generate kwargs) for every configuration; `plain` first in each mode."""
    configs = []
    for mode, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        configs.append((f"{mode}/plain", {**sampling, "use_draft": False}))
        if has_draft:
            model = {**sampling, "drafter": "model"}
            for k in ks if mode == "greedy" else ks[:1]:
                configs.append((f"{mode}/draft K={k}", {**model, "draft_tokens": k}))
            configs.append((f"{mode}/draft auto", {**model, "draft_tokens": "auto"}))
        if mode == "greedy":
            configs.append((f"{mode}/prompt-lookup K=4",
                            {**sampling, "drafter": "prompt-lookup", "draft_tokens": 4}))
        configs.append((f"{mode}/prompt-lookup auto",
                        {**sampling, "drafter": "prompt-lookup", "draft_tokens": "auto"}))
        if has_draft:
            # auto against a fixed K of the same drafter (the first of --ks; K = 1 is the
            # best fixed K of the shipped drafts).
            configs.append((f"{mode}/lookup+model K={ks[0]}",
                            {**sampling, "drafter": "lookup+model", "draft_tokens": ks[0]}))
            configs.append((f"{mode}/lookup+model auto",
                            {**sampling, "drafter": "lookup+model", "draft_tokens": "auto"}))
    return configs


# Why --quick measures prompt lookup on a bundle without a draft model.
NO_DRAFT_QUICK = ("this bundle has no draft model, so the runtime's default drafter cannot "
                  "run: --quick compares plain decoding with prompt lookup instead")


def quick_configurations(has_draft: bool) -> list[tuple[str, dict]]:
    """`--quick`: plain decoding and the runtime's defaults (what `Generator.generate` does
    when given no drafting settings: greedy, its default drafter and draft_tokens). Those
    need a draft model; without one, prompt lookup with its default draft_tokens stands in
    (NO_DRAFT_QUICK)."""
    second = (("greedy/default", {}) if has_draft
              else ("greedy/prompt-lookup auto", {"drafter": "prompt-lookup"}))
    return [("greedy/plain", {"use_draft": False}), second]


def run_ours(gen: Generator, prompts: list[dict], configs: list[tuple[str, dict]],
             max_new_tokens: int, progress=None) -> dict[str, list[dict]]:
    """Per configuration, the stats of every prompt (same order as `prompts`)."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for i, p in enumerate(prompts):
        for name, kwargs in configs:
            out = gen.generate(**prompt_input(p), max_new_tokens=max_new_tokens, seed=i,
                               **kwargs)
            runs[name].append({**out.stats, "category": p["category"]})
            if progress:
                progress.update()
    return runs


def aggregate(stats: list[dict]) -> dict:
    """Totals over prompts and their rates (runtime/stats.py `rates`: ratios of sums)."""
    totals = {k: sum(x[k] for x in stats) for k in TOTALS}
    width = max((len(x["position_tries"]) for x in stats), default=0)
    for key in ("position_tries", "position_accepts"):
        totals[key] = [sum(x[key][j] for x in stats if j < len(x[key])) for j in range(width)]
    row = rates(totals, generations=len(stats))
    return {"tokens": totals["tokens_generated"],
            "tokens_per_second": row.pop("decode_tokens_per_second"), **row}


def per_prompt_speedups(stats: list[dict], plain: list[dict]) -> list[float | None]:
    """Per prompt, decode tokens per second over plain decoding's on the same prompt; None
    where either decoded nothing (the first token came from the prompt's prefill and the
    generation stopped there)."""
    speedups = []
    for s, p in zip(stats, plain, strict=True):
        ours, base = (aggregate([x])["tokens_per_second"] for x in (s, p))
        speedups.append(ours / base if ours > 0 and base > 0 else None)
    return speedups


def geometric_mean(values: list[float | None]) -> float | None:
    """Geometric mean of the values that are not None; None when there are none."""
    kept = [v for v in values if v is not None]
    return math.exp(sum(map(math.log, kept)) / len(kept)) if kept else None
