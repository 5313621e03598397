"""Fused attention (`--attention fused`): one GroupQueryAttention node per layer that writes
the KV cache in place (layout "bhsd-inplace"). It computes what the portable graph
computes, speculative decoding on it stays exact, and it is refused where it cannot run."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from test_cli import assert_one_line_error, call_main
from tiny_models import save_tiny
from transformers import AutoConfig

from specedge.export.bundle_writer import export_bundle
from specedge.export.graph.families import attention_form, kernel_rotates
from specedge.runtime import Generator
from specedge.runtime.backends import load_backend
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.errors import BackendUnavailableError


@pytest.fixture(scope="module")
def portable_twin(tiny_checkpoints, tmp_path_factory):
    """The fused bundle's checkpoint, exported with portable attention."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-h16-portable"
    export_bundle(str(tiny_checkpoints["llama-h16"]), out, draft_layers=1,
                  attention="portable")
    return out


def _ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_fused_graphs_have_one_attention_node_per_layer(tiny_fused_bundle, portable_twin):
    manifest = load_bundle(tiny_fused_bundle).manifest
    for role in ("target", "draft"):
        model = manifest["models"][role]
        assert model["kv_layout"] == "bhsd-inplace"
        presents = [o["shape"] for o in model["outputs"] if o["name"].startswith("present")]
        assert presents and all(p == ["B", model["num_kv_heads"], "C", 16] for p in presents)
        ops = _ops(tiny_fused_bundle / model["file"])
        assert ops["GroupQueryAttention"] == model["num_layers"]
        assert ops["Softmax"] == 0  # no attention left outside the fused node
        assert load_bundle(portable_twin).manifest["models"][role]["kv_layout"] == "bhsd-fixed"
        assert _ops(portable_twin / model["file"])["GroupQueryAttention"] == 0
    assert manifest["source"]["attention"] == "fused"


def test_fused_graph_declares_its_output_shapes(tiny_checkpoints, tmp_path):
    """The exporter cannot infer GroupQueryAttention's shapes, so the graph declares them:
    the bundle reads the logits' and the features' widths from the graph."""
    from specedge.export.graph.trace import export_onnx
    from specedge.export.sources import load_model

    model, _ = load_model(tiny_checkpoints["llama-h16"])
    export_onnx(model, str(tmp_path / "g.onnx"), features=True, attention="fused")
    graph = onnx.load(str(tmp_path / "g.onnx")).graph
    shapes = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim]
              for o in graph.output}
    cfg = model.config
    assert shapes["logits"] == ["B", "N", cfg.vocab_size]
    assert shapes["hidden_states"] == ["B", "F", cfg.hidden_size]  # features_to_keep rows
    assert shapes["present.1.value"] == ["B", cfg.num_key_value_heads, "C", 16]


def test_fused_module_computes_what_the_portable_module_computes(tiny_checkpoints):
    """The torch side of the fused export (what tracing runs) against the portable module,
    eagerly: the same logits, and the new rows written into the buffers."""
    import torch

    from specedge.export.graph.trace import wrap
    from specedge.export.sources import load_model

    model, _ = load_model(tiny_checkpoints["llama-h16"])
    cfg = model.config
    past = [torch.randn(1, cfg.num_key_value_heads, 16, 16) for _ in range(4)]
    ids, past_length = torch.tensor([[5, 9, 7]]), torch.tensor([4])
    args = (ids, torch.arange(4, 7).unsqueeze(0), past_length, torch.tensor([3]))
    with torch.no_grad():
        logits, *rows = wrap(model)(*args, *past)
        fused_logits, *buffers = wrap(model, attention="fused")(*args, *past)
    torch.testing.assert_close(fused_logits, logits, atol=1e-5, rtol=1e-5)
    for buf, new, old in zip(buffers, rows, past):
        torch.testing.assert_close(buf[:, :, 4:7], new, atol=1e-5, rtol=1e-5)
        assert torch.equal(buf[:, :, :4], old[:, :, :4])
        assert torch.equal(buf[:, :, 7:], old[:, :, 7:])


@pytest.mark.parametrize("arch", ["llama-h16", "llama", "gpt2"])
def test_fused_graph_passes_verify(arch, tiny_checkpoints, tmp_path):
    """--verify: logits within 1e-3 of transformers over a prompt and 32 cached steps, and
    the same 32 greedy tokens. Heads of 16 (the kernel rotates), of 8 (the graph rotates)
    and GPT-2 (no rotary)."""
    manifest = export_bundle(str(tiny_checkpoints[arch]), tmp_path / "b",
                             draft_layers=1, attention="fused", verify=True)
    assert manifest["models"]["target"]["kv_layout"] == "bhsd-inplace"
    for role in ("target", "draft"):
        report = manifest["verify"][role]
        assert report["ok"], report
        assert report["greedy_matches"] == report["greedy_steps"] == 32


def test_fused_and_portable_graphs_agree_step_by_step(tiny_fused_bundle, portable_twin):
    """The same calls (prefill, verifications of 1-4 tokens, rollbacks) on both graphs: the
    same logits and the same cache rows, which the fused graph wrote in place."""
    agree_step_by_step(OrtCpuBackend(load_bundle(tiny_fused_bundle).target),
                       OrtCpuBackend(load_bundle(portable_twin).target))


