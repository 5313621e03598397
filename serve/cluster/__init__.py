"""The same OpenAI app on a Ray Serve cluster of devices: one replica per device
(docs/cluster.md). The only package that imports ray (the `ray` extra).

`application.py` makes the application of two deployments, `replica.py`'s
`GeneratorReplica` (one Generator on one device) and `ingress.py`'s `Ingress` (the app of
`specedge serve` calling the replicas), and deploys it. Run it with `specedge serve --bundle
B --ray ADDRESS`, or with Ray's own tools: `serve run specedge.serve.cluster:app_builder
bundle=B replicas=2`, or a `serve deploy` config whose import_path is
`specedge.serve.cluster:app_builder`.
"""

from specedge.serve.cluster.application import (
    APP_NAME,
    ClusterSettings,
    app_builder,
    build_cluster_app,
    run_cluster,
)
from specedge.serve.cluster.ingress import BundleText, Ingress, RayEngine
from specedge.serve.cluster.replica import GeneratorReplica, ReplicaMetrics

__all__ = ["APP_NAME", "BundleText", "ClusterSettings", "GeneratorReplica", "Ingress",
           "RayEngine", "ReplicaMetrics", "app_builder", "build_cluster_app", "run_cluster"]
