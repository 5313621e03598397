"""Weight-only quantized graphs for ONNX Runtime CPU, and what quantizing cost.

int4 / int8: onnxruntime's weight-only quantizer turns every MatMul with a constant weight
into MatMulNBits (blocks of 32 along the reduction axis with a scale and an integer zero
point each; accuracy_level 4 lets the CPU kernels compute in int8), one weight at a time so
that a model of billions of parameters quantizes in the memory of its largest weight.
int4 first moves each block's offset into a small fp32 product (`_centre_blocks`), so that
its 4-bit codes hold GGUF's Q4_1 grid (w = d * q + m) exactly; it keeps the LM head at 8 bits, as
llama.cpp keeps its output tensor. Both turn the embedding Gather into GatherBlockQuantized
(4 bits through the quantizer, 8 bits by `_embedding_8bit`): a Gather reads one row per
token, so this saves file size and memory, not time. On SmolLM2 (dequantized from a Q4_1
GGUF) int4 is then nearly lossless (perplexity +1.0-1.3%, against +25% with the quantizer
alone), two thirds of int8's size and ~1.1x its speed: the offset products cost most of
what 4-bit weights save on a model this small. (HQQ's float zero points: +0.02%, but ONNX
Runtime's CPU kernel runs them ~8x slower.)
fp16: weights and activations in fp16, inputs and outputs kept fp32 so the KV-cache
contract does not change (ONNX Runtime's CPU fp16 kernels are few: this is for GPUs).

Quantizing the target changes the model, so the export measures the change: greedy
agreement with the fp32 graph (teacher-forced on its greedy tokens) and the perplexity of
both graphs on a text sample. It also measures batch invariance, with one-token steps run as
the runtime runs them: one-row and multi-row calls take different ONNX Runtime kernel paths,
and the int8-activation kernels grow the 1e-7 difference to about a logit, so the runtime runs
a fused graph's one-token steps as two rows (ort_cpu.py; docs/design.md, "Batch invariance
of quantized graphs"); a portable int8/int4 graph stays about a logit apart.
"""

from __future__ import annotations

import gc
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from specedge.export.activation_stats import mean_squares
from specedge.export.onnx_files import is_external, load_graph, save_graph
from specedge.export.verify import graph_backend
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import FEATURES_OUT
from specedge.runtime.stats import next_token_nll

PRECISIONS = ("fp32", "fp16", "int8", "int4")
BLOCK_SIZE = 32
# int4's block along the reduction axis (`--int4-block`) and the LM head's bits
# (`--int4-head-bits`): the defaults are GGUF's Q4_1 block, which the exact grid holds, and
# llama.cpp's 8-bit output tensor. Larger blocks and a 4-bit head run faster and cost
# quality (docs/export.md#int4-blocks-and-the-lm-head).
INT4_BLOCKS = (32, 64, 128)
INT4_HEAD_BITS = (8, 4)
HEAD_BITS = 8  # the default of INT4_HEAD_BITS
# Tokens per call of the quality report's perplexity: memory is one chunk's logits (32 x
# 262144 float64 = 64 MB at Gemma 3's vocabulary), not the whole text's.
PERPLEXITY_CHUNK = 32

PERPLEXITY_TEXT = (
    "The library opened at nine in the morning, and by ten the reading room was full. "
    "Students sat with their notes spread across the long wooden tables, while an old man "
    "near the window read a newspaper slowly, turning each page with care. Outside, the "
    "rain had stopped, and the street was bright with puddles that reflected the sky. "
    "A librarian walked between the shelves, returning books to their places and answering "
    "questions in a quiet voice. Most people came here to study, but some came simply to "
    "sit somewhere warm and calm, away from the noise of the city."
)


# How int4 holds a MatMul weight: "exact" keeps each block's float offset in a small fp32
# product beside the MatMulNBits (`_centre_blocks`: GGUF's Q4_1 grid exactly, four more nodes a
# weight); "search" stores an integer zero point chosen per block by a search
# (export/int4_blocks.py): the MatMulNBits node alone.
INT4_GRIDS = ("exact", "search")


