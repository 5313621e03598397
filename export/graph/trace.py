"""Trace a model into an ONNX graph file with the bundle's KV-cache I/O: the export module
for its family (`wrap`), the trace, and the tied head shared with the embedding table."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn
from torch.onnx.errors import OnnxExporterWarning

from specedge.export.graph.decoder import Decoder
from specedge.export.graph.families import (
    FEATURE_DRAFT_FAMILIES,
    GEMMA_FAMILY,
    GPT2_FAMILY,
    LLAMA_FAMILY,
    SUPPORTED_ARCHITECTURES,
    attention_form,
    model_dims,
)
from specedge.export.graph.gemma import GemmaDecoder
from specedge.export.graph.gpt2 import GPT2Decoder
from specedge.export.graph.granite import GraniteDecoder
from specedge.export.graph.llama import LlamaFamilyDecoder
from specedge.export.graph.olmo2 import Olmo2Decoder
from specedge.export.graph.phi3 import Phi3Decoder
from specedge.export.graph.stablelm import StableLmDecoder
from specedge.export.onnx_files import load_array, load_graph, save_graph
from specedge.runtime.bundle import FEATURES_IN, FEATURES_KEEP, FEATURES_OUT, graph_io

OPSET = 21
# The opset of a graph with batched attention: TensorScatter and Attention's
# nonpad_kv_seqlen are opset 24's, past what the TorchScript exporter traces at, so the
# graph is traced at OPSET and its opset raised afterwards (`raise_opset` checks each node
# against opset 24's schemas; --verify and the tests check what the graph computes).
BATCHED_OPSET = 24
# Bumped when the same checkpoint would export to a different graph, so that bundles made
# by an older exporter are not taken as up to date (export/bundle_writer.py).
# The revisions are listed in CHANGELOG.md.
GRAPH_REVISION = 11
# The export module of each architecture: the decoder skeleton (graph/decoder.py) with the
# family's hooks.
DECODERS: dict[str, type[Decoder]] = {
    **dict.fromkeys(LLAMA_FAMILY, LlamaFamilyDecoder), **dict.fromkeys(GPT2_FAMILY, GPT2Decoder),
    **dict.fromkeys(GEMMA_FAMILY, GemmaDecoder), "phi3": Phi3Decoder, "granite": GraniteDecoder,
    "olmo2": Olmo2Decoder, "stablelm": StableLmDecoder}


def wrap(model: nn.Module, features: bool | nn.Module = False,
         attention: str = "portable") -> nn.Module:
    """The export module for a Hugging Face causal LM, or ValueError if unsupported.

    `features`: the graph also outputs the target's features for a feature draft (True,
    or the feature draft; families.py `FEATURE_DRAFT_FAMILIES`).
    `attention`: the attention's form, "portable", "fused" or "batched" (families.py
    `attention_form` says which models can have which)."""
    model_type = model.config.model_type
    if features and model_type not in FEATURE_DRAFT_FAMILIES:
        raise ValueError(f"feature drafts take a target of the families "
                         f"{', '.join(FEATURE_DRAFT_FAMILIES)}, not {model_type!r}")
    if attention != "portable":
        attention_form(attention, "", model.config)  # raises for models it cannot have
    if model_type in DECODERS:
        return DECODERS[model_type](model, features, attention)
    raise ValueError(f"architecture {model_type!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def raise_opset(model: onnx.ModelProto, opset: int) -> None:
    """Declare the graph's ONNX opset `opset`, in place, and check each of its ONNX nodes
    against that opset's schemas (inputs, attributes), so that an operator whose signature
    changed since the traced opset is an error here, not a graph ONNX Runtime refuses."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = opset
    model.ir_version = max(model.ir_version, 10)
    context = onnx.checker.C.CheckerContext()
    context.ir_version = model.ir_version
    context.opset_imports = {entry.domain: entry.version for entry in model.opset_import}
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx"):
            onnx.checker.check_node(node, context)


def pin_output_widths(model: onnx.ModelProto, widths: dict[str, int]) -> None:
    """Give outputs `widths` (name: size of the last axis) a fixed last axis, in place."""
    for output in model.graph.output:
        if output.name in widths:
            dim = output.type.tensor_type.shape.dim[-1]
            dim.Clear()
            dim.dim_value = widths[output.name]


