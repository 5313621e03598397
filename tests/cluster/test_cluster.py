"""`specedge serve --ray` on a real two-node Ray cluster (conftest.py), driven with the
official `openai` client and raw HTTP: the same answers as the Python API, one replica on
each node, a dropped stream freeing its replica within a step, 429 past the queue, and a
killed replica failing its request clearly and being replaced."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from cluster.conftest import MODEL

from specedge.runtime import Generator

CHATS = [[{"role": "user", "content": text}] for text in ("hello world", "a, b, c!")]
LONG = 900         # max_tokens that keeps a replica busy for seconds
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def gen(slow_bundle):
    return Generator.from_bundle(slow_bundle, threads=1)


def chat_body(text: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def sse_events(lines) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in lines if line.startswith("data: ")]


def post_chat(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def two_at_once(url: str, text: str, max_tokens: int) -> list[httpx.Response]:
    """Two requests sent together: with one request per replica, each replica serves one
    when both are free."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda _: post_chat(url, chat_body(text, max_tokens)), range(2)))


@pytest.mark.parametrize("messages", CHATS)
def test_unary_and_streamed_chats_equal_the_generator(cluster_app, gen, messages):
    want = gen.generate(messages=messages, max_new_tokens=40)
    client = cluster_app.client()
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                           temperature=0)
    assert whole.choices[0].message.content == want.text
    assert whole.usage.completion_tokens == len(want.token_ids)
    assert whole.usage.prompt_tokens == len(gen.encode_prompt(messages=messages))
    pieces = []
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages,
                                                max_tokens=40, temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == want.text
    assert finish == "length"


