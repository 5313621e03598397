"""int4 with integer zero points found by a search (export/int4_blocks.py), packed for
ONNX Runtime's MatMulNBits, and the `--int4-grid` choice that uses them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specedge.export.int4_blocks import Int4Blocks, matmul_nbits_arrays, search_int4


def min_max(weight: np.ndarray, block: int = 32) -> Int4Blocks:
    """Plain rounding: scale = range / 15 (0 kept in the range), zero point = -min / scale."""
    k, n = weight.shape
    blocks = weight.reshape(k // block, block, n)
    low = np.minimum(blocks.min(axis=1), 0)
    high = np.maximum(blocks.max(axis=1), 0)
    scale = (high - low) / 15
    zero = np.clip(np.rint(-low / scale), 0, 15)
    codes = np.clip(np.rint(blocks / scale[:, None]) + zero[:, None], 0, 15)
    return Int4Blocks(codes.astype(np.uint8).reshape(k, n), scale.astype(np.float32),
                      zero.astype(np.uint8), block)


def block_errors(q: Int4Blocks, weight: np.ndarray, importance=None) -> np.ndarray:
    k, n = weight.shape
    a = np.ones(k) if importance is None else importance
    e = (a[:, None] * (q.dequantized() - weight) ** 2).reshape(k // q.block, q.block, n)
    return e.sum(axis=1)


def test_a_weight_on_an_integer_grid_comes_back_exactly():
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.01, 0.1, size=(2, 1, 8)).astype(np.float32)
    zero = rng.integers(0, 16, size=(2, 1, 8))
    codes = rng.integers(0, 16, size=(2, 32, 8))
    codes[:, 0], codes[:, 1] = 0, 15  # every block spans its whole grid
    weight = (scale * (codes - zero)).reshape(64, 8)
    q = search_int4(weight)
    np.testing.assert_allclose(q.dequantized(), weight, rtol=0, atol=1e-6)


def test_every_block_is_at_least_as_close_as_plain_rounding():
    rng = np.random.default_rng(1)
    weight = (rng.standard_t(4, size=(256, 48)) * 0.02 + 0.003).astype(np.float32)
    searched, plain = block_errors(search_int4(weight), weight), block_errors(min_max(weight),
                                                                              weight)
    assert (searched <= plain * (1 + 1e-5)).all()
    assert searched.sum() < 0.95 * plain.sum()  # and closer overall


def test_importance_moves_the_error_to_channels_that_matter_less():
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(128, 32)).astype(np.float32) * 0.05
    importance = np.where(np.arange(128) % 32 < 4, 100.0, 1.0)  # 4 loud channels a block
    alike, weighted = search_int4(weight), search_int4(weight, importance=importance)
    assert (block_errors(weighted, weight, importance).sum()
            < block_errors(alike, weight, importance).sum())


def test_a_reduction_axis_off_the_block_is_refused():
    with pytest.raises(ValueError, match="multiple of the block"):
        search_int4(np.zeros((40, 4), np.float32))


@pytest.mark.parametrize("k", [64, 96])  # an even and an odd number of blocks
def test_matmul_nbits_computes_with_the_searched_weight(k):
    """ONNX Runtime's kernel reads the packed codes, scales and zero points as the
    dequantized weight says (accuracy level 0: fp32 activations, so only rounding differs)."""
    rng = np.random.default_rng(3)
    n = 40
    q = search_int4(rng.normal(size=(k, n)).astype(np.float32) * 0.05)
    b, scales, zero_points = matmul_nbits_arrays(q)
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=32, accuracy_level=0)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, n])],
        [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S"),
         numpy_helper.from_array(zero_points, "Z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    a = rng.normal(size=(3, k)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"A": a})[0], a @ q.dequantized(),
                               rtol=1e-5, atol=1e-5)


def test_the_search_grid_bundle_runs_one_matmul_a_weight(tiny_checkpoints, tmp_path):
    """An int4 export with the search grid has no offset products (Reshape, ReduceSum,
    MatMul, Add after each MatMulNBits), records its node counts, reports its quality, and
    greedy speculative decoding equals plain decoding on it."""
    from specedge.export.bundle_writer import export_bundle
    from specedge.runtime import Generator

    out = tmp_path / "b"
    manifest = export_bundle(str(tiny_checkpoints["llama-h16"]), out, draft_layers=1,
                             precision="int4", int4_grid="search", attention="fused")
    graph = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    assert not [n for n in graph.node if n.name.endswith("_add_offset")]
    assert [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert manifest["source"]["int4_grid"] == "search"
    counts = manifest["models"]["target"]["optimized_nodes"]
    # 4 MatMulNBits, 2 SkipSimplifiedLayerNormalization, attention, Split, QuickGelu, Mul
    # (on fused attention: one GroupQueryAttention node).
    assert counts["all"] > 0 and counts["per_layer"] <= 10
    assert 0 <= manifest["quantization"]["greedy_agreement"] <= 1
    gen = Generator.from_bundle(out)
    for prompt in ["hello", "the cat sat"]:
        plain = gen.generate(prompt, max_new_tokens=24, use_draft=False)
        spec = gen.generate(prompt, max_new_tokens=24, draft_tokens=3)
        assert spec.token_ids == plain.token_ids


def test_int4_grid_is_checked_with_the_precision(tiny_checkpoints, tmp_path):
    from specedge.export.settings import ExportSettings

    with pytest.raises(ValueError, match="--int4-grid must be one of"):
        ExportSettings(model="m", out=tmp_path, precision="int4", int4_grid="nearest")
    with pytest.raises(ValueError, match="applies to --precision int4 only"):
        ExportSettings(model="m", out=tmp_path, precision="int8", int4_grid="search")


@pytest.mark.parametrize("grid", ["exact", "search"])
def test_int4_block_and_head_bits_reach_every_matmul(tiny_checkpoints, tmp_path, grid):
    """--int4-block 64 --int4-head-bits 4: every MatMulNBits of the target, the LM head
    included, is 4-bit in blocks of 64; the bundle records both, and greedy speculative
    decoding still equals plain decoding on it."""
    from specedge.export.bundle_writer import export_bundle
    from specedge.runtime import Generator

    out = tmp_path / "b"
    manifest = export_bundle(str(tiny_checkpoints["llama-h16"]), out, draft_layers=1,
                             precision="int4", int4_grid=grid, int4_block=64,
                             int4_head_bits=4)
    assert (manifest["source"]["int4_block"], manifest["source"]["int4_head_bits"]) == (64, 4)
    graph = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: a.i for a in n.attribute} for n in nbits]
    assert len(nbits) >= 5  # 2 layers x (QKV, output, gate/up, down) and the head
    assert all(a["bits"] == 4 and a["block_size"] == 64 for a in attrs), attrs
    vocab = manifest["models"]["target"]["vocab_size"]
    assert any(a["N"] == vocab for a in attrs)  # the head, at 4 bits
    gen = Generator.from_bundle(out)
    for prompt in ["hello", "the cat sat"]:
        plain = gen.generate(prompt, max_new_tokens=24, use_draft=False)
        spec = gen.generate(prompt, max_new_tokens=24, draft_tokens=3)
        assert spec.token_ids == plain.token_ids


def test_int4_block_and_head_bits_are_checked(tmp_path):
    from specedge.export.settings import ExportSettings

    with pytest.raises(ValueError, match="--int4-block must be one of 32, 64, 128"):
        ExportSettings(model="m", out=tmp_path, precision="int4", int4_block=48)
    with pytest.raises(ValueError, match="--int4-head-bits must be one of 8, 4"):
        ExportSettings(model="m", out=tmp_path, precision="int4", int4_head_bits=2)
    with pytest.raises(ValueError, match="apply to --precision int4 only"):
        ExportSettings(model="m", out=tmp_path, precision="int8", int4_block=64)
