"""`specedge serve --ray --max-batch 2` on the real two-node cluster (conftest.py): one
replica generates two requests at once (Ray sends it --max-batch of them), their streams
interleave, and each answer is the Generator's alone."""

from __future__ import annotations

import json
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


def _stream(url: str, prompt: str) -> tuple[str, float, float]:
    """A streamed greedy completion: (text, when its first text came, when its last did)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "stream": True, "speculative": {"drafter": "model", "draft_tokens": 2}}
    text, times = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "choices" in event, event
            piece = event["choices"][0]["text"]
            if piece:
                text.append(piece)
                times.append(time.monotonic())
    return "".join(text), times[0], times[-1]


def test_one_replica_generates_two_requests_at_once(batched_app, batched_bundle):
    """One replica, two streams sent together: each streams its first text before the other
    ends (one at a time, the second would start after the first's last token), and each
    text equals the Generator's greedy answer alone."""
    gen = Generator.from_bundle(batched_bundle, threads=1)
    want = [gen.generate(p, raw=True, max_new_tokens=TOKENS, use_draft=False).text
            for p in PROMPTS]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: _stream(batched_app.url, p), PROMPTS))
    assert [text for text, _, _ in got] == want
    (_, first_a, last_a), (_, first_b, last_b) = got
    assert max(first_a, first_b) < min(last_a, last_b)
