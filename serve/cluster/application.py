"""The cluster mode's Ray Serve application, one replica per device: how it spreads over the
cluster (`ClusterSettings`), its two deployments built and bound (`build_cluster_app`, and
`app_builder` for Ray's own tools), and deploying it on a cluster (`run_cluster`).

Two deployments make the application (docs/cluster.md):

- `GeneratorReplica`: one Generator on one device. `max_ongoing_requests` = --max-batch (1:
  a Generator serves one sequence at a time; more: a BatchSession batches them), and a
  custom resource (`edge_device` by default) that
  each device node offers once, so each node hosts one replica. Its `generate` streams a
  request's text pieces; every speculative step runs on the replica's one step thread, off
  the event loop, so a cancellation (the client went away) lands between two steps: the
  generation then ends after the step in progress and the Generator is free for the next
  request. `check_health` runs a one-token step when the replica is idle, and checks that
  tokens keep coming when it is busy.
- `Ingress`: the app of `specedge serve` (app.build_app), with a `RayEngine` in place of the
  local worker: it parses and checks requests, applies the chat template with the bundle's
  tokenizer (no model sessions), frames SSE, and calls the replicas through a streaming
  DeploymentHandle. Requests wait for a free replica in the handle's queue, capped by
  `max_queued_requests` (--max-queue): past it they get 429 with Retry-After, the shape
  `specedge serve` answers.

Run it with `specedge serve --bundle B --ray ADDRESS` (cli.py), or with Ray's own tools:
`serve run specedge.serve.cluster:app_builder bundle=B replicas=2`, or a `serve deploy`
config whose import_path is `specedge.serve.cluster:app_builder` (args: the names of
`ServerSettings` and `ClusterSettings`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import ray
from ray import serve

from specedge.cli_common import draft_tokens_arg, on_off_arg, spinning_arg
from specedge.serve.app import ServerSettings
from specedge.serve.cluster.ingress import Ingress
from specedge.serve.cluster.replica import GeneratorReplica

log = logging.getLogger("specedge.serve")

APP_NAME = "specedge"
# The resource Ray gives the head node alone (and 1 of it), for actors that must run there.
HEAD_NODE_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class ClusterSettings:
    """How the app spreads over the cluster (`specedge serve --ray` flags)."""

    min_replicas: int = 1
    max_replicas: int = 1                # more than min: autoscaling on ongoing requests
    # Seconds the load must stay above (below) one ongoing request per replica before a
    # replica is added (removed): Ray Serve's defaults. A replica costs a bundle load and a
    # device, so neither follows a short burst.
    upscale_delay: float = 30.0
    downscale_delay: float = 600.0
    device_resource: str = "edge_device"  # the custom resource each device node offers once
    ingress_max_ongoing: int = 1024      # requests one ingress replica holds at a time
    health_check_period: float = 10.0    # seconds between replica health checks
    health_check_timeout: float = 30.0

    def check(self) -> None:
        if self.min_replicas < 1 or self.max_replicas < self.min_replicas:
            raise ValueError(f"replicas: need 1 <= min ({self.min_replicas}) <= max "
                             f"({self.max_replicas})")
        if self.upscale_delay < 0 or self.downscale_delay < 0:
            raise ValueError(f"scaling delays must be >= 0 seconds (up {self.upscale_delay:g}, "
                             f"down {self.downscale_delay:g})")


def build_cluster_app(settings: ServerSettings, cluster: ClusterSettings):
    """The Ray Serve application: the ingress, and the replicas it calls."""
    cluster.check()
    device = {"resources": {cluster.device_resource: 1}, "num_cpus": 0}
    if settings.backend in ("ort-cuda", "tensorrt"):
        device["num_gpus"] = 1
    if cluster.min_replicas == cluster.max_replicas:
        scaling: dict[str, Any] = {"num_replicas": cluster.min_replicas}
    else:
        scaling = {"autoscaling_config": {
            "min_replicas": cluster.min_replicas, "max_replicas": cluster.max_replicas,
            "target_ongoing_requests": settings.max_batch, "upscale_delay_s": cluster.upscale_delay,
            "downscale_delay_s": cluster.downscale_delay}}
    replica = serve.deployment(
        GeneratorReplica, name="GeneratorReplica", max_ongoing_requests=settings.max_batch,
        max_queued_requests=settings.max_queue, ray_actor_options=device,
        health_check_period_s=cluster.health_check_period,
        health_check_timeout_s=cluster.health_check_timeout,
        graceful_shutdown_timeout_s=settings.shutdown_timeout, **scaling)
    # The ingress holds every request's stream, also those of replicas on other nodes: on a
    # device node that leaves, it would take them all down with it, so it runs on the head
    # node (Ray's own head resource), which the cluster does not outlive anyway.
    ingress = serve.deployment(
        serve.ingress()(Ingress), name="Ingress", num_replicas=1,
        max_ongoing_requests=cluster.ingress_max_ongoing,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        graceful_shutdown_timeout_s=settings.shutdown_timeout)
    return ingress.bind(replica.bind(settings), settings)


def app_builder(args: dict[str, str]):
    """The entry point of `serve run specedge.serve.cluster:app_builder bundle=B ...` and of
    a `serve deploy` config: `args` name ServerSettings' and ClusterSettings' fields, and
    `replicas` sets both min_replicas and max_replicas."""
    args = dict(args)
    if "bundle" not in args:
        raise ValueError("give the bundle: serve run specedge.serve.cluster:app_builder "
                         "bundle=/path/to/bundle")
    if "replicas" in args:
        args["min_replicas"] = args["max_replicas"] = args.pop("replicas")
    return build_cluster_app(_settings(ServerSettings, args), _settings(ClusterSettings, args))


def _settings(kind, args: dict[str, str]):
    """The fields of `kind` given in `args` (strings from the command line, or YAML values),
    converted to each field's type; unknown names are an error."""
    known = {f.name: f for f in fields(kind)}
    values = {}
    for name in [n for n in args if n in known]:
        value, default = args[name], known[name].default
        if isinstance(value, str):
            try:
                value = _converted(name, value, default)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{name}: {e}") from None
        values[name] = value
    unknown = set(args) - {f.name for f in fields(ServerSettings)} \
        - {f.name for f in fields(ClusterSettings)}
    if unknown:
        raise ValueError(f"unknown arguments {sorted(unknown)}; known: "
                         f"{sorted(f.name for f in fields(ServerSettings))} and "
                         f"{sorted(f.name for f in fields(ClusterSettings))}")
    return kind(**values)


