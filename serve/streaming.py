"""Waiting on a job while watching its client, and the server-sent-events response.

Both answers, whole and streamed, wait on the job's events the same way (`job_events`):
the ASGI `http.disconnect` message ends the job at once (queued: out of the queue;
running: after the step in progress), the request timeout ends it with a 504, and a
silence longer than the keep-alive interval yields a "keepalive" event, which a stream
sends as an SSE comment so that proxies and clients do not give up on a long prefill or
a long wait in the queue.

The SSE response is written here rather than with a library's streaming response, so that
the disconnect watch, the keep-alive and the closing error event are all in one place.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from specedge.serve.protocol import APIError
from specedge.serve.worker import Job

Receive = Callable[[], Awaitable[dict]]
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


class ClientGone(Exception):
    """The client disconnected: nothing more can be sent."""


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _disconnected(receive: Receive) -> None:
    """Return when the client has gone (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def ended_early(job: Job, shutdown_message: str) -> APIError:
    """The error for a job that ended before its generation did."""
    if job.why_cancelled == "shutdown":
        return APIError(503, shutdown_message, type="server_error", code="shutting_down")
    return APIError(499, "the request was cancelled", code="cancelled")


class Withdraws(Protocol):
    """What runs the jobs (worker.LocalEngine, cluster's RayEngine): it can take one back."""

    def withdraw(self, job: Job, why: str) -> None: ...


async def job_events(job: Job, engine: Withdraws, receive: Receive, timeout: float,
                     keepalive: float) -> AsyncIterator[tuple[str, Any]]:
    """The job's events up to ("done", result) or ("error", exception), with
    ("keepalive", None) after `keepalive` seconds of silence.

    Raises ClientGone when the client disconnects and APIError(504) when the request has
    run `timeout` seconds since it arrived; either way the job is withdrawn.
    """
    gone = asyncio.ensure_future(_disconnected(receive))
    get: asyncio.Future | None = None
    deadline = job.arrived + timeout
    try:
        while True:
            get = get or asyncio.ensure_future(job.events.get())
            wait = max(0.0, min(keepalive, deadline - time.monotonic()))
            done, _ = await asyncio.wait({get, gone}, timeout=wait,
                                         return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                kind, value = get.result()
                get = None
                yield kind, value
                if kind in ("done", "error"):
                    return
            elif gone in done:
                engine.withdraw(job, "disconnected")
                raise ClientGone
            elif time.monotonic() >= deadline:
                engine.withdraw(job, "timeout")
                raise APIError(504, f"the request ran longer than the server's request "
                               f"timeout ({timeout:g} s) and was stopped; ask for fewer "
                               "tokens, or start the server with a longer --request-timeout",
                               type="timeout_error", code="request_timeout")
            else:
                yield "keepalive", None
    finally:
        gone.cancel()
        if get is not None:
            get.cancel()
        if not job.finished:
            engine.withdraw(job, "disconnected")


class EventStream:
    """An ASGI response that sends `frames(receive)` as a text/event-stream body."""

    media_type = "text/event-stream"

    def __init__(self, frames: Callable[[Receive], AsyncIterator[bytes]],
                 headers: dict[str, str] | None = None):
        self.frames = frames
        self.headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: dict, receive: Receive, send: Callable) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # reverse proxies: do not buffer the events
            *self.headers,
        ]})
        async for frame in self.frames(receive):
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