def agree_step_by_step(first: OrtCpuBackend, second: OrtCpuBackend) -> None:
    """A prefill, verifications of 1-4 tokens and rollbacks on both backends: the same
    logits and cache rows (also tests/export/test_batched_attention.py)."""
    caches = first.new_cache(64), second.new_cache(64)
    rng = np.random.default_rng(0)
    calls = [(list(rng.integers(3, 34, 6)), None)]
    calls += [(list(rng.integers(3, 34, t)), int(rng.integers(0, t))) for t in (3, 1, 4, 2, 4)]
    for ids, keep_rows in calls:
        a = first.forward(caches[0], ids, len(ids)).copy()
        b = second.forward(caches[1], ids, len(ids)).copy()
        np.testing.assert_allclose(a, b, atol=1e-4)
        for cache in caches:
            if keep_rows is not None:  # a verification that kept `keep_rows` of its rows
                cache.rollback(cache.length - len(ids) + keep_rows)
    assert caches[0].length == caches[1].length
    n = caches[0].length
    np.testing.assert_allclose(caches[0].planes[..., :n, :], caches[1].planes[..., :n, :],
                               atol=1e-5)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("drafter", ["model", "lookup+model"])
def test_greedy_speculative_equals_plain_on_fused_graphs(tiny_fused_bundle, k, drafter):
    gen = Generator.from_bundle(tiny_fused_bundle)
    for prompt in ["hello world", "the cat sat on the mat", "a, b, c!"]:
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=40, draft_tokens=k,
                            drafter=drafter)
        assert spec.token_ids == plain.token_ids
        assert spec.stats["target_calls"] < plain.stats["target_calls"]


@pytest.fixture(scope="module")
def fused_feature_bundle(tiny_checkpoints, tmp_path_factory):
    """A feature draft (EAGLE) distilled for the head-size-16 tiny target, both graphs
    fused and checked at export (--verify)."""
    from specedge.export.distill.config import DistillConfig
    from specedge.export.distill.train import distill

    root = tmp_path_factory.mktemp("fused-feature")
    distill(root / "draft", DistillConfig(
        target=str(tiny_checkpoints["llama-h16"]), kind="feature", head_tokens=16,
        prompts=32, new_tokens=24, generate_batch=16, epochs=2, batch=8))
    manifest = export_bundle(str(tiny_checkpoints["llama-h16"]), root / "bundle",
                             draft=str(root / "draft"), attention="fused", verify=True)
    return root / "bundle", manifest


def test_fused_feature_draft_verifies_and_stays_exact(fused_feature_bundle):
    out, manifest = fused_feature_bundle
    for role in ("target", "draft"):
        assert manifest["verify"][role]["ok"], manifest["verify"][role]
        assert manifest["models"][role]["kv_layout"] == "bhsd-inplace"
    bundle = load_bundle(out)
    assert bundle.draft.reads_features and bundle.draft.features == bundle.target.features
    gen = Generator.from_bundle(out)
    for prompt in ("hello world", "the cat sat", "why?"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        for k in (1, 3):
            spec = gen.generate(prompt, raw=True, max_new_tokens=40, draft_tokens=k,
                                drafter="model")
            assert spec.token_ids == plain.token_ids
            assert spec.stats["draft_calls"] > 0


def test_fused_bundle_is_refused_off_the_cpu_backend(tiny_fused_bundle):
    bundle = load_bundle(tiny_fused_bundle)
    with pytest.raises(BackendUnavailableError, match="--attention portable"):
        load_backend("host-emulated", bundle, "target")


def test_fused_bundle_needs_a_recent_onnxruntime(tiny_fused_bundle, monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", "1.21.1")
    with pytest.raises(BackendUnavailableError, match="onnxruntime >= 1.22"):
        OrtCpuBackend(load_bundle(tiny_fused_bundle).target)


def test_attention_choice(tiny_checkpoints, tmp_path):
    h16 = AutoConfig.from_pretrained(tiny_checkpoints["llama-h16"])
    h8 = AutoConfig.from_pretrained(tiny_checkpoints["llama"])
    gpt2 = AutoConfig.from_pretrained(tiny_checkpoints["gpt2"])
    h6 = AutoConfig.from_pretrained(save_tiny(tmp_path / "h6", "llama", hidden_size=24))
    # auto: batched for every quantized graph (ONNX Runtime CPU only anyway), so that
    # int8/int4 stay batch invariant, alone and in batches; portable for fp32/fp16 (every
    # backend). GroupQueryAttention needs heads of 8k dims; batched takes any.
    for config in (h16, h8, gpt2, h6):
        assert attention_form("auto", "int8", config) == "batched"
        assert attention_form("auto", "int4", config) == "batched"
        assert attention_form("auto", "fp32", config) == "portable"
        assert attention_form("auto", "fp16", config) == "portable"
        assert attention_form("batched", "fp32", config) == "batched"
        assert attention_form("portable", "int8", config) == "portable"
    for config in (h16, h8, gpt2):
        assert attention_form("fused", "fp32", config) == "fused"  # asked for only
    with pytest.raises(ValueError, match="multiple of 8.*not 6"):
        attention_form("fused", "int8", h6)
    with pytest.raises(ValueError, match="--attention must be one of"):
        attention_form("flash", "fp32", h16)
    # The kernel rotates where it can (16k dims); the graph rotates otherwise, or no rotary.
    assert kernel_rotates(h16) and not kernel_rotates(h8) and not kernel_rotates(gpt2)


def test_cli_refuses_fused_attention_it_cannot_build(capsys, tiny_checkpoints, tmp_path):
    out = tmp_path / "bundle"
    h6 = save_tiny(tmp_path / "h6", "llama", hidden_size=24)
    code, stdout, err = call_main(capsys, "export", h6, "--out", out, "--attention", "fused")
    assert_one_line_error(code, err, "--attention fused needs a head size", "portable")
    assert stdout == "" and not out.exists()
    code, stdout, err = call_main(capsys, "export", tiny_checkpoints["llama-h16"], "--out",
                                  out, "--attention", "fused", "--backend", "tensorrt")
    assert_one_line_error(code, err, "--backend tensorrt needs --attention portable")
    assert not out.exists()
