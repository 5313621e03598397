"""A graph's entry in the bundle's manifest (`models.target`, `models.draft`): the model's
dimensions, the graph's file and sizes, its KV layout and features, and its inputs and
outputs with the shapes the runtime's contract states."""

from __future__ import annotations

from pathlib import Path

import onnx

from specedge.export.graph.families import model_dims_of
from specedge.export.node_counts import optimized_node_counts
from specedge.export.onnx_files import data_file, load_graph
from specedge.export.verify import graph_attention, graph_features, graph_kv_layout
from specedge.runtime.bundle import (
    FEATURES_IN,
    FEATURES_KEEP,
    FEATURES_OUT,
    KV_LAYOUT_IN_PLACE,
)

_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
           onnx.TensorProto.INT64: "int64"}


def _io_spec(graph: onnx.GraphProto, dims: dict, features: int, kv_layout: str,
             keeps: bool) -> tuple[list[dict], list[dict]]:
    """Names and dtypes as the graph has them; shapes as the contract states them (the
    exporter leaves some static dims symbolic)."""
    kv = ["B", dims["num_kv_heads"], None, dims["head_dim"]]
    in_place = kv_layout == KV_LAYOUT_IN_PLACE  # presents are the whole cache buffers
    shapes = {"input_ids": ["B", "T"], "position_ids": ["B", "T"], "past_length": ["B"],
              "logits_to_keep": [1], "logits": ["B", "N", dims["vocab_size"]],
              FEATURES_IN: ["B", "T", features], FEATURES_KEEP: [1],
              FEATURES_OUT: ["B", "F" if keeps else "T", features]}

    def entry(v) -> dict:
        elem = v.type.tensor_type.elem_type
        rows = "C" if v.name.startswith("past") or in_place else "T"
        shape = shapes.get(v.name) or [d if d is not None else rows for d in kv]
        return {"name": v.name, "dtype": _DTYPES.get(elem, str(elem)), "shape": shape}

    return [entry(v) for v in graph.input], [entry(v) for v in graph.output]


def graph_batch_rows(graph: onnx.GraphProto) -> bool:
    """Whether the graph takes several rows, each at its own past_length (format 4): its
    input_ids' first dim is dynamic."""
    ids = next(v for v in graph.input if v.name == "input_ids")
    return not ids.type.tensor_type.shape.dim[0].HasField("dim_value")


def model_entry(config, path: Path, max_context: int | None, precision: str) -> dict:
    """The manifest's entry for the graph at `path`, exported from a model with the Hugging
    Face `config`; its context capped at `max_context` (None: the model's)."""
    dims = model_dims_of(config)
    graph = load_graph(path).graph
    features, reads, keeps = graph_features(graph)
    kv_layout = graph_kv_layout(graph)
    inputs, outputs = _io_spec(graph, dims, features, kv_layout, keeps)
    if max_context:
        dims["max_context"] = min(dims["max_context"], max_context)
    entry = {"file": path.name, "architecture": config.model_type, **dims,
             "dtype": "float32", "precision": precision, "kv_layout": kv_layout,
             "attention": graph_attention(graph), "file_size": path.stat().st_size,
             "inputs": inputs, "outputs": outputs}
    if data_file(path).is_file():  # a graph over 2 GB keeps its weights beside it
        entry |= {"data_file": data_file(path).name,
                  "data_file_size": data_file(path).stat().st_size}
    if features:
        entry |= {"features": features, "reads_features": reads}
    if keeps:
        entry[FEATURES_KEEP] = True
    if graph_batch_rows(graph):
        entry["batch_rows"] = True
    if not data_file(path).is_file():
        # A graph over 2 GB is not counted: ONNX Runtime would write its optimized copy,
        # weights and all, to count it.
        entry["optimized_nodes"] = optimized_node_counts(path, dims["num_layers"])
    return entry