def share_tied_head(model: onnx.ModelProto, folder: Path) -> bool:
    """Make the LM head of the graph `model` read the embedding table instead of its own
    transposed copy, in place; its tensors may be references into files in `folder`.

    The exporter folds `x @ W^T` into MatMul(x, W^T) with W^T stored as a second initializer;
    for tied embeddings that is a duplicate of the largest tensor (113 MB for SmolLM2, 1 GB
    for Llama 3.2 1B). Gemm(x, W, transB=1) computes the same product from W itself. One
    pair of tables is in memory at a time.
    """
    inits = {i.name: i for i in model.graph.initializer}
    tables = [n.input[0] for n in model.graph.node if n.op_type == "Gather" and
              n.input[0] in inits and len(inits[n.input[0]].dims) == 2]
    changed = False
    for node in model.graph.node:
        head = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if head is None or len(head.dims) != 2:
            continue
        for name in tables:
            if list(inits[name].dims) == list(head.dims)[::-1] and np.array_equal(
                    load_array(inits[name], folder), load_array(head, folder).T):
                model.graph.initializer.remove(inits.pop(node.input[1]))
                node.op_type = "Gemm"
                node.input[1] = name
                node.attribute.append(onnx.helper.make_attribute("transB", 1))
                changed = True
                break
    return changed


def export_onnx(model: nn.Module, path: str | Path, share_head: bool = True,
                features: bool | nn.Module = False, attention: str = "portable") -> None:
    """Trace `model` into an ONNX graph at `path` with the bundle's KV-cache I/O.

    `share_head`: for tied embeddings, let the LM head read the embedding table (no second
    copy). Quantized exports keep the copy, so that the head gets quantized as a MatMul.
    `features`: a target that also outputs its features (True, or the feature draft that
    reads them). A feature draft (export/drafts/feature.py) is its own
    export module and always has feature I/O.
    `attention`: the attention's form (`wrap`); "fused" and "batched" have the KV layout
    "bhsd-inplace" (a feature draft is switched to it with its `use_attention`).
    """
    fused = attention != "portable"
    dims = model_dims(model)
    n, kv, d = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    dtype = next(model.parameters()).dtype
    # Example sizes; the batch, token and cache axes are dynamic in the graph. Two rows of
    # different lengths, so that nothing of one row's length is taken for a constant.
    b, t, capacity = 2, 3, 8
    reads = getattr(model, "reads_features", False)  # a feature draft (export/drafts)
    past_length = torch.tensor([2, 1])
    args = (torch.zeros(b, t, dtype=torch.long),
            past_length.unsqueeze(1) + torch.arange(t), past_length, torch.tensor([t]),
            *[torch.zeros(b, kv, capacity, d, dtype=dtype) for _ in range(2 * n)])
    if reads:
        args += (torch.zeros(b, t, model.config.hidden_size, dtype=dtype),)
    # A target's features: for the last features_to_keep positions (runtime/bundle.py).
    keeps = bool(features) and not reads
    if keeps:
        args += (torch.tensor([t]),)
    inputs, outputs = graph_io(n, reads, bool(features) or reads, keeps)
    dynamic = {"input_ids": {0: "B", 1: "T"}, "position_ids": {0: "B", 1: "T"},
               "past_length": {0: "B"}, "logits": {0: "B", 1: "N"}}
    for name in inputs[4:]:
        if name != FEATURES_KEEP:
            dynamic[name] = {0: "B", 1: "T"} if name == FEATURES_IN else {0: "B", 2: "C"}
    for name in outputs[1:]:
        dynamic[name] = ({0: "B", 1: "F" if keeps else "T"} if name == FEATURES_OUT
                         else {0: "B", 2: "C" if fused else "T"})
    if reads:
        model.use_attention(attention)
    module = model if reads else wrap(model, features, attention)
    path = Path(path)
    # torch writes a graph over 2 GB as one file per tensor beside it: trace into a folder of
    # its own, then gather the tensors into `path` (and its data file), one at a time.
    with tempfile.TemporaryDirectory(prefix=".trace.", dir=path.parent) as work:
        traced = Path(work) / "graph.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            # Neither warning is the user's to act on: the values the tracer warns about
            # (layer sizes, the rotary split) are constants of the model by design, and opset
            # 21, past the one the TorchScript exporter names as its highest, is the one
            # every graph is checked at against transformers (--verify and the tests).
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", "Exporting to ONNX opset version",
                                    OnnxExporterWarning)
            torch.onnx.export(module.eval(), args, str(traced), input_names=inputs,
                              output_names=outputs, dynamic_axes=dynamic,
                              opset_version=OPSET, dynamo=False)
        graph = load_graph(traced)
        if attention == "batched":
            raise_opset(graph, BATCHED_OPSET)
            # The tracer cannot see through ONNX's Attention, and leaves the widths after
            # it unnamed; the manifest and the runtime read them from the graph.
            widths = {"logits": dims["vocab_size"]}
            if bool(features) or reads:
                widths[FEATURES_OUT] = model.config.hidden_size
            pin_output_widths(graph, widths)
        if share_head and model.config.tie_word_embeddings:
            share_tied_head(graph, Path(work))
        save_graph(graph, Path(work), path)
