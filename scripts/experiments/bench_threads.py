"""ONNX Runtime's thread settings on a quiet and on a loaded CPU: intra-op threads and
whether they spin while they wait for work, against the runtime's default, in one run.

    python scripts/experiments/bench_threads.py [--bundle DIR] [--rounds 8] [--prompts 3]
        [--max-new-tokens 96] [--threads 1 all] [--loads quiet busy] [--busy-cores 1]
        [--out bench_results/threads.json]

Each configuration is a `Generator` opened with `threads` (an integer, or "all": ONNX
Runtime's one thread per core) and `spinning` on or off, plus "all, auto": the default,
which spins while other processes leave the cores idle and reopens its sessions when that
changes (runtime/cpu_load.py; its reopening counts in its time), and "all, spin, no stop": spinning
threads that also keep spinning between runs, ONNX Runtime's own default without the
runtime's `session.force_spinning_stop` (ort_cpu.py `spinning_entries`). The baseline
is "all, spin": ONNX Runtime's thread count, spinning within a run. Each configuration decodes
the first prompt of each category of the shipped prompt set, greedy, twice: plain
(`use_draft=False`) and with the default drafting (lookup+model, auto K).

Loads: "quiet" runs nothing else; "busy" starts `--busy-cores` processes that each spin in
a Python loop (`while True: pass`), unpinned, for the whole block. A steady busy loop is a
competitor whose demand does not depend on the settings being measured: a background
service or a sensor loop that keeps a core busy. A second specedge generation as the
competitor would load the cores in bursts shaped by its own thread settings, which mixes two
effects into one figure.

Everything is interleaved: each round runs both loads (their order alternating), and in each
load every prompt on every configuration (their order rotating), plain then default. A
configuration's figure in a round is the seconds per new token over the round's prompts,
and its ratio is the baseline's seconds per token over its own, in that round and load
(above 1: faster than the baseline). The report gives each ratio's median over rounds and
the 95% interval of bench/intervals.py (`ratio_ci`), and whether every configuration
emitted the same greedy tokens.

Time: rounds x loads x (configurations x prompts x 2) generations of `--max-new-tokens`,
plus one warm-up each: about 26 minutes with the defaults on a quiet 2-core AMD EPYC, 36
on a loaded one (6 configurations, 2 loads, 8 rounds, 3 prompts, 96 tokens).
Prints a table and writes bench_results/threads.json (settings, machine, commit, every
round's seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from specedge.bench.intervals import ratio_ci
from specedge.prompts import load_prompts
from specedge.runtime import Generator
from specedge.runtime.backends import ort_cpu

BUNDLE = Path.home() / ".cache/specedge/bundles/smollm2-feature-int4"
MODES = {"plain": {"use_draft": False}, "default": {}}
BASELINE = "all, spin"
NO_STOP = "all, spin, no stop"
AUTO = "all, auto"


@dataclass
class Configuration:
    name: str
    threads: int | None
    spinning: bool | str
    stop_between_runs: bool = True

    def open(self, bundle: Path) -> Generator:
        if self.stop_between_runs:
            return Generator.from_bundle(bundle, threads=self.threads, spinning=self.spinning)
        # ONNX Runtime's own default: the pools also spin between runs.
        with mock.patch.object(ort_cpu, "spinning_entries",
                               lambda spinning: {"session.intra_op.allow_spinning": "1"}):
            return Generator.from_bundle(bundle, threads=self.threads, spinning=True)


def configurations(threads: list[str]) -> list[Configuration]:
    """The baseline first, then each thread count with spinning on and off, then all cores
    with spinning "auto", then the baseline without the stop between runs."""
    out = [Configuration(BASELINE, None, True)]
    for t in threads:
        count = None if t == "all" else int(t)
        for spinning in (True, False):
            name = f"{t}, {'spin' if spinning else 'no spin'}"
            if name != BASELINE:
                out.append(Configuration(name, count, spinning))
    return out + [Configuration(AUTO, None, "auto"),
                  Configuration(NO_STOP, None, True, stop_between_runs=False)]


@contextlib.contextmanager
def load(kind: str, cores: int) -> Iterator[None]:
    """Nothing for "quiet"; for "busy", `cores` processes spinning in a Python loop."""
    procs = ([subprocess.Popen([sys.executable, "-c", "while True: pass"])
              for _ in range(cores)] if kind == "busy" else [])
    try:
        time.sleep(0.5 if procs else 0)  # let them reach the cores
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def one_prompt_per_category(n: int) -> list[str]:
    seen: dict[str, str] = {}
    for p in load_prompts():
        seen.setdefault(p["category"], p["prompt"])
    return list(seen.values())[:n]


def machine() -> dict:
    """CPU model, cores and flags as `lscpu` reports them."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = {k.strip(): v.strip() for k, _, v in
                  (line.partition(":") for line in text.splitlines())}
    return {"cpu": fields.get("Model name", platform.processor()),
            "cpus": fields.get("CPU(s)"), "flags": fields.get("Flags", "").split(),
            "system": platform.platform()}


def commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                          capture_output=True, text=True)
    return done.stdout.strip() or None


def main() -> None:
    paragraphs = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=paragraphs[0],
                                 epilog=next(p for p in paragraphs if p.startswith("Time:")),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=BUNDLE)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=3, help="one per category, in file order")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", nargs="+", default=["1", "all"],
                    help="thread counts (integers or 'all'), each with spinning on and off")
    ap.add_argument("--loads", nargs="+", choices=["quiet", "busy"], default=["quiet", "busy"])
    ap.add_argument("--busy-cores", type=int, default=1,
                    help="busy-loop processes of the busy load")
    ap.add_argument("--out", type=Path, default=Path("bench_results/threads.json"))
    args = ap.parse_args()

    configs = configurations(args.threads)
    prompts = one_prompt_per_category(args.prompts)
    gens = {c.name: c.open(args.bundle) for c in configs}
    settings = dict(raw=False, max_new_tokens=args.max_new_tokens)
    for gen in gens.values():  # warm-up: first-run allocations, auto K's first steps
        for mode in MODES.values():
            gen.generate(prompts[0], **settings, **mode)

    # seconds[load][mode][config] = per round, (seconds, new tokens)
    seconds = {ld: {m: {c.name: [] for c in configs} for m in MODES} for ld in args.loads}
    tokens: dict[tuple, dict[str, list[int]]] = {}
    started = time.perf_counter()
    for r in range(args.rounds):
        loads = args.loads if r % 2 == 0 else args.loads[::-1]
        for kind in loads:
            spent = {m: {c.name: [0.0, 0] for c in configs} for m in MODES}
            with load(kind, args.busy_cores):
                for i, prompt in enumerate(prompts):
                    shift = (r + i) % len(configs)
                    for c in configs[shift:] + configs[:shift]:
                        for mode, extra in MODES.items():
                            t0 = time.perf_counter()
                            result = gens[c.name].generate(prompt, **settings, **extra)
                            spent[mode][c.name][0] += time.perf_counter() - t0
                            spent[mode][c.name][1] += len(result.token_ids)
                            tokens.setdefault((kind, mode, i), {})[c.name] = result.token_ids
            for mode in MODES:
                for name, (s, n) in spent[mode].items():
                    seconds[kind][mode][name].append((s, n))
        if r == 0:
            print(f"round 1 took {time.perf_counter() - started:.0f} s; about "
                  f"{(time.perf_counter() - started) * (args.rounds - 1) / 60:.0f} min to go",
                  file=sys.stderr)

    rows = []
    print(f"| load | mode | configuration | tok/s (median) | speed / '{BASELINE}' "
          "(median [95% CI]) |")
    print("|---|---|---|---|---|")
    for kind in args.loads:
        for mode in MODES:
            base = [s / n for s, n in seconds[kind][mode][BASELINE]]
            for c in configs:
                per_token = [s / n for s, n in seconds[kind][mode][c.name]]
                ci = ratio_ci([b / x for b, x in zip(base, per_token)])
                tps = statistics.median(1 / x for x in per_token)
                rows.append({"load": kind, "mode": mode, "configuration": c.name,
                             "threads": c.threads, "spinning": c.spinning,
                             "stop_between_runs": c.stop_between_runs,
                             "tokens_per_second_median": tps, "ratio": ci,
                             "rounds": seconds[kind][mode][c.name]})
                band = ("" if ci["ci95"] is None
                        else f" [{ci['ci95'][0]:.2f}, {ci['ci95'][1]:.2f}]")
                print(f"| {kind} | {mode} | {c.name} | {tps:.1f} | "
                      f"{ci['median']:.2f}x{band} |")
    same = all(len({tuple(t) for t in by.values()}) == 1 for by in tokens.values())
    print(f"same greedy tokens in every configuration: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(), "machine": machine(), "command": sys.argv,
        "bundle": str(args.bundle), "rounds": args.rounds, "prompts": prompts,
        "max_new_tokens": args.max_new_tokens, "busy_cores": args.busy_cores,
        "baseline": BASELINE, "same_tokens": same, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
