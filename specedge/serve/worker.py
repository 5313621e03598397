"""The generator's one worker thread and its bounded FIFO queue.

A `Generator` serves one sequence at a time, so requests wait their turn here, and the
HTTP event loop never runs a model: the worker thread does, and hands each text piece to
the request's asyncio queue with `loop.call_soon_threadsafe`. A request that goes away
(its client disconnected, it timed out, the server is shutting down) is `withdraw`n: taken
out of the queue if it is waiting, or told to stop through its cancel event, which the
generator checks after every speculative step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("specedge.serve")


class QueueFull(Exception):
    """Every queue slot is taken: answered with 429 and Retry-After."""


@dataclass
class Job:
    """One request's generation: `kwargs` for `Generator.stream`; events go to `events` as
    ("piece", text), then ("done", GenerationResult) or ("error", exception)."""

    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: bool = False
    why_cancelled: str | None = None  # "disconnected", "timeout" or "shutdown"

    def post(self, kind: str, value: Any = None) -> None:
        """Called on the worker thread: hand an event to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Worker:
    """Runs jobs one at a time on its own thread; at most `max_queue` wait."""

    def __init__(self, max_queue: int, on_queue_change=None):
        self.max_queue = max_queue
        self.generator = None  # set once the bundle is loaded
        self.running: Job | None = None
        self.last_progress = time.monotonic()  # when the running job last made progress
        self._queue: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._on_queue_change = on_queue_change or (lambda waiting, running: None)
        self.thread = threading.Thread(target=self._serve, name="specedge-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        return self.running is None and not self._queue

    def submit(self, job: Job) -> None:
        with self._wake:
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(job)
            self._changed()
            self._wake.notify()

    def withdraw(self, job: Job, why: str) -> None:
        """Stop `job`: drop it from the queue, or cancel it after the running step."""
        with self._wake:
            if job.finished:
                return
            job.why_cancelled = job.why_cancelled or why
            job.cancel.set()
            if job in self._queue:
                self._queue.remove(job)
                job.finished = True
                self._changed()
                job.post("done", None)

    def withdraw_all(self, why: str) -> None:
        with self._wake:
            jobs = [*self._queue, *([self.running] if self.running else [])]
        for job in jobs:
            self.withdraw(job, why)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def _changed(self) -> None:
        self._on_queue_change(len(self._queue), int(self.running is not None))

    def _next(self) -> Job | None:
        with self._wake:
            while not self._queue and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            job = self.running = self._queue.popleft()
            job.started = self.last_progress = time.monotonic()
            self._changed()
            return job

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            try:
                for piece in self.generator.stream(cancel=job.cancel, **job.kwargs):
                    self.last_progress = time.monotonic()
                    job.post("piece", piece)
                outcome = ("done", self.generator.last_result)
            except Exception as e:  # a bad request the checks missed, or a model failure
                if not isinstance(e, ValueError):
                    log.exception("generation failed")
                outcome = ("error", e)
            with self._wake:  # finished before the last event, so nobody withdraws it after
                job.finished = True
                self.running = None
                self._changed()
            job.post(*outcome)
