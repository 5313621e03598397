"""What `specedge serve` costs and delivers through HTTP: requests and tokens per second,
time to first token and inter-token latency, at several concurrencies, against
llama-cpp-python's OpenAI-compatible server on the same weights and against the
in-process Generator.

Systems, all greedy on the same prompts (specedge's prompt set, spread over its categories)
with the same max_tokens, every request streamed (so the first token and each later one are
seen when the client receives them):

- `specedge spec`: `specedge serve --bundle B --threads N`, speculative decoding on (the
  server's default: the bundle's draft, K auto);
- `specedge plain`: the same server, each request with `"speculative": {"enabled": false}`;
- `llama.cpp server`: `python -m llama_cpp.server` (llama-cpp-python) on the same weights
  written as a Q4_1 GGUF (gguf_writer.py beside this script; Q4_1 is the grid of our int4, see
  scripts/experiments/bench_scaling.py), same threads, flash attention on (its fastest plain mode),
  repeat penalty off, a new request queued behind the running one (llama-cpp-python's
  default stops the running one); skipped, with the reason, when llama_cpp.server does not
  import or with --no-llama-cpp;
- `llama.cpp server lookup`: the same with llama-cpp-python's speculative mode, prompt-lookup
  decoding (10 tokens);
- with --max-batch N: `specedge batch spec` / `specedge batch plain`, the same server with
  --max-batch N; and `llama-server -np` / `llama-server -np ngram`, llama.cpp's own server
  (`bash scripts/install_llama_cpp.sh --server`, or --llama-server PATH) on the same GGUF
  with N parallel slots and continuous batching, plain and with its n-gram speculation
  (`--spec-type ngram-simple`, 10 tokens from 2-grams);
- `in-process spec` / `in-process plain`: `Generator.stream` on the same bundle in this
  process, at concurrency 1 only, so that the HTTP layer's cost is a number.

A run is one system at one concurrency C: C client threads send the prompts (at least C
requests, the prompts repeated if there are fewer) and each takes the next as soon as its
answer ends. Both servers generate one sequence at a time, so C > 1 measures queueing:
requests per second stays near C = 1's while time to first token grows with the queue.

Figures of a run (docs/bench.md#reading-the-ratios for why rates are ratios of sums):

- req/s and tok/s: requests and completion tokens over the run's wall time (prefill,
  queueing and the HTTP round trip included). Completion tokens are the server's usage
  (specedge, `stream_options.include_usage`), max_tokens when a llama.cpp answer stops for
  length, else its streamed chunks (llama-cpp-python streams one token a chunk);
- TTFT: from sending a request to its first chunk with text;
- ITL: the gaps between successive chunks with text, as the client sees them (a
  speculative step can deliver several tokens in one chunk, so its gaps are fewer and
  longer than plain decoding's);
- TPOT: per request, (last text chunk - first text chunk) / (tokens - 1);
- tok/call (specedge): decoded tokens per target call, from each answer's `speculative`
  statistics, counted as the runtime counts them (1.00 for plain decoding).

TTFT, ITL and TPOT percentiles pool every request of every round; req/s and tok/s are the
median over rounds. "ITL p99, worst request" is not pooled: each request's own p99 over the
same prompt's one at a time (`specedge spec` at concurrency 1, the same round), the largest
of a round (`worst_request_itl`): batching aims to keep every request's p99 within twice its
own alone. Every round runs every system and concurrency once, in a rotating
order, so the machine's drift falls on all of them alike. A ratio quoted (specedge over
llama.cpp, HTTP over in-process, speculative over plain) is taken round by round, reported
as its median over rounds with a 95% confidence interval: exp(mean ± t(0.975, R-1) *
sd / sqrt(R)) of the log ratios (R rounds, none for R = 1).

The client runs on the same machine as the servers and takes some of its CPU; it takes the
same share from every system.

Servers keep the prompts they computed (llama.cpp's server its slots' and `--cache-ram`;
ours, on a batched bundle, its slots' and `--prompt-cache-mb`), and every round asks the
same prompts again, so from the second round on a prompt is mostly found, not computed:
the figures of a server that answers the same questions again. `--unique-prompts` starts
each request's message with a tag of its own: distinct users' questions, which share only
the chat template's system prompt.

    python scripts/experiments/bench_serve.py [--bundle DIR] [--threads N] [--rounds 3]
        [--concurrency 1 4 16] [--prompts 16] [--max-tokens 64] [--unique-prompts] [--quick]
        [--no-llama-cpp] [--max-batch N] [--llama-server PATH]
        [--out bench_results/serve.json]

Without --bundle: SmolLM2-135M-Instruct at int4 with the shipped draft (drafts/
smollm2-135m), exported once into the specedge cache (bundles/smollm2-int4). The GGUF and
the servers' logs go in a folder named after --out beside it (bench_results/serve/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scaling import LLAMA_CPP_QUANT, git_commit, machine  # noqa: E402

from specedge.bench.intervals import ratio_ci  # noqa: E402
from specedge.prompts import load_prompts  # noqa: E402
from specedge.runtime.atomic_files import atomic_write  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DRAFT = ROOT / "drafts" / "smollm2-135m"
START_TIMEOUT = 300.0      # seconds for a server to load its model and answer
REQUEST_TIMEOUT = 600.0
LLAMA_CPP_CONTEXT = 2048

SPEC, PLAIN, LLAMA = "specedge spec", "specedge plain", "llama.cpp server"
# The same server with --max-batch N: up to N requests at once, sharing each model call.
BATCH_SPEC, BATCH_PLAIN = "specedge batch spec", "specedge batch plain"
LLAMA_LOOKUP = "llama.cpp server lookup"
# llama.cpp's own llama-server with --max-batch parallel slots (continuous batching), plain
# and with its n-gram speculation (--spec-type ngram-simple).
LLAMA_SLOTS, LLAMA_SLOTS_NGRAM = "llama-server -np", "llama-server -np ngram"
LLAMAS = (LLAMA, LLAMA_LOOKUP, LLAMA_SLOTS, LLAMA_SLOTS_NGRAM)
IN_SPEC, IN_PLAIN = "in-process spec", "in-process plain"
SYSTEMS = (SPEC, PLAIN, BATCH_SPEC, BATCH_PLAIN, LLAMA, LLAMA_LOOKUP, LLAMA_SLOTS,
           LLAMA_SLOTS_NGRAM, IN_SPEC, IN_PLAIN)
# llama-cpp-python's own speculative mode: prompt-lookup decoding, its default 10 tokens
# from n-grams of up to 2; llama-server's ngram-simple is given the same sizes.
LLAMA_LOOKUP_TOKENS = 10
LLAMA_LOOKUP_NGRAM = 2
# Where `bash scripts/install_llama_cpp.sh --server` puts llama-server.
LLAMA_SERVER = ROOT / ".venv" / "llama.cpp" / "bin" / "llama-server"
IN_PROCESS = {IN_SPEC: True, IN_PLAIN: False}  # name: speculative on
QUICK = {"rounds": 1, "concurrency": [1, 4], "prompts": 4}


# ------------------------------------------------------------------------------ statistics

def percentiles(values: list[float]) -> dict:
    """p50 and p99 (numpy's linear interpolation), None for no values."""
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


# ------------------------------------------------------------------------------- requests

@dataclass
class Answer:
    """One streamed request as the client saw it (seconds from when it was sent)."""

    arrivals: list[float] = field(default_factory=list)  # each chunk with text
    tokens: int = 0
    seconds: float = 0.0
    error: str | None = None
    finish: str | None = None  # the answer's finish_reason
    speculative: dict | None = None  # the answer's speculative statistics, if any

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or len(self.arrivals) < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (self.tokens - 1)


def stream_chat(client: httpx.Client, url: str, body: dict) -> Answer:
    """POST a streamed chat completion and time its chunks."""
    answer = Answer()
    chunks, usage, extra = 0, None, None
    t0 = time.perf_counter()
    try:
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and keep-alive comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error'].get('message')}")
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("speculative"):
                    extra = event["speculative"]
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        answer.arrivals.append(time.perf_counter() - t0)
                        chunks += 1
                    answer.finish = choice.get("finish_reason") or answer.finish
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        answer.error = f"{type(e).__name__}: {e}"
    answer.seconds = time.perf_counter() - t0
    if usage is not None:
        answer.tokens = usage["completion_tokens"]
    elif answer.finish == "length":
        answer.tokens = body["max_tokens"]
    else:
        answer.tokens = chunks
    answer.speculative = extra
    return answer


@dataclass
class Run:
    """One system at one concurrency, one round."""

    seconds: float
    answers: list[Answer]

    @property
    def ok(self) -> list[Answer]:
        return [a for a in self.answers if a.error is None]

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.ok)

    def rates(self) -> dict:
        return {"requests_per_second": len(self.ok) / self.seconds,
                "tokens_per_second": self.tokens / self.seconds,
                "ttft_p50": percentiles([a.ttft for a in self.ok if a.ttft is not None])["p50"],
                "itl_p99": percentiles([g for a in self.ok for g in a.gaps])["p99"]}