def quantize_graph(source: Path, path: Path, precision: str, int4_grid: str = "exact",
                   calibration_ids: list[int] | None = None, int4_block: int = BLOCK_SIZE,
                   int4_head_bits: int = HEAD_BITS) -> None:
    """Write the fp32 graph at `source` in `precision` at `path` (and its data file when the
    result is large: export/onnx_files.py). int4 only: `int4_block` weights a block along
    the reduction axis (INT4_BLOCKS) and `int4_head_bits` bits for the LM head
    (INT4_HEAD_BITS).

    int8 and int4 go one weight at a time: each MatMul or Gather weight is read from
    `source`'s files, quantized and dropped before the next, so that memory holds the
    quantized graph and one fp32 weight (plus the quantizer's copies of it), not the fp32
    model. fp16 converts the whole graph in memory (it is for GPU bundles)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    source, path = Path(source), Path(path)
    if source.resolve() == path.resolve():
        raise ValueError(f"quantize into a new file, not over {source} itself")
    folder = source.parent
    model = load_graph(source)
    if precision == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        onnx.external_data_helper.load_external_data_for_model(model, str(folder))
        model = convert_float_to_float16(model, keep_io_types=True)
    elif precision != "fp32":
        if int4_grid not in INT4_GRIDS:
            raise ValueError(f"int4_grid must be one of {', '.join(INT4_GRIDS)}, "
                             f"got {int4_grid!r}")
        if int4_block not in INT4_BLOCKS or int4_head_bits not in INT4_HEAD_BITS:
            raise ValueError(f"the int4 block must be one of {INT4_BLOCKS} and the head's "
                             f"bits one of {INT4_HEAD_BITS}, got {int4_block}, "
                             f"{int4_head_bits}")
        importance = None
        if precision == "int4" and int4_grid == "search" and calibration_ids:
            importance = mean_squares(source, model, _matmul_inputs(model), calibration_ids)
        int4 = precision == "int4"
        block, head_bits = (int4_block, int4_head_bits) if int4 else (BLOCK_SIZE, HEAD_BITS)
        _quantize_weights(model, folder, precision, int4_grid, importance or {}, block,
                          head_bits)
    save_graph(model, folder, path)


def _matmul_inputs(model: onnx.ModelProto) -> list[str]:
    """The activations the graph's MatMuls with a constant 2-D weight multiply."""
    weights = {i.name for i in model.graph.initializer if len(i.dims) == 2}
    return sorted({n.input[0] for n in model.graph.node
                   if n.op_type == "MatMul" and n.input[1] in weights})


def _quantize_weights(model: onnx.ModelProto, folder: Path, precision: str,
                      int4_grid: str = "exact",
                      importance: dict[str, np.ndarray] | None = None,
                      block: int = BLOCK_SIZE, head_bits: int = HEAD_BITS) -> None:
    """int8: every MatMul weight -> MatMulNBits at 8 bits, every embedding Gather ->
    GatherBlockQuantized at 8 bits (`_embedding_8bit`). int4 (blocks of `block`): the LM
    head at `head_bits` bits, a feature draft's fuse product at 8, every
    other MatMul weight centred on its blocks' offsets (`_centre_blocks`) and at 4 bits, or
    with `int4_grid` "search" at 4 bits with searched zero points (`_searched_matmul`,
    errors weighed by `importance` [activation name -> [K]] where given); the embedding at 4
    bits. In place, one weight in memory at a time."""
    importance = importance or {}
    graph = model.graph
    uses = Counter(name for node in graph.node for name in node.input)
    uses.update(i.name for i in graph.input)  # an initializer a caller may override stays
    weights = {i.name: i for i in graph.initializer if uses[i.name] == 1}  # rewritten once
    heads = set(_head_matmuls(model))
    ranks = _activation_ranks(model)
    quantizers = {}
    nodes = []
    for node in list(graph.node):
        weight = weights.get(node.input[0] if node.op_type == "Gather" else
                             node.input[1] if node.op_type == "MatMul" else "")
        if weight is None or len(weight.dims) != 2 or (
                node.op_type == "Gather" and _attribute(node, "axis", 0) != 0):
            nodes.append(node)
            continue
        # The quantizer reads the weight from the graph: bring this one into memory.
        if is_external(weight):
            onnx.external_data_helper.load_external_data_for_tensor(weight, str(folder))
        # A feature draft's fuse product (it feeds only the draft) runs on no rows in plain
        # decoding (runtime/bundle.py, features_to_keep), and ONNX Runtime's ReduceSum
        # mishandles an empty input: no offset products for it, 8 bits at int4 too.
        fuse = FEATURES_OUT in node.output
        bits = 8 if precision == "int8" or fuse else head_bits if node.name in heads else 4
        on_blocks = node.op_type == "MatMul" and bits == 4 and weight.dims[0] % block == 0
        if node.op_type == "Gather" and precision == "int8":
            new = [_embedding_8bit(graph, node, weight)]
        elif on_blocks and int4_grid == "search":
            new = [_searched_matmul(graph, node, weight, importance.get(node.input[0]), block)]
        else:
            added = (_centre_blocks(graph, node, weight, block, _rank(ranks, node))
                     if on_blocks else [])
            key = (bits, node.op_type)
            if key not in quantizers:
                quantizers[key] = _node_quantizer(bits, node.op_type,
                                                  block if on_blocks else BLOCK_SIZE)
            new = quantizers[key].quantize(node, [graph]) + added
        nodes += new
        if all(weight.name not in n.input for n in new):  # replaced, not skipped
            graph.initializer.remove(weight)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    model.ir_version = max(model.ir_version, 10)  # 4-bit tensor types need IR version 10


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _node_quantizer(bits: int, op: str, block: int = BLOCK_SIZE):
    """onnxruntime's quantizer of one node: blocks of `block` along the reduction axis
    (MatMul's K, an embedding row) with a scale and an integer zero point each;
    accuracy_level 4 lets the CPU kernels compute with int8 activations."""
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    # Its module logs a line per node at INFO (about 1400 for SmolLM2) under the export's
    # progress bar; warnings still show.
    nbits.logger.setLevel(logging.WARNING)
    return nbits.DefaultWeightOnlyQuantizer(nbits.DefaultWeightOnlyQuantConfig(
        block_size=block, is_symmetric=False, accuracy_level=4, bits=bits,
        op_types_to_quantize=(op,), quant_axes=(("MatMul", 0), ("Gather", 1))))


