"""Losing a device node while two streams run, one on each node's replica: the stream whose
replica was on the lost node ends with an error event and [DONE] (never a cut that reads as
a whole answer), the stream on the head's replica goes on to its end and equals the Python
API's answer, and the ingress, on the head node, keeps serving. Runs after the other cluster
tests (it kills the worker node), and starts a new worker node at the end."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from cluster.conftest import MODEL, deployed

from specedge.runtime import Generator

LONG = 900      # tokens: the streams run for seconds, through the node's loss
SHORT = 40      # the answer checked against the Python API after the loss


@pytest.fixture(scope="module")
def gen(slow_bundle):
    return Generator.from_bundle(slow_bundle, threads=1)


def stream(url: str, text: str, max_tokens: int, out: dict) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out["events"] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180) as r:
        out["status"], out["node"] = r.status_code, r.headers.get("x-specedge-node")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out["events"].append(data if data == "[DONE]" else json.loads(data))


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def test_losing_a_node_ends_only_its_streams_and_with_an_error(ray_cluster, slow_bundle,
                                                               tmp_path, gen):
    head_id = ray_cluster.driver(
        "print(next(n['NodeID'] for n in ray.nodes() if n['Alive'] and "
        "'node:__internal_head__' in n['Resources']))").strip()
    with deployed(ray_cluster, slow_bundle, tmp_path, "--replicas", "2") as app:
        # Ray's actor table (the state API needs the dashboard, which the test cluster
        # runs without).
        ingress_nodes = ray_cluster.driver(
            "from ray._private.state import actors\n"
            "print(' '.join(a['Address']['NodeID'] for a in actors().values() "
            "if a['State'] == 'ALIVE' and 'Ingress' in a['Name']))").split()
        assert ingress_nodes == [head_id]

        node_ids = set(ray_cluster.node_ids())
        outs = [{}, {}]
        threads = [threading.Thread(target=stream, args=(app.url, f"node loss {i}", LONG,
                                                         outs[i])) for i in (0, 1)]
        for t in threads:
            t.start()
        # The node goes as soon as both streams run: asking Ray anything here would start
        # a driver process (seconds), and the lost node's stream must still be running when
        # its node goes.
        deadline = time.monotonic() + 60
        while not all(len(o.get("events", [])) > 3 for o in outs):
            assert time.monotonic() < deadline, outs
            time.sleep(0.05)
        os.killpg(ray_cluster.nodes[-1].proc.pid, signal.SIGKILL)  # the device node is gone
        at_loss = [len(o["events"]) for o in outs]
        assert {o["node"] for o in outs} == node_ids, outs
        for t in threads:
            t.join(180)
        lost = next(o for o in outs if o["node"] != head_id)
        kept = next(o for o in outs if o["node"] == head_id)

        assert lost["events"][-1] == "[DONE]", lost["events"][-3:]
        assert "error" in lost["events"][-2], (at_loss, lost["events"][-3:])
        error = lost["events"][-2]["error"]
        assert error["code"] == "replica_failed", error
        assert not any(isinstance(e, dict) and e.get("choices")
                       and e["choices"][0]["finish_reason"] for e in lost["events"])

        assert kept["events"][-1] == "[DONE]", kept["events"][-3:]
        assert kept["events"][-2]["choices"][0]["finish_reason"] == "length"
        want = gen.generate(messages=[{"role": "user", "content": "node loss " + str(
            outs.index(kept))}], max_new_tokens=LONG).text
        assert text_of(kept["events"]) == want

        # The ingress and the head's replica still serve.
        r = httpx.post(app.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "after"}],
            "max_tokens": SHORT, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == gen.generate(
            messages=[{"role": "user", "content": "after"}], max_new_tokens=SHORT).text
    ray_cluster.start_worker()
