"""Quantized exports: the graphs are really quantized, the report measures the change, and
speculative decoding stays exact against the (quantized) target."""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import onnx
import pytest

from specedge.export.bundle_writer import export_bundle
from specedge.runtime import Generator


@pytest.fixture(scope="module", params=["int4", "int8", "fp16"])
def quantized(request, tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / request.param
    manifest = export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1,
                             precision=request.param)
    return request.param, out, manifest


def _ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_graphs_are_quantized(quantized, tiny_bundle):
    precision, out, manifest = quantized
    for role in ("target", "draft"):
        assert manifest["models"][role]["precision"] == precision
        ops = _ops(out / f"{role}.onnx")
        if precision == "fp16":
            fp32 = onnx.load(str(tiny_bundle / f"{role}.onnx"))
            assert all(i.data_type == onnx.TensorProto.FLOAT16
                       for i in onnx.load(str(out / f"{role}.onnx")).graph.initializer
                       if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                       and len(i.dims) == 2)
            assert len(fp32.graph.initializer) > 0
        else:
            # q/k/v, o, gate/up and down per layer (export/graph/llama.py fuses the projections
            # that share an input), and no float weight product left over
            assert ops["MatMulNBits"] >= 4 * manifest["models"][role]["num_layers"]
            graph = onnx.load(str(out / f"{role}.onnx"), load_external_data=False).graph
            weights = {i.name for i in graph.initializer}
            # int4's block offset products stay fp32 (export/quantize.py)
            assert not [n.name for n in graph.node
                        if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights
                        and not (precision == "int4" and n.name.endswith("_offset"))]
            bits = {n.name: next((a.i for a in n.attribute if a.name == "bits"), 4)
                    for n in graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
            vocabulary = manifest["models"][role]["vocab_size"]
            head = [n.name for n in graph.node if n.op_type == "MatMulNBits"
                    and next(a.i for a in n.attribute if a.name == "N") == vocabulary]
            embedding = [n.name for n in graph.node if n.op_type == "GatherBlockQuantized"]
            assert len(head) == 1 and bits[head[0]] == 8  # int4 keeps the head at 8 bits
            assert len(embedding) == 1  # the table is quantized too, at the graph's bits
            want = 4 if precision == "int4" else 8
            assert {b for n, b in bits.items() if n not in head} == {want}
    assert (out / "target.onnx").stat().st_size < (tiny_bundle / "target.onnx").stat().st_size


def test_report_measures_the_change(quantized):
    precision, out, manifest = quantized
    report = manifest["quantization"]
    assert 0.0 <= report["greedy_agreement"] <= 1.0 and report["greedy_steps"] == 64
    assert report["perplexity_fp32"] > 1 and report["perplexity"] > 1
    assert report["batch_invariant"] == (report["batch_max_logit_diff"] <= 1e-3)
    assert report["perplexity_change"] == pytest.approx(
        report["perplexity"] / report["perplexity_fp32"] - 1)
    assert json.loads((out / "manifest.json").read_text())["precision"] == precision


def test_speculative_is_exact_on_a_quantized_target(quantized):
    _, out, _ = quantized
    gen = Generator.from_bundle(out)
    for prompt in ("hello world", "the cat sat"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=30, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=30, draft_tokens=3,
                            drafter="model")
        assert spec.token_ids == plain.token_ids


def test_quantizing_logs_no_line_per_node(tiny_checkpoints, tmp_path, caplog):
    """ONNX Runtime's quantizer logs each node at INFO; the export's output stays its
    progress bar and report."""
    with caplog.at_level(logging.INFO):
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", precision="int8")
    assert not [r.getMessage() for r in caplog.records
                if r.name.startswith("onnxruntime") and r.levelno < logging.WARNING]


def test_unknown_precision_is_refused(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="--precision must be one of"):
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", precision="int3")
    assert not (tmp_path / "b").exists()


def _matmul_graph(w: np.ndarray, path) -> None:
    """y = x @ w, x [1, T, K]."""
    k, n = w.shape
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="m")], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "T", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, "T", n])],
        [onnx.numpy_helper.from_array(w.astype(np.float32), "w")])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)],
                                     ir_version=10), str(path))