def _searched_matmul(graph: onnx.GraphProto, node: onnx.NodeProto, weight: onnx.TensorProto,
                     importance: np.ndarray | None = None,
                     block: int = BLOCK_SIZE) -> onnx.NodeProto:
    """The MatMul `node` of the constant [K, N] `weight` (in memory) as one MatMulNBits at 4
    bits, blocks of `block`, with integer zero points found by `search_int4` (errors weighed
    by `importance` [K] when given); adds its tensors to `graph`."""
    from specedge.export.int4_blocks import matmul_nbits_arrays, search_int4

    k, n = weight.dims
    packed, scales, zero_points = matmul_nbits_arrays(
        search_int4(onnx.numpy_helper.to_array(weight), block, importance))
    name = weight.name
    graph.initializer.extend([onnx.numpy_helper.from_array(packed, f"{name}_Q4"),
                              onnx.numpy_helper.from_array(scales, f"{name}_scales"),
                              onnx.numpy_helper.from_array(zero_points, f"{name}_zero_points")])
    return onnx.helper.make_node(
        "MatMulNBits", [node.input[0], f"{name}_Q4", f"{name}_scales", f"{name}_zero_points"],
        list(node.output), name=f"{node.name or name}_Q4", domain="com.microsoft",
        K=k, N=n, bits=4, block_size=block, accuracy_level=4)


