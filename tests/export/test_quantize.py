"""Quantized exports: the graphs are really quantized, the report is what the graphs compute
(recomputed here without the export's code) and scores a corrupted graph worse, and
speculative decoding stays exact against the (quantized) target."""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from scipy.special import log_softmax

from specedge.export.bundle_writer import VERIFY_PROMPT, export_bundle
from specedge.export.quantize import (
    PERPLEXITY_CHUNK,
    PERPLEXITY_TEXT,
    chunked_perplexity,
    quantization_report,
)
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


class _Graph:
    """One graph run by ONNX Runtime directly, its KV cache kept here in numpy: the bundle's
    contract written out again, so that the report is checked against what the graph
    computes, not against the runtime's backends or the product's formulas. Portable
    graphs read past rows [0, past_length) of a fixed-capacity buffer and return the T new
    rows; in-place graphs (GroupQueryAttention, or TensorScatter and Attention) return
    the whole buffers with the rows written, and take a one-token step as two rows, the
    token twice, keeping the first (the runtime's batch-invariant step, docs/design.md)."""

    def __init__(self, path, capacity: int):
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.kv = {i.name: np.zeros((1, i.shape[1], capacity + 1, i.shape[3]), np.float32)
                   for i in self.session.get_inputs() if i.name.startswith("past_key_values")}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.in_place = any(n.op_type in ("GroupQueryAttention", "TensorScatter")
                            for n in onnx.load(str(path), load_external_data=False).graph.node)
        self.length = 0

    def __call__(self, ids: list[int], keep: int = 1) -> np.ndarray:
        """Logits [keep, V] of the last `keep` of `ids`; their K/V rows join the cache."""
        padded = self.in_place and len(ids) == 1
        if padded:
            ids, keep = ids * 2, 2
        t = len(ids)
        logits, *presents = self.session.run(None, {
            "input_ids": np.array([ids], np.int64),
            "position_ids": np.arange(self.length, self.length + t)[None],
            "past_length": np.array([self.length]), "logits_to_keep": np.array([keep]),
            **self.kv})
        for name, rows in zip(self.outputs[1:], presents):
            past = name.replace("present.", "past_key_values.")
            if self.in_place:
                self.kv[past] = rows
            else:
                self.kv[past][:, :, self.length:self.length + t] = rows
        self.length += t - padded
        return logits[0][:1] if padded else logits[0]


