"""ONNX graph files whose weights do not fit in one protobuf message.

A protobuf message holds at most 2 GB, and a model of 1B parameters has 5 GB of fp32
weights. So a large graph is two files: FILE.onnx (the graph, its tensors as references) and
FILE.onnx.data (the tensors, each at an offset aligned to ALIGNMENT), which ONNX Runtime and
TensorRT's ONNX parser both read. The tools here move one tensor at a time, so that memory
holds one tensor of the model, not all of them: `DataFile` appends tensors to a data file,
`load_array` reads one initializer wherever it lives, `save_graph` writes a graph whose
tensors may still point into other files. Graphs under INLINE_LIMIT stay one file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper as external

# Above this many bytes of tensors a graph keeps them in a data file (protobuf's hard limit
# is 2 GB; the margin holds the graph itself).
INLINE_LIMIT = 1_800_000_000
# Tensors smaller than this stay in the graph file (norm weights, shapes): not worth a read.
SMALL_TENSOR = 1024
# Offsets on 64 KB boundaries, so that ONNX Runtime can map each tensor from the file
# (Windows' allocation granularity; a multiple of every page size).
ALIGNMENT = 65536


def data_file(path: Path) -> Path:
    """Where the tensors of the graph at `path` go when it has a data file."""
    return path.with_name(path.name + ".data")


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The size of a tensor's data, from its shape and type, without reading it."""
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def load_array(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """One initializer's values, read from its data file (relative to `folder`) if it has one.
    The proto itself is left as it is."""
    return onnx.numpy_helper.to_array(tensor, base_dir=str(folder))


def load_graph(path: Path) -> onnx.ModelProto:
    """The graph at `path` with its large tensors left as references into their files."""
    return onnx.load(str(path), load_external_data=False)


class DataFile:
    """Appends tensors to one data file; each tensor's proto then refers to its place there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(b"")
        self.size = 0

    def put(self, tensor: onnx.TensorProto) -> None:
        """Move `tensor`'s values (which must be in the proto) to the end of the file."""
        if not tensor.HasField("raw_data"):  # values in a typed field (float_data, ...)
            tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor),
                                                         tensor.name))
        offset = -(-self.size // ALIGNMENT) * ALIGNMENT
        external.set_external_data(tensor, self.path.name, offset=offset)
        external.save_external_data(tensor, str(self.path.parent))
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        self.size = offset + tensor_bytes(tensor)


def all_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The graph's initializers and the tensors of its nodes' attributes (Constant values,
    such as a rotary table, are written to the data file as well)."""
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                tensors.append(attribute.t)
            elif attribute.type == onnx.AttributeProto.TENSORS:
                tensors.extend(attribute.tensors)
    return tensors


def save_graph(model: onnx.ModelProto, source: Path, path: Path) -> None:
    """Write `model` at `path`, its tensors inline when they fit (INLINE_LIMIT), else in
    `data_file(path)`, one at a time. Tensors that are references are read from their files
    relative to the folder `source`; `path` must not be the file they are read from."""
    tensors = all_tensors(model)
    if sum(tensor_bytes(t) for t in tensors) <= INLINE_LIMIT:
        for t in tensors:
            if is_external(t):
                external.load_external_data_for_tensor(t, str(source))
        onnx.save(model, str(path))
        return
    data = DataFile(data_file(path))
    for t in tensors:
        if is_external(t):
            external.load_external_data_for_tensor(t, str(source))
        if tensor_bytes(t) >= SMALL_TENSOR:
            data.put(t)
    onnx.save(model, str(path))


def graph_files(path: Path) -> list[Path]:
    """The files of the graph at `path`: itself, and its data file if it has one."""
    return [p for p in (path, data_file(path)) if p.is_file()]
