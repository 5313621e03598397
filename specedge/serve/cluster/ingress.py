"""The ingress deployment: `specedge serve`'s app (app.build_app) with a RayEngine in place
of the local worker, calling the replicas through a streaming DeploymentHandle; it holds
the bundle's tokenizer and chat template, not its models (docs/cluster.md)."""

from __future__ import annotations

import asyncio
import logging
import threading
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
from specedge.serve.worker import Job, QueueFull

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
    handle. A request's HTTP answer starts once a replica has taken it, so that a request
    refused by the full queue gets a plain 429 (a stream sends no event until then)."""

    def __init__(self, replica, settings: ServerSettings):
        self.replica = replica.options(stream=True)
        self.settings = settings
        self.waiting = 0
        self.running = 0
        self.jobs: dict[int, Job] = {}  # by id(job): the running ones

    def start(self, loaded: Callable[[BundleText], None],
              failed: Callable[[str], None]) -> None:
        def load() -> None:
            try:
                text = BundleText(self.settings.bundle)
            except Exception as e:
                failed(str(e) or type(e).__name__)
                return
            loaded(text)

        threading.Thread(target=load, name="specedge-load", daemon=True).start()

    def stop(self) -> None:
        self.withdraw_all("shutdown")

    async def submit(self, ids: list[int], config: GenerationConfig) -> Job:
        job = Job({}, asyncio.get_running_loop())
        stream = self.replica.generate.remote(ids, config)
        self.waiting += 1
        try:
            first = await asyncio.wait_for(stream.__anext__(), self.settings.request_timeout)
        except asyncio.TimeoutError:
            stream.cancel()
            raise APIError(504, "the request waited longer than the server's request timeout "
                           f"({self.settings.request_timeout:g} s) for a replica and was "
                           "dropped; retry later, or add replicas", type="timeout_error",
                           code="request_timeout") from None
        except BackPressureError:
            raise QueueFull(f"every replica is busy and {self.settings.max_queue} requests "
                            "are already waiting; retry shortly") from None
        except DeploymentUnavailableError as e:
            raise APIError(503, f"no replica can take requests: {e}", type="server_error",
                           code="replicas_unavailable", headers={"Retry-After": "5"}) from e
        except (RayActorError, ActorUnavailableError) as e:
            raise _replica_lost(e) from e
        except BaseException:
            stream.cancel()
            raise
        finally:
            self.waiting -= 1
        who = first["started"]
        job.headers = {"x-specedge-replica": who["replica"], "x-specedge-node": who["node"],
                       "x-specedge-replica-pid": str(who["pid"])}
        job.started = time.monotonic()
        job.pump = asyncio.ensure_future(self._pump(job, stream))
        self.jobs[id(job)] = job
        return job

    async def _pump(self, job: Job, stream) -> None:
        """The replica's items into the job's events, as the local worker posts them."""
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
            raise RuntimeError("the replica's stream ended without a result")
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            if not job.finished:
                job.finished = True
                lost = isinstance(e, (RayActorError, ActorUnavailableError))
                job.events.put_nowait(("error", _replica_lost(e) if lost else e))
        finally:
            self.running -= 1
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
