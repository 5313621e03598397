"""The benchmark's outputs: JSON, a markdown table, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [("tok/s", "tokens_per_second", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
           ("ideal", "ideal_speedup", "{:.2f}x"), ("meas/ideal", "measured_over_ideal", "{:.2f}"),
           ("accept", "acceptance_rate", "{:.2f}"), ("tok/call", "tokens_per_target_call",
                                                     "{:.2f}"),
           ("K mean", "mean_draft_tokens", "{:.1f}"), ("c", "draft_cost_ratio_c", "{:.3f}"),
           ("outside", "outside_model_share", "{:.1%}")]


def markdown(results: dict) -> str:
    lines = [f"# specedge bench: {results['bundle']}", "",
             f"{results['prompts']} prompts x {results['max_new_tokens']} new tokens; "
             f"precision {results['precision']}; speedup = tok/s / plain tok/s of the same "
             "mode, measured in the same run.", "",
             "| configuration | " + " | ".join(c[0] for c in COLUMNS) + " | per-position |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for name, row in results["configurations"].items():
        cells = [fmt.format(row[key]) for _, key, fmt in COLUMNS]
        per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"]) or "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {per_pos} |")
    configs = results["configurations"]
    cats = sorted({cat for row in configs.values() for cat in row["by_category"]})
    lines += ["", "## Speedup by prompt category (tok/s over plain, same mode and category)",
              "", "| configuration | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name, row in configs.items():
        plain = configs[name.split("/")[0] + "/plain"]["by_category"]
        lines.append(f"| {name} | " + " | ".join(
            f"{row['by_category'][c] / plain[c]:.2f}x" if c in row["by_category"] else "-"
            for c in cats) + " |")
    best = results["systems"]["specedge best"]["configuration"]
    lines += ["", f"## Systems (greedy, first {results['systems_prompts']} prompts)", "",
              f"End to end, prompt evaluation included; the systems take turns prompt by "
              f"prompt. specedge best: {best}, the fastest greedy configuration above on "
              f"these prompts.", "",
              f"Perplexity: each system's own weights on the prompt set's passages "
              f"({results['quality_tokens']} tokens, the same ids for all).", "",
              "| system | tok/s | ours / system | perplexity |", "|---|---|---|---|"]
    ours = results["systems"]["specedge best"]["tokens_per_second"]
    for name, row in results["systems"].items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | |")
        else:
            lines.append(f"| {name} | {row['tokens_per_second']:.1f} | "
                         f"{ours / row['tokens_per_second']:.2f}x | {row['perplexity']:.2f} |")
    return "\n".join(lines) + "\n"


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    configs = results["configurations"]
    fixed = [(int(n.split("K=")[1]), r) for n, r in configs.items()
             if n.startswith("greedy/draft K=")]
    if fixed:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ks = [k for k, _ in fixed]
        ax.plot(ks, [r["speedup"] for _, r in fixed], "o-", label="measured")
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
    systems = {n: r for n, r in results["systems"].items() if "skipped" not in r}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh(list(systems), [r["tokens_per_second"] for r in systems.values()])
    ax.set(xlabel="tokens / s (greedy decode)", title="systems, same prompts")
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
