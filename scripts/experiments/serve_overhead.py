"""Where batched serving's throughput goes between the runtime and the HTTP client: the same
prompts, `--concurrency` at a time, decoded by a `BatchSession` in this process and by
`specedge serve --max-batch N` answering whole and streamed, side by side in rounds taken
in turns. Also the server with a shorter GIL switch interval (`--switch-intervals`): a
server runs its event loop and the sequences' threads in one interpreter, and a thread that
returns from ONNX Runtime waits for the interpreter lock while another runs Python (up to
the switch interval, 5 ms by default, against a 15-20 ms batched step).

For each system: completion tokens a second over the round's wall time, and the CPU seconds
the server process and this process (the clients, or the in-process decode) took, from
/proc. Prints a table (medians over rounds, ratios to in-process with 95% confidence
intervals of the round-by-round log ratios) and writes JSON. Then, with `--calls`, where
the in-process session's time goes: one more run with a timer around each model call,
summed by model and by kind (a prompt chunk alone on its row, or a call of R rows of T
tokens).

    python scripts/experiments/serve_overhead.py --bundle B [--max-batch 4] [--concurrency 4]
        [--prompts 8] [--tokens 64] [--rounds 5] [--threads 2]
        [--switch-intervals 0.0005] [--calls] [--out bench_results/serve_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_serve import ServerProcess, free_port

from specedge.bench.intervals import ratio_ci
from specedge.prompts import load_prompts
from specedge.runtime import Generator
from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.batch import BatchSession
from specedge.runtime.config import GenerationConfig

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def start_server(bundle: Path, threads: int, max_batch: int, switch: float | None,
                 logs: Path) -> ServerProcess:
    """`specedge serve --max-batch N`, with the interpreter's switch interval set first."""
    port = free_port()
    setup = f"sys.setswitchinterval({switch}); " if switch else ""
    code = f"import sys; {setup}from specedge.cli import main; main(sys.argv[1:])"
    return ServerProcess(
        f"specedge serve (switch {switch})", [
            sys.executable, "-c", code, "serve", "--bundle", str(bundle), "--port", str(port),
            "--threads", str(threads), "--max-batch", str(max_batch), "--max-queue", "256",
            "--model-name", "bench", "--log-level", "warning"],
        port, "/health", logs / f"serve-{port}.log")