def http_run(url: str, bodies: list[dict], concurrency: int) -> Run:
    """Send `bodies` from `concurrency` threads, each taking the next when its answer ends."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(timeout=REQUEST_TIMEOUT, limits=limits) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        answers = list(pool.map(lambda body: stream_chat(client, url, body), bodies))
        seconds = time.perf_counter() - t0
    return Run(seconds, answers)


def in_process_run(generator, messages: list[list[dict]], max_tokens: int,
                   speculative: bool) -> Run:
    """The same requests through `Generator.stream`, one after another."""
    answers = []
    t0 = time.perf_counter()
    for m in messages:
        answer = Answer()
        start = time.perf_counter()
        for piece in generator.stream(messages=m, max_new_tokens=max_tokens, temperature=0.0,
                                      use_draft=speculative):
            if piece:
                answer.arrivals.append(time.perf_counter() - start)
        answer.seconds = time.perf_counter() - start
        answer.tokens = len(generator.last_result.token_ids)
        answer.finish = ("length" if generator.last_result.stop_reason == "max_new_tokens"
                         else "stop")
        answer.speculative = generator.last_result.stats
        answers.append(answer)
    return Run(time.perf_counter() - t0, answers)


# -------------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a loopback port, its output in `log`; stopped on exit."""

    def __init__(self, name: str, command: list[str], port: int, ready_path: str, log: Path,
                 env: dict[str, str] | None = None):
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         env=env)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {self.proc.returncode}; its "
                                   f"output ({log}):\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + ready_path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not answer {ready_path} within "
                                   f"{START_TIMEOUT:.0f} s; its output is in {log}")
            time.sleep(0.25)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_specedge(bundle: Path, threads: int, logs: Path, max_batch: int = 1
                   ) -> ServerProcess:
    port = free_port()
    name, log = (SPEC, "specedge.log") if max_batch == 1 else (BATCH_SPEC, "specedge_batch.log")
    return ServerProcess(name, [sys.executable, "-m", "specedge.cli", "serve", "--bundle",
                                str(bundle), "--port", str(port), "--threads", str(threads),
                                "--max-queue", "256", "--max-batch", str(max_batch),
                                "--log-level", "warning"],
                         port, "/health", logs / log)


