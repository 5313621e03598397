"""Weight-only quantized graphs for ONNX Runtime CPU, and what quantizing cost.

int4 / int8: onnxruntime's MatMulNBitsQuantizer turns every MatMul with a constant weight
into MatMulNBits (blocks of 32 along the reduction axis with a scale and an integer zero
point each; accuracy_level 4 lets the CPU kernels compute in int8). int4 first moves each
block's offset into a small fp32 product (`_split_block_offset`), so that its 4-bit codes
hold GGUF's Q4_1 grid (w = d * q + m) exactly; it keeps the LM head at 8 bits, as
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
both graphs on a text sample. It also measures batch invariance: ONNX Runtime's int8-compute
kernels quantize activations per call, so logits from one K+1-token verification call and
from K+1 one-token steps can differ (on SmolLM2 by up to ~1 logit in int8, 1.7 in int4,
against 3e-5 in fp32).
Speculative decoding is exact for the target as the verification call computes it; where
the graph is not batch invariant, greedy speculative output can part from plain decoding of
the same quantized graph at a near tie.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from specedge.export.verify import graph_backend
from specedge.runtime.backends.ort_cpu import OrtCpuBackend

PRECISIONS = ("fp32", "fp16", "int8", "int4")
BLOCK_SIZE = 32
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


def quantize_graph(path: Path, precision: str) -> None:
    """Rewrite the fp32 graph at `path` in `precision`, in place."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    if precision == "fp32":
        return
    model = onnx.load(str(path))
    if precision == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(model, keep_io_types=True)
    elif precision == "int8":
        model = _weight_only(model, 8, ("MatMul",))
        _embedding_8bit(model)
    else:
        heads = _head_matmuls(model)
        model = _weight_only(model, 8, ("MatMul",),
                             exclude=[n.name for n in model.graph.node if n.name not in heads])
        # the head is no MatMul now; the block offsets stay fp32 (they are tiny)
        model = _weight_only(model, 4, ("MatMul", "Gather"), exclude=_split_block_offset(model))
    onnx.save(model, str(path))


def _split_block_offset(model: onnx.ModelProto) -> list[str]:
    """Prepare every MatMul with a constant weight for Q4_1's grid, in place.

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
    blocksum(x) [.., K/32] sums x over each block. Returns the names of the added MatMuls,
    which stay fp32 (1/32 of the main product's work).
    """
    graph = model.graph
    uses = Counter(name for node in graph.node for name in node.input)
    weights = {i.name: i for i in graph.initializer if uses[i.name] == 1}  # rewritten once
    added, nodes = [], []
    for node in graph.node:
        nodes.append(node)
        w = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or len(w.dims) != 2 or w.dims[0] % BLOCK_SIZE:
            continue
        k, n = w.dims
        blocks = onnx.numpy_helper.to_array(w).reshape(k // BLOCK_SIZE, BLOCK_SIZE, n)
        low, high = blocks.min(axis=1), blocks.max(axis=1)
        offsets = low + 8 * (high - low) / 15
        w.CopyFrom(onnx.numpy_helper.from_array(
            (blocks - offsets[:, None]).reshape(k, n).astype(np.float32), w.name))
        graph.initializer.extend([
            onnx.numpy_helper.from_array(offsets.astype(np.float32), f"{w.name}_block_offset"),
            onnx.numpy_helper.from_array(np.array([-1, k // BLOCK_SIZE, BLOCK_SIZE]),
                                         f"{w.name}_blocks")])
        out = node.output[0]
        name = node.name or out
        node.output[0] = f"{out}_centred"
        nodes += [
            onnx.helper.make_node("Reshape", [node.input[0], f"{w.name}_blocks"],
                                  [f"{out}_blocks"], name=f"{name}_blocks"),
            onnx.helper.make_node("ReduceSum", [f"{out}_blocks", "specedge_last_axis"],
                                  [f"{out}_block_sum"], name=f"{name}_block_sum", keepdims=0),
            onnx.helper.make_node("MatMul", [f"{out}_block_sum", f"{w.name}_block_offset"],
                                  [f"{out}_offset"], name=f"{name}_offset"),
            # [T, N] + [1, T, N]: the graphs' batch is 1
            onnx.helper.make_node("Add", [node.output[0], f"{out}_offset"], [out],
                                  name=f"{name}_add_offset")]
        added.append(f"{name}_offset")
    if added:
        graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1]),
                                                              "specedge_last_axis"))
    del graph.node[:]
    graph.node.extend(nodes)
    return added


