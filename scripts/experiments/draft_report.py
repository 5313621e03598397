"""What a feature draft is worth, as users will see it, on prompt sets it never saw: per
prompt set, the teacher-forced agreement at each drafting step (draft_agreement.py, no timing
noise) and, from `specedge bench` on a bundle with the draft, the acceptance per position,
tokens per target call, the draft's cost c and the speed over plain decoding at each fixed K
and at auto K.

    python scripts/experiments/draft_report.py --draft drafts/smollm2-135m-feature \\
        [--bundle B] [--model smollm2-135m] [--precision int4] [--max-new-tokens 96] \\
        [--steps 3] [--ks 1 2 3] [--limit N] [--out draft_report]

Without --bundle it exports one (`specedge export MODEL --draft DRAFT --precision P`) into
OUT/bundle, once. The prompt sets: the bench's (specedge/prompts.jsonl) and
docs/examples/prompts.jsonl, both kept out of every corpus (export/distill/grow.py). Prints a
markdown table and writes OUT/report.json. Needs the export extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# The command line of this interpreter's specedge, whether or not its venv is on PATH.
SPECEDGE = [sys.executable, "-m", "specedge.cli"]

REPO = Path(__file__).resolve().parents[2]
PROMPT_SETS = {"bench": None, "examples": REPO / "docs" / "examples" / "prompts.jsonl"}


def bench_rows(bench: dict) -> dict[str, dict]:
    """The greedy configurations of a bench.json: name -> the figures a draft is judged by."""
    keys = ("acceptance_rate", "acceptance_per_position", "tokens_per_target_call",
            "draft_cost_ratio_c", "mean_draft_tokens", "speedup", "speedup_geomean")
    return {name.split("/", 1)[1]: {k: row.get(k) for k in keys}
            for name, row in bench["configurations"].items()
            if name.startswith("greedy/") and name != "greedy/plain"}


def markdown(report: dict) -> str:
    lines = ["| prompts | agreement by step (teacher-forced) | configuration | acceptance "
             "per position | tokens / target call | c | speed / plain |",
             "|---|---|---|---|---|---|---|"]
    for name, part in report["sets"].items():
        agreement = " ".join(f"{a:.2f}" for a in part["step_agreement"])
        for config, row in part["runtime"].items():
            per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"] or [])
            lines.append(f"| {name} ({part['prompts']}) | {agreement} | {config} | {per_pos} | "
                         f"{row['tokens_per_target_call']:.2f} | "
                         f"{row['draft_cost_ratio_c'] or 0:.3f} | {row['speedup']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, required=True, help="a feature draft folder")
    ap.add_argument("--bundle", type=Path, default=None,
                    help="a bundle with this draft (default: exported into OUT/bundle)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts a set")
    ap.add_argument("--out", type=Path, default=Path("draft_report"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import draft_agreement

    from specedge.export.distill.draft_folder import load_draft

    args.out.mkdir(parents=True, exist_ok=True)
    bundle = args.bundle or args.out / "bundle"
    if args.bundle is None:
        subprocess.run([*SPECEDGE, "export", args.model, "--draft", str(args.draft),
                        "--precision", args.precision, "--out", str(bundle)], check=True,
                       stdout=subprocess.DEVNULL)
    report = {"draft": str(args.draft), "bundle": str(bundle), "model": args.model,
              "max_new_tokens": args.max_new_tokens, "sets": {}}
    for name, prompts in PROMPT_SETS.items():
        target, tok, runs = draft_agreement.target_answers(args.model, args.limit,
                                                           args.max_new_tokens, prompts)
        draft = load_draft(args.draft, target, tok)
        draft_agreement.agreement(draft, runs, target)  # adds the earlier layers' outputs
        steps = draft_agreement.step_agreement(draft, runs, args.steps)
        out = args.out / name
        command = [*SPECEDGE, "bench", "--bundle", str(bundle), "--baselines", "--ks",
                   *map(str, args.ks), "--max-new-tokens", str(args.max_new_tokens),
                   "--out", str(out)]
        if prompts:
            command += ["--prompts", str(prompts)]
        if args.limit:
            command += ["--limit", str(args.limit)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        bench = json.loads((out / "bench.json").read_text())
        report["sets"][name] = {"prompts": bench["prompts"], "step_agreement": steps,
                                "runtime": bench_rows(bench)}
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(markdown(report))


if __name__ == "__main__":
    main()
