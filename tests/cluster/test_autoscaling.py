"""Autoscaling on the two-node cluster (conftest.py): `--min-replicas 1 --max-replicas 2`
starts one replica, adds the second (on the other node's device) while requests outnumber
the replicas, serves every request meanwhile, and goes back to one when the load ends.
Ray Serve's autoscaler sees the load through metrics that handles push every 10 s, averaged
over 30 s; the delays are set short so that the test waits for that alone (some 20 s each
way)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from cluster.conftest import MODEL, deployed

from specedge.serve.cluster import APP_NAME

CLIENTS = 3          # requests kept in flight: more than the two replicas can take
TOKENS = 300         # a request of a second or two on the slow bundle
SCALE_TIMEOUT = 120  # seconds for the autoscaler to act, each way


@pytest.fixture(scope="module")
def autoscaled(ray_cluster, slow_bundle, tmp_path_factory):
    with deployed(ray_cluster, slow_bundle, tmp_path_factory.mktemp("autoscaled-app"),
                  "--min-replicas", "1", "--max-replicas", "2", "--upscale-delay", "1",
                  "--downscale-delay", "2", "--max-queue", "8") as app:
        yield app


def replicas_when(cluster, want: int, timeout: float) -> dict[str, int]:
    """The replica deployment's replicas by state, once `want` of them run and no other
    is starting or stopping, or after `timeout` seconds (then whatever they are)."""
    return json.loads(cluster.driver(f"""
import json, time
from ray import serve
deadline = time.monotonic() + {timeout}
while True:
    app = serve.status().applications.get({APP_NAME!r})
    states = app.deployments["GeneratorReplica"].replica_states
    if states == {{"RUNNING": {want}}} or time.monotonic() > deadline:
        break
    time.sleep(1)
print(json.dumps(states))
""", timeout=timeout + 60))


def test_load_adds_a_replica_on_the_other_node_and_quiet_removes_it(autoscaled, ray_cluster):
    assert replicas_when(ray_cluster, 1, 60) == {"RUNNING": 1}
    stop = threading.Event()
    answers: list[httpx.Response] = []

    def keep_sending(client: int) -> None:
        while not stop.is_set():
            answers.append(httpx.post(
                autoscaled.url + "/v1/chat/completions", timeout=120,
                json={"model": MODEL, "max_tokens": TOKENS, "temperature": 0,
                      "messages": [{"role": "user", "content": f"client {client}"}]}))

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        senders = [pool.submit(keep_sending, i) for i in range(CLIENTS)]
        try:
            while len({a.headers.get("x-specedge-replica") for a in answers}) < 2:
                assert time.monotonic() - started < SCALE_TIMEOUT, \
                    f"no second replica under load: {replicas_when(ray_cluster, 2, 0)}"
                for sender in senders:
                    if sender.done():
                        sender.result()  # a client that failed: its error
                time.sleep(0.5)
        finally:
            stop.set()
    scaled_up = time.monotonic() - started
    assert [a.status_code for a in answers] == [200] * len(answers), \
        [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["usage"]["completion_tokens"] == TOKENS for a in answers)
    assert {a.headers["x-specedge-node"] for a in answers} == set(ray_cluster.node_ids())

    quiet = time.monotonic()
    assert replicas_when(ray_cluster, 1, SCALE_TIMEOUT) == {"RUNNING": 1}, \
        f"still more than one replica {time.monotonic() - quiet:.0f} s after the load ended"
    # The one replica left serves.
    after = httpx.post(autoscaled.url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "max_tokens": 5, "temperature": 0,
                             "messages": [{"role": "user", "content": "after"}]})
    assert after.status_code == 200, after.text
    print(f"scaled up in {scaled_up:.0f} s, down in {time.monotonic() - quiet:.0f} s")
