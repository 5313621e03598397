"""`specedge bench --bundle DIR`: run every configuration on the prompt set (the shipped one
or the user's --prompts file), compare with the other systems, write bench.json, bench.md
and PNG plots. `--quick`: plain decoding against the runtime's defaults only."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specedge.bench import baselines, openvino_genai, ort_genai, report
from specedge.bench.configs import (
    NO_DRAFT_QUICK,
    aggregate,
    configurations,
    geometric_mean,
    per_prompt_speedups,
    quick_configurations,
    run_ours,
)
from specedge.bench.perplexity import model_perplexity
from specedge.cli_common import (
    add_backend_flag,
    add_bundle_flag,
    add_max_new_tokens_flag,
    add_spinning_flag,
    add_threads_flag,
    bad_input_exits_2,
)
from specedge.prompts import load_prompts, prompt_input, read_prompt_file
from specedge.runtime import Generator
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.config import GenerationConfig

# The other systems `--baselines` chooses from (bench/baselines.py, bench/ort_genai.py).
BASELINES = ("transformers", "llama.cpp", "onnxruntime-genai", "openvino-genai")


def _positive(text: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bundle_flag(p, help=None, value_type=Path)
    add_max_new_tokens_flag(p)
    p.add_argument("--prompts", type=Path, metavar="FILE.jsonl",
                   help='your own prompts, one JSON object a line: {"category": ..., '
                        '"prompt": ...} or {"category": ..., "messages": [...]} (default: '
                        "the shipped prompt set)")
    p.add_argument("--quick", action="store_true",
                   help="time two configurations only, plain decoding and the runtime's "
                        "defaults, each prompt once, without the other systems; its time "
                        "grows with the prompts (--limit N takes the first N)")
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="fixed K values to try, the first also when sampling (default 1 2 3 4)")
    p.add_argument("--systems-prompts", type=int, default=8,
                   help="prompts for the other systems, which are slow (default 8)")
    p.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(BASELINES),
                   metavar="SYSTEM",
                   help="the other systems to compare with: transformers, llama.cpp, "
                        "onnxruntime-genai, openvino-genai (default all four; --baselines "
                        "alone: none)")
    p.add_argument("--rounds", type=_positive, default=3,
                   help="times the system comparison runs its prompts, each round giving "
                        "one ratio for the confidence interval (default 3)")
    p.add_argument("--also", type=Path, nargs="+", default=[], metavar="BUNDLE",
                   help="other exports of the same model (another precision or int4 grid) "
                        "timed in the system comparison too, plain and with the defaults, "
                        "each with its perplexity: the Pareto line picks, for each peer, our "
                        "fastest system at a perplexity no higher than the peer's")
    add_threads_flag(p, help=None)
    add_spinning_flag(p)
    add_backend_flag(p, help="runtime backend of our configurations (default ort-cpu)")
    p.add_argument("--out", type=Path, default=Path("bench_results"),
                   help="folder for bench.json, bench.md and the plots (default bench_results)")
    p.add_argument("--store-auto-k", action="store_true",
                   help="also store what auto K measured over the runs in the bundle's "
                        "auto_k.json, replacing what the export measured, so that the next "
                        "Generator on it starts from these figures (default: the bundle is "
                        "left as it is; a run of a few prompts is a noisy measurement)")


def _gguf(bundle: Path) -> Path | None:
    source = json.loads((bundle / "manifest.json").read_text())["source"]["model"]
    if source.endswith(".gguf"):
        return Path(source)
    if source == "smollm2-135m":
        from specedge.export.sources import fetch_smollm2_gguf

        return fetch_smollm2_gguf()
    return None


def _ours(gen: Generator, kwargs: dict, max_new_tokens: int, quality: float) -> dict:
    """One of our configurations as a system for `baselines.time_systems`: its decode time
    is the runtime's own (total minus prefill, as in the configuration tables)."""
    def generate(ids: list[int]) -> baselines.Generation:
        stats = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, **kwargs).stats
        return baselines.Generation(stats["tokens_generated"],
                                    stats["time_total_s"] - stats["time_prefill_s"])
    return {"generate": generate, "perplexity": quality}


def _prompts(args: argparse.Namespace) -> list[dict]:
    """--prompts FILE, else the shipped set; the first --limit of them."""
    prompts = read_prompt_file(args.prompts) if args.prompts else load_prompts()
    return prompts[:args.limit] if args.limit else prompts