def ask(client: httpx.Client, url: str, prompt: str, tokens: int, stream: bool) -> int:
    """One greedy chat answer; its completion tokens (the server's usage)."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = client.post(url, json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    used = 0
    with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    used = event["usage"]["completion_tokens"]
    return used


def threaded(prompts: list[str], concurrency: int, answer) -> int:
    """`answer(prompt)` for every prompt from `concurrency` threads, each taking the next
    prompt when its answer ends; the tokens summed."""
    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(answer, prompts))


def http_round(server: ServerProcess, prompts: list[str], concurrency: int, tokens: int,
               stream: bool) -> dict:
    url = server.url + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency)
    with httpx.Client(timeout=600, limits=limits) as client:
        server_cpu, own_cpu = cpu_seconds(server.proc.pid), time.process_time()
        start = time.perf_counter()
        n = threaded(prompts, concurrency, lambda p: ask(client, url, p, tokens, stream))
        seconds = time.perf_counter() - start
    return {"tokens": n, "seconds": seconds,
            "server_cpu": cpu_seconds(server.proc.pid) - server_cpu,
            "client_cpu": time.process_time() - own_cpu}


def in_process_round(gen: Generator, prompts: list[str], concurrency: int, tokens: int,
                     max_batch: int) -> dict:
    session = BatchSession(gen, max_batch)
    config = GenerationConfig(max_new_tokens=tokens)

    def answer(prompt: str) -> int:
        ids = gen.encode_prompt(messages=[{"role": "user", "content": prompt}])
        pieces = session.run(ids, config)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return len(done.value.token_ids)

    own_cpu = time.process_time()
    start = time.perf_counter()
    n = threaded(prompts, concurrency, answer)
    return {"tokens": n, "seconds": time.perf_counter() - start, "server_cpu": 0.0,
            "client_cpu": time.process_time() - own_cpu}


def call_times(gen: Generator, prompts: list[str], concurrency: int, tokens: int,
               max_batch: int) -> dict:
    """One in-process run with every model call timed: {kind: [calls, seconds]}, the run's
    seconds and tokens."""
    from specedge.runtime.backends.ort_cpu import OrtCpuBackend

    times: dict[str, list] = {}
    originals = {name: getattr(OrtCpuBackend, name) for name in ("forward", "forward_slots")}

    def timed(name: str):
        def call(self, *args, **kwargs):
            start = time.perf_counter()
            out = originals[name](self, *args, **kwargs)
            role = "draft" if self.spec is gen.bundle.draft else "target"
            if name == "forward":  # a prompt, or a chunk of one, alone on its row
                kind = f"{role} prompt chunk"
            else:
                rows = args[2]
                kind = f"{role} {len(rows)} rows x {max(len(t) for t in rows.values())}"
            entry = times.setdefault(kind, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            return out
        return call

    for name in originals:
        setattr(OrtCpuBackend, name, timed(name))
    try:
        run = in_process_round(gen, prompts, concurrency, tokens, max_batch)
    finally:
        for name, original in originals.items():
            setattr(OrtCpuBackend, name, original)
    return {"calls": times, "seconds": run["seconds"], "tokens": run["tokens"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--switch-intervals", type=float, nargs="*", default=[0.0005])
    p.add_argument("--calls", action="store_true",
                   help="then time each model call of one more in-process run")
    p.add_argument("--out", type=Path, default=Path("bench_results/serve_overhead.json"))
    args = p.parse_args(argv)
    # Evenly spaced through the shipped set, as bench_serve.py picks them (its categories
    # come in blocks: chat, summaries of ~100-token texts, code, ...).
    shipped = load_prompts()
    n = min(args.prompts, len(shipped))
    prompts = [shipped[k * len(shipped) // n]["prompt"] for k in range(n)]
    gen = Generator.from_bundle(args.bundle, threads=args.threads)
    logs = args.out.parent / "serve_overhead_logs"
    servers = {"server": start_server(args.bundle, args.threads, args.max_batch, None, logs)}
    for s in args.switch_intervals:
        servers[f"server switch {s * 1000:g} ms"] = start_server(
            args.bundle, args.threads, args.max_batch, s, logs)
    systems = ["in-process"]
    for name in servers:
        systems += [f"{name} whole", f"{name} streamed"]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    try:
        for r in range(args.rounds + 1):  # round 0 warms every system up, not counted
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for system in order:
                if system == "in-process":
                    run = in_process_round(gen, prompts, args.concurrency, args.tokens,
                                           args.max_batch)
                else:
                    name, mode = system.rsplit(" ", 1)
                    run = http_round(servers[name], prompts, args.concurrency, args.tokens,
                                     mode == "streamed")
                if r:
                    runs[system].append(run)
                print(f"round {r} {system}: {run['tokens'] / run['seconds']:.1f} tok/s",
                      flush=True)
    finally:
        for server in servers.values():
            server.stop()
    base = [run["tokens"] / run["seconds"] for run in runs["in-process"]]
    rows = []
    for system in systems:
        rates = [run["tokens"] / run["seconds"] for run in runs[system]]
        ratio = ratio_ci([a / b for a, b in zip(rates, base)])
        rows.append({"system": system, "tokens_per_second": statistics.median(rates),
                     "server_cpu_per_token_ms": 1000 * statistics.median(
                         run["server_cpu"] / run["tokens"] for run in runs[system]),
                     "client_cpu_per_token_ms": 1000 * statistics.median(
                         run["client_cpu"] / run["tokens"] for run in runs[system]),
                     "ratio_to_in_process": ratio["median"], "ratio_ci95": ratio["ci95"]})
    print(f"\n{'system':36} {'tok/s':>7} {'/ in-process':>22} {'server cpu':>11} "
          f"{'client cpu':>11}  (ms a token)")
    for row in rows:
        ci = row["ratio_ci95"]
        ci_text = f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
        print(f"{row['system']:36} {row['tokens_per_second']:7.1f} "
              f"{row['ratio_to_in_process']:8.2f}x{ci_text:13} "
              f"{row['server_cpu_per_token_ms']:11.2f} {row['client_cpu_per_token_ms']:11.2f}")
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
              "runs": runs}
    if args.calls:
        split = result["calls"] = call_times(gen, prompts, args.concurrency, args.tokens,
                                             args.max_batch)
        total = sum(seconds for _, seconds in split["calls"].values())
        print(f"\nin process, one run timed call by call: {split['tokens'] / split['seconds']:.1f}"
              f" tok/s, model calls {total / split['seconds']:.0%} of the wall time")
        for kind, (n, seconds) in sorted(split["calls"].items(), key=lambda kv: -kv[1][1]):
            print(f"  {kind:24} {n:5d} calls {seconds:6.2f} s "
                  f"({seconds / split['seconds']:4.0%}) {1000 * seconds / n:6.1f} ms each")
    atomic_write(args.out, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