def _activation_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank of every value ONNX's shape inference can tell, on a copy of the graph
    without weights (an initializer becomes an input of its shape): [B, T, K] activations
    have 3, the LM head's flattened input 2."""
    graph = model.graph
    weights = [onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
               for i in graph.initializer]
    skeleton = onnx.helper.make_model(
        onnx.helper.make_graph(list(graph.node), "ranks", list(graph.input) + weights,
                               list(graph.output), value_info=list(graph.value_info)),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    inferred = onnx.shape_inference.infer_shapes(skeleton).graph
    return {v.name: len(v.type.tensor_type.shape.dim)
            for v in [*inferred.value_info, *inferred.input]
            if v.type.tensor_type.HasField("shape")}


def _rank(ranks: dict[str, int], node: onnx.NodeProto) -> int:
    if node.input[0] not in ranks:
        raise ValueError(f"the rank of {node.input[0]!r}, which {node.name!r} multiplies, is "
                         "not known to ONNX's shape inference: the int4 offset product "
                         "cannot be shaped for it")
    return ranks[node.input[0]]


def _centre_blocks(graph: onnx.GraphProto, node: onnx.NodeProto, weight: onnx.TensorProto,
                   block: int = BLOCK_SIZE, rank: int = 3) -> list[onnx.NodeProto]:
    """Prepare the MatMul `node` for Q4_1's grid: centre its `weight` (in memory) on each
    block's offset, in place, and return the nodes that add the offsets' product back.

    Q4_1 stores a block of 32 weights (along the reduction axis K) as w = d * q + m with a
    float m; ONNX Runtime's fast 4-bit kernels take integer zero points only, and a
    rounded zero point moves the whole grid (SmolLM2, whose weights come dequantized from
    a Q4_1 GGUF: perplexity +16% instead of +1%). So each block's offset goes into its own
    product:

        x @ W = x @ (W - C) + blocksum(x) @ Offsets,   C = Offsets repeated over each block

    with offset c = m + 8 d, the block's midpoint: W - C spans [-8 d, 7 d], which the
    asymmetric 4-bit quantizer stores with scale d and zero point 8, exactly Q4_1's grid
    (lossless for weights already on one), and centred, so the int8 activations of the
    fast kernels do not see a large product that the offset term then cancels.
    blocksum(x) [.., K/32] sums x over each block. The offset product stays fp32 (1/32 of
    the main product's work). x has `rank` dims ([B, T, K], or the LM head's [B N, K]):
    its blocks are x's leading dims (copied by Reshape's 0s) times [K/32, 32], so that the
    offset product has the main one's shape whatever the batch.
    """
    k, n = weight.dims
    blocks = onnx.numpy_helper.to_array(weight).reshape(k // block, block, n)
    low, high = blocks.min(axis=1), blocks.max(axis=1)
    offsets = low + 8 * (high - low) / 15
    weight.CopyFrom(onnx.numpy_helper.from_array(
        (blocks - offsets[:, None]).reshape(k, n).astype(np.float32), weight.name))
    graph.initializer.extend([
        onnx.numpy_helper.from_array(offsets.astype(np.float32), f"{weight.name}_block_offset"),
        onnx.numpy_helper.from_array(np.array([0] * (rank - 1) + [k // block, block]),
                                     f"{weight.name}_blocks")])
    if not any(i.name == "specedge_last_axis" for i in graph.initializer):
        graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1]),
                                                              "specedge_last_axis"))
    out = node.output[0]
    name = node.name or out
    node.output[0] = f"{out}_centred"
    return [
        onnx.helper.make_node("Reshape", [node.input[0], f"{weight.name}_blocks"],
                              [f"{out}_blocks"], name=f"{name}_blocks"),
        onnx.helper.make_node("ReduceSum", [f"{out}_blocks", "specedge_last_axis"],
                              [f"{out}_block_sum"], name=f"{name}_block_sum", keepdims=0),
        onnx.helper.make_node("MatMul", [f"{out}_block_sum", f"{weight.name}_block_offset"],
                              [f"{out}_offset"], name=f"{name}_offset"),
        onnx.helper.make_node("Add", [node.output[0], f"{out}_offset"], [out],
                              name=f"{name}_add_offset")]


def _embedding_8bit(graph: onnx.GraphProto, node: onnx.NodeProto,
                    table: onnx.TensorProto) -> onnx.NodeProto:
    """The Gather `node` from the constant [V, H] fp32 `table` (in memory) ->
    GatherBlockQuantized at 8 bits: blocks of BLOCK_SIZE along H,
    w = scale * (q - zero_point) with uint8 q and zero point, the range widened to hold 0,
    as MatMulNBits stores int8 weights. ONNX Runtime's quantizer writes this op at 4 bits
    only; its CPU kernel also reads 8 (uint8 data, gather axis 0). On SmolLM2 the table is
    113 MB of fp32 in the target and again in the draft, which embeds tokens too: 8 bits
    take each graph's copy to 33 MB. Adds the new tensors to `graph`; the caller drops
    `table`."""
    rows, width = table.dims
    blocks = onnx.numpy_helper.to_array(table).reshape(rows, width // BLOCK_SIZE, BLOCK_SIZE)
    low = np.minimum(blocks.min(axis=-1), 0.0)
    high = np.maximum(blocks.max(axis=-1), 0.0)
    scale = np.where(high > low, (high - low) / 255, 1.0).astype(np.float32)
    zero = np.clip(np.round(-low / scale), 0, 255)
    codes = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, 255)
    name = table.name
    graph.initializer.extend([
        onnx.numpy_helper.from_array(codes.astype(np.uint8).reshape(rows, width), f"{name}_Q8"),
        onnx.numpy_helper.from_array(scale, f"{name}_scales"),
        onnx.numpy_helper.from_array(zero.astype(np.uint8), f"{name}_zero_points")])
    return onnx.helper.make_node(
        "GatherBlockQuantized",
        [f"{name}_Q8", node.input[1], f"{name}_scales", f"{name}_zero_points"],
        list(node.output), name=f"{node.name or name}_Q8", domain="com.microsoft",
        gather_axis=0, quantize_axis=1, block_size=BLOCK_SIZE, bits=8)


