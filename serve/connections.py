"""What one client connection may hold of `specedge serve`: a header block of bounded size,
sent within a time limit, among a bounded number of open connections.

uvicorn's HTTP/1.1 protocol (h11) bounds a header block only while it is incomplete, waits
forever for a request that never ends its headers, and accepts connections until the
process runs out of file descriptors. So a client that opens connections and sends a
header byte a second (slowloris), or never sends at all, locks everyone else out. Here a
connection must finish its request line and headers within `--header-timeout` seconds of
its first byte (or of opening), in at most `--max-header-bytes`, else it gets 408 or 431
and is closed; a connection beyond `--max-connections` gets 503 and is closed at once. The
request body has its own time limit, in the app (app.py, `read_json`), and an idle
keep-alive connection closes after uvicorn's keep-alive timeout.

h11 also frames a stream for an HTTP/1.0 client by closing the connection (it has no
chunked encoding), where httptools, uvicorn's other protocol, sends chunks it cannot read.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specedge.serve.settings import ConnectionLimits

log = logging.getLogger("specedge.serve")

_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
              b"connection: close\r\n\r\n")
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\n"
         b"connection: close\r\n\r\n")


def protocol_class(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits`, for `uvicorn.Config(http=...)`."""

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._head_bytes = 0  # of the request line and headers arriving
            if len(self.connections) > limits.max_connections:
                log.warning("refusing a connection: %d are open (--max-connections)",
                            len(self.connections) - 1)
                self._close_with(_BUSY)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():  # refused above: what follows is not read
                return
            if self.conn.their_state is h11.IDLE:  # a request line and headers arriving
                if self._header_timer is None:
                    self._arm()  # the next request on a kept-alive connection has begun
                # h11 bounds only a header block still incomplete; one that arrives whole
                # is counted here.
                end = data.find(b"\r\n\r\n")
                size = self._head_bytes + (len(data) if end < 0 else end)
                if size > limits.max_header_bytes:
                    self._close_with(_TOO_LARGE)
                    return
                self._head_bytes = size if end < 0 else 0
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # its headers are complete (or the connection failed)
                self._head_bytes = 0

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._close_with(_TIMEOUT)

        def _close_with(self, response: bytes) -> None:
            self.transport.write(response)
            self.transport.close()

    return LimitedH11Protocol
