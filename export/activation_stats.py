"""How large the activations are that each weight of a graph multiplies, measured by running
the fp32 graph on calibration tokens: what a quantizer weighs its errors by
(export/int4_blocks.py `search_int4`, `importance`).

The error a quantized weight adds to x @ W is sum_k x_k e_k, so a channel k whose
activations are large costs more per unit of error; the statistic is the mean square of
x_k over the calibration tokens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx

from specedge.runtime.bundle import FEATURES_KEEP

# The graph inputs a calibration run feeds (a target's features for every position, so
# that what only they need is calibrated too); a graph with others (a feature draft reads
# the target's features) is not calibrated.
_CALL_INPUTS = {"input_ids", "position_ids", "past_length", "logits_to_keep", FEATURES_KEEP}


def mean_squares(source: Path, model: onnx.ModelProto, names: list[str],
                 ids: list[int]) -> dict[str, np.ndarray] | None:
    """{activation name: mean over `ids` of its square, per channel of its last axis} for
    the fp32 graph `model` (loaded from `source`, whose folder holds its external data), the
    prompt `ids` run in one call on an empty cache. None when the graph takes inputs other
    than the token call's and its KV cache."""
    import onnxruntime as ort

    graph = model.graph
    inputs = [i for i in graph.input if i.name not in _CALL_INPUTS]
    if any(not i.name.startswith("past_key_values.") for i in inputs) or not ids:
        return None
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    t = len(ids)
    call = {"input_ids": np.array([ids], np.int64),
            "position_ids": np.arange(t, dtype=np.int64)[None],
            "past_length": np.zeros(1, np.int64), "logits_to_keep": np.ones(1, np.int64),
            FEATURES_KEEP: np.array([t], np.int64)}
    feeds = {i.name: call[i.name] for i in graph.input if i.name in call}
    for i in inputs:  # [B, kv_heads, C, head_dim]: one row, room for the prompt
        dims = [d.dim_value or t for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = np.zeros([1, *dims[1:]], np.float32)
    # Written beside `source`, so that its external data references resolve.
    with tempfile.NamedTemporaryFile(dir=Path(source).parent, suffix=".onnx") as f:
        onnx.save(probe, f.name)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(f.name, options, providers=["CPUExecutionProvider"])
        values = session.run(names, feeds)
    return {n: np.square(v.reshape(-1, v.shape[-1]).astype(np.float64)).mean(axis=0)
            for n, v in zip(names, values)}
