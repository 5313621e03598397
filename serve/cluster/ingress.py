"""The ingress deployment: `specedge serve`'s app (app.build_app) with a RayEngine in place
of the local worker, calling the replicas through a streaming DeploymentHandle; it holds
the bundle's tokenizer and chat template, not its models (docs/cluster.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from specedge.runtime.bundle import load_bundle
from specedge.runtime.config import GenerationConfig
from specedge.runtime.generator import GenerationResult, context_limit
from specedge.runtime.text import TextCodec
from specedge.serve.app import Server, ServerSettings, build_app
from specedge.serve.protocol import APIError
from specedge.serve.worker import Job, QueueFull, load_in_background

log = logging.getLogger("specedge.serve")


class BundleText:
    """The bundle's tokenizer and chat template without its models: what the ingress encodes
    prompts (TextCodec.encode_prompt) and checks context lengths with (the runtime's
    context_limit), exactly as a Generator does."""

    def __init__(self, path: str):
        self.bundle = load_bundle(path)
        self.codec = TextCodec(self.bundle)

    def encode_prompt(self, *args, **kwargs) -> list[int]:
        return self.codec.encode_prompt(*args, **kwargs)

    def context_limit(self, config: GenerationConfig) -> int:
        return context_limit(self.bundle, config)


class RayEngine:
    """app.LocalEngine's interface, generations sent to GeneratorReplica through a streaming
    handle. `submit` returns once a replica has taken the request, or once the request has
    waited the keep-alive interval in the handle's queue: a full queue refuses a request at
    once (429 before any HTTP answer starts), and a request still waiting after that was
    queued, so its answer starts and a stream sends keep-alive comments while it waits, as
    `specedge serve` does for a queued request (its answer then has no x-specedge-replica
    headers: no replica had it when they were sent)."""

    def __init__(self, replica, settings: ServerSettings):
        self.replica = replica.options(stream=True)
        self.settings = settings
        self.waiting = 0
        self.running = 0
        self.jobs: dict[int, Job] = {}  # by id(job): submitted and not yet over

    def start(self, loaded: Callable[[BundleText], None],
              failed: Callable[[str], None]) -> None:
        load_in_background(lambda: BundleText(self.settings.bundle), loaded, failed)

    def stop(self) -> None:
        self.withdraw_all("shutdown")

    async def submit(self, ids: list[int], config: GenerationConfig) -> Job:
        job = Job(ids, config, asyncio.get_running_loop())
        stream = self.replica.generate.remote(job.prompt_ids, job.config)
        taken = asyncio.ensure_future(self._taken(job, stream))
        try:
            wait = min(self.settings.keepalive, self.settings.request_timeout)
            await asyncio.wait_for(asyncio.shield(taken), wait)
        except asyncio.TimeoutError:
            pass  # queued: the job's events say when a replica takes it
        except BaseException:
            if not taken.done():  # the client went away while it waited
                taken.cancel()
                stream.cancel()
            raise  # or the request was refused: the handle has dropped it
        job.pump = asyncio.ensure_future(self._pump(job, stream, taken))
        self.jobs[id(job)] = job
        return job

    async def _taken(self, job: Job, stream) -> None:
        """Wait for the replica's first item, which says who took the request."""
        self.waiting += 1
        try:
            first = await stream.__anext__()
        except BackPressureError:
            raise QueueFull(f"every replica is busy and {self.settings.max_queue} requests "
                            "are already waiting; retry shortly") from None
        except DeploymentUnavailableError as e:
            raise APIError(503, f"no replica can take requests: {e}", type="server_error",
                           code="replicas_unavailable", headers={"Retry-After": "5"}) from e
        except (RayActorError, ActorUnavailableError) as e:
            raise _replica_lost(e) from e
        finally:
            self.waiting -= 1
        who = first["started"]
        job.headers.update({"x-specedge-replica": who["replica"],
                            "x-specedge-node": who["node"],
                            "x-specedge-replica-pid": str(who["pid"])})
        job.started = time.monotonic()

    async def _pump(self, job: Job, stream, taken: asyncio.Future) -> None:
        """The replica's items into the job's events, as the local worker posts them."""
        try:
            await taken
            self.running += 1
            try:
                async for item in stream:
                    if "piece" in item:
                        job.events.put_nowait(("piece", item["piece"]))
                        continue
                    job.finished = True
                    if "done" in item:
                        result: GenerationResult = item["done"]
                        job.events.put_nowait(("done", result))
                    else:
                        job.events.put_nowait(("error", ValueError(item["error"])))
                    return
            finally:
                self.running -= 1
            raise RuntimeError("the replica's stream ended without a result")
        except asyncio.CancelledError:
            taken.cancel()
            stream.cancel()
            raise
        except Exception as e:
            if not job.finished:
                job.finished = True
                lost = isinstance(e, (RayActorError, ActorUnavailableError))
                job.events.put_nowait(("error", _replica_lost(e) if lost else e))
        finally:
            self.jobs.pop(id(job), None)

    def withdraw(self, job: Job, why: str) -> None:
        if job.finished:
            return
        job.why_cancelled = job.why_cancelled or why
        job.finished = True
        job.pump.cancel()
        job.events.put_nowait(("done", None))

    def withdraw_all(self, why: str) -> None:
        for job in list(self.jobs.values()):
            self.withdraw(job, why)

    @property
    def idle(self) -> bool:
        return self.waiting == 0 and self.running == 0

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running

    def problem(self) -> dict:
        return {"waiting": self.waiting, "running": self.running}


def _replica_lost(error: BaseException) -> APIError:
    log.warning("a replica stopped during a request: %s", error)
    return APIError(503, "the replica serving this request stopped before the answer was "
                    "done (its process ended or its node left the cluster); retry the "
                    "request", type="server_error", code="replica_failed",
                    headers={"Retry-After": "1"})


class Ingress:
    """The HTTP side: `specedge serve`'s app, on a RayEngine."""

    def __init__(self, replica, settings: ServerSettings):
        self.server = Server(settings, engine=RayEngine(replica, settings))

    def __serve_build_asgi_app__(self):
        return build_app(self.server.settings, server=self.server)
