"""`specedge serve`: the command line; the server runs on uvicorn and drains on SIGTERM
(draining.py), or on a Ray Serve cluster with --ray (cluster/)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from specedge.cli_common import (
    add_backend_flag,
    add_bundle_flag,
    add_draft_threshold_flag,
    add_draft_tokens_flag,
    add_drafter_flag,
    add_spinning_flag,
    add_threads_flag,
    bad_input_exits_2,
    fail,
)
from specedge.runtime.bundle import Bundle, load_bundle
from specedge.runtime.errors import SpecEdgeError
from specedge.serve.settings import ConnectionLimits, ServerSettings

log = logging.getLogger("specedge.serve")
# The flags' defaults are the settings' own (settings.py).
SERVER = ServerSettings
LIMITS = ConnectionLimits


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_bundle_flag(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for every interface, with an API key)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    add_backend_flag(p)
    add_threads_flag(p)
    add_spinning_flag(p)
    p.add_argument("--model-name", default=None,
                   help="the model's name in the API (default: the bundle folder's name)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (default: $SPECEDGE_API_KEY "
                     "if set; a key on the command line shows in the process list, so "
                     "prefer --api-key-file or the variable)")
    key.add_argument("--api-key-file", type=Path, default=None,
                     help="read the API key from this file")
    p.add_argument("--max-queue", type=int, default=SERVER.max_queue,
                   help="requests that may wait for the generator; more get 429 (default 32)")
    p.add_argument("--max-batch", type=int, default=SERVER.max_batch,
                   help="requests generated at once, their steps sharing each model call "
                   "(continuous batching); more than 1 needs batched attention (int8/int4 "
                   "bundles by default; exact at every precision) or portable (default 1: "
                   "one at a time)")
    p.add_argument("--prompt-cache-mb", type=int, default=SERVER.prompt_cache_mb,
                   help="on a bundle exported with --attention batched: host memory (MiB) "
                   "for the K/V rows of earlier requests, so that a prompt that starts like "
                   "one of them (a system prompt, an earlier turn) computes only the rest "
                   "(default 256; 0: off)")
    p.add_argument("--request-timeout", type=float, default=SERVER.request_timeout,
                   help="seconds from a request's arrival to its last token (default 600)")
    p.add_argument("--shutdown-timeout", type=float, default=SERVER.shutdown_timeout,
                   help="on SIGTERM, seconds to let in-flight requests finish (default 30)")
    add_draft_tokens_flag(p, "K for requests that do not set their own: an integer or 'auto' "
                          "(default: auto when greedy, 1 when sampling; auto for both with "
                          "--max-batch over 1, priced for the whole batch)")
    add_drafter_flag(p)
    add_draft_threshold_flag(p, "for requests that do not set their own: stop drafting when "
                             "the draft's probability for its token is below this (default "
                             "0: off)")
    p.add_argument("--max-tokens", type=int, default=SERVER.max_tokens,
                   help="the most tokens one request may ask for (default 4096)")
    p.add_argument("--max-messages", type=int, default=SERVER.max_messages,
                   help="the most messages one chat request may hold (default 512)")
    p.add_argument("--max-body-bytes", type=int, default=SERVER.max_body_bytes,
                   help="the largest request body (default 2 MiB)")
    p.add_argument("--keepalive", type=float, default=SERVER.keepalive,
                   help="seconds of silence before a stream sends a keep-alive comment "
                   "(default 15)")
    limits = p.add_argument_group("limits on clients (docs/serve.md#limits)")
    limits.add_argument("--max-connections", type=int,
                        default=LIMITS.max_connections,
                        help="connections open at once; more get 503 and are closed "
                        "(default 256)")
    limits.add_argument("--header-timeout", type=float,
                        default=LIMITS.header_timeout,
                        help="seconds a client has to send a request's headers (default 10)")
    limits.add_argument("--body-timeout", type=float, default=SERVER.body_timeout,
                        help="seconds a client has to send a request's body (default 30)")
    limits.add_argument("--max-header-bytes", type=int,
                        default=LIMITS.max_header_bytes,
                        help="the most bytes of a request line and its headers (default "
                        "16384)")
    limits.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                        help="Host names to answer besides IP addresses, localhost and this "
                        "machine's name (NAME, .example.com for a domain and its subdomains, "
                        "or '*'; default none); other names are refused, as DNS rebinding "
                        "would send them")
    limits.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                        help="web pages on other sites that may call the API "
                        "(scheme://host[:port], or '*'; default none): requests from other "
                        "pages' Origin are refused")
    p.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the chat page at / (default: served)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="default info")
    ray = p.add_argument_group("cluster mode (the ray extra; docs/cluster.md)")
    ray.add_argument("--ray", metavar="ADDRESS", default=None,
                     help="serve on the Ray cluster whose head is at ADDRESS (host:port, or "
                     "'auto' on a node of it): one replica per node that offers the device "
                     "resource; --max-queue then caps the requests waiting for a replica")
    ray.add_argument("--replicas", type=int, default=None,
                     help="a fixed number of replicas (default: --min-replicas, or 1)")
    ray.add_argument("--min-replicas", type=int, default=None,
                     help="autoscaling on ongoing requests between --min-replicas and "
                     "--max-replicas")
    ray.add_argument("--max-replicas", type=int, default=None)
    ray.add_argument("--upscale-delay", type=float, default=None, metavar="SECONDS",
                     help="how long requests must outnumber the replicas before one is added "
                     "(default 30)")
    ray.add_argument("--downscale-delay", type=float, default=None, metavar="SECONDS",
                     help="how long replicas must outnumber the requests before one is removed "
                     "(default 600)")
    ray.add_argument("--device-resource", default="edge_device",
                     help="the Ray custom resource each device node offers once (default "
                     "edge_device: ray start --resources '{\"edge_device\": 1}')")
    ray.add_argument("--proxy-location", default="EveryNode",
                     choices=["EveryNode", "HeadOnly"],
                     help="where Ray Serve runs its HTTP proxy on --host:--port (default: "
                     "every node)")


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text().strip()
        except OSError as e:
            fail(f"cannot read the API key file: {e}")
        if not key:
            fail(f"the API key file {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get("SPECEDGE_API_KEY") or None


def _settings(args: argparse.Namespace) -> ServerSettings:
    """The flags as ServerSettings, which check their own ranges (settings.py)."""
    if not 0 <= args.port < 65536:
        fail(f"--port must be in [0, 65535], got {args.port}")
    with bad_input_exits_2():
        return ServerSettings(
            bundle=args.bundle, backend=args.backend, threads=args.threads,
            spinning=args.thread_spinning,
            model_name=args.model_name, api_key=_api_key(args), max_queue=args.max_queue,
            max_batch=args.max_batch, prompt_cache_mb=args.prompt_cache_mb,
            request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
            draft_tokens=args.draft_tokens, drafter=args.drafter,
            draft_threshold=args.draft_threshold, max_tokens=args.max_tokens,
            max_messages=args.max_messages, max_body_bytes=args.max_body_bytes,
            keepalive=args.keepalive, body_timeout=args.body_timeout,
            allowed_hosts=tuple(args.allowed_hosts),
            allowed_origins=tuple(args.allowed_origins), ui=args.ui)


def _limits(args: argparse.Namespace) -> ConnectionLimits:
    """The client-connection flags as ConnectionLimits, which check their own ranges."""
    with bad_input_exits_2():
        return ConnectionLimits(max_connections=args.max_connections,
                                header_timeout=args.header_timeout,
                                max_header_bytes=args.max_header_bytes)


def _cluster(args: argparse.Namespace):
    """ClusterSettings from the --ray flags."""
    from specedge.serve.cluster import ClusterSettings

    bounds = (args.min_replicas, args.max_replicas)
    if args.replicas is not None and bounds != (None, None):
        fail("give --replicas, or --min-replicas and --max-replicas, not both")
    if args.replicas is not None:
        low = high = args.replicas
    else:
        low = 1 if args.min_replicas is None else args.min_replicas
        high = max(low, 1) if args.max_replicas is None else args.max_replicas
    delays = {name: getattr(args, name) for name in ("upscale_delay", "downscale_delay")
              if getattr(args, name) is not None}
    settings = ClusterSettings(min_replicas=low, max_replicas=high,
                               device_resource=args.device_resource, **delays)
    with bad_input_exits_2():
        settings.check()
    return settings


def check_batchable(settings: ServerSettings, bundle: Bundle) -> None:
    """Exit 2, saying what to export, when --max-batch > 1 cannot run on this bundle and
    backend (locally, and on every cluster replica)."""
    if settings.max_batch <= 1:
        return
    from specedge.runtime.backends.engine_manifest import check_max_batch, engine_entry
    from specedge.runtime.backends.ort_cpu import check_batch_rows

    with bad_input_exits_2():
        for role, spec in (("target", bundle.target), ("draft", bundle.draft)):
            if spec is None:
                continue
            check_batch_rows(spec)
            if settings.backend == "tensorrt":  # the engines were built for the batch
                check_max_batch(engine_entry(bundle, role), settings.max_batch)


def run_serve_on_ray(args: argparse.Namespace) -> None:
    """The same app on a Ray Serve cluster (cluster/), until SIGTERM or Ctrl-C."""
    try:
        from specedge.serve.cluster import run_cluster
    except ImportError as e:
        fail(f"`specedge serve --ray` needs the ray extra (missing {e.name}): "
             "pip install 'specedge[serve,ray]'")
    settings = _settings(args)
    cluster = _cluster(args)
    try:
        bundle = load_bundle(settings.bundle)
    except SpecEdgeError as e:
        fail(str(e))
    check_batchable(settings, bundle)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s:     %(name)s: %(message)s")
    stop = threading.Event()

    def wait() -> None:
        # Installed once connected: ray.init sets a SIGTERM handler of its own.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        log.info("stopping: taking the app off the cluster")

    try:
        run_cluster(args.ray, settings, cluster, args.host, args.port, wait,
                    proxy_location=args.proxy_location)
    except Exception as e:  # Ray's own errors: the cluster is unreachable, a deploy failed
        fail(f"cannot serve {settings.bundle} on the Ray cluster {args.ray}: {e}")
    sys.exit(0)


def run_serve(args: argparse.Namespace) -> None:
    if getattr(args, "ray", None):
        run_serve_on_ray(args)
    try:
        import uvicorn

        from specedge.serve.app import Server, build_app
    except ImportError as e:
        fail(f"`specedge serve` needs the serve extra (missing {e.name}): "
             "pip install 'specedge[serve]'")
    settings, limits = _settings(args), _limits(args)
    try:
        bundle = load_bundle(settings.bundle)  # a bad folder fails here, before the port opens
    except SpecEdgeError as e:
        fail(str(e))
    check_batchable(settings, bundle)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s:     %(name)s: %(message)s")
    if settings.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who reaches this port can "
                    "use the model; set --api-key-file or $SPECEDGE_API_KEY", args.host)
    from specedge.runtime.generator import Generator
    from specedge.serve.connections import protocol_class
    from specedge.serve.draining import DrainingServer

    server = Server(settings, lambda: Generator.from_bundle(
        bundle, backend=settings.backend, threads=settings.threads,
        spinning=settings.spinning))
    app = build_app(settings, server=server)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, lifespan="on",
                            http=protocol_class(limits),
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    runner = DrainingServer(config, server, settings.shutdown_timeout)
    server.on_failure = runner.failed
    runner.run()
    if runner.exit_code:
        fail(f"cannot serve {settings.bundle}: {server.failure}")
    runner.exit_after_worker(0)