def import_error(module: str) -> str | None:
    """Why `module` does not import in this Python (its last line of error), or None."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=120)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def gguf_for(bundle: Path, cache: Path) -> Path:
    """The bundle's source checkpoint written as a Q4_1 GGUF, once, into cache/gguf."""
    from gguf_writer import write_gguf

    from specedge.export.sources import resolve_checkpoint

    source = json.loads((bundle / "manifest.json").read_text())["source"]["model"]
    checkpoint = resolve_checkpoint(source)
    out = cache / "gguf" / f"{bundle.name}-{LLAMA_CPP_QUANT}.gguf"
    if not out.is_file() or out.stat().st_mtime < (checkpoint / "config.json").stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {out}", file=sys.stderr)
        write_gguf(checkpoint, out, quant=LLAMA_CPP_QUANT)
    return out


def start_llama_cpp(gguf: Path, threads: int, logs: Path, lookup: bool = False
                    ) -> tuple[ServerProcess, int]:
    """llama-cpp-python's server on `gguf` in its fastest mode (flash attention on), with its
    prompt-lookup decoding when `lookup`; and the n_batch it runs with."""
    from specedge.bench.baselines import _llama_cpp_batch

    n_batch = _llama_cpp_batch(gguf, threads)
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
               "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--n_ctx", str(LLAMA_CPP_CONTEXT),
               "--n_batch", str(n_batch), "--n_ubatch", str(n_batch), "--verbose", "False",
               "--flash_attn", "True",
               # By default a new request stops the one running: queue them, as specedge does.
               "--interrupt_requests", "False"]
    if lookup:
        command += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens",
                    str(LLAMA_LOOKUP_TOKENS)]
    name = LLAMA_LOOKUP if lookup else LLAMA
    log = logs / ("llama_cpp_lookup.log" if lookup else "llama_cpp.log")
    return ServerProcess(name, command, port, "/v1/models", log), n_batch