def _perplexity(path, ids: list[int], chunk: int = PERPLEXITY_CHUNK) -> float:
    """exp of the mean negative log-likelihood of ids[1:], from calls of `chunk` tokens
    through the KV cache (the report's definition: its memory is one chunk's logits)."""
    graph, rows = _Graph(path, len(ids)), []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:min(start + chunk, len(ids) - 1)]
        rows.append(graph(piece, len(piece)).astype(np.float64))
    nll = -log_softmax(np.concatenate(rows), axis=-1)[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def _greedy_agreement(reference, quantized, prompt: list[int], steps: int = 64) -> float:
    """Share of `steps` positions of the reference's greedy continuation of `prompt` where
    the quantized graph, fed the same tokens, picks the same argmax."""
    ref, quant = _Graph(reference, len(prompt) + steps), _Graph(quantized, len(prompt) + steps)
    feed, same = prompt, 0
    for _ in range(steps):
        want = int(np.argmax(ref(feed)[-1]))
        same += int(np.argmax(quant(feed)[-1])) == want
        feed = [want]
    return same / steps


def _batch_difference(path, ids: list[int], t: int = 4) -> float:
    """Max |logit| difference between the last t tokens as t one-token calls and as one."""
    one, many = _Graph(path, len(ids)), _Graph(path, len(ids))
    one(ids[:-t])
    many(ids[:-t])
    singles = np.stack([one([i])[-1] for i in ids[-t:]])
    return float(np.abs(many(ids[-t:], t) - singles).max())


def _sampled_text(path, prompt: list[int], n: int, seed: int) -> list[int]:
    """`prompt` and n tokens drawn from the graph's own softmax (T = 1), seeded: no model
    has a lower expected log-loss on text drawn from a distribution than that distribution
    (Gibbs' inequality), so a damaged model must score a higher perplexity on it."""
    graph, rng = _Graph(path, len(prompt) + n), np.random.default_rng(seed)
    ids, feed = list(prompt), list(prompt)
    for _ in range(n):
        logits = graph(feed)[-1].astype(np.float64)
        p = np.exp(logits - logits.max())
        feed = [int(rng.choice(p.size, p=p / p.sum()))]
        ids += feed
    return ids


def _corrupted(path, out, seed: int = 0) -> None:
    """A copy of the graph with half the values of every weight tensor (float weights, 8-
    and 4-bit codes, scales) shuffled among themselves: the same sizes, types and value
    ranges, another model."""
    model = onnx.load(str(path))
    rng = np.random.default_rng(seed)
    kinds = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.UINT8)
    for init in model.graph.initializer:
        if init.data_type not in kinds or len(init.dims) < 2:
            continue
        w = onnx.numpy_helper.to_array(init)
        flat = w.reshape(-1).copy()
        pick = rng.choice(flat.size, flat.size // 2, replace=False)
        flat[pick] = flat[rng.permutation(pick)]
        init.CopyFrom(onnx.numpy_helper.from_array(flat.reshape(w.shape), init.name))
    onnx.save(model, str(out))


@pytest.fixture(scope="module")
def report_inputs(tiny_checkpoints) -> tuple[list[int], list[int]]:
    """The prompt and text the export measures on, tokenized as the export does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    # the report cuts the text to the model's context (512 positions)
    return tokenizer(VERIFY_PROMPT)["input_ids"], tokenizer(PERPLEXITY_TEXT)["input_ids"][:512]


def test_report_is_what_the_graphs_compute(quantized, tiny_bundle, report_inputs):
    """Every figure of the manifest's quantization report, recomputed from the graphs'
    logits (ONNX Runtime called directly, the KV cache and the log-softmax in numpy): the
    fp32 reference is the tiny bundle's target graph, the same weights."""
    precision, out, manifest = quantized
    prompt, text = report_inputs
    report = manifest["quantization"]
    reference, graph = tiny_bundle / "target.onnx", out / "target.onnx"
    assert report["greedy_steps"] == 64
    assert report["greedy_agreement"] == _greedy_agreement(reference, graph, prompt, 64)
    ppl_fp32, ppl = _perplexity(reference, text), _perplexity(graph, text)
    assert report["perplexity_fp32"] == pytest.approx(ppl_fp32, rel=1e-5)
    assert report["perplexity"] == pytest.approx(ppl, rel=1e-5)
    assert report["perplexity_change"] == pytest.approx(ppl / ppl_fp32 - 1, abs=1e-5)
    diff = _batch_difference(graph, prompt)
    assert report["batch_max_logit_diff"] == pytest.approx(diff, abs=1e-6)
    assert report["batch_invariant"] == (diff <= 1e-3)
    assert json.loads((out / "manifest.json").read_text())["precision"] == precision


def test_a_corrupted_graph_scores_worse(quantized, tiny_bundle, report_inputs, tmp_path):
    """Control: the export's report function on the quantized graph and on a copy with half
    of every weight tensor shuffled, measured on 120 tokens sampled from the fp32 graph
    (seed 0) after the prompt's first 8: the corrupted copy must agree less with fp32's
    greedy tokens and have a higher perplexity, and the recomputation must see the same.
    (Measured: agreement 0.50-0.98 against 0.02-0.06, perplexity 11.4-17.4 against
    98-145; the fp32 graph's own is 11.5.)"""
    _, out, manifest = quantized
    prompt, _ = report_inputs
    reference, graph, broken = tiny_bundle / "target.onnx", out / "target.onnx", \
        tmp_path / "corrupted.onnx"
    _corrupted(graph, broken)
    text = _sampled_text(reference, prompt[:8], 120, seed=0)
    entry = manifest["models"]["target"]
    dims = {k: entry[k] for k in ("num_layers", "num_kv_heads", "head_dim", "vocab_size",
                                  "max_context")}
    good = quantization_report(reference, graph, dims, prompt, text)
    bad = quantization_report(reference, broken, dims, prompt, text)
    assert bad["greedy_agreement"] < good["greedy_agreement"] - 0.2, (good, bad)
    assert bad["perplexity"] > 2 * good["perplexity"], (good, bad)
    assert bad["perplexity_change"] > good["perplexity_change"]
    assert bad["greedy_agreement"] == _greedy_agreement(reference, broken, prompt, 64)
    assert bad["perplexity"] == pytest.approx(_perplexity(broken, text), rel=1e-5)


def test_speculative_is_exact_on_a_quantized_target(quantized):
    """Greedy speculative tokens equal plain ones, with drafts both accepted and rejected
    (otherwise the equality would hold whatever verification did)."""
    _, out, _ = quantized
    gen = Generator.from_bundle(out)
    accepted = rejected = 0
    for prompt in ("hello world", "the cat sat"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=30, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=30, draft_tokens=3,
                            drafter="model")
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats["accepted_tokens"]
        rejected += sum(spec.stats["position_tries"]) - spec.stats["accepted_tokens"]
    assert accepted > 0 and rejected > 0, (accepted, rejected)


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
    quantize_graph(tmp_path / "g.onnx", tmp_path / "q.onnx", "int4")
    graph = onnx.load(str(tmp_path / "q.onnx")).graph
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
    (y,) = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"x": x})
    assert np.linalg.norm(y - x @ w) < 0.02 * np.linalg.norm(x @ w)


