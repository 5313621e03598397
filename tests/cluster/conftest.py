"""A real two-node Ray cluster on 127.0.0.1, and `specedge serve --ray` deployed on it.

Each node is a `ray start --block` process in a session of its own (one CPU, the dashboard
and usage stats off, one `edge_device`), so the test can stop exactly the processes it
started: SIGTERM to each `ray start`, then SIGKILL to whatever is left in its process group.
The app serves a bundle slow enough (a few ms a token on one thread) that a request can be
dropped, queued or have its replica killed while it runs.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_process import free_port
from tiny_models import export_slow_bundle


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Every test here is a `cluster` test: the main suite leaves them out (-m "not
    cluster") and CI runs them as a step of their own (scripts/test.sh)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)


CONTEXT = 1024
NODE_START_TIMEOUT = 90.0
DEPLOY_TIMEOUT = 180.0
MODEL = "slow"
MAX_QUEUE = 2
KEEPALIVE = 1.0


@pytest.fixture(scope="session")
def slow_bundle(tmp_path_factory) -> Path:
    """A slow random Llama of CONTEXT positions (tiny_models.export_slow_bundle)."""
    return export_slow_bundle(tmp_path_factory.mktemp("cluster-bundle"), CONTEXT)


class Node:
    """One `ray start --block` process and its process group."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(["ray", "start", "--block", *args], stdout=out,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:  # raylet and gcs_server share its group; workers end with their raylet
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Cluster:
    def __init__(self, address: str, nodes: list[Node], env: dict[str, str],
                 metrics_ports: list[int], worker_args: list[str], logs: Path):
        self.address, self.nodes, self.env = address, nodes, env
        self.metrics_ports = metrics_ports  # each node's Prometheus export of Ray's metrics
        self.worker_args, self.logs = worker_args, logs

    def start_worker(self) -> Node:
        """A worker node joining the cluster (again, after a test killed one), returned
        once the cluster has two nodes alive."""
        worker = Node(["--address", self.address, "--dashboard-agent-listen-port",
                       str(free_port()), "--metrics-export-port", str(self.metrics_ports[1]),
                       *self.worker_args], self.logs / f"worker-{len(self.nodes)}.log",
                      self.env)
        self.nodes.append(worker)
        deadline = time.monotonic() + NODE_START_TIMEOUT
        while len(self.node_ids(check=False)) < 2:
            assert worker.proc.poll() is None, worker.log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the worker node did not join the cluster"
            time.sleep(1)
        return worker

    def driver(self, code: str, timeout: float = 60, check: bool = True) -> str:
        """What `code` prints, run in a short-lived driver process connected to the
        cluster (`ray` is imported); with `check`, the process must succeed."""
        code = f"import ray; ray.init(address={self.address!r}, logging_level='ERROR')\n{code}"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=self.env, timeout=timeout)
        assert out.returncode == 0 or not check, out.stderr
        return out.stdout

    def node_ids(self, check: bool = True) -> list[str]:
        """The alive nodes' ids (none while the head cannot take a driver yet, unless
        `check`)."""
        return self.driver("print(' '.join(n['NodeID'] for n in ray.nodes() if n['Alive']))",
                           check=check).split()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """Head and worker nodes on 127.0.0.1, each with --num-cpus 1 and {"edge_device": 1}."""
    tmp = tmp_path_factory.mktemp("ray")
    # Token authentication with a token of the test's own: a `ray.init()` run on this machine
    # before leaves ~/.ray/auth_token, and nodes started beside it refuse each other
    # (docs/cluster.md, "InvalidAuthToken").
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--resources", '{"edge_device": 1}',
              "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    metrics_ports = [free_port(), free_port()]
    # Unix socket paths must stay short: a temp dir of its own under /tmp.
    temp_dir = Path(f"/tmp/specedge-ray-{os.getpid()}")
    head = Node(["--head", "--port", str(port), "--include-dashboard=false",
                 "--temp-dir", str(temp_dir), "--ray-client-server-port", str(free_port()),
                 "--dashboard-agent-listen-port", str(free_port()),
                 "--metrics-export-port", str(metrics_ports[0]), *common],
                tmp / "head.log", env)
    nodes = [head]
    try:
        _wait_for_port(port, head, NODE_START_TIMEOUT)
        cluster = Cluster(address, nodes, env, metrics_ports, common, tmp)
        cluster.start_worker()
        yield cluster
    finally:
        for node in reversed(nodes):
            node.stop()


def _wait_for_port(port: int, node: Node, timeout: float) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        assert node.proc.poll() is None, node.log.read_text(errors="replace")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, f"no head node on port {port}"
        time.sleep(0.5)


class Deployed:
    """`specedge serve --ray` running the app on the cluster, at `url`."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path, bundle: Path):
        self.proc, self.url, self.log, self.bundle = proc, url, log, bundle

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                      timeout=kwargs.pop("timeout", 120), **kwargs)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def deployed(ray_cluster: Cluster, bundle: Path, tmp: Path, *flags: str) -> Iterator[Deployed]:
    """`specedge serve --ray` with `flags` (HTTP on the head only), up until the block ends;
    then SIGTERM, which takes the app off the cluster, and Serve with it, so the next
    deployment starts Serve anew on its own port."""
    port = free_port()
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specedge.cli", "serve", "--bundle", str(bundle),
             "--ray", ray_cluster.address, "--threads", "1", "--model-name", MODEL,
             "--port", str(port), "--proxy-location", "HeadOnly", "--log-level", "warning",
             *flags],
            stdout=out, stderr=subprocess.STDOUT, env=ray_cluster.env)
    app = Deployed(proc, f"http://127.0.0.1:{port}", log, bundle)
    try:
        deadline = time.monotonic() + DEPLOY_TIMEOUT
        while True:
            assert proc.poll() is None, f"specedge serve --ray exited:\n{app.output()}"
            try:
                if httpx.get(app.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not deployed:\n{app.output()}"
            time.sleep(0.5)
        yield app
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def cluster_app(ray_cluster, slow_bundle, tmp_path_factory) -> Iterator[Deployed]:
    """Two replicas (one per node), room for MAX_QUEUE waiting requests, a keep-alive
    comment after KEEPALIVE silent seconds."""
    with deployed(ray_cluster, slow_bundle, tmp_path_factory.mktemp("cluster-app"),
                  "--replicas", "2", "--max-queue", str(MAX_QUEUE),
                  "--keepalive", str(KEEPALIVE)) as app:
        yield app
