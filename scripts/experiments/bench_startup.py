"""From process start to the first token: `specedge generate` and `specedge serve` on a
bundle, split into Python's start and specedge's imports, opening the graphs (ONNX Runtime
session creation) and the first token (prefill), each process new, rounds interleaved.
Prints a table and writes JSON.

    python scripts/experiments/bench_startup.py --bundle B [--rounds 5] [--threads N]
        [--out bench_results/startup.json]

`generate`: a child process that stamps the time after its imports, after
`Generator.from_bundle` and after the first token of a one-token generation, against the
parent's time just before it started it (`specedge generate`'s own work, without its
argument parsing). `serve`: `specedge serve` started, `/health` polled until it answers
200, then one chat request of one token; the time to its answer from the process start.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specedge.runtime.atomic_files import atomic_write

CHILD = r"""
import json, sys, time
import specedge.runtime
from specedge.runtime import Generator
imported = time.time()
gen = Generator.from_bundle(sys.argv[1], threads=int(sys.argv[2]) or None)
opened = time.time()
gen.generate("Hello", max_new_tokens=1, use_draft=False)
print(json.dumps({"imported": imported, "opened": opened, "first_token": time.time()}))
"""


def generate_once(bundle: Path, threads: int) -> dict[str, float]:
    start = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, str(bundle), str(threads)],
                         capture_output=True, text=True, check=True)
    stamps = json.loads(out.stdout.strip().splitlines()[-1])
    return {"import_s": stamps["imported"] - start,
            "open_s": stamps["opened"] - stamps["imported"],
            "first_token_s": stamps["first_token"] - stamps["opened"],
            "total_s": stamps["first_token"] - start}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(bundle: Path, threads: int) -> dict[str, float]:
    import httpx

    port = _free_port()
    start = time.time()
    args = [sys.executable, "-m", "specedge.cli", "serve", "--bundle", str(bundle), "--port",
            str(port), "--log-level", "warning"] + (["--threads", str(threads)] if threads
                                                    else [])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"specedge serve exited: {proc.stderr.read().decode()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        ready = time.time()
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
            "temperature": 0})
        r.raise_for_status()
        answered = time.time()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"ready_s": ready - start, "first_answer_s": answered - ready,
            "total_s": answered - start}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: one per core")
    ap.add_argument("--out", type=Path, default=Path("bench_results/startup.json"))
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"generate": [], "serve": []}
    for r in range(args.rounds):
        order = ("generate", "serve") if r % 2 == 0 else ("serve", "generate")
        for what in order:
            once = generate_once if what == "generate" else serve_once
            runs[what].append(once(args.bundle, args.threads))
            print(f"round {r + 1}/{args.rounds} {what}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in runs[what][-1].items()), flush=True)
    report = {"bundle": str(args.bundle), "rounds": args.rounds, "threads": args.threads,
              "cpu_count": os.cpu_count(), "runs": runs, "median": {}}
    print("\n| command | part | median s | min s | max s |\n|---|---|---|---|---|")
    for what, rows in runs.items():
        report["median"][what] = {}
        for part in rows[0]:
            values = [row[part] for row in rows]
            report["median"][what][part] = statistics.median(values)
            print(f"| {what} | {part} | {statistics.median(values):.2f} | {min(values):.2f} | "
                  f"{max(values):.2f} |")
    atomic_write(args.out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