def test_the_chat_page_and_token_marks_come_through_the_proxy(cluster_app, gen):
    """The chat page is served at / by the ingress, and a stream that asks for token marks
    gets them from the replica (pieces sent while the last was on its way arrive as one):
    marks covering each chunk's text, and steps that add up to the answer's statistics."""
    page = httpx.get(cluster_app.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    body = chat_body(CHATS[0][0]["content"], 40, stream=True)
    body["speculative"] = {"drafter": "model", "draft_tokens": 2, "marks": True}
    with httpx.stream("POST", cluster_app.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    content = [e for e in events[1:] if not e["choices"][0]["finish_reason"]]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in content)
    assert text == gen.generate(messages=CHATS[0], max_new_tokens=40).text
    for e in content:
        chars = sum(n for n, _ in e["speculative"]["marks"])
        assert chars == len(e["choices"][0]["delta"].get("content", ""))
    steps = [s for e in content for s in e["speculative"]["steps"]]
    stats = events[-1]["speculative"]
    assert len(steps) == stats["target_calls"] + 1
    assert sum(s["accepted"] for s in steps) == stats["accepted_tokens"]


def test_two_replicas_serve_from_two_nodes(cluster_app, ray_cluster, gen):
    """Two requests at once, each longer than the time to send the other: with one
    request per replica, they run on the two replicas, one on each node."""
    want = gen.generate(messages=CHATS[0], max_new_tokens=200).text
    answers = two_at_once(cluster_app.url, CHATS[0][0]["content"], 200)
    assert [a.status_code for a in answers] == [200, 200]
    assert all(a.json()["choices"][0]["message"]["content"] == want for a in answers)
    replicas = {a.headers["x-specedge-replica"] for a in answers}
    nodes = {a.headers["x-specedge-node"] for a in answers}
    assert len(replicas) == 2, replicas
    assert nodes == set(ray_cluster.node_ids()), nodes


def test_each_replica_exports_its_speculative_metrics(cluster_app, ray_cluster):
    """Each node's Ray metrics export has the speculative counters of its own replica,
    tagged with the replica; the app's /metrics has the same counters over all replicas,
    under `specedge serve`'s names. (A node's export also keeps the series of replicas
    that an earlier deployment ran there: only this app's two count.)"""
    answers = two_at_once(cluster_app.url, "count me", 200)
    ours = {a.headers["x-specedge-replica"] for a in answers}
    assert len(ours) == 2, ours
    served = re.compile(r'^ray_specedge_generation_tokens(?:_total)?\{[^}]*replica="([^"]+)"'
                        r'[^}]*\} ([0-9.e+]+)$', re.M)
    deadline = time.monotonic() + 60  # Ray exports its metrics every few seconds
    while True:
        per_node = [[(replica, value) for replica, value in served.findall(httpx.get(
            f"http://127.0.0.1:{port}/metrics", timeout=10).text) if replica in ours]
            for port in ray_cluster.metrics_ports]
        if all(per_node):
            break
        assert time.monotonic() < deadline, f"no replica metrics on some node: {per_node}"
        time.sleep(2)
    assert {replica for node in per_node for replica, _ in node} == ours, per_node
    assert all(float(value) > 0 for node in per_node for _, value in node)
    text = httpx.get(cluster_app.url + "/metrics", timeout=10).text
    for name in ("specedge_generation_tokens_total", "specedge_spec_decode_num_drafts_total",
                 "specedge_spec_decode_num_accepted_tokens_total"):
        value = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        assert value and float(value.group(1)) > 0, name


def test_a_dropped_stream_frees_its_replica_within_a_step(cluster_app, gen):
    """A client that goes away mid-stream: its generation stops after the step in flight,
    so both replicas at once serve the next two requests, correctly, long before the
    dropped request would have ended."""
    with httpx.Client(timeout=60) as http:
        started = time.monotonic()
        with http.stream("POST", cluster_app.url + "/v1/chat/completions",
                         json=chat_body("hello world", LONG, stream=True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got >= 5:
                    break
        first_pieces = time.monotonic() - started
    want = gen.generate(messages=CHATS[1], max_new_tokens=20).text
    t0 = time.monotonic()
    answers = two_at_once(cluster_app.url, CHATS[1][0]["content"], 20)
    both = time.monotonic() - t0
    assert [a.status_code for a in answers] == [200, 200]
    assert all(a.json()["choices"][0]["message"]["content"] == want for a in answers)
    assert len({a.headers["x-specedge-replica"] for a in answers}) == 2
    # The dropped request needed LONG tokens: far more than 5 pieces' time (first_pieces)
    # and than the two short answers, had it kept its replica busy.
    full = gen.generate(messages=CHATS[0], max_new_tokens=LONG).stats["time_total_s"]
    assert both < full / 2, (both, full, first_pieces)


def hold_a_replica(url: str, held: threading.Event, release: threading.Event) -> None:
    """Stream a LONG answer: set `held` once its first token came (a replica has it), then
    read on until `release` is set, and drop the stream (its replica is freed within a step,
    test_a_dropped_stream_frees_its_replica_within_a_step)."""
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json=chat_body("busy", LONG, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content"' in line:
                held.set()
            if release.is_set():
                return
    raise AssertionError(f"the held answer of {LONG} tokens ended before it was released")


def test_a_stream_waiting_for_a_replica_gets_keep_alives_then_its_answer(cluster_app, gen):
    """Both replicas busy until this test frees them: a streamed request waits in the queue,
    and its answer starts anyway, with keep-alive comments until a replica takes it (as
    `specedge serve` answers a queued stream), then the same text as the Generator. The
    replicas are held by streams dropped only once the waiting stream has had a keep-alive,
    so the wait cannot end early on a fast machine."""
    want = gen.generate(messages=CHATS[1], max_new_tokens=20).text
    release = threading.Event()
    helds = [threading.Event() for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(hold_a_replica, cluster_app.url, held, release) for held in helds]
        try:
            for held in helds:
                assert held.wait(60), [b.exception() for b in busy if b.done()]
            with httpx.stream("POST", cluster_app.url + "/v1/chat/completions", timeout=60,
                              json=chat_body(CHATS[1][0]["content"], 20, stream=True)) as r:
                assert r.status_code == 200
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if line == ": keep-alive":
                        release.set()
        finally:
            release.set()
    texts = [json.loads(line[6:])["choices"][0]["delta"].get("content")
             if line.startswith("data: {") else None for line in lines]
    first_text = next(i for i, text in enumerate(texts) if text)
    assert lines[:first_text].count(": keep-alive") >= 1, lines[:first_text]
    assert lines[-1] == "data: [DONE]"
    assert "".join(text or "" for text in texts) == want
    for b in busy:
        b.result()  # each held its replica until released


def test_more_requests_than_replicas_and_queue_get_429(cluster_app):
    """Two replicas and two queue slots: of eight requests sent at once, each replica serves
    one in full, and those beyond the queue get 429 with Retry-After in OpenAI's error
    shape; none hangs and none is lost. (How many are served is not exact: a request that
    arrives after one has finished finds room.)"""
    n, tokens = 8, 600
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda i: post_chat(cluster_app.url, chat_body(
            f"request {i}", tokens), timeout=90), range(n)))
    codes = [a.status_code for a in answers]
    assert len(answers) == n and set(codes) <= {200, 429}, [a.text[:100] for a in answers]
    assert codes.count(200) >= 2 and codes.count(429) >= 1, codes
    for a in answers:
        if a.status_code == 200:
            assert a.json()["usage"]["completion_tokens"] == tokens
        else:
            assert a.headers["retry-after"] == "1"
            error = a.json()["error"]
            assert set(error) == ERROR_KEYS
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
    # After the burst, the cluster serves again.
    assert post_chat(cluster_app.url, chat_body("after", 5)).status_code == 200


def test_a_killed_replica_fails_its_request_and_is_replaced(cluster_app, gen):
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", cluster_app.url + "/v1/chat/completions",
                         json=chat_body("hello world", LONG, stream=True)) as response:
            assert response.status_code == 200
            killed = response.headers["x-specedge-replica"]
            pid = int(response.headers["x-specedge-replica-pid"])
            lines = response.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 5:
                    os.kill(pid, signal.SIGKILL)
                    break
            events += [line for line in lines if line.startswith("data: ")]
    payloads = sse_events(events)
    assert payloads[-1] == "[DONE]"
    error = payloads[-2]["error"]
    assert error["code"] == "replica_failed", payloads[-2]
    assert "retry" in error["message"]
    assert not any(p != "[DONE]" and p.get("choices") and p["choices"][0]["finish_reason"]
                   for p in payloads), "the killed request must not look finished"

    # Ray replaces the replica; later requests succeed, on two live replicas again.
    want = gen.generate(messages=CHATS[1], max_new_tokens=20).text
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    while True:
        answers = two_at_once(cluster_app.url, CHATS[1][0]["content"], 20)
        ok = [a for a in answers if a.status_code == 200]
        assert all(a.json()["choices"][0]["message"]["content"] == want for a in ok)
        seen |= {a.headers["x-specedge-replica"] for a in ok}
        if len(seen - {killed}) >= 2:
            break
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {seen}"
        time.sleep(1)