def start_llama_server(binary: Path, gguf: Path, threads: int, logs: Path, slots: int,
                       ngram: bool = False) -> ServerProcess:
    """llama.cpp's llama-server on `gguf` with `slots` parallel sequences (continuous
    batching), each with the context llama-cpp-python's server gets, flash attention on, its
    own batch sizes; with its n-gram speculation when `ngram`."""
    port = free_port()
    command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--threads", str(threads), "--threads-batch", str(threads),
               "--ctx-size", str(LLAMA_CPP_CONTEXT * slots), "--parallel", str(slots),
               "--cont-batching", "--flash-attn", "on", "--no-webui"]
    if ngram:
        command += ["--spec-type", "ngram-simple",
                    "--spec-ngram-simple-size-n", str(LLAMA_LOOKUP_NGRAM),
                    "--spec-ngram-simple-size-m", str(LLAMA_LOOKUP_TOKENS)]
    name = LLAMA_SLOTS_NGRAM if ngram else LLAMA_SLOTS
    log = logs / ("llama_server_ngram.log" if ngram else "llama_server.log")
    return ServerProcess(name, command, port, "/health", log)


def default_bundle() -> Path:
    """SmolLM2-135M-Instruct at int4 with the shipped draft, exported once into the cache
    (export_bundle skips a bundle that is up to date)."""
    from specedge.export.bundle_writer import export_bundle
    from specedge.export.sources import cache_dir

    out = cache_dir() / "bundles" / "smollm2-int4"
    export_bundle("smollm2-135m", out, draft=str(SMOLLM2_DRAFT), precision="int4")
    return out


def tagged(prompts: list[str], run: str) -> list[str]:
    """The prompts, each message starting with a tag of its own ("[run.i]"), so that no
    server has computed the prompt before (servers that keep prompts, llama.cpp's and
    ours, then reuse only the chat template's system prompt): requests of distinct users."""
    return [f"[{run}.{i}] {p}" for i, p in enumerate(prompts)]


def select_prompts(n: int) -> list[dict]:
    """`n` prompts of the shipped set, evenly spaced through it (its categories come in
    blocks, so the first n would be one category)."""
    prompts = load_prompts()
    n = min(n, len(prompts))
    return [{**prompts[i], "index": i} for i in (k * len(prompts) // n for k in range(n))]


# ---------------------------------------------------------------------------- the bench

def body(system: str, prompt: str, max_tokens: int) -> dict:
    """The streamed greedy chat request `system` is sent."""
    b = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
         "temperature": 0.0, "stream": True}
    if system in LLAMAS:
        return {**b, "repeat_penalty": 1.0}  # llama-cpp-python's default is 1.1
    return {**b, "stream_options": {"include_usage": True},
            "speculative": {"enabled": system in (SPEC, BATCH_SPEC)}}


def prompt_tokens(url: str, system: str, prompt: str) -> int:
    """The prompt's token count as the server reports it (a one-token whole answer)."""
    b = {**body(system, prompt, 1), "stream": False}
    b.pop("stream_options", None)
    r = httpx.post(url, json=b, timeout=REQUEST_TIMEOUT)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def summarize(runs: list[Run]) -> dict:
    """A system's figures at one concurrency over its rounds."""
    answers = [a for run in runs for a in run.ok]
    rates = [run.rates() for run in runs]
    ms = 1000.0
    row = {
        "requests_per_second": statistics.median(r["requests_per_second"] for r in rates),
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rates),
        "rounds": rates,
        "requests": len(answers),
        "errors": sum(len(run.answers) - len(run.ok) for run in runs),
        "completion_tokens": sum(a.tokens for a in answers),
        "finish_reasons": dict(sorted(Counter(str(a.finish) for a in answers).items())),
    }
    for key, values in (("ttft_ms", [a.ttft for a in answers if a.ttft is not None]),
                        ("itl_ms", [g for a in answers for g in a.gaps]),
                        ("tpot_ms", [t for a in answers if (t := a.tpot) is not None])):
        row[key] = {p: None if v is None else v * ms for p, v in percentiles(values).items()}
    # As the runtime counts it (runtime/stats.py): each answer's first token comes from the
    # prompt's call, the others from the decoding calls.
    counted = [a for a in answers if a.speculative and a.tokens]
    calls = sum(a.speculative.get("target_calls") or 0 for a in counted)
    if calls:
        row["tokens_per_target_call"] = sum(a.tokens - 1 for a in counted) / calls
    first_error = next((a.error for run in runs for a in run.answers if a.error), None)
    if first_error:
        row["first_error"] = first_error
    return row