def _head_matmuls(model: onnx.ModelProto) -> list[str]:
    """The MatMuls whose [H, V] weight is an embedding table's [V, H] shape transposed."""
    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    tables = {shapes[n.input[0]] for n in model.graph.node
              if n.op_type == "Gather" and len(shapes.get(n.input[0], ())) == 2}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and shapes.get(n.input[1], ())[::-1] in tables]


BATCH_TOLERANCE = 1e-3


def batch_difference(backend: OrtCpuBackend, ids: list[int], t: int = 4) -> float:
    """Max |logit| difference between t one-token steps and one t-token call."""
    split = len(ids) - t
    one = backend.new_cache(len(ids))
    backend.forward(one, ids[:split], 1)
    singles = np.stack([backend.forward(one, [i], 1)[-1].copy() for i in ids[split:]])
    many = backend.new_cache(len(ids))
    backend.forward(many, ids[:split], 1)
    return float(np.abs(backend.forward(many, ids[split:], t) - singles).max())


def chunked_perplexity(backend: OrtCpuBackend, ids: list[int],
                       chunk: int = PERPLEXITY_CHUNK) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under the graph, fed `chunk` tokens
    a call through its KV cache: memory holds one chunk's logits. (Where the graph is not
    batch invariant, int8 and int4, the chunk size is part of the measurement.)"""
    if len(ids) < 2:
        raise ValueError(f"perplexity needs 2 or more ids, got {len(ids)}")
    cache = backend.new_cache(len(ids))
    nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:min(start + chunk, len(ids) - 1)]  # the last id is only predicted
        logits = backend.forward(cache, piece, len(piece))
        nll += next_token_nll(logits, ids[start + 1:start + 1 + len(piece)])
    return float(np.exp(nll / (len(ids) - 1)))


def _greedy_path(backend: OrtCpuBackend, prompt_ids: list[int], steps: int) -> list[int]:
    """The graph's own greedy tokens after `prompt_ids`, `steps` of them."""
    cache = backend.new_cache(len(prompt_ids) + steps)
    feed, path = prompt_ids, []
    for _ in range(steps):
        path.append(int(np.argmax(backend.forward(cache, feed, 1)[-1])))
        feed = [path[-1]]
    return path


def _agreement(backend: OrtCpuBackend, prompt_ids: list[int], path: list[int]) -> int:
    """How many of `path`'s tokens the graph also picks greedily, fed `path` itself
    (teacher-forced: one miss does not move the later steps)."""
    cache = backend.new_cache(len(prompt_ids) + len(path))
    feed, agree = prompt_ids, 0
    for want in path:
        agree += want == int(np.argmax(backend.forward(cache, feed, 1)[-1]))
        feed = [want]
    return agree


def quantization_report(reference: Path, quantized: Path, dims: dict, prompt_ids: list[int],
                        text_ids: list[int], steps: int = 64) -> dict:
    """Greedy agreement and perplexity of `quantized` against the fp32 `reference`.

    Everything stays within the model's context (`dims["max_context"]`): the text is cut to
    it and the greedy steps end at it; a position beyond the context would index past the
    position embedding of a model such as GPT-2."""
    context = dims["max_context"]
    text_ids = list(text_ids)[:context]
    prompt_ids = list(prompt_ids)[:max(4, context // 2)]
    steps = max(1, min(steps, context - len(prompt_ids)))
    # One graph open at a time: the fp32 session of a 1B-parameter model alone holds its
    # 5 GB of weights (and ONNX Runtime's packed copies of them).
    ref = graph_backend(reference, dims)
    path = _greedy_path(ref, prompt_ids, steps)
    ppl_ref = chunked_perplexity(ref, text_ids)
    del ref
    gc.collect()
    quant = graph_backend(quantized, dims)
    agree = _agreement(quant, prompt_ids, path)
    ppl_quant = chunked_perplexity(quant, text_ids)
    batch_diff = batch_difference(quant, prompt_ids)
    return {"greedy_agreement": agree / len(path), "greedy_steps": len(path),
            "perplexity_fp32": ppl_ref, "perplexity": ppl_quant,
            "perplexity_change": ppl_quant / ppl_ref - 1.0,
            "batch_max_logit_diff": batch_diff,
            "batch_invariant": batch_diff <= BATCH_TOLERANCE}