def _converted(name: str, value: str, default: object) -> object:
    """`value`, a string given for the field `name`, as that field's type (the default's)."""
    if name == "threads":
        return int(value)
    if name == "draft_tokens":
        return draft_tokens_arg(value)
    if name == "spinning":
        return spinning_arg(value)
    if isinstance(default, bool):  # before int: a bool is one; "on" or "off", as the flag
        return on_off_arg(value)
    if isinstance(default, (int, float)):
        return type(default)(value)
    if isinstance(default, tuple):  # allowed_hosts, allowed_origins: comma-separated
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return value


def run_cluster(address: str, settings: ServerSettings, cluster: ClusterSettings,
                host: str, port: int, wait: Callable[[], None],
                proxy_location: str = "EveryNode") -> None:
    """Connect to the Ray cluster at `address`, deploy the app with HTTP on host:port (Ray
    Serve's proxy; where Serve already runs on the cluster, its proxy keeps its own
    address), block in `wait`, and take the app down after it returns, and Serve with it
    when no other application is left."""
    ray.init(address=address, logging_level=logging.WARNING)
    serve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    serve.run(build_cluster_app(settings, cluster), name=APP_NAME, route_prefix="/")
    log.info("serving %s at http://%s:%d on Ray cluster %s", settings.name, host, port,
             address)
    try:
        wait()
    finally:
        serve.delete(APP_NAME)
        if not set(serve.status().applications) - {APP_NAME}:  # Serve ran for this app alone
            serve.shutdown()
