"""The replica deployment: one Generator on one device, one generation at a time, every
step on one thread off the event loop so that a cancellation lands between two steps; with
--max-batch N, up to N generations at once in a BatchSession, each on a thread of its own,
their steps sharing each model call (docs/cluster.md)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Generator as PieceGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve

from specedge.runtime.batch import BatchSession
from specedge.runtime.config import GenerationConfig
from specedge.runtime.generator import GenerationResult, Generator
from specedge.runtime.pieces import Piece
from specedge.runtime.prefix_store import PrefixStore
from specedge.serve.app import ServerSettings
from specedge.serve.metrics import BATCH_ROWS_BUCKETS, LATENCY_BUCKETS, generation_counts

log = logging.getLogger("specedge.serve")


class ReplicaMetrics:
    """`specedge serve`'s speculative counters and latency histograms (metrics.py), kept by
    each replica through Ray's metrics: Ray tags them with the deployment and the replica
    and exports them on each node's metrics port with a `ray_` prefix
    (`ray_specedge_spec_decode_num_accepted_tokens_total{replica=...}`). The ingress's
    /metrics has the same series summed over the replicas, under their own names; the
    sequences each batched call carried (`specedge_batch_rows`) are the replica's only."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Histogram

        def counter(name: str, what: str, tags: tuple[str, ...] = ()) -> Counter:
            return Counter(name, description=what, tag_keys=tags)

        def histogram(name: str, what: str) -> Histogram:
            return Histogram(name, description=what, boundaries=list(LATENCY_BUCKETS))

        self.prompt_tokens = counter("specedge_prompt_tokens", "prompt tokens processed")
        self.generation_tokens = counter("specedge_generation_tokens", "tokens generated")
        self.target_calls = counter("specedge_target_calls", "target model calls")
        self.num_drafts = counter("specedge_spec_decode_num_drafts", "steps that drafted")
        self.draft_tokens = counter("specedge_spec_decode_num_draft_tokens", "tokens drafted")
        self.accepted_tokens = counter("specedge_spec_decode_num_accepted_tokens",
                                       "draft tokens accepted")
        self.accepted_per_pos = counter("specedge_spec_decode_num_accepted_tokens_per_pos",
                                        "draft tokens accepted at each draft position",
                                        ("position",))
        self.ttft = histogram("specedge_time_to_first_token_seconds",
                              "the replica's start of a request to its first text")
        self.latency = histogram("specedge_request_latency_seconds",
                                 "the replica's start of a request to its last token")
        self.batch_rows = Histogram("specedge_batch_rows", description="sequences carried "
                                    "by each batched target call (--max-batch > 1)",
                                    boundaries=list(BATCH_ROWS_BUCKETS))

    def batch_call(self, rows: int) -> None:
        """One target call that carried `rows` sequences (BatchSession's on_call)."""
        self.batch_rows.observe(rows)

    def generation(self, stats: dict, prompt_tokens: int, first: float | None,
                   seconds: float) -> None:
        for name, count in generation_counts(stats, prompt_tokens).items():
            if count:  # a Ray counter takes only positive increments
                getattr(self, name).inc(count)
        for position, accepted in enumerate(stats["position_accepts"]):
            if accepted:
                self.accepted_per_pos.inc(accepted, tags={"position": str(position)})
        if first is not None:
            self.ttft.observe(first)
        self.latency.observe(seconds)


