"""`specedge serve --max-batch N` through the real server: requests that run at the same
time share model calls (continuous batching), join and leave between steps, and each
answer is the one the Generator gives alone; a request cancelled in the middle of a batch
ends alone; /metrics counts the rows of each batched call."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import run_server

from specedge.runtime import Generator

PROMPTS = ["the cat sat on the mat", "once upon a time", "why?", "one, two, three",
           "a b a b a b", "hello"]


@pytest.fixture(scope="module")
def gen(tiny_batched_bundle):
    return Generator.from_bundle(tiny_batched_bundle, threads=1)


@pytest.fixture(scope="module")
def server(tiny_batched_bundle, tmp_path_factory):
    with run_server(tiny_batched_bundle, tmp_path_factory.mktemp("serve-batch"), "--max-batch",
                    "3", "--max-queue", "16", "--model-name", "tiny") as server:
        yield server


def _batch_rows(server) -> tuple[float, float]:
    """(batched target calls, those that carried more than one row) from /metrics."""
    text = httpx.get(server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("specedge_batch_rows_")}
    calls = values["specedge_batch_rows_count"]
    return calls, calls - values['specedge_batch_rows_bucket{le="1.0"}']


def test_concurrent_requests_share_calls_and_get_their_own_answers(server, gen):
    """12 requests from 6 clients at once (prompts, lengths and drafters differ, some
    streamed), 3 generated at a time: every answer equals the Generator's greedy answer
    alone, and many batched calls carried several rows (how many depends on how the
    clients' requests overlap)."""
    calls0, shared0 = _batch_rows(server)
    settings = [{"enabled": False}, {"drafter": "model", "draft_tokens": 2},
                {"drafter": "prompt-lookup", "draft_tokens": 3}]
    requests = [(PROMPTS[i % 6], 30 + 3 * i, settings[i % 3], i % 2 == 0) for i in range(12)]

    def ask(request):
        prompt, n, speculative, stream = request
        client = server.client()
        if not stream:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                             temperature=0,
                                             extra_body={"speculative": speculative}
                                             ).choices[0].text
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                           temperature=0, stream=True,
                                           extra_body={"speculative": speculative})
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(ask, requests))
    for (prompt, n, _, _), text in zip(requests, answers):
        assert text == gen.generate(prompt, raw=True, max_new_tokens=n, use_draft=False).text
    calls, shared = _batch_rows(server)
    assert calls > calls0 and shared - shared0 >= 20


def test_a_request_cancelled_mid_batch_ends_alone(server, gen):
    """A streamed request whose client goes away after a few chunks is cancelled at the
    next step; the two requests in the batch with it finish with their whole answers, and
    the server takes the next request. The cancelled request asked for 480 tokens, a
    target call each: the target calls the three made (/metrics) stay far below that, so
    its cancel reached the batch."""
    calls0, _ = _batch_rows(server)
    long = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0,
            "stream": True, "speculative": {"enabled": False}}
    results = {}

    def whole(name, prompt, n):
        results[name] = server.client().completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0].text

    companions = [threading.Thread(target=whole, args=(i, PROMPTS[i], 60)) for i in (1, 2)]
    with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=30) as r:
        lines = r.iter_lines()
        for t in companions:
            t.start()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 5:
                break
    for t in companions:
        t.join(60)
    for i in (1, 2):
        assert results[i] == gen.generate(PROMPTS[i], raw=True, max_new_tokens=60,
                                          use_draft=False).text
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json().get("running", 0) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["running"] == 0
    calls, _ = _batch_rows(server)
    assert calls - calls0 < 300  # the companions' 2 x 60 tokens, and a few of the long one's
    after = server.client().completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=8,
                                               temperature=0)
    assert after.choices[0].text == gen.generate(PROMPTS[3], raw=True, max_new_tokens=8).text


def test_max_batch_refuses_a_bundle_that_cannot_batch(tiny_fused_bundle, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specedge.cli", "serve", "--bundle",
                          str(tiny_fused_bundle), "--max-batch", "2", "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--attention batched" in out.stderr


def test_a_negative_prompt_cache_is_refused_in_one_line(tiny_batched_bundle):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specedge.cli", "serve", "--bundle",
                          str(tiny_batched_bundle), "--max-batch", "2", "--prompt-cache-mb",
                          "-1", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "prompt_cache_mb (--prompt-cache-mb) must be an integer >= 0, got -1" in \
        out.stderr.strip().splitlines()[-1]


def test_the_prompt_cache_flag_reaches_the_batch_engine(tiny_batched_bundle):
    import argparse

    from specedge.serve.app import Server
    from specedge.serve.cli import _settings, add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = ["--bundle", str(tiny_batched_bundle), "--max-batch", "2"]
    assert _settings(parser.parse_args(args)).prompt_cache_mb == 256
    settings = _settings(parser.parse_args([*args, "--prompt-cache-mb", "3"]))
    assert Server(settings).engine.store_bytes == 3 * 2**20


def test_one_request_at_a_time_the_prompt_cache_goes_to_the_generator(tiny_batched_bundle):
    import threading

    from specedge.runtime import Generator
    from specedge.serve.worker import LocalEngine

    engine = LocalEngine(4, 30.0, lambda: Generator.from_bundle(tiny_batched_bundle),
                         max_batch=1, store_bytes=3 * 2**20)
    done, got = threading.Event(), []
    engine.start(lambda g: (got.append(g), done.set()), lambda m: (got.append(m), done.set()))
    try:
        assert done.wait(60)
        assert isinstance(got[0], Generator), got
        assert got[0].prompt_store.budget == 3 * 2**20
        assert engine.worker.session is None
    finally:
        engine.stop()
        engine.join(10)


def test_failed_batched_jobs_free_their_slots():
    """A batched job whose generation raises is answered with its error and leaves the
    running jobs: after more failures than `max_batch`, the worker still runs the next
    job (a failed job left counted as running would take a slot for good)."""
    import asyncio

    from specedge.runtime.config import GenerationConfig
    from specedge.serve.worker import Job, Worker

    class Session:
        def run(self, prompt_ids, config, cancel=None):
            if prompt_ids == [0]:
                raise RuntimeError("the model failed")
            yield "piece"
            return "result"

    async def main() -> list[list[tuple[str, object]]]:
        worker = Worker(max_queue=8, max_batch=2)
        worker.generator, worker.session = object(), Session()
        worker.start()
        loop = asyncio.get_running_loop()
        jobs = [Job([0], GenerationConfig(), loop) for _ in range(3)]
        jobs.append(Job([1], GenerationConfig(), loop))
        events = []
        for job in jobs:
            worker.submit(job)
            got = []
            while not got or got[-1][0] not in ("done", "error"):
                got.append(await asyncio.wait_for(job.events.get(), 10))
            events.append(got)
        worker.stop()
        assert worker.running == 0
        return events

    events = asyncio.run(main())
    for got in events[:3]:
        assert got[-1][0] == "error" and "the model failed" in str(got[-1][1])
    assert events[3] == [("piece", "piece"), ("done", "result")]
