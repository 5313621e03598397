"""The benchmark's outputs: JSON, a markdown table, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specedge.bench.baselines import PEERS

COLUMNS = [("tok/s", "tokens_per_second", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
           ("geo", "speedup_geomean", "{:.2f}x"),
           ("ideal", "ideal_speedup", "{:.2f}x"), ("meas/ideal", "measured_over_ideal", "{:.2f}"),
           ("accept", "acceptance_rate", "{:.2f}"), ("tok/call", "tokens_per_target_call",
                                                     "{:.2f}"),
           ("K mean", "mean_draft_tokens", "{:.1f}"), ("c", "draft_cost_ratio_c", "{:.3f}"),
           ("outside", "outside_model_share", "{:.1%}")]


def _cell(fmt: str, value: float | None) -> str:
    """A figure, or "-" where it is undefined (a ratio over nothing decoded)."""
    return "-" if value is None else fmt.format(value)


def _category(name: str) -> str:
    """A category name as a markdown table cell."""
    return name.replace("|", "\\|").replace("\n", " ")


def markdown(results: dict) -> str:
    source = (f"prompts from {results['prompt_file']}" if results.get("prompt_file")
              else "the shipped prompt set")
    lines = [f"# specedge bench{' --quick' if results.get('quick') else ''}: "
             f"{results['bundle']}", "",
             f"{results['prompts']} prompts ({source}) x {results['max_new_tokens']} new "
             f"tokens; precision {results['precision']}; speedup = tok/s / plain tok/s of the "
             "same mode, measured in the same run (ratio of sums); geo = geometric mean of "
             "the per-prompt speedups.", ""]
    configs = results["configurations"]
    if results.get("quick"):
        (_, plain), (name, default) = configs.items()  # --quick: plain, then the defaults
        counted = sum(x is not None for x in default["speedup_per_prompt"])
        what = ("the default settings" if name == "greedy/default"
                else f"{name} (the bundle has no draft model)")
        lines += [f"**Speedup of {what} over plain decoding: "
                  f"{_cell('{:.2f}x', default['speedup'])}** (total decode tokens over total "
                  f"decode time: {default['tokens_per_second']:.1f} against "
                  f"{plain['tokens_per_second']:.1f} tok/s); "
                  f"{_cell('{:.2f}x', default['speedup_geomean'])} as the geometric mean of "
                  f"{counted} per-prompt speedups.", ""]
    lines += ["| configuration | " + " | ".join(c[0] for c in COLUMNS) + " | per-position |",
              "|---" * (len(COLUMNS) + 2) + "|"]
    for name, row in configs.items():
        cells = [_cell(fmt, row[key]) for _, key, fmt in COLUMNS]
        per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"]) or "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {per_pos} |")
    cats = sorted({cat for row in configs.values() for cat in row["by_category"]})
    lines += ["", "## Speedup by prompt category (tok/s over plain, same mode and category)",
              "", "| configuration | " + " | ".join(map(_category, cats)) + " |",
              "|---" * (len(cats) + 1) + "|"]
    for name, row in configs.items():
        plain = configs[name.split("/")[0] + "/plain"]["by_category"]
        lines.append(f"| {name} | " + " | ".join(
            f"{row['by_category'][c] / plain[c]:.2f}x"
            if c in row["by_category"] and plain.get(c) else "-" for c in cats) + " |")
    if results.get("categories"):
        lines += ["", "Prompts per category: " + ", ".join(
            f"{_category(c)} {n}" for c, n in results["categories"].items()) + "."]
    if "systems" in results:
        lines += _systems_markdown(results)
    return "\n".join(lines) + "\n"


def _rate(value: float | None) -> str:
    return _cell("{:.1f}", value)


def _interval(r: dict) -> str:
    """A ratio's 95% confidence interval, or "-" with one round."""
    return "-" if r["ci95"] is None else f"{r['ci95'][0]:.2f}–{r['ci95'][1]:.2f}x"


def _systems_markdown(results: dict) -> list[str]:
    systems = results["systems"]
    rounds = results.get("systems_rounds", 1)
    best = systems["specedge best"]["configuration"]
    lines = ["", f"## Systems (greedy, first {results['systems_prompts']} prompts, {rounds} "
             f"round{'s' if rounds != 1 else ''})", "",
             "Each round, the systems take turns prompt by prompt. End to end: tokens over "
             "the whole generation, prompt evaluation included; decode: the tokens after the "
             "first over the time after the first arrived. Both are the median over rounds "
             f"(ratios of sums within a round). specedge best: {best}, the fastest greedy "
             "configuration above on these prompts (end to end).", "",
             f"Perplexity: each system's own weights on the shipped prompt set's passages "
             f"({results['quality_tokens']} tokens, the same ids for all).", "",
             "| system | end to end tok/s | decode tok/s | perplexity | end to end tok/s by "
             "round |", "|---|---|---|---|---|"]
    for name, row in systems.items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | |")
        else:
            by_round = " ".join(_rate(r["tokens_per_second"]) for r in row["rounds"])
            lines.append(f"| {name} | {_rate(row['tokens_per_second'])} | "
                         f"{_rate(row['decode_tokens_per_second'])} | "
                         f"{row['perplexity']:.2f} | {by_round} |")
    ratios = results.get("system_ratios", [])
    if ratios:
        lines += ["", f"Ratios to {' and '.join(_peers_in(ratios))}: per round, then their median "
                  "and the 95% confidence interval of their geometric mean (Student t over "
                  "rounds): a ratio moves by several percent from run to run on one machine, "
                  "so read its interval. A peer's best: the fastest of its systems on that "
                  "speed (median over rounds).", "",
                  "| ratio | speed | median | 95% CI | by round |", "|---|---|---|---|---|"]
        for r in ratios:
            name = r["ratio"]
            if name.endswith(" best"):
                name += f" ({r['denominator']})"
            lines.append(f"| {name} | {r['speed']} | {r['median']:.2f}x | {_interval(r)} | "
                         + " ".join(f"{x:.2f}" for x in r["rounds"]) + " |")
    for peer in PEERS:
        if peer in _peers_in(ratios):
            continue
        skipped = [f"{name}: {row['skipped']}" for name, row in systems.items()
                   if name.startswith(f"{peer} ") and "skipped" in row]
        if skipped or not ratios:
            lines += ["", f"No ratio to {peer}: " + ("; ".join(skipped) if skipped else
                                                     "it was not among --baselines") + "."]
    lines += _pareto_markdown(results.get("pareto", []))
    llama = next((row for row in systems.values() if "build" in row), None)
    if llama:
        lines += ["", f"llama.cpp: flash attention on, n_batch {llama['n_batch']}; its build: "
                      f"`{llama['build']}`"]
    return lines + _ort_genai_line(systems) + _openvino_line(systems)


