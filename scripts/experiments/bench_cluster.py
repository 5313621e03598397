"""What the cluster mode costs and delivers: `specedge serve --ray` with one and with two
replicas against the single-process `specedge serve`, in requests per second, tokens per
second and time to first token, at several concurrencies (docs/cluster.md).

The script starts a local two-node Ray cluster on 127.0.0.1 (two `ray start --block`
processes, each with one `edge_device`, the dashboard and usage stats off) and stops it at
the end. Systems, all greedy and streamed on the same prompts (scripts/experiments/bench_serve.py's
requests, figures and statistics):

- `single`: `specedge serve --bundle B --threads N`;
- `ray x1`, `ray x2`: `specedge serve --bundle B --ray ADDR --replicas 1|2 --threads N`,
  through Ray Serve's HTTP proxy on the head node.

Memory: the resident memory (RSS) of each node's processes (its `ray start` and the
processes under it: raylet, GCS, agents, and the Serve actors Ray starts there), by
process, when the cluster is idle and with each configuration deployed (then also the
`specedge serve --ray` process, Ray's driver, which stays up while the app runs), beside the
single server's.

The single server stays up the whole run; each Ray configuration is deployed in turn, and in
each round the single server and the deployed configuration take turns, so the ratio
`ray xK / single` is taken round by round (median and 95% CI, specedge.bench.intervals).
Both nodes of the local cluster share this machine's cores, so `ray x2` measures the
scheduling over two replicas, not two devices' worth of speed. The goal the cluster mode
aims at: `ray x1 / single` tok/s at concurrency 1 >= 0.90.

    python scripts/experiments/bench_cluster.py [--bundle DIR] [--threads N] [--rounds 3]
        [--concurrency 1 4 8] [--prompts 8] [--max-tokens 64] [--quick]
        [--out bench_results/cluster.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scaling import git_commit, machine  # noqa: E402
from bench_serve import (  # noqa: E402
    REQUEST_TIMEOUT,
    SPEC,
    Run,
    ServerProcess,
    body,
    default_bundle,
    free_port,
    http_run,
    select_prompts,
    start_specedge,
    stream_chat,
    summarize,
)

from specedge.bench.intervals import ratio_ci  # noqa: E402
from specedge.runtime.atomic_files import atomic_write  # noqa: E402

SINGLE = "single"
QUICK = {"rounds": 1, "concurrency": [1, 4], "prompts": 4}
NODE_TIMEOUT = 90.0
IDLE_SETTLE = 10.0  # seconds for a new cluster's processes to finish starting


class LocalCluster:
    """A head and a worker node on 127.0.0.1, each a `ray start --block` in its own
    process group, stopped (SIGTERM, then SIGKILL to the group) by `stop`."""

    def __init__(self, logs: Path):
        logs.mkdir(parents=True, exist_ok=True)
        # Token authentication with a token of its own (docs/cluster.md, "InvalidAuthToken").
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        common = ["--num-cpus", "1", "--resources", '{"edge_device": 1}',
                  "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
                  "--dashboard-agent-listen-port"]
        self.procs: list[subprocess.Popen] = []
        self._start(["--head", "--port", str(port), "--include-dashboard=false",
                     "--temp-dir", f"/tmp/specedge-bench-ray-{os.getpid()}",
                     "--ray-client-server-port", str(free_port()), *common,
                     str(free_port())], logs / "head.log")
        time.sleep(5)
        self._start(["--address", self.address, *common, str(free_port())],
                    logs / "worker.log")
        deadline = time.monotonic() + NODE_TIMEOUT
        while self.nodes() < 2:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the local Ray cluster did not start; see {logs}")
            time.sleep(1)

    def _start(self, args: list[str], log: Path) -> None:
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(["ray", "start", "--block", *args],
                                               stdout=out, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True))

    def nodes(self) -> int:
        code = (f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
                "print(sum(n['Alive'] for n in ray.nodes()))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=self.env, timeout=60)
        return int(done.stdout.strip() or 0)

    def memory(self) -> dict[str, dict[str, float]]:
        """MiB of resident memory by process, for each node ("head", "worker"): its `ray
        start` and every process started under it (GCS, raylet, agents, and the workers of
        the actors Ray places there), named by their command line (Ray names an actor's
        process `ray::ServeReplica:APP:DEPLOYMENT`, `ray::ProxyActor`, ...). RSS counts
        shared libraries in every process, so a node's sum is an upper bound."""
        nodes: dict[str, dict[str, float]] = {}
        for proc, node in zip(self.procs, ("head", "worker")):
            sizes = nodes.setdefault(node, {})
            root = psutil.Process(proc.pid)
            for member in [root, *root.children(recursive=True)]:
                try:
                    name, rss = process_name(member.cmdline()), member.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
                sizes[name] = sizes.get(name, 0.0) + rss / 2**20
        return nodes

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def process_name(cmdline: list[str]) -> str:
    """A short name for a process of a Ray node: its program, or the actor Ray runs in it."""
    if not cmdline:
        return "?"
    first = cmdline[0]
    if first.startswith("ray::"):  # an actor or worker: Ray sets its title
        return first.split()[0]
    program, args = Path(first).name, cmdline[1:]
    if program.startswith("python") and args:
        if "-m" in args[:-1]:
            return f"python -m {args[args.index('-m') + 1]}"
        script = next((a for a in args if not a.startswith("-")), None)
        if script:  # a script: Ray's log monitor, agents, the `ray` command itself
            return f"python {Path(script).name}"
    return program


