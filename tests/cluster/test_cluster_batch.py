"""`specedge serve --ray --max-batch 2` on the real two-node cluster (conftest.py): one
replica generates two requests at once (Ray sends it --max-batch of them), their streams
interleave, each answer is the Generator's alone, and the replica's Ray metrics count its
calls that carried both."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from cluster.conftest import CONTEXT, MODEL, deployed
from tiny_models import export_slow_bundle

from specedge.runtime import Generator

PROMPTS = ["hello world", "a, b, c!"]
TOKENS = 300  # a second or more each: two answers one after the other do not overlap


@pytest.fixture(scope="module")
def batched_bundle(tmp_path_factory):
    """The cluster tests' slow model on batched attention."""
    return export_slow_bundle(tmp_path_factory.mktemp("cluster-batch-bundle"), CONTEXT,
                              attention="batched")


@pytest.fixture(scope="module")
def batched_app(ray_cluster, batched_bundle, tmp_path_factory):
    with deployed(ray_cluster, batched_bundle, tmp_path_factory.mktemp("cluster-batch"),
                  "--replicas", "1", "--max-batch", "2") as app:
        yield app


def _stream(url: str, prompt: str) -> tuple[str, float, float, str]:
    """A streamed greedy completion: (text, when its first text came, when its last did,
    the replica that served it)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "stream": True, "speculative": {"drafter": "model", "draft_tokens": 2}}
    text, times = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        replica = response.headers["x-specedge-replica"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "choices" in event, event
            piece = event["choices"][0]["text"]
            if piece:
                text.append(piece)
                times.append(time.monotonic())
    return "".join(text), times[0], times[-1], replica


def _batch_rows(ray_cluster, replica: str) -> dict[str, float]:
    """The replica's `specedge_batch_rows` histogram, {le: cumulative count}, from the Ray
    metrics export of whichever node it runs on (exported every few seconds)."""
    bucket = re.compile(r'^ray_specedge_batch_rows_bucket\{([^}]*)\} ([0-9.e+]+)$', re.M)
    deadline = time.monotonic() + 60
    while True:
        found = {}
        for port in ray_cluster.metrics_ports:
            for tags, value in bucket.findall(httpx.get(f"http://127.0.0.1:{port}/metrics",
                                                        timeout=10).text):
                le = re.search(r'le="([^"]+)"', tags)
                if f'replica="{replica}"' in tags and le:
                    found[le.group(1)] = float(value)
        if found:
            return found
        assert time.monotonic() < deadline, f"no specedge_batch_rows of replica {replica}"
        time.sleep(2)


def test_one_replica_generates_two_requests_at_once(batched_app, batched_bundle, ray_cluster):
    """One replica, two streams sent together: each streams its first text before the other
    ends (one at a time, the second would start after the first's last token), each text
    equals the Generator's greedy answer alone, and the replica's metrics count calls of
    two rows."""
    gen = Generator.from_bundle(batched_bundle, threads=1)
    want = [gen.generate(p, raw=True, max_new_tokens=TOKENS, use_draft=False).text
            for p in PROMPTS]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: _stream(batched_app.url, p), PROMPTS))
    assert [text for text, _, _, _ in got] == want
    (_, first_a, last_a, replica), (_, first_b, last_b, other) = got
    assert max(first_a, first_b) < min(last_a, last_b)
    assert replica == other
    rows = _batch_rows(ray_cluster, replica)
    assert rows["2.0"] - rows["1.0"] > 0, rows  # calls that carried both sequences
