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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specedge.runtime.config import GenerationConfig
from specedge.runtime.generator import Generator

log = logging.getLogger("specedge.serve")


class QueueFull(Exception):
    """Every queue slot is taken: answered with 429 and Retry-After."""


@dataclass
class Job:
    """One request's generation: its prompt's token ids and its settings; events go to
    `events` as ("piece", text), then ("done", GenerationResult) or ("error", exception)."""

    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: bool = False
    why_cancelled: str | None = None  # "disconnected", "timeout" or "shutdown"
    headers: dict[str, str] = field(default_factory=dict)  # added to the HTTP response

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
                for piece in self.generator.stream(prompt_ids=job.prompt_ids, config=job.config,
                                                   cancel=job.cancel):
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


def load_in_background(load: Callable[[], Any], loaded: Callable[[Any], None],
                       failed: Callable[[str], None]) -> threading.Thread:
    """Run `load` on a thread of its own, then `loaded(what it returned)`, or
    `failed(message)` when it raised: an engine's start, so that /health answers while the
    bundle opens."""
    def run() -> None:
        try:
            value = load()
        except Exception as e:  # any failure to open the bundle ends the server
            failed(str(e) or type(e).__name__)
            return
        loaded(value)

    thread = threading.Thread(target=run, name="specedge-load", daemon=True)
    thread.start()
    return thread


class LocalEngine:
    """What runs generations in `specedge serve`: one Generator in this process, behind the
    Worker's thread and bounded queue. The cluster mode puts Ray replicas behind the same
    interface (cluster/ingress.py, RayEngine): `start`, `stop`, `submit`, `withdraw`,
    `withdraw_all`, `idle`, `in_flight`, `problem`."""

    def __init__(self, max_queue: int, stall_timeout: float, load: Callable[[], Generator],
                 on_queue_change: Callable[[int, int], None] | None = None):
        self.load = load
        self.stall_timeout = stall_timeout
        self.worker = Worker(max_queue, on_queue_change)
        self.loader: threading.Thread | None = None

    def start(self, loaded: Callable[[Generator], None],
              failed: Callable[[str], None]) -> None:
        """Open the bundle on a thread; then call `loaded(generator)` or `failed(message)`.
        The generator is what the app encodes prompts and checks contexts with."""
        self.worker.start()

        def load() -> Generator:
            generator = self.load()
            # One short generation, so the first request does not pay for the first call.
            generator.generate(prompt_ids=[0], max_new_tokens=2, use_draft=False)
            self.worker.generator = generator
            return generator

        self.loader = load_in_background(load, loaded, failed)

    def stop(self) -> None:
        self.worker.withdraw_all("shutdown")
        self.worker.stop()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the loading and worker threads to end (after
        `stop`); whether they did."""
        deadline = time.monotonic() + timeout
        for thread in (self.loader, self.worker.thread):
            if thread is not None and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    return False
        return True

    async def submit(self, ids: list[int], config: GenerationConfig) -> Job:
        """Queue a generation; QueueFull when every queue slot is taken."""
        job = Job(ids, config, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull:
            raise QueueFull(f"the server is busy: {self.worker.max_queue} requests are "
                            "already waiting; retry shortly") from None
        return job

    def withdraw(self, job: Job, why: str) -> None:
        self.worker.withdraw(job, why)

    def withdraw_all(self, why: str) -> None:
        self.worker.withdraw_all(why)

    @property
    def idle(self) -> bool:
        return self.worker.idle

    @property
    def in_flight(self) -> int:
        return self.worker.waiting + int(self.worker.running is not None)

    def stalled(self) -> float:
        """Seconds the running generation has gone without a token (0 when idle)."""
        if self.worker.running is None:
            return 0.0
        return time.monotonic() - self.worker.last_progress

    def problem(self) -> tuple[str, str] | dict:
        """/health's view: (status, error) when unhealthy, else the queue's counts."""
        if not self.worker.thread.is_alive():
            return "failed", "the worker thread died"
        stalled = self.stalled()
        if stalled > self.stall_timeout:
            return "stalled", f"no token for {stalled:.0f} s"
        return {"waiting": self.worker.waiting, "running": int(self.worker.running is not None)}