def worst_request_itl(run: Run, alone: Run) -> float | None:
    """The largest, over `run`'s requests, of a request's inter-token p99 over the same
    prompt's in `alone` (a run of the prompts one at a time, the same round): batching aims
    to keep it within 2 for every request, which the pooled p99 does not show (a request with a
    long prompt beside it can have its gaps all long while most requests' are short).
    Request i of a run is prompt i modulo the prompts (`measure`), so `run`'s i-th answer
    pairs with `alone`'s (i mod its length)-th. None when no pair has gaps on both sides."""
    ratios = []
    for i, answer in enumerate(run.answers):
        base = alone.answers[i % len(alone.answers)]
        if answer.error or base.error or not answer.gaps or not base.gaps:
            continue
        own = percentiles(base.gaps)["p99"]
        if own > 0:
            ratios.append(percentiles(answer.gaps)["p99"] / own)
    return max(ratios, default=None)


def ratios(runs: dict[tuple[str, int], list[Run]], concurrency: list[int]) -> list[dict]:
    """The ratios the report quotes, round by round (see the module docstring)."""
    out = []

    def add(name: str, c: int, num: str, den: str, key: str, goal: str | None = None,
            den_c: int | None = None):
        """num at concurrency c over den at den_c (default c), round by round."""
        den_c = c if den_c is None else den_c
        if (num, c) not in runs or (den, den_c) not in runs:
            return
        per_round = [a.rates()[key] / b.rates()[key]
                     for a, b in zip(runs[num, c], runs[den, den_c])
                     if a.rates()[key] and b.rates()[key]]
        if per_round:
            out.append({"ratio": name, "concurrency": c, **ratio_ci(per_round),
                        "goal": goal})

    for c in concurrency:
        add(f"{SPEC} / {LLAMA_LOOKUP} tok/s", c, SPEC, LLAMA_LOOKUP, "tokens_per_second")
        add(f"{SPEC} / {LLAMA} tok/s", c, SPEC, LLAMA, "tokens_per_second")
        add(f"{PLAIN} / {LLAMA} tok/s", c, PLAIN, LLAMA, "tokens_per_second")
        add(f"{SPEC} / {PLAIN} tok/s", c, SPEC, PLAIN, "tokens_per_second")
        add(f"{BATCH_SPEC} / {SPEC} tok/s", c, BATCH_SPEC, SPEC, "tokens_per_second",
            ">= 2.5" if c == 4 else ">= 1" if c == 1 else None)
        add(f"{BATCH_PLAIN} / {PLAIN} tok/s", c, BATCH_PLAIN, PLAIN, "tokens_per_second")
        add(f"{BATCH_SPEC} / {LLAMA} tok/s", c, BATCH_SPEC, LLAMA, "tokens_per_second")
        add(f"{BATCH_SPEC} / {LLAMA_SLOTS} tok/s", c, BATCH_SPEC, LLAMA_SLOTS,
            "tokens_per_second", ">= 1" if c == 4 else None)
        add(f"{BATCH_SPEC} / {LLAMA_SLOTS_NGRAM} tok/s", c, BATCH_SPEC, LLAMA_SLOTS_NGRAM,
            "tokens_per_second")
        add(f"{BATCH_PLAIN} / {LLAMA_SLOTS} tok/s", c, BATCH_PLAIN, LLAMA_SLOTS,
            "tokens_per_second")
        add(f"{BATCH_SPEC} / {SPEC} at 1 ITL p99", c, BATCH_SPEC, SPEC, "itl_p99", "<= 2",
            den_c=1)
        if (BATCH_SPEC, c) in runs and (SPEC, 1) in runs:
            worst = [w for a, b in zip(runs[BATCH_SPEC, c], runs[SPEC, 1])
                     if (w := worst_request_itl(a, b)) is not None]
            if worst:
                out.append({"ratio": f"{BATCH_SPEC} / {SPEC} at 1 ITL p99, worst request",
                            "concurrency": c, **ratio_ci(worst), "goal": "<= 2"})
    if 1 in concurrency:
        add(f"{SPEC} / {IN_SPEC} tok/s", 1, SPEC, IN_SPEC, "tokens_per_second", ">= 0.95")
        add(f"{PLAIN} / {IN_PLAIN} tok/s", 1, PLAIN, IN_PLAIN, "tokens_per_second", ">= 0.95")
        add(f"{SPEC} / {LLAMA} TTFT p50", 1, SPEC, LLAMA, "ttft_p50", "<= 1")
        add(f"{SPEC} / {LLAMA_LOOKUP} TTFT p50", 1, SPEC, LLAMA_LOOKUP, "ttft_p50", "<= 1")
        add(f"{PLAIN} / {LLAMA} TTFT p50", 1, PLAIN, LLAMA, "ttft_p50", "<= 1")
    return out


