"""Quantized exports: the graphs are really quantized, the report measures the change, and
speculative decoding stays exact against the (quantized) target."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest

from specedge.export.bundle import export_bundle
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
            # q/k/v, o, gate/up and down per layer (export/graph.py fuses the projections
            # that share an input), and no float weight product left over
            assert ops["MatMulNBits"] >= 4 * manifest["models"][role]["num_layers"]
            graph = onnx.load(str(out / f"{role}.onnx"), load_external_data=False).graph
            weights = {i.name for i in graph.initializer}
            assert not [n.name for n in graph.node
                        if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
            bits = {n.name: next((a.i for a in n.attribute if a.name == "bits"), 4)
                    for n in graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
            vocabulary = manifest["models"][role]["vocab_size"]
            head = [n.name for n in graph.node if n.op_type == "MatMulNBits"
                    and next(a.i for a in n.attribute if a.name == "N") == vocabulary]
            embedding = [n.name for n in graph.node if n.op_type == "GatherBlockQuantized"]
            assert len(head) == 1 and bits[head[0]] == 8  # int4 keeps the head at 8 bits
            # GatherBlockQuantized is 4-bit only: int8 leaves the embedding in fp32
            assert len(embedding) == (precision == "int4")
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
        spec = gen.generate(prompt, raw=True, max_new_tokens=30, draft_tokens=3)
        assert spec.token_ids == plain.token_ids


def test_unknown_precision_is_refused(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="--precision must be one of"):
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", precision="int3")
    assert not (tmp_path / "b").exists()
