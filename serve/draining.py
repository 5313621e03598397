"""The uvicorn server of `specedge serve`, which drains on SIGTERM.

uvicorn on its own stops listening at the first SIGTERM, so a client that connects during
shutdown gets "connection refused", and it re-raises the signal at exit, so the process
ends with status -15. Here the first SIGTERM (or Ctrl-C) only drains: new requests get 503
while those in flight finish, up to the shutdown timeout; those still running then end with
an error event, and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import logging
import time

import uvicorn

from specedge.serve.app import Server

log = logging.getLogger("specedge.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above; `exit_code` is 1 when the app failed to
    start (the bundle could not be opened), else 0."""

    def __init__(self, config: uvicorn.Config, server: Server, shutdown_timeout: float):
        super().__init__(config)
        self.app_server = server
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: float | None = None
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        server = self.app_server
        if self.drain_deadline is not None or server.phase != "ready":
            self.force_exit = self.drain_deadline is not None
            self.should_exit = True
            return
        log.info("draining: no new requests; waiting up to %g s for %d in flight",
                 self.shutdown_timeout, server.engine.in_flight)
        server.drain()
        self.drain_deadline = time.monotonic() + self.shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        engine = self.app_server.engine
        if self.drain_deadline is not None and not self.should_exit:
            if engine.idle:
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                log.warning("shutdown timeout: stopping the requests still in flight")
                engine.withdraw_all("shutdown")
                self.should_exit = True
        return await super().on_tick(counter)

    def failed(self, message: str) -> None:
        self.exit_code = 1
        self.should_exit = True
