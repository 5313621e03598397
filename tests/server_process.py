"""The real server, started as a subprocess on a free loopback port, for the tests to drive
with the official `openai` client and raw HTTP (tests/serve and tests/cluster use it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"),
                      max_retries=0, timeout=kwargs.pop("timeout", 60), **kwargs)

    def rss_mb(self) -> float:
        """Resident memory of the server process, from /proc."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS line")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_server(bundle: Path, tmp_path: Path, *flags: str,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """`specedge serve --bundle BUNDLE FLAGS` started on a free port, its output in a log."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specedge.cli", "serve", "--bundle", str(bundle),
             "--port", str(port), "--threads", "1", *flags],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return ServerProcess(proc, port, log)


@contextmanager
def run_server(bundle: Path, tmp_path: Path, *flags: str,
               env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`start_server`, yielded once /health answers 200; killed at the end."""
    server = start_server(bundle, tmp_path, *flags, env=env)
    proc = server.proc
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n"
                                   f"{server.output()}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready:\n{server.output()}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