def _q4_1_grid(k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """A [k, n] weight on Q4_1's grid: w = d * q + m per block of 32 along k, every block
    using levels 0 and 15 (as Q4_1's quantizer makes them)."""
    blocks = k // 32
    d = rng.uniform(0.001, 0.05, (blocks, 1, n)).astype(np.float16).astype(np.float32)
    m = rng.normal(0, 0.1, (blocks, 1, n)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (blocks, 32, n))
    q[:, 0], q[:, 1] = 0, 15
    return (d * q + m).reshape(k, n)


def test_int4_holds_a_q4_1_grid_exactly(tmp_path):
    """Weights on Q4_1's grid (SmolLM2's come dequantized from a Q4_1 GGUF) come out of the
    int4 graph as they went in: 4-bit codes with zero point 8 plus an fp32 block offset."""
    from specedge.export.quantize import quantize_graph

    rng = np.random.default_rng(0)
    w = _q4_1_grid(64, 24, rng)
    _matmul_graph(w, tmp_path / "g.onnx")
    quantize_graph(tmp_path / "g.onnx", "int4")
    graph = onnx.load(str(tmp_path / "g.onnx")).graph
    init = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    (node,) = [n for n in graph.node if n.op_type == "MatMulNBits"]
    packed = init[node.input[1]]  # [N, K/32, 16]: two 4-bit codes per byte, low one first
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(24, 64).T
    scales = init[node.input[2]].reshape(24, 2)
    assert (init[node.input[3]] == 8 + (8 << 4)).all()  # zero point 8 everywhere
    offset = init["w_block_offset"]  # [K/32, N]
    rebuilt = (codes - 8.0) * np.repeat(scales.T, 32, axis=0) + np.repeat(offset, 32, axis=0)
    np.testing.assert_allclose(rebuilt, w, rtol=0, atol=1e-6)
    # and the graph computes x @ W, up to the int8 activations of the fast kernel
    import onnxruntime as ort

    x = rng.normal(size=(1, 3, 64)).astype(np.float32)
    (y,) = ort.InferenceSession(str(tmp_path / "g.onnx")).run(None, {"x": x})
    assert np.linalg.norm(y - x @ w) < 0.02 * np.linalg.norm(x @ w)


def test_block_offset_split_keeps_the_function(tiny_bundle, tmp_path):
    """x @ W = x @ (W - C) + blocksum(x) @ Offsets: the fp32 graph computes the same
    logits."""
    import onnxruntime as ort

    from specedge.export.quantize import _split_block_offset
    from specedge.runtime.bundle import graph_io, load_bundle

    spec = load_bundle(tiny_bundle).target
    model = onnx.load(str(spec.path))
    assert _split_block_offset(model)
    onnx.save(model, str(tmp_path / "split.onnx"))
    inputs, _ = graph_io(spec.num_layers)
    rng = np.random.default_rng(1)
    feeds = {"input_ids": np.array([[5, 6, 7]]), "position_ids": np.array([[4, 5, 6]]),
             "past_length": np.array([4]), "logits_to_keep": np.array([3])}
    for name in inputs[4:]:
        feeds[name] = rng.normal(size=(1, spec.num_kv_heads, 8, spec.head_dim)).astype(
            np.float32)
    before = ort.InferenceSession(str(spec.path)).run(None, feeds)
    after = ort.InferenceSession(str(tmp_path / "split.onnx")).run(None, feeds)
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_int8_embedding_rows_are_within_half_a_step(tmp_path):
    """An int8 graph's embedding table is stored at 8 bits per block of 32 (a quarter of its
    fp32 size), and every row it gathers is within half a quantization step of the
    original, zeros exactly (the block's range holds 0)."""
    import onnxruntime as ort

    from specedge.export.quantize import quantize_graph

    rng = np.random.default_rng(2)
    table = rng.normal(0, 0.05, (300, 64)).astype(np.float32)
    table[7] = 0.0  # a row of zeros: scale 1, code = zero point
    table[9, :32] = np.abs(table[9, :32])  # a block with no negative value
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["table", "ids"], ["y"], name="embed")], "g",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, "T"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, "T", 64])],
        [onnx.numpy_helper.from_array(table, "table")])
    path = tmp_path / "g.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)],
                                     ir_version=10), str(path))
    fp32_size = path.stat().st_size
    quantize_graph(path, "int8")
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["GatherBlockQuantized"]
    assert path.stat().st_size < 0.35 * fp32_size
    ids = np.arange(300)[None]
    (y,) = ort.InferenceSession(str(path)).run(None, {"ids": ids})
    blocks = table.reshape(300, 2, 32)
    step = (np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)) / 255
    error = np.abs(y[0] - table).reshape(300, 2, 32).max(-1)
    assert (error <= step / 2 + 1e-7).all()
    assert (y[0, 7] == 0).all()
    assert error.max() > 0  # quantized, not passed through