class GeneratorReplica:
    """One bundle opened on this node's device; `settings.max_batch` generations at a time
    (Ray sends it as many: application.py, max_ongoing_requests)."""

    def __init__(self, settings: ServerSettings):
        self.generator = Generator.from_bundle(settings.bundle, backend=settings.backend,
                                               threads=settings.threads,
                                               spinning=settings.spinning)
        # One generation at a time: every step runs on one thread, in order. Batched: a
        # thread each, and a slot more than Ray sends requests, for the idle health check's
        # one-token step, which may meet a request that arrives meanwhile.
        self.metrics = ReplicaMetrics()
        self.session = (BatchSession(self.generator, settings.max_batch + 1,
                                     self.metrics.batch_call, settings.prompt_cache_mb * 2**20)
                        if settings.max_batch > 1 else None)
        if self.session is None:
            self.generator.prompt_store = PrefixStore(settings.prompt_cache_mb * 2**20)
        self.steps = ThreadPoolExecutor(settings.max_batch + (self.session is not None),
                                        thread_name_prefix="specedge-steps")
        self.steps.submit(self._one_token).result()  # the first request pays no warm-up
        self.stall_timeout = settings.stall_timeout
        self.runs = 0  # generations submitted to the step thread and not yet over
        self.runs_lock = threading.Lock()
        self.last_progress = time.monotonic()
        context = serve.get_replica_context()
        self.identity = {"replica": context.replica_id.unique_id,
                         "node": ray.get_runtime_context().get_node_id(),
                         "pid": os.getpid()}
        log.info("replica %s ready on node %s", self.identity["replica"],
                 self.identity["node"])

    def _one_token(self) -> None:
        for _ in self._pieces([0], GenerationConfig(max_new_tokens=1, use_draft=False)):
            pass

    def _pieces(self, ids: list[int], config: GenerationConfig,
                cancel: threading.Event | None = None
                ) -> PieceGenerator[Piece, None, GenerationResult]:
        """One generation's pieces; returns its GenerationResult."""
        if self.session is not None:
            return (yield from self.session.run(ids, config, cancel))
        return (yield from self.generator.stream_pieces(prompt_ids=ids, config=config,
                                                        cancel=cancel))

    def _run(self, ids: list[int], config: GenerationConfig, cancel: threading.Event,
             put: Callable[[tuple[str, Any]], None]) -> None:
        """On a step thread: one generation, its pieces handed to the event loop as they
        are accepted; `cancel` ends it after the step in flight."""
        pieces = self._pieces(ids, config, cancel)
        try:
            while True:
                put(("piece", next(pieces)))
                self.last_progress = time.monotonic()
        except StopIteration as done:
            put(("done", done.value))
        except ValueError as e:  # a request the runtime refuses: the client's mistake
            put(("error", str(e)))
        except Exception as e:
            log.exception("generation failed")
            put(("failed", e))
        finally:
            with self.runs_lock:
                self.runs -= 1

    async def generate(self, ids: list[int], config: GenerationConfig
                       ) -> AsyncIterator[dict[str, Any]]:
        """{"started": identity}, then {"piece": Piece}..., then {"done": GenerationResult}
        or {"error": message} for a request the runtime refuses (the client's mistake).
        The pieces accepted while the last one was on its way go as one, so a fast
        model's stream costs fewer messages, never later text."""
        yield {"started": self.identity}
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        with self.runs_lock:
            self.runs += 1
        self.last_progress = began = time.monotonic()
        first = None
        self.steps.submit(self._run, ids, config, cancel,
                          lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        try:
            while True:
                items = [await events.get()]
                while not events.empty():
                    items.append(events.get_nowait())
                pieces = [value for kind, value in items if kind == "piece"]
                if pieces:
                    piece = Piece.joined(pieces)
                    if piece.text:
                        first = first or time.monotonic() - began
                    yield {"piece": piece}
                kind, value = items[-1]
                if kind == "done":
                    self.metrics.generation(value.stats, len(ids), first,
                                            time.monotonic() - began)
                    yield {"done": value}
                    return
                if kind == "error":
                    yield {"error": value}
                    return
                if kind == "failed":
                    raise value
        finally:
            cancel.set()  # the client went away (or the generation is over: no effect)

    async def check_health(self) -> None:
        """Busy: tokens keep coming. Idle: a one-token step runs (never queued behind a
        generation, which could outlast Ray's health-check timeout)."""
        if self.runs:
            stalled = time.monotonic() - self.last_progress
            if stalled > self.stall_timeout:
                raise RuntimeError(f"no token for {stalled:.0f} s")
            return
        await asyncio.get_running_loop().run_in_executor(self.steps, self._one_token)

    def __del__(self) -> None:
        self.steps.shutdown(wait=False, cancel_futures=True)
