"""The generator's worker and its bounded FIFO queue.

The HTTP event loop never runs a model: the worker does, and hands each text piece to the
request's asyncio queue with `loop.call_soon_threadsafe`. With `max_batch` 1 a `Generator`
serves one sequence at a time on the worker's thread and requests wait their turn here.
With more, up to `max_batch` requests run at once, each on a thread of its own in one
BatchSession (runtime/batch.py), whose model calls carry every running sequence: a
request joins the batch between two steps as soon as a slot is free, and leaves it when
it ends (continuous batching). A request that goes away (its client disconnected, it
timed out, the server is shutting down) is `withdraw`n: taken out of the queue if it is
waiting, or told to stop through its cancel event, which the generator checks after every
speculative step.
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
from specedge.runtime.prefix_store import PrefixStore

log = logging.getLogger("specedge.serve")


class QueueFull(Exception):
    """Every queue slot is taken: answered with 429 and Retry-After."""


@dataclass
class Job:
    """One request's generation: its prompt's token ids and its settings; events go to
    `events` as ("piece", Piece), then ("done", GenerationResult) or ("error", exception)."""

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
    """Runs up to `max_batch` jobs at once; at most `max_queue` wait."""

    def __init__(self, max_queue: int, on_queue_change=None, max_batch: int = 1):
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.generator = None  # set once the bundle is loaded
        self.session = None    # the BatchSession, with max_batch > 1
        self.active: list[Job] = []
        self.last_progress = time.monotonic()  # when a running job last made progress
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
    def running(self) -> int:
        return len(self.active)

    @property
    def idle(self) -> bool:
        return not self.active and not self._queue

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
            jobs = [*self._queue, *self.active]
        for job in jobs:
            self.withdraw(job, why)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def _changed(self) -> None:
        self._on_queue_change(len(self._queue), len(self.active))

    def _next(self) -> Job | None:
        """The next job, once one waits and a slot is free (None: stopping)."""
        with self._wake:
            while (not self._queue or len(self.active) >= self.max_batch) \
                    and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            job = self._queue.popleft()
            self.active.append(job)
            job.started = self.last_progress = time.monotonic()
            self._changed()
            return job

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            if self.session is None:
                self._run(job)
            else:
                threading.Thread(target=self._run, args=(job,), daemon=True,
                                 name="specedge-sequence").start()

    def _run(self, job: Job) -> None:
        try:
            if self.session is None:
                pieces = self.generator.stream_pieces(prompt_ids=job.prompt_ids,
                                                      config=job.config, cancel=job.cancel)
            else:
                pieces = self.session.run(job.prompt_ids, job.config, job.cancel)
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as done:
                    result = done.value
                    break
                self.last_progress = time.monotonic()
                job.post("piece", piece)
            outcome = ("done", result)
        except Exception as e:  # a bad request the checks missed, or a model failure
            if not isinstance(e, ValueError):
                log.exception("generation failed")
            outcome = ("error", e)
        with self._wake:  # finished before the last event, so nobody withdraws it after
            job.finished = True
            self.active.remove(job)
            self._changed()
            self._wake.notify()
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
                 on_queue_change: Callable[[int, int], None] | None = None,
                 max_batch: int = 1, on_batch_call: Callable[[int], None] | None = None,
                 store_bytes: int = 0):
        """`store_bytes`: host memory for the rows of earlier prompts
        (runtime/prefix_store.py): the batch's store with max_batch > 1, else the
        generator's."""
        self.load = load
        self.store_bytes = store_bytes
        self.stall_timeout = stall_timeout
        self.worker = Worker(max_queue, on_queue_change, max_batch)
        self.on_batch_call = on_batch_call
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
            if self.worker.max_batch > 1:  # raises, saying what to export, for a bundle
                from specedge.runtime.batch import BatchSession  # that cannot batch

                self.worker.session = BatchSession(generator, self.worker.max_batch,
                                                   self.on_batch_call, self.store_bytes)
            else:
                generator.prompt_store = PrefixStore(self.store_bytes)
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
        return self.worker.waiting + self.worker.running

    def stalled(self) -> float:
        """Seconds the running generation has gone without a token (0 when idle)."""
        if not self.worker.running:
            return 0.0
        return time.monotonic() - self.worker.last_progress

    def problem(self) -> tuple[str, str] | dict:
        """/health's view: (status, error) when unhealthy, else the queue's counts."""
        if not self.worker.thread.is_alive():
            return "failed", "the worker thread died"
        stalled = self.stalled()
        if stalled > self.stall_timeout:
            return "stalled", f"no token for {stalled:.0f} s"
        return {"waiting": self.worker.waiting, "running": self.worker.running}
