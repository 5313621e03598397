"""Batched attention (`--attention batched`): per layer, two TensorScatter nodes write the
new K/V rows into the cache in place and ONNX's Attention (opset 24) attends over it, so
that one call takes several rows of several tokens (batched decoding). It computes what
transformers computes, a row alike in every call of two or more tokens (int8/int4 stay
exact), and it is refused where it cannot run."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from test_cli import assert_one_line_error, call_main
from test_fused_attention import agree_step_by_step
from tiny_models import save_tiny_more

from specedge.export.bundle_writer import export_bundle
from specedge.runtime import Generator
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.errors import BackendUnavailableError


def _graph(path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


@pytest.mark.parametrize("arch", ["llama", "llama-h16", "gpt2"])
def test_batched_graph_passes_verify(arch, tiny_checkpoints, tmp_path):
    """--verify: logits within 1e-3 of transformers over a prompt and 32 cached steps and
    the same 32 greedy tokens, with q and k rotated by the graph (heads of 8), by ONNX
    Runtime's RotaryEmbedding (heads of 16), or not at all (GPT-2). Each layer has one
    Attention and two TensorScatter nodes, no GroupQueryAttention and no Softmax, at opset
    24; the manifest names the form."""
    manifest = export_bundle(str(tiny_checkpoints[arch]), tmp_path / "b", draft_layers=1,
                             attention="batched", verify=True)
    assert manifest["source"]["attention"] == "batched"
    assert manifest["versions"]["opset"] == 24
    for role in ("target", "draft"):
        model = manifest["models"][role]
        assert manifest["verify"][role]["ok"], manifest["verify"][role]
        assert model["kv_layout"] == "bhsd-inplace" and model["attention"] == "batched"
        graph = _graph(tmp_path / "b" / model["file"])
        ops = Counter(n.op_type for n in graph.graph.node)
        layers = model["num_layers"]
        assert ops["Attention"] == layers and ops["TensorScatter"] == 2 * layers
        assert ops["GroupQueryAttention"] == 0 and ops["Softmax"] == 0
        assert ops["RotaryEmbedding"] == (layers if arch == "llama-h16" else 0)
        assert {o.domain: o.version for o in graph.opset_import}[""] == 24


def test_batched_int4_graph_is_batch_invariant(tiny_checkpoints, tmp_path):
    """The export's own check (one 4-token call against four one-token steps, which the
    runtime runs as two rows) finds no difference at int4: the logits are bit for bit."""
    manifest = export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", draft_layers=1,
                             precision="int4", attention="batched")
    assert manifest["quantization"]["batch_max_logit_diff"] == 0.0
    assert manifest["quantization"]["batch_invariant"] is True


@pytest.fixture(scope="module")
def batched_and_fused(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("batched-vs-fused")
    for form in ("batched", "fused"):
        export_bundle(str(tiny_checkpoints["llama-h16"]), root / form, draft_layers=1,
                      attention=form)
    return root / "batched", root / "fused"


def test_batched_and_fused_graphs_agree_step_by_step(batched_and_fused):
    """The same calls (prefill, verifications of 1-4 tokens, rollbacks) on both in-place
    graphs: the same logits and the same cache rows. A batched graph's cache starts small
    and grows, as it attends over the whole capacity."""
    batched, fused = (OrtCpuBackend(load_bundle(b).target) for b in batched_and_fused)
    assert batched.grows_cache and not fused.grows_cache
    agree_step_by_step(batched, fused)


def test_greedy_speculative_equals_plain_on_batched_graphs(batched_and_fused):
    gen = Generator.from_bundle(batched_and_fused[0])
    for prompt in ["hello world", "the cat sat on the mat", "a, b, c!"]:
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=40, draft_tokens=3,
                            drafter="lookup+model")
        assert spec.token_ids == plain.token_ids


def test_batched_bundle_needs_onnxruntime_1_31(batched_and_fused, monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", "1.30.0")
    with pytest.raises(BackendUnavailableError, match="onnxruntime >= 1.31"):
        OrtCpuBackend(load_bundle(batched_and_fused[0]).target)


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3_text"])
def test_sliding_windows_batch_and_stay_exact(arch, tmp_path):
    """Sliding windows are a mask (graph/attention.py `scatter_inputs`): Phi-3 (a window in
    every layer), Gemma 2 and Gemma 3 (windowed and full layers alternating, soft-capping)
    pass --verify with batched attention, and prompts past the window decoded together
    (greedy, plain and speculative) are each what that prompt gives alone."""
    from tiny_models import GEMMA_WINDOW, PHI3_WINDOW, save_tiny_gemma

    from specedge.runtime import GenerationConfig
    from specedge.runtime.batch import BatchGenerator, BatchRequest

    save = save_tiny_more if arch == "phi3" else save_tiny_gemma
    checkpoint = save(tmp_path / arch, arch)
    manifest = export_bundle(str(checkpoint), tmp_path / "b", draft_layers=1,
                             attention="batched", verify=True)
    assert manifest["verify"]["target"]["ok"] and manifest["verify"]["draft"]["ok"]
    nodes = Counter(n.op_type for n in _graph(tmp_path / "b" / "target.onnx").graph.node)
    assert nodes["Attention"] > 0 and nodes["GroupQueryAttention"] == 0
    window = PHI3_WINDOW if arch == "phi3" else GEMMA_WINDOW
    prompts = [[3 + (i * 7 + j) % 29 for j in range(window + 5 + 3 * i)] for i in range(3)]
    gen = Generator.from_bundle(tmp_path / "b", threads=1)
    configs = [dict(use_draft=False), dict(draft_tokens=2, drafter="model")]
    alone = [gen.generate(prompt_ids=p, max_new_tokens=12, **c).token_ids
             for p in prompts for c in configs]
    together = BatchGenerator(gen, max_batch=6).generate(
        [BatchRequest(prompt_ids=p, config=GenerationConfig(max_new_tokens=12, **c))
         for p in prompts for c in configs])
    assert [r.token_ids for r in together] == alone


def test_batched_attention_is_refused_where_it_cannot_be(capsys, tiny_checkpoints, tmp_path):
    """TensorRT engines, feature drafts: one line each, saying what to export instead, and
    no bundle."""
    out = tmp_path / "bundle"
    code, _, err = call_main(capsys, "export", tiny_checkpoints["llama-h16"], "--out", out,
                             "--attention", "batched", "--backend", "tensorrt")
    assert_one_line_error(code, err, "--backend tensorrt needs --attention portable")
    assert not out.exists()


def test_a_feature_draft_exports_batched(feature_draft, tiny_checkpoints, tmp_path):
    """The feature draft's layer runs on batched attention as the target's do: both graphs
    pass --verify, the draft's in place with one Attention and two TensorScatter nodes,
    and greedy speculative decoding on it equals plain decoding."""
    out = tmp_path / "b"
    manifest = export_bundle(str(tiny_checkpoints["llama"]), out, draft=str(feature_draft[0]),
                             attention="batched", verify=True)
    draft = manifest["models"]["draft"]
    assert manifest["verify"]["draft"]["ok"] and manifest["verify"]["target"]["ok"]
    assert draft["reads_features"] and draft["attention"] == "batched"
    assert draft["kv_layout"] == "bhsd-inplace"
    ops = Counter(n.op_type for n in _graph(out / draft["file"]).graph.node)
    assert ops["Attention"] == 1 and ops["TensorScatter"] == 2
    assert ops["GroupQueryAttention"] == 0
    gen = Generator.from_bundle(out)
    drafted = 0
    for prompt in ("hello world", "the cat sat"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=32, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=32, draft_tokens=3,
                            drafter="model")
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats["drafted_tokens"]
    assert drafted > 0