def measure(bundle: Path, gguf_source, threads: int, rounds: int, concurrency: list[int],
            prompts: list[dict], max_tokens: int, cache: Path, llama_cpp: bool,
            max_batch: int = 1, llama_server: Path | None = None,
            unique: bool = False) -> dict:
    """Start the servers, run every round, and return the report's figures. `unique`: each
    request's message starts with a tag of its own (`tagged`)."""
    from specedge.runtime.generator import Generator

    logs = cache / "logs"
    servers: dict[str, ServerProcess] = {}
    info: dict = {}
    try:
        print("starting specedge serve", file=sys.stderr)
        servers[SPEC] = start_specedge(bundle, threads, logs)
        if max_batch > 1:
            servers[BATCH_SPEC] = start_specedge(bundle, threads, logs, max_batch)
        if llama_cpp:
            why = import_error("llama_cpp.server.app")
            if why is None:
                try:
                    gguf = gguf_source()
                    print("starting llama_cpp.server", file=sys.stderr)
                    servers[LLAMA], n_batch = start_llama_cpp(gguf, threads, logs)
                    servers[LLAMA_LOOKUP], _ = start_llama_cpp(gguf, threads, logs, True)
                    info = {"gguf": str(gguf), "gguf_mb": gguf.stat().st_size / 1e6,
                            "quant": LLAMA_CPP_QUANT, "n_batch": n_batch,
                            "n_ctx": LLAMA_CPP_CONTEXT, "flash_attn": True,
                            "lookup_tokens": LLAMA_LOOKUP_TOKENS}
                except Exception as e:  # an optional system: specedge's figures still stand
                    info = {"skipped": f"llama.cpp server failed: {type(e).__name__}: "
                                       f"{str(e)[:2000]}"}
            else:
                info = {"skipped": f"llama_cpp.server does not import ({why}); pip install "
                                   "'llama-cpp-python[server]'"}
        else:
            info = {"skipped": "--no-llama-cpp"}
        if llama_server is not None:
            gguf = gguf_source()
            print(f"starting {llama_server} -np {max_batch}", file=sys.stderr)
            for ngram in (False, True):
                server = start_llama_server(llama_server, gguf, threads, logs, max_batch, ngram)
                servers[server.name] = server
            info["llama_server"] = {"binary": str(llama_server), "parallel": max_batch,
                                    "ngram": [LLAMA_LOOKUP_NGRAM, LLAMA_LOOKUP_TOKENS]}
        if "skipped" in info:
            print(f"llama.cpp server skipped: {info['skipped']}", file=sys.stderr)
        generator = Generator.from_bundle(bundle, threads=threads)

        urls = {SPEC: servers[SPEC].url + "/v1/chat/completions"}
        urls[PLAIN] = urls[SPEC]
        if BATCH_SPEC in servers:
            urls[BATCH_SPEC] = urls[BATCH_PLAIN] = (servers[BATCH_SPEC].url
                                                     + "/v1/chat/completions")
        for name in LLAMAS:
            if name in servers:
                urls[name] = servers[name].url + "/v1/chat/completions"
        first = prompts[0]["prompt"]
        counts = {name: prompt_tokens(url, name, first) for name, url in urls.items()
                  if name not in (PLAIN, BATCH_PLAIN)}
        counts["in-process"] = len(generator.encode_prompt(first))
        if len(set(counts.values())) > 1:
            print(f"note: the first prompt's token counts differ between systems: {counts}",
                  file=sys.stderr)
        # One untimed request per system and mode: the first call of each code path.
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            for name, url in urls.items():
                warm = stream_chat(client, url, body(name, first, max_tokens))
                if warm.error:
                    raise RuntimeError(f"{name} failed its first request: {warm.error}")
        for speculative in IN_PROCESS.values():
            generator.generate(first, max_new_tokens=max_tokens, use_draft=speculative)

        runs: dict[tuple[str, int], list[Run]] = {}
        plan = [(name, c) for c in concurrency for name in urls] + \
               [(name, 1) for name in IN_PROCESS if 1 in concurrency]
        for r in range(rounds):
            turn = r % len(plan)
            for name, c in plan[turn:] + plan[:turn]:
                n = max(len(prompts), c)
                chosen = [prompts[i % len(prompts)]["prompt"] for i in range(n)]
                if unique:
                    chosen = tagged(chosen, f"{r}.{plan.index((name, c))}")
                if name in IN_PROCESS:
                    run = in_process_run(generator, [[{"role": "user", "content": p}]
                                                     for p in chosen], max_tokens,
                                         IN_PROCESS[name])
                else:
                    run = http_run(urls[name], [body(name, p, max_tokens) for p in chosen], c)
                runs.setdefault((name, c), []).append(run)
                rate = run.rates()
                print(f"round {r + 1}/{rounds} {name} c={c}: "
                      f"{rate['tokens_per_second']:.1f} tok/s, "
                      f"{rate['requests_per_second']:.2f} req/s"
                      + (f", {len(run.answers) - len(run.ok)} errors"
                         if len(run.ok) < len(run.answers) else ""), file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()

    systems: dict[str, dict] = {}
    for (name, c), rs in runs.items():
        systems.setdefault(name, {})[str(c)] = summarize(rs)
    order = {name: i for i, name in enumerate(SYSTEMS)}
    return {"systems": dict(sorted(systems.items(), key=lambda kv: order[kv[0]])),
            "ratios": ratios(runs, concurrency), "llama_cpp": info,
            "prompt_tokens_first": counts}


# ---------------------------------------------------------------------------- report

def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def _ci(r: dict) -> str:
    return "—" if r["ci95"] is None else f"{r['ci95'][0]:.2f}–{r['ci95'][1]:.2f}"


def table(results: dict) -> str:
    """The markdown tables: every system and concurrency, then the ratios."""
    lines = [f"specedge serve bench: {Path(results['bundle']).name}, {results['threads']} "
             f"threads, {results['machine']['cpu']}; {results['prompts']} prompts x "
             f"max_tokens {results['max_tokens']}, greedy, streamed; {results['rounds']} "
             f"round(s); load average {results['load_average']['start']} at the start, "
             f"{results['load_average']['end']} at the end", "",
             "| system | conc | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
             "ITL p99 ms | TPOT p50 ms | tok/call |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, by_c in results["systems"].items():
        for c, row in by_c.items():
            call = row.get("tokens_per_target_call")
            lines.append(
                f"| {name} | {c} | {row['requests_per_second']:.2f} | "
                f"{row['tokens_per_second']:.1f} | {_ms(row['ttft_ms']['p50'])} | "
                f"{_ms(row['ttft_ms']['p99'])} | {_ms(row['itl_ms']['p50'])} | "
                f"{_ms(row['itl_ms']['p99'])} | {_ms(row['tpot_ms']['p50'])} | "
                f"{'—' if call is None else f'{call:.2f}'} |")
    lines += ["", "| ratio | conc | median | 95% CI | goal |", "|---|---|---|---|---|"]
    for r in results["ratios"]:
        lines.append(f"| {r['ratio']} | {r['concurrency']} | {r['median']:.3f} | {_ci(r)} | "
                     f"{r['goal'] or ''} |")
    if "skipped" in results["llama_cpp"]:
        lines += ["", f"llama.cpp server skipped: {results['llama_cpp']['skipped']}"]
    errors = {f"{n} c={c}": row["first_error"] for n, by_c in results["systems"].items()
              for c, row in by_c.items() if row["errors"]}
    for where, error in errors.items():
        lines.append(f"\n{where}: failed requests, the first: {error}")
    return "\n".join(lines) + "\n"


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work on the machine, which the figures
    include."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this system
        return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=None,
                    help="bundle folder (default: SmolLM2-135M-Instruct int4, exported once "
                         "into the specedge cache)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads of every system (default: all cores)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds; each runs every system and concurrency once (default 3)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                    help="client concurrencies (default 1 4 16)")
    ap.add_argument("--prompts", type=int, default=16,
                    help="prompts of the shipped set, spread over it (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--unique-prompts", action="store_true",
                    help="start each request's message with a tag of its own, so that no "
                    "server finds a prompt it computed before (servers keep prompts: "
                    "llama.cpp's, and ours on a batched bundle); without it every round "
                    "asks the same prompts again")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['rounds']} round, concurrency "
                         f"{' '.join(map(str, QUICK['concurrency']))}, {QUICK['prompts']} "
                         "prompts: a couple of minutes")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--max-batch", type=int, default=0,
                    help="also run the server with --max-batch N (a bundle exported with "
                         "--attention batched or portable), as 'specedge batch spec/plain' "
                         "(default 0: not)")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="llama.cpp's llama-server binary, run with --max-batch parallel "
                         "slots beside the batching server (default: the one `bash "
                         "scripts/install_llama_cpp.sh --server` builds, if built)")
    ap.add_argument("--out", type=Path, default=Path("bench_results/serve.json"),
                    help="the JSON report; the GGUF and server logs go in a folder of its "
                         "name beside it")
    args = ap.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.quick:
        args.rounds, args.concurrency, args.prompts = (QUICK["rounds"], QUICK["concurrency"],
                                                       QUICK["prompts"])
    if min(args.rounds, args.prompts, args.max_tokens, args.threads, *args.concurrency) < 1:
        ap.error("--rounds, --prompts, --max-tokens, --threads and --concurrency must be at "
                 "least 1")
    concurrency = sorted(set(args.concurrency))
    cache = args.out.parent / args.out.stem
    bundle = (args.bundle or default_bundle()).resolve()
    if not (bundle / "manifest.json").is_file():
        ap.error(f"{bundle} is not a bundle (no manifest.json): make one with "
                 "`specedge export`")
    prompts = select_prompts(args.prompts)
    llama_server = None
    if args.max_batch > 1 and not args.no_llama_cpp:
        llama_server = args.llama_server or (LLAMA_SERVER if LLAMA_SERVER.is_file() else None)
        if llama_server is None:
            print("llama-server -np skipped: not built (bash scripts/install_llama_cpp.sh "
                  "--server), or name it with --llama-server", file=sys.stderr)

    results = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["python", "scripts/experiments/bench_serve.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "bundle": str(bundle),
        "precision": json.loads((bundle / "manifest.json").read_text()).get("precision"),
        "threads": args.threads, "rounds": args.rounds, "concurrency": concurrency,
        "max_batch": args.max_batch, "unique_prompts": args.unique_prompts,
        "prompts": len(prompts), "prompt_indices": [p["index"] for p in prompts],
        "prompt_categories": sorted({p["category"] for p in prompts}),
        "max_tokens": args.max_tokens, "greedy": True, "stream": True,
        "load_average": {"start": _load()},
    }
    results.update(measure(bundle, lambda: gguf_for(bundle, cache), args.threads,
                           args.rounds, concurrency, prompts, args.max_tokens, cache,
                           not args.no_llama_cpp, args.max_batch, llama_server,
                           args.unique_prompts))
    results["load_average"]["end"] = _load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