def process_rss(pid: int) -> float:
    """MiB of resident memory of a process and its children."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def start_on_ray(cluster: LocalCluster, bundle: Path, replicas: int, threads: int,
                 logs: Path) -> ServerProcess:
    port = free_port()
    return ServerProcess(f"ray x{replicas}", [
        sys.executable, "-m", "specedge.cli", "serve", "--bundle", str(bundle), "--ray",
        cluster.address, "--replicas", str(replicas), "--threads", str(threads),
        "--max-queue", "256", "--port", str(port), "--proxy-location", "HeadOnly",
        "--log-level", "warning"], port, "/health", logs / f"ray-x{replicas}.log",
        env=cluster.env)


def measure(bundle: Path, threads: int, rounds: int, concurrency: list[int],
            prompts: list[dict], max_tokens: int, logs: Path) -> dict:
    runs: dict[tuple[str, int], list[Run]] = {}
    cluster = LocalCluster(logs / "ray")
    time.sleep(IDLE_SETTLE)
    memory = {"idle": cluster.memory()}
    single = start_specedge(bundle, threads, logs)
    try:
        for replicas in (1, 2):
            name = f"ray x{replicas}"
            print(f"deploying {name}", file=sys.stderr)
            app = start_on_ray(cluster, bundle, replicas, threads, logs)
            try:
                urls = {SINGLE: single.url + "/v1/chat/completions",
                        name: app.url + "/v1/chat/completions"}
                first = prompts[0]["prompt"]
                with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
                    for url in urls.values():  # one untimed request each: first calls
                        for _ in range(replicas):
                            warm = stream_chat(client, url, body(SPEC, first, max_tokens))
                            if warm.error:
                                raise RuntimeError(f"{url}: first request failed: "
                                                   f"{warm.error}")
                memory[name] = {**cluster.memory(),
                                "driver": {"specedge serve --ray": process_rss(app.proc.pid)}}
                memory[SINGLE] = {"single": {"specedge serve": process_rss(single.proc.pid)}}
                plan = [(system, c) for c in concurrency for system in urls]
                for r in range(rounds):
                    turn = r % len(plan)
                    for system, c in plan[turn:] + plan[:turn]:
                        n = max(len(prompts), c)
                        chosen = [prompts[i % len(prompts)]["prompt"] for i in range(n)]
                        run = http_run(urls[system], [body(SPEC, p, max_tokens)
                                                      for p in chosen], c)
                        key = (f"{SINGLE} (beside {name})" if system == SINGLE else system, c)
                        runs.setdefault(key, []).append(run)
                        rate = run.rates()
                        print(f"round {r + 1}/{rounds} {key[0]} c={c}: "
                              f"{rate['tokens_per_second']:.1f} tok/s, "
                              f"{rate['requests_per_second']:.2f} req/s", file=sys.stderr)
            finally:
                app.stop()
    finally:
        single.stop()
        cluster.stop()

    systems: dict[str, dict] = {}
    for (name, c), rs in runs.items():
        systems.setdefault(name, {})[str(c)] = summarize(rs)
    ratios = []
    for replicas in (1, 2):
        name = f"ray x{replicas}"
        for c in concurrency:
            for key, label in (("tokens_per_second", "tok/s"), ("ttft_p50", "TTFT p50")):
                pairs = zip(runs.get((name, c), []),
                            runs.get((f"{SINGLE} (beside {name})", c), []))
                per_round = [a.rates()[key] / b.rates()[key] for a, b in pairs
                             if a.rates()[key] and b.rates()[key]]
                if per_round:
                    goal = ">= 0.90" if (replicas, c, key) == (1, 1, "tokens_per_second") \
                        else None
                    ratios.append({"ratio": f"{name} / {SINGLE} {label}", "concurrency": c,
                                   **ratio_ci(per_round), "goal": goal})
    return {"systems": systems, "ratios": ratios, "memory_mib": memory}


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def table(results: dict) -> str:
    lines = [f"specedge serve --ray bench: {Path(results['bundle']).name}, "
             f"{results['threads']} threads a server, {results['machine']['cpu']}; "
             f"{results['prompts']} prompts x max_tokens {results['max_tokens']}, greedy, "
             f"streamed; {results['rounds']} round(s); a local two-node cluster", "",
             "| system | conc | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | errors |",
             "|---|---|---|---|---|---|---|"]
    for name, by_c in results["systems"].items():
        for c, row in by_c.items():
            p50, p99 = (_ms(row["ttft_ms"][q]) for q in ("p50", "p99"))
            lines.append(f"| {name} | {c} | {row['requests_per_second']:.2f} | "
                         f"{row['tokens_per_second']:.1f} | {p50} | {p99} | "
                         f"{row['errors']} |")
    lines += ["", "| ratio | conc | median | 95% CI | goal |", "|---|---|---|---|---|"]
    for r in results["ratios"]:
        ci = "—" if r["ci95"] is None else f"{r['ci95'][0]:.2f}–{r['ci95'][1]:.2f}"
        lines.append(f"| {r['ratio']} | {r['concurrency']} | {r['median']:.3f} | {ci} | "
                     f"{r['goal'] or ''} |")
    lines += ["", "| memory (RSS, MiB) | node | total | largest processes |",
              "|---|---|---|---|"]
    for phase, nodes in results["memory_mib"].items():
        for node, processes in nodes.items():
            top = sorted(processes.items(), key=lambda kv: -kv[1])[:4]
            lines.append(f"| {phase} | {node} | {sum(processes.values()):.0f} | "
                         + ", ".join(f"{name} {mib:.0f}" for name, mib in top) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=None)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads of each server and replica (default 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK} (the figures mean little)")
    p.add_argument("--out", type=Path, default=Path("bench_results/cluster.json"))
    args = p.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    bundle = args.bundle or default_bundle()
    prompts = select_prompts(args.prompts)
    logs = args.out.with_suffix("")
    results = {"bundle": str(bundle), "threads": args.threads, "rounds": args.rounds,
               "prompts": len(prompts), "max_tokens": args.max_tokens,
               "concurrency": args.concurrency, "machine": machine(),
               "commit": git_commit(), "date": datetime.datetime.now(
                   datetime.timezone.utc).isoformat(timespec="seconds")}
    results |= measure(bundle, args.threads, args.rounds, args.concurrency, prompts,
                       args.max_tokens, logs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(results, indent=1).encode())
    print(table(results))
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
