"""Our configurations, run prompt by prompt (interleaved, so machine noise hits all alike),
and their aggregate figures."""

from __future__ import annotations

import json
from importlib import resources

from specedge.runtime import Generator
from specedge.runtime.stats import ideal_speedup

GREEDY = {}
SAMPLED = {"temperature": 0.7, "top_p": 0.9}


def load_prompts(limit: int | None = None) -> list[dict]:
    text = resources.files("specedge.bench").joinpath("prompts.jsonl").read_text()
    prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


def configurations(ks: list[int], has_draft: bool) -> list[tuple[str, dict]]:
    """(name, generate kwargs) for every configuration; `plain` first in each mode."""
    configs = []
    for mode, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        configs.append((f"{mode}/plain", {**sampling, "use_draft": False}))
        if has_draft:
            for k in ks if mode == "greedy" else ks[:1]:
                configs.append((f"{mode}/draft K={k}", {**sampling, "draft_tokens": k}))
            configs.append((f"{mode}/draft auto", {**sampling, "draft_tokens": "auto"}))
        if mode == "greedy":
            configs.append((f"{mode}/prompt-lookup K=4",
                            {**sampling, "drafter": "prompt-lookup", "draft_tokens": 4}))
    return configs


def run_ours(gen: Generator, prompts: list[dict], configs: list[tuple[str, dict]],
             max_new_tokens: int, progress=None) -> dict[str, list[dict]]:
    """Per configuration, the stats of every prompt (same order as `prompts`)."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for i, p in enumerate(prompts):
        for name, kwargs in configs:
            out = gen.generate(p["prompt"], max_new_tokens=max_new_tokens, seed=i, **kwargs)
            runs[name].append({**out.stats, "category": p["category"]})
            if progress:
                progress.update()
    return runs


def aggregate(stats: list[dict]) -> dict:
    """Totals over prompts: rates are ratios of sums, not means of ratios."""
    s = {k: sum(x[k] for x in stats) for k in (
        "tokens_generated", "target_calls", "draft_calls", "drafted_tokens", "accepted_tokens",
        "time_total_s", "time_prefill_s", "time_draft_s", "time_target_s")}
    decode = s["time_total_s"] - s["time_prefill_s"]
    model = sum((1 - x["outside_model_share"]) * (x["time_total_s"] - x["time_prefill_s"])
                for x in stats)
    width = max((len(x["position_tries"]) for x in stats), default=0)
    tries, accepts = [0] * width, [0] * width
    for x in stats:
        for j, (t, a) in enumerate(zip(x["position_tries"], x["position_accepts"])):
            tries[j] += t
            accepts[j] += a
    examined = sum(tries)  # beta = accepted / examined drafts, as in runtime/stats.py
    beta = s["accepted_tokens"] / examined if examined else 0.0
    target_step = s["time_target_s"] / s["target_calls"] if s["target_calls"] else 0.0
    c = (s["time_draft_s"] / s["draft_calls"]) / target_step if s["draft_calls"] else 0.0
    mean_k = s["drafted_tokens"] / s["target_calls"] if s["target_calls"] else 0.0
    return {
        "tokens": s["tokens_generated"],
        "tokens_per_second": (s["tokens_generated"] - len(stats)) / decode if decode else 0.0,
        "acceptance_rate": beta,
        "acceptance_per_position": [a / t if t else 0.0 for a, t in zip(accepts, tries)],
        "tokens_per_target_call": (s["tokens_generated"] - len(stats)) / s["target_calls"]
        if s["target_calls"] else 0.0,
        "mean_draft_tokens": mean_k,
        "draft_cost_ratio_c": c,
        "ideal_speedup": ideal_speedup(beta, mean_k, c) if mean_k else 1.0,
        "outside_model_share": 1 - model / decode if decode else 0.0,
    }
