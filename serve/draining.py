"""The uvicorn server of `specedge serve`, which drains on SIGTERM.

uvicorn on its own stops listening at the first SIGTERM, so a client that connects during
shutdown gets "connection refused", and it re-raises the signal at exit, so the process
ends with status -15. Here the first SIGTERM (or Ctrl-C) only drains: new requests get 503
while those in flight finish, up to the shutdown timeout; those still running then end with
an error event, and the process exits 0. A second signal stops without the wait: the
requests in flight end with the error event after their current step. A third closes the
connections as they are.

The process exits only once the worker thread has left the model (`exit_after_worker`):
ONNX Runtime aborts the process ("terminate called without an active exception") when the
interpreter shuts down while a thread is still inside one of its calls.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import NoReturn

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
        self.stopping_now = False
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        server = self.app_server
        if self.stopping_now or server.phase != "ready" and self.drain_deadline is None:
            self.force_exit = self.stopping_now  # a third signal
            self.should_exit = True
            return
        if self.drain_deadline is not None:  # a second signal
            log.info("stopping now: ending the %d requests in flight", server.engine.in_flight)
            server.engine.withdraw_all("shutdown")
            self.stopping_now = True
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

    def exit_after_worker(self, code: int, within: float = 10.0) -> NoReturn:
        """Exit with `code` once the engine's threads have stopped; after `within` seconds
        without them, at once (os._exit), which skips the interpreter's shutdown that would
        abort the process while a model call runs."""
        engine = self.app_server.engine
        engine.stop()
        if engine.join(within):
            sys.exit(code)
        log.warning("the model call in progress did not end within %g s; exiting without it",
                    within)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
