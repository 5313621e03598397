"""How many nodes ONNX Runtime runs for a graph, after its CPU optimizer: in all, and per
decoder layer. Each node costs the runtime's own time between kernels besides its work, so
on a small model the count is a large part of a step (docs/export.md, "Nodes per layer").
"""

from __future__ import annotations

import statistics
import tempfile
from collections import Counter
from pathlib import Path

import onnx


def optimized_node_counts(path: Path, layers: int) -> dict:
    """{"all": nodes of the optimized graph, "per_layer": nodes from one layer's attention
    to the next's} for the graph at `path` with `layers` decoder layers, optimized as the
    ort-cpu backend optimizes it (every level). A layer's span is measured between
    consecutive nodes of an op type that occurs once a layer (the attention when fused), in
    the optimized graph's topological order, and its median over the layers is taken."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.log_severity_level = 3  # its note that such a file fits this machine only
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        nodes = list(onnx.load(options.optimized_model_filepath,
                               load_external_data=False).graph.node)
    ops = [n.op_type for n in nodes]
    counts = Counter(ops)
    once_a_layer = [op for op in dict.fromkeys(ops) if counts[op] == layers]
    per_layer = None
    if once_a_layer and layers > 1:
        anchor = "GroupQueryAttention" if "GroupQueryAttention" in once_a_layer \
            else once_a_layer[0]
        at = [i for i, op in enumerate(ops) if op == anchor]
        per_layer = int(statistics.median(b - a for a, b in zip(at, at[1:])))
    return {"all": len(nodes), "per_layer": per_layer}