def _prompt_ids(gen: Generator, prompts: list[dict], configs: list[tuple[str, dict]],
                max_new_tokens: int, source: str) -> list[list[int]]:
    """Every prompt's token ids, as the generator encodes them, checked before anything is
    timed: ValueError names the prompt (its file and line) that the bundle cannot run."""
    limit = min(gen.context_limit(GenerationConfig.of(max_new_tokens=max_new_tokens, **kwargs))
                for _, kwargs in configs)
    all_ids = []
    for i, p in enumerate(prompts):
        where = f"{source} line {p['line']}" if "line" in p else f"{source} prompt {i + 1}"
        if "messages" in p and not gen.codec.has_chat_template:
            raise ValueError(f"{where}: this bundle has no chat template, so it cannot run a "
                             "'messages' prompt: write the text as one 'prompt' string")
        try:
            ids = gen.encode_prompt(**prompt_input(p))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"{where}: the prompt's {len(ids)} tokens plus --max-new-tokens "
                             f"{max_new_tokens} exceed the bundle's context of {limit} tokens: "
                             "shorten the prompt or lower --max-new-tokens")
        all_ids.append(ids)
    return all_ids


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _table(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration, its aggregate row with speedups over plain decoding of its mode
    (ratio of sums, and the geometric mean of per-prompt speedups) and tok/s by category."""
    table = {}
    for name, stats in runs.items():
        row = aggregate(stats)
        plain_name = name.split("/")[0] + "/plain"
        plain = table[plain_name] if name != plain_name else row
        row["speedup"] = _ratio(row["tokens_per_second"], plain["tokens_per_second"])
        per_prompt = per_prompt_speedups(stats, runs[plain_name])
        row["speedup_geomean"] = geometric_mean(per_prompt)
        row["speedup_per_prompt"] = per_prompt
        row["measured_over_ideal"] = (None if row["speedup"] is None
                                      else row["speedup"] / row["ideal_speedup"])
        row["by_category"] = {cat: aggregate([s for s in stats if s["category"] == cat])
                              ["tokens_per_second"] for cat in sorted({s["category"]
                                                                       for s in stats})}
        table[name] = row
    return table


def _systems(args: argparse.Namespace, gen: Generator, runs: dict[str, list[dict]],
             configs: list[tuple[str, dict]], prompt_ids: list[list[int]]) -> dict:
    """The system comparison: our plain and fastest greedy configuration (and the --also
    exports) against the baselines chosen by --baselines on the first --systems-prompts
    prompts, --rounds times, end to end and decode, with perplexities, the ratios to the
    peers (baselines.PEERS) and the Pareto line."""
    n = min(args.systems_prompts, len(prompt_ids))
    end_to_end = {name: sum(s["tokens_generated"] for s in stats[:n]) /
                  sum(s["time_total_s"] for s in stats[:n]) for name, stats in runs.items()
                  if name.startswith("greedy/")}
    best = max(end_to_end, key=end_to_end.get)  # the fastest exact configuration
    # The shipped set's passages, whatever --prompts: the same text for every system.
    text_ids = baselines.quality_text_ids(gen.codec, load_prompts())[:gen.bundle.target.max_context]
    ours = _graph_perplexity(args, gen, text_ids)
    kwargs = dict(configs)
    systems = {"specedge plain": _ours(gen, kwargs["greedy/plain"], args.max_new_tokens, ours),
               "specedge best": {**_ours(gen, kwargs[best], args.max_new_tokens, ours),
                                 "configuration": best}}
    for bundle in args.also:
        systems.update(_other_export(args, bundle, text_ids))
    if "transformers" in args.baselines:
        systems.update(baselines.transformers_systems(args.bundle, args.max_new_tokens,
                                                      text_ids))
    if "llama.cpp" in args.baselines:
        systems.update(baselines.llama_cpp_systems(_gguf(args.bundle), args.max_new_tokens,
                                                   args.threads or os.cpu_count() or 1,
                                                   text_ids))
    if "onnxruntime-genai" in args.baselines:
        systems.update(ort_genai.ort_genai_systems(args.bundle, args.max_new_tokens,
                                                   args.threads, text_ids))
    if "openvino-genai" in args.baselines:
        systems.update(openvino_genai.openvino_systems(args.bundle, args.max_new_tokens,
                                                       args.threads, text_ids))
    # Every system gets the ids our configurations decoded from (a `messages` prompt
    # through the bundle's chat template), so all of them see the same prompts.
    systems = baselines.time_systems(systems, prompt_ids[:n], rounds=args.rounds,
                                     progress=True)
    return {"systems_prompts": n, "systems_rounds": args.rounds,
            "quality_tokens": len(text_ids), "systems": systems,
            "system_ratios": baselines.system_ratios(systems),
            "pareto": baselines.pareto_ratios(systems)}


def _graph_perplexity(args: argparse.Namespace, gen: Generator, text_ids: list[int]) -> float:
    """The target graph's perplexity on `text_ids`, on ONNX Runtime CPU whatever the bench's
    backend: a property of the graph."""
    return model_perplexity(OrtCpuBackend(gen.bundle.target, args.threads,
                                          spinning=args.thread_spinning), text_ids)


def _other_export(args: argparse.Namespace, bundle: Path, text_ids: list[int]) -> dict:
    """An --also bundle as two systems, "specedge NAME plain" and "specedge NAME default"
    (NAME its folder's name), with its graph's perplexity on `text_ids`."""
    gen = Generator.from_bundle(bundle, backend=args.backend, threads=args.threads,
                                spinning=args.thread_spinning)
    quality = _graph_perplexity(args, gen, text_ids)
    gen.generate(prompt_ids=text_ids[:8], max_new_tokens=4)  # warm up, as our configurations
    return {f"specedge {bundle.name} plain": _ours(gen, {"use_draft": False},
                                                   args.max_new_tokens, quality),
            f"specedge {bundle.name} default": _ours(gen, {}, args.max_new_tokens, quality)}


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    prompts = _prompts(args)  # a bad prompt file fails before the bundle loads
    if args.also and args.quick:
        raise ValueError("--also times other exports in the system comparison, which --quick "
                         "leaves out: drop one of them")
    for bundle in args.also:  # before anything is timed
        if not (bundle / "manifest.json").is_file():
            raise ValueError(f"--also {bundle}: no bundle there (no manifest.json); give "
                             "folders made by `specedge export`")
    gen = Generator.from_bundle(args.bundle, backend=args.backend, threads=args.threads,
                                spinning=args.thread_spinning)
    source = str(args.prompts) if args.prompts else "the shipped prompt set"
    has_draft = gen.draft is not None
    if args.quick and not has_draft:
        print(f"specedge bench: {NO_DRAFT_QUICK}", file=sys.stderr)
    configs = (quick_configurations(has_draft) if args.quick
               else configurations(args.ks, has_draft))
    prompt_ids = _prompt_ids(gen, prompts, configs, args.max_new_tokens, source)
    for _, kwargs in configs:  # warm up every code path once
        gen.generate(**prompt_input(prompts[0]), max_new_tokens=min(8, args.max_new_tokens),
                     **kwargs)
    bar = tqdm(total=len(prompts) * len(configs), desc="bench", unit="run", file=sys.stderr)
    runs = run_ours(gen, prompts, configs, args.max_new_tokens, bar)
    bar.close()

    categories = {}
    for p in prompts:
        categories[p["category"]] = categories.get(p["category"], 0) + 1
    results = {"bundle": str(args.bundle), "backend": args.backend,
               "precision": gen.bundle.manifest.get("precision"),
               "prompt_file": str(args.prompts) if args.prompts else None,
               "quick": args.quick, "prompts": len(prompts),
               "categories": dict(sorted(categories.items())),
               "max_new_tokens": args.max_new_tokens, "configurations": _table(runs)}
    if not args.quick:
        results.update(_systems(args, gen, runs, configs, prompt_ids))
    results["auto_k"] = _store_measurements(gen) if args.store_auto_k else None
    return results


def _store_measurements(gen: Generator) -> str | None:
    """Store what auto K measured over the runs in the bundle (auto_k.json), where the next
    Generator on it starts from them; a bundle that cannot be written only loses that."""
    try:
        path = gen.save_measurements("specedge bench")
    except OSError as e:
        print(f"specedge bench: auto K's measurements were not stored in the bundle ({e})",
              file=sys.stderr)
        return None
    print(f"stored auto K's measurements in {path}", file=sys.stderr)
    return str(path)


def main(args: argparse.Namespace) -> None:
    """`specedge bench`: run, write the report, print its markdown; a bad bundle, prompt file
    or setting ends it with one line on stderr and status 2."""
    with bad_input_exits_2():
        results = run(args)
        for path in report.write(results, args.out):
            print(f"wrote {path}", file=sys.stderr)
        print(report.markdown(results))
