"""The OpenAI-compatible app: one bundle, the routes `specedge serve` answers, and what
runs the generations behind them: one local worker (worker.py, LocalEngine), or Ray Serve
replicas on a cluster of devices (cluster/), with the same routes, checks and error shapes.

    POST /v1/chat/completions, /v1/completions   generation, whole or streamed (SSE)
    GET  /v1/models                              the one model
    POST /tokenize, /detokenize                  the bundle's tokenizer
    GET  /health                                 200 ready; 503 loading, draining, stalled;
                                                 both say whether a key is required
    GET  /metrics                                Prometheus (metrics.py)
    GET  /                                       the chat page (page.py), unless --no-ui

A request is checked (key, size, JSON, fields, the runtime's own setting checks, context
length) on the event loop, its prompt encoded in a thread, and only then queued, so a bad
request never takes a queue slot. Every error is OpenAI's shape (protocol.APIError).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specedge.runtime.bundle import Bundle
from specedge.runtime.config import (
    GenerationConfig,
    check_token_ids,
    short_repr,
)
from specedge.runtime.generator import GenerationResult, Generator
from specedge.runtime.pieces import Piece
from specedge.runtime.text import TextCodec
from specedge.serve.metrics import ServerMetrics
from specedge.serve.origins import OriginGuard
from specedge.serve.page import chat_page
from specedge.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Framing,
    TokenizeRequest,
    bad_request,
    parse,
)
from specedge.serve.settings import ServerSettings
from specedge.serve.streaming import (
    DONE,
    KEEPALIVE,
    ClientGone,
    EventStream,
    ended_early,
    job_events,
    sse,
)
from specedge.serve.worker import Job, LocalEngine, QueueFull

log = logging.getLogger("specedge.serve")


class PromptText(Protocol):
    """What the app encodes prompts, checks context lengths and decodes tokens with: the
    engine's Generator in `specedge serve`, the bundle's text side alone (cluster's
    BundleText) in the ingress of the cluster mode."""

    bundle: Bundle
    codec: TextCodec

    def encode_prompt(self, prompt: str | None = None, prompt_ids: Sequence[int] | None = None,
                      messages: Sequence[dict[str, str]] | None = None,
                      raw: bool = False) -> list[int]: ...

    def context_limit(self, config: GenerationConfig) -> int: ...


class Server:
    """The app's state: the engine that runs generations (LocalEngine, or Ray replicas in
    the cluster mode), the metrics, and where the server is in its life: "loading",
    "ready", "draining" (SIGTERM: finishing in-flight requests) or "failed"."""

    def __init__(self, settings: ServerSettings, load: Callable[[], Generator] | None = None,
                 engine=None):
        self.settings = settings
        self.metrics = ServerMetrics()
        if engine is None:
            engine = LocalEngine(settings.max_queue, settings.stall_timeout,
                                 load or (lambda: Generator.from_bundle(
                                     settings.bundle, backend=settings.backend,
                                     threads=settings.threads,
                                     spinning=settings.spinning)),
                                 self.metrics.queue_changed, settings.max_batch,
                                 self.metrics.batch_call, settings.prompt_cache_mb * 2**20)
        self.engine = engine
        self.text: PromptText | None = None  # set once the engine has loaded the bundle
        self.phase = "loading"
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] = lambda message: None

    # ---- life -------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine.start(self._loaded, self._failed)

    def _loaded(self, text: PromptText) -> None:
        self.text = text
        if self.phase == "loading":
            self.phase = "ready"
            log.info("ready: %s on %s", self.settings.name, self.settings.backend)

    def _failed(self, message: str) -> None:
        self.failure = message
        self.phase = "failed"
        log.error("cannot load the bundle: %s", message)
        self.on_failure(message)

    def drain(self) -> None:
        """Stop taking requests; those in flight go on."""
        self.phase = "draining"

    def stop(self) -> None:
        self.engine.stop()

    # ---- checks -----------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "invalid or missing API key: send the header "
                           "'Authorization: Bearer KEY' with the server's key",
                           type="authentication_error", code="invalid_api_key")

    def check_ready(self) -> PromptText:
        if self.phase == "ready" and self.text is not None:
            return self.text
        message = {"loading": "the model is still loading; retry in a few seconds",
                   "draining": "the server is shutting down and takes no new requests",
                   "failed": f"the model failed to load: {self.failure}"}[self.phase]
        raise APIError(503, message, type="server_error", code=f"model_{self.phase}"
                       if self.phase != "draining" else "shutting_down",
                       headers={"Retry-After": "5"} if self.phase == "loading" else None)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.name:
            raise APIError(404, f"the model {model!r} does not exist; this server has "
                           f"{self.settings.name!r}", param="model", code="model_not_found")

    async def read_json(self, request: Request) -> object:
        limit = self.settings.max_body_bytes
        too_big = APIError(413, f"the request body is over the server's limit of {limit} "
                           "bytes (--max-body-bytes)", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > limit:
                    raise too_big

        try:
            await asyncio.wait_for(read(), self.settings.body_timeout)
        except ClientDisconnect:
            raise ClientGone from None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within "
                           f"{self.settings.body_timeout:g} s; send it whole, or start the "
                           "server with a longer --body-timeout",
                           code="request_timeout") from None
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    # ---- generation -------------------------------------------------------------------------

    async def prepare(self, request: Request, chat: bool
                      ) -> tuple[ChatRequest | CompletionRequest, list[int], GenerationConfig]:
        """Every check that can fail before the request takes a queue slot."""
        self.check_key(request)
        text = self.check_ready()
        req = parse(ChatRequest if chat else CompletionRequest, await self.read_json(request))
        if unknown := req.unknown_fields():
            # repr: a client's field name never forges a line or a control sequence in the log
            log.warning("ignoring unknown request fields: %s%s",
                        ", ".join(short_repr(name, 40) for name in unknown[:8]),
                        f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        req.check_supported()
        self.check_model(req.model)
        if chat and len(req.messages) > self.settings.max_messages:
            raise bad_request(f"{len(req.messages)} messages is over the server's limit of "
                              f"{self.settings.max_messages} (--max-messages)",
                              param="messages")
        ids = await asyncio.to_thread(self._encode, text, req)
        asked = req.requested_tokens()
        if asked is not None and asked > self.settings.max_tokens:
            raise bad_request(f"max_tokens {asked} is over the server's limit of "
                              f"{self.settings.max_tokens} (--max-tokens)",
                              param="max_tokens")
        config = req.generation_config(asked or 1, self.settings.draft_tokens,
                                       self.settings.drafter, self.settings.draft_threshold)
        try:
            context = text.context_limit(config)
        except ValueError as e:
            raise bad_request(str(e), param="speculative") from e
        room = context - len(ids)
        if room < (asked or 1):
            message = (f"the prompt ({len(ids)} tokens) plus max_tokens ({asked}) is over the "
                       f"model's context of {context} tokens; shorten the prompt or ask for "
                       "fewer tokens" if asked else
                       f"the prompt ({len(ids)} tokens) fills the model's context of {context} "
                       "tokens and leaves no room for an answer; shorten the prompt")
            raise bad_request(message, param="messages" if chat else "prompt",
                              code="context_length_exceeded")
        new_tokens = asked or min(room, self.settings.max_tokens)
        return req, ids, GenerationConfig.of(config, max_new_tokens=new_tokens)

    @staticmethod
    def _encode(text: PromptText, req: ChatRequest | CompletionRequest) -> list[int]:
        try:
            if isinstance(req, ChatRequest):
                return text.encode_prompt(messages=req.chat_messages())
            if isinstance(req.prompt, list):
                return text.encode_prompt(prompt_ids=req.prompt)
            return text.encode_prompt(req.prompt, raw=True)
        except ValueError as e:
            raise bad_request(str(e), param="messages" if isinstance(req, ChatRequest)
                              else "prompt") from e

    async def submit(self, ids: list[int], config: GenerationConfig) -> Job:
        try:
            return await self.engine.submit(ids, config)
        except QueueFull as e:
            raise _as_api_error(e) from None

    def events(self, job: Job, receive) -> AsyncIterator[tuple[str, object]]:
        s = self.settings
        return job_events(job, self.engine, receive, s.request_timeout, s.keepalive)

    def finished(self, job: Job, result: GenerationResult, prompt_tokens: int) -> None:
        self.metrics.generation(result.stats, prompt_tokens, time.monotonic() - job.arrived)

    async def whole(self, request: Request, job: Job, ids: list[int], chat: bool,
                    marks: bool) -> dict:
        """A non-streamed completion; with `marks`, those of every piece."""
        first = True
        pieces: list[Piece] = []
        async for kind, value in self.events(job, request.receive):
            if kind == "piece":
                if first and value.text:
                    self.metrics.ttft.observe(time.monotonic() - job.arrived)
                    first = False
                if marks:
                    pieces.append(value)
            elif kind == "error":
                raise _as_api_error(value)
            elif kind == "done":
                if value is None or value.stop_reason == "cancelled":
                    raise ended_early(job, "the server shut down before the answer was done")
                self.finished(job, value, len(ids))
                return Framing(chat, self.settings.name).whole(
                    value, len(ids), Piece.joined(pieces) if marks else None)
        raise ClientGone  # the events end only with done or error

    def streamed(self, request: Request, job: Job, ids: list[int], chat: bool,
                 usage: bool, marks: bool) -> EventStream:
        framing = Framing(chat, self.settings.name)
        endpoint = request.url.path

        async def frames(receive) -> AsyncIterator[bytes]:
            status = 200
            try:
                if chat:
                    yield sse(framing.chunk(role=True, usage_field=usage))
                first = True
                async for kind, value in self.events(job, receive):
                    if kind == "keepalive":
                        yield KEEPALIVE
                    elif kind == "piece":
                        if not (value.text or marks):
                            continue  # a step that showed no text: nothing to send
                        if first and value.text:
                            self.metrics.ttft.observe(time.monotonic() - job.arrived)
                            first = False
                        yield sse(framing.chunk(value, usage_field=usage, marks=marks))
                    elif kind == "error":
                        raise _as_api_error(value)
                    elif value is None or value.stop_reason == "cancelled":
                        raise ended_early(job, "the server shut down before the answer "
                                          "was done")
                    else:
                        self.finished(job, value, len(ids))
                        yield sse(framing.chunk(finish=value, usage_field=usage))
                        if usage:
                            yield sse(framing.usage_chunk(value, len(ids)))
                yield DONE
            except APIError as e:
                # The status line is sent: the error goes as the stream's last event.
                status = e.status
                yield sse(e.body())
                yield DONE
            except ClientGone:
                status = 499
            finally:
                self.metrics.requests.labels(endpoint, str(status)).inc()

        return EventStream(frames, job.headers)

    # ---- routes -----------------------------------------------------------------------------

    async def completions(self, request: Request, chat: bool) -> Response:
        req, ids, config = await self.prepare(request, chat)
        job = await self.submit(ids, config)
        if req.stream:
            return self.streamed(request, job, ids, chat, req.include_usage, req.include_marks)
        return JSONResponse(await self.whole(request, job, ids, chat, req.include_marks),
                            headers=job.headers)

    async def tokenize(self, request: Request) -> dict:
        self.check_key(request)
        text = self.check_ready()
        req = parse(TokenizeRequest, await self.read_json(request))
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'")
        try:
            if req.messages is not None:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                ids = await asyncio.to_thread(text.encode_prompt, messages=messages)
            else:
                ids = await asyncio.to_thread(text.encode_prompt, req.prompt, raw=True)
        except ValueError as e:
            raise bad_request(str(e)) from e
        return {"count": len(ids), "max_model_len": text.bundle.target.max_context,
                "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        self.check_key(request)
        text = self.check_ready()
        req = parse(DetokenizeRequest, await self.read_json(request))
        self.check_model(req.model)
        try:
            ids = check_token_ids(req.tokens, text.bundle.target.vocab_size)
        except ValueError as e:
            raise bad_request(str(e).replace("prompt_ids", "tokens"), param="tokens") from e
        return {"prompt": text.codec.decode(ids)}

    def models(self, request: Request) -> dict:
        self.check_key(request)
        text = self.check_ready()
        return {"object": "list", "data": [{
            "id": self.settings.name, "object": "model", "created": 0, "owned_by": "specedge",
            "max_model_len": text.bundle.target.max_context}]}

    def health(self) -> Response:
        # Whether the API asks for a key: the chat page asks the user for it before it calls
        # the API, instead of meeting a 401 as it opens.
        key = {"key_required": self.settings.api_key is not None}
        if self.phase != "ready":
            body = {"status": self.phase} | ({"error": self.failure} if self.failure else {})
            return JSONResponse(body | key, status_code=503)
        problem = self.engine.problem()
        if isinstance(problem, tuple):
            return JSONResponse({"status": problem[0], "error": problem[1]} | key,
                                status_code=503)
        return JSONResponse({"status": "ok"} | problem | key)


def _as_api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFull):
        return APIError(429, str(error), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(error, ValueError):
        return bad_request(str(error))
    return APIError(500, f"generation failed: {error}", type="server_error")


def _json(endpoint: str, server: Server, handler) -> Callable:
    """A route that answers the handler's dict as JSON, an APIError in OpenAI's shape, and
    counts the status."""

    async def route(request: Request) -> Response:
        try:
            result = handler(request)
            if asyncio.iscoroutine(result):
                result = await result
            response = result if isinstance(result, (Response, EventStream)) \
                else JSONResponse(result)
        except APIError as e:
            response = JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except ClientGone:
            response = Response(status_code=499)
        if not isinstance(response, EventStream):
            server.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    return route


def build_app(settings: ServerSettings, load: Callable[[], Generator] | None = None,
              server: Server | None = None) -> Starlette:
    """The Starlette app for `settings`, the one app of both modes: `specedge serve` runs it
    on uvicorn with a LocalEngine, the cluster mode inside a Ray Serve ingress with Ray
    replicas behind it (cluster/). `load` opens the bundle (Generator.from_bundle by
    default), on a thread after start-up, so /health answers 503 while it runs."""
    if server is None:
        server = Server(settings, load)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        server.start()
        yield
        server.stop()

    async def not_found(request: Request, exc: HTTPException) -> Response:
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: "
                         f"{exc.detail}", code="not_found" if exc.status_code == 404 else None)
        # exc.headers: 405's Allow, which lists the methods the path takes
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        error = APIError(500, f"internal error: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    def metrics(request: Request) -> Response:
        return Response(generate_latest(server.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/chat/completions", _json("/v1/chat/completions", server,
              lambda r: server.completions(r, chat=True)), methods=["POST"]),
        Route("/v1/completions", _json("/v1/completions", server,
              lambda r: server.completions(r, chat=False)), methods=["POST"]),
        Route("/v1/models", _json("/v1/models", server, server.models), methods=["GET"]),
        Route("/tokenize", _json("/tokenize", server, server.tokenize), methods=["POST"]),
        Route("/detokenize", _json("/detokenize", server, server.detokenize),
              methods=["POST"]),
        Route("/health", lambda r: server.health(), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if settings.ui:
        routes.append(Route("/", chat_page, methods=["GET"]))
    paths = {route.path for route in routes}

    def refused(path: str) -> None:
        if path in paths:  # a label per known path only: a client cannot grow /metrics
            server.metrics.requests.labels(path, "403").inc()

    middleware = [Middleware(OriginGuard, allowed_hosts=settings.allowed_hosts,
                             allowed_origins=settings.allowed_origins, refused=refused)]
    if settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["authorization", "content-type"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: not_found, Exception: server_error})
    app.state.server = server
    return app