def _weight_only(model: onnx.ModelProto, bits: int, ops: tuple[str, ...],
                 exclude: list[str] | None = None) -> onnx.ModelProto:
    """Each of `ops` with a constant weight -> MatMulNBits / GatherBlockQuantized, except
    the `exclude`d nodes."""
    from onnxruntime.quantization import matmul_nbits_quantizer
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # Its module logs a line per node at INFO (about 1400 for SmolLM2) under the export's
    # progress bar; warnings still show.
    matmul_nbits_quantizer.logger.setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=BLOCK_SIZE, is_symmetric=False, accuracy_level=4,
        nodes_to_exclude=exclude, op_types_to_quantize=ops,
        quant_axes=(("MatMul", 0), ("Gather", 1)))
    quantizer.process()
    return quantizer.model.model


def _embedding_8bit(model: onnx.ModelProto) -> None:
    """Each Gather from a constant [V, H] fp32 table -> GatherBlockQuantized at 8 bits, in
    place: blocks of BLOCK_SIZE along H, w = scale * (q - zero_point) with uint8 q and zero
    point, the range widened to hold 0, as MatMulNBits stores int8 weights. ONNX Runtime's
    quantizer writes this op at 4 bits only; its CPU kernel also reads 8 (uint8 data,
    gather axis 0). On SmolLM2 the table is 113 MB of fp32 in the target and again in the
    draft, which embeds tokens too: 8 bits take each graph's copy to 33 MB."""
    graph = model.graph
    uses = Counter(name for node in graph.node for name in node.input)
    uses.update(i.name for i in graph.input)  # an initializer a caller may override stays
    tables = {i.name: i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT
              and len(i.dims) == 2 and i.dims[1] % BLOCK_SIZE == 0 and uses[i.name] == 1}
    for index, node in enumerate(graph.node):
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[0] not in tables or axis != 0:
            continue
        table = tables[node.input[0]]
        rows, width = table.dims
        blocks = onnx.numpy_helper.to_array(table).reshape(rows, width // BLOCK_SIZE, BLOCK_SIZE)
        low = np.minimum(blocks.min(axis=-1), 0.0)
        high = np.maximum(blocks.max(axis=-1), 0.0)
        scale = np.where(high > low, (high - low) / 255, 1.0).astype(np.float32)
        zero = np.clip(np.round(-low / scale), 0, 255)
        codes = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, 255)
        name = table.name
        graph.initializer.remove(table)
        graph.initializer.extend([
            onnx.numpy_helper.from_array(codes.astype(np.uint8).reshape(rows, width),
                                         f"{name}_Q8"),
            onnx.numpy_helper.from_array(scale, f"{name}_scales"),
            onnx.numpy_helper.from_array(zero.astype(np.uint8), f"{name}_zero_points")])
        graph.node[index].CopyFrom(onnx.helper.make_node(
            "GatherBlockQuantized",
            [f"{name}_Q8", node.input[1], f"{name}_scales", f"{name}_zero_points"],
            list(node.output), name=f"{node.name or name}_Q8", domain="com.microsoft",
            gather_axis=0, quantize_axis=1, block_size=BLOCK_SIZE, bits=8))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


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
        x = backend.forward(cache, piece, len(piece)).astype(np.float64)
        x -= x.max(axis=-1, keepdims=True)
        picked = x[np.arange(len(piece)), ids[start + 1:start + 1 + len(piece)]]
        nll -= float((picked - np.log(np.exp(x).sum(axis=-1))).sum())
    return float(np.exp(nll / (len(ids) - 1)))


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
    ref, quant = graph_backend(reference, dims), graph_backend(quantized, dims)
    ref_cache, quant_cache = ref.new_cache(len(prompt_ids) + steps), \
        quant.new_cache(len(prompt_ids) + steps)
    feed, agree = prompt_ids, 0
    for _ in range(steps):
        want = int(np.argmax(ref.forward(ref_cache, feed, 1)[-1]))
        agree += want == int(np.argmax(quant.forward(quant_cache, feed, 1)[-1]))
        feed = [want]  # both follow the fp32 greedy path
    ppl_ref, ppl_quant = chunked_perplexity(ref, text_ids), chunked_perplexity(quant, text_ids)
    batch_diff = batch_difference(quant, prompt_ids)
    return {"greedy_agreement": agree / steps, "greedy_steps": steps,
            "perplexity_fp32": ppl_ref, "perplexity": ppl_quant,
            "perplexity_change": ppl_quant / ppl_ref - 1.0,
            "batch_max_logit_diff": batch_diff,
            "batch_invariant": batch_diff <= BATCH_TOLERANCE}