def _pareto_markdown(entries: list[dict]) -> list[str]:
    """The Pareto line (`baselines.pareto_ratios`): for each peer's best, our fastest system
    with a perplexity no higher than its, and the ratio."""
    if not entries:
        return []
    lines = ["", "Pareto line: each peer's best against the fastest of our systems whose "
             "perplexity is no higher than its (speed at equal or better quality).", "",
             "| peer's best (perplexity) | speed | ours (perplexity) | median | 95% CI | "
             "by round |", "|---|---|---|---|---|---|"]
    for e in entries:
        peer = f"{e['denominator']} ({e['denominator_perplexity']:.2f})"
        if e["numerator"] is None:
            lines.append(f"| {peer} | {e['speed']} | none: our lowest is "
                         f"{e['lowest']} ({e['lowest_perplexity']:.2f}) | - | - | - |")
        else:
            lines.append(f"| {peer} | {e['speed']} | {e['numerator']} "
                         f"({e['numerator_perplexity']:.2f}) | {e['median']:.2f}x | "
                         f"{_interval(e)} | " + " ".join(f"{x:.2f}" for x in e["rounds"])
                         + " |")
    return lines


def _peers_in(ratios: list[dict]) -> list[str]:
    """The peers the ratios are taken to ("specedge best / <peer> best", ...), in PEERS'
    order."""
    taken = {r["ratio"].split(" / ", 1)[1].rsplit(" ", 1)[0] for r in ratios}
    return [peer for peer in PEERS if peer in taken]


def _ort_genai_line(systems: dict) -> list[str]:
    """What onnxruntime-genai ran, when it ran: its version, how each model was built and
    its n-gram settings."""
    rows = [row for row in systems.values() if "builder_options" in row]
    if not rows:
        return []
    builds = {row["variant"]: row["builder_options"] for row in rows}
    ngram = next((row["speculative"] for row in rows if "speculative" in row), {})
    return ["", f"onnxruntime-genai {rows[0]['version']}: int4 CPU models from its model "
            "builder (`-p int4 -e cpu`), " + ", ".join(
                f"{variant}: `--extra_options {' '.join(options)}`" if options
                else f"{variant}: its defaults" for variant, options in builds.items())
            + "; n-gram: " + " ".join(f"`{k}={v}`" for k, v in ngram.items()) + "."]


def _openvino_line(systems: dict) -> list[str]:
    """What OpenVINO GenAI ran, when it ran: its version, its model and its prompt lookup."""
    rows = [row for row in systems.values() if "weights" in row]
    if not rows:
        return []
    lookup = next((row["lookup"] for row in rows if "lookup" in row), {})
    return ["", f"openvino-genai {rows[0]['version']}: its model from `optimum-cli export "
            f"openvino` ({rows[0]['weights']}); prompt lookup: "
            + " ".join(f"`{k}={v}`" for k, v in lookup.items()) + "."]


def plots(results: dict, out: Path) -> list[Path]:
    """The PNG plots this run has data for (none in a --quick run)."""
    configs = results["configurations"]
    fixed = [(int(n.split("K=")[1]), r) for n, r in configs.items()
             if n.startswith("greedy/draft K=")]
    if not fixed and "systems" not in results:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if fixed:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ks = [k for k, _ in fixed]
        ax.plot(ks, [r["speedup"] or 0.0 for _, r in fixed], "o-", label="measured")
        ax.plot(ks, [r["ideal_speedup"] for _, r in fixed], "s--", label="ideal")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="K (draft tokens)", ylabel="speedup over plain", title="greedy")
        ax.legend()
        written.append(_save(fig, out / "speedup_vs_k.png"))
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for k, r in fixed:
            pos = r["acceptance_per_position"]
            ax.plot(range(1, len(pos) + 1), pos, "o-", label=f"K={k}")
        ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1),
               title="acceptance per position (greedy)")
        ax.legend()
        written.append(_save(fig, out / "acceptance_per_position.png"))
    if "systems" not in results:
        return written
    systems = {n: r for n, r in results["systems"].items() if "skipped" not in r}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    at = np.arange(len(systems))
    ax.barh(at - 0.2, [r["tokens_per_second"] or 0.0 for r in systems.values()], 0.4,
            label="end to end")
    ax.barh(at + 0.2, [r["decode_tokens_per_second"] or 0.0 for r in systems.values()], 0.4,
            label="decode")
    ax.set_yticks(at, list(systems))
    ax.invert_yaxis()
    ax.set(xlabel="tokens / s (greedy, median over rounds)", title="systems, same prompts")
    ax.legend()
    written.append(_save(fig, out / "systems.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    (out / "bench.md").write_text(markdown(results))
    return [out / "bench.json", out / "bench.md", *plots(results, out)]