def test_block_offset_split_keeps_the_function(tiny_bundle, tmp_path):
    """x @ W = x @ (W - C) + blocksum(x) @ Offsets: the fp32 graph computes the same
    logits."""
    import onnxruntime as ort

    from specedge.export.quantize import _activation_ranks, _centre_blocks, _rank
    from specedge.runtime.bundle import graph_io, load_bundle

    spec = load_bundle(tiny_bundle).target
    model = onnx.load(str(spec.path))
    weights = {i.name: i for i in model.graph.initializer}
    ranks = _activation_ranks(model)
    nodes = []
    for node in list(model.graph.node):
        nodes.append(node)
        if node.op_type == "MatMul" and node.input[1] in weights:
            nodes += _centre_blocks(model.graph, node, weights[node.input[1]],
                                    rank=_rank(ranks, node))
    assert len(nodes) > len(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
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
    quantize_graph(path, tmp_path / "q.onnx", "int8")
    path = tmp_path / "q.onnx"
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


def test_int8_export_of_a_short_context_model(tmp_path):
    """GPT-2 with 256 positions: the report's text (561 characters, one id each) is cut to
    the context, where ONNX Runtime's position Gather would otherwise index past its table
    ("indices element out of data bounds")."""
    from tiny_models import char_tokenizer, tiny_model

    model = tiny_model("gpt2", max_positions=256)
    model.save_pretrained(tmp_path / "gpt2")
    char_tokenizer().save_pretrained(tmp_path / "gpt2")
    manifest = export_bundle(str(tmp_path / "gpt2"), tmp_path / "b", precision="int8")
    report = manifest["quantization"]
    assert manifest["models"]["target"]["max_context"] == 256
    assert report["greedy_steps"] == 64 and 0 <= report["greedy_agreement"] <= 1
    assert 1 < report["perplexity_fp32"] < 1e3 and abs(report["perplexity_change"]) < 0.5


class _Recording:
    """A backend that records how many logit rows each call asks for."""

    def __init__(self, backend):
        self.backend, self.kept = backend, []

    def new_cache(self, capacity):
        return self.backend.new_cache(capacity)

    def forward(self, cache, ids, keep):
        self.kept.append(keep)
        return self.backend.forward(cache, ids, keep)


def test_perplexity_runs_in_chunks(tiny_bundle, report_inputs):
    """The report's perplexity asks for at most PERPLEXITY_CHUNK logit rows a call (its
    memory is one chunk's logits, whatever the text's length), covers every position, and
    on an fp32 graph equals the perplexity from one call over the whole text."""
    from specedge.export.verify import graph_backend
    from specedge.runtime.bundle import load_bundle

    _, text = report_inputs
    spec = load_bundle(tiny_bundle).target
    dims = {k: getattr(spec, k) for k in ("num_layers", "num_kv_heads", "head_dim",
                                          "vocab_size", "max_context")}
    backend = _Recording(graph_backend(spec.path, dims))
    chunked = chunked_perplexity(backend, text)
    assert max(backend.kept) == PERPLEXITY_CHUNK and sum(backend.kept) == len(text) - 1
    assert chunked == pytest.approx(_perplexity(spec.path, text, chunk=len(text)), rel=1e-5)
    assert chunked_perplexity(backend, text[:5]) == pytest.approx(
        _perplexity(spec.path, text[:5], chunk=len(text)), rel=1e-5)
