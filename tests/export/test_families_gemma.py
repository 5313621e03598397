"""Gemma 2 and Gemma 3 text (export/graph/gemma.py) on tiny random-weight models
with every Gemma feature on and a sliding window (8) shorter than the prompts: the graphs
match transformers, plain decoding of the bundle is transformers' greedy generate,
speculative decoding equals plain, and fused attention (GroupQueryAttention with
soft-capping, q and k rotated by the graph: what int8 gets by default) matches
transformers and keeps int8 speculative decoding equal to plain."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from tiny_models import (
    EOS,
    GEMMA_ARCHITECTURES,
    GEMMA_WINDOW,
    save_tiny_gemma,
    tiny_gemma,
)
from transformers import AutoConfig

from specedge.export.bundle_writer import VERIFY_PROMPT, export_bundle
from specedge.export.drafts.truncated import attach_head, truncated_draft
from specedge.export.graph.families import kernel_rotates
from specedge.export.graph.gemma import check_gemma
from specedge.export.graph.trace import wrap
from specedge.export.sources import load_model
from specedge.runtime import Generator

PROMPTS = ("the quick brown fox jumps over the lazy dog", "once upon a time, far away")
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=GEMMA_ARCHITECTURES)
def gemma(request, tmp_path_factory):
    """(architecture, checkpoint, fp32 bundle with --draft-layers 1 and --verify, manifest)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    checkpoint = save_tiny_gemma(root / "checkpoint", arch)
    manifest = export_bundle(str(checkpoint), root / "bundle", draft_layers=1, verify=True)
    return arch, checkpoint, root / "bundle", manifest


def test_tiny_models_exercise_every_feature():
    """The tiny models' layers alternate between the kinds, and the prompts are longer
    than the window, so a graph that ignored the window would fail the tests below."""
    for arch in GEMMA_ARCHITECTURES:
        cfg = tiny_gemma(arch).config
        assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
        assert cfg.sliding_window == GEMMA_WINDOW
        assert all(len(p) > 2 * GEMMA_WINDOW for p in PROMPTS)
    cfg = tiny_gemma("gemma3_text").config
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 100.0
    assert cfg.rope_parameters["full_attention"]["rope_type"] == "linear"


def test_graphs_match_transformers(gemma):
    arch, _, _, manifest = gemma
    for role in ("target", "draft"):
        report = manifest["verify"][role]
        assert report["ok"], report
        assert report["max_abs_logit_diff"] < 1e-4
        assert report["greedy_matches"] == report["greedy_steps"] == 32
        model = manifest["models"][role]
        assert model["architecture"] == arch
        # The window is a mask, not a cap: the bundle holds the model's full context.
        assert model["max_context"] == 512
        assert model["kv_layout"] == "bhsd-fixed"
    assert manifest["models"]["draft"]["num_layers"] == 1


def test_plain_decoding_is_transformers_greedy_generate(gemma):
    _, checkpoint, bundle, _ = gemma
    model, tokenizer = load_model(checkpoint)
    gen = Generator.from_bundle(bundle)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        ours = gen.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, use_draft=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        theirs = out[0, len(ids):].tolist()
        assert ours.token_ids == theirs
        assert len(theirs) >= 24 and EOS not in theirs[:24]
        assert len(set(theirs)) > 3  # text, not one repeated token


def _speculative_equals_plain(bundle, k: int) -> None:
    """Greedy speculative tokens (the model draft, K = k) equal plain ones on PROMPTS, with
    the draft called."""
    gen = Generator.from_bundle(bundle)
    for prompt in PROMPTS:
        plain = gen.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, draft_tokens=k,
                            drafter="model")
        assert spec.token_ids == plain.token_ids
        assert spec.stats["draft_calls"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_plain(gemma, k):
    _speculative_equals_plain(gemma[2], k)


def test_a_checkpoint_draft_stays_exact(gemma, tmp_path):
    """--draft: another (2-layer) model of the family with the same tokenizer."""
    arch, checkpoint, _, _ = gemma
    draft = save_tiny_gemma(tmp_path / "draft", arch, layers=2, seed=1)
    manifest = export_bundle(str(checkpoint), tmp_path / "b", draft=str(draft))
    assert manifest["models"]["draft"]["num_layers"] == 2
    _speculative_equals_plain(tmp_path / "b", 2)


def test_truncated_draft_keeps_the_layer_kinds(gemma):
    """A draft of the first N layers keeps each layer's kind (sliding or global), and its
    export module computes what transformers computes for it, past the window."""
    arch, checkpoint, _, _ = gemma
    target, tokenizer = load_model(checkpoint)
    draft = truncated_draft(target, 3)
    assert draft.config.layer_types == target.config.layer_types[:3]
    assert len(set(draft.config.layer_types)) == 2
    ids = torch.tensor([tokenizer(VERIFY_PROMPT)["input_ids"]])
    t, cfg = ids.shape[1], draft.config
    past = [torch.zeros(1, cfg.num_key_value_heads, 4, cfg.head_dim) for _ in range(6)]
    with torch.no_grad():
        logits, *_ = wrap(draft)(ids, torch.arange(t).unsqueeze(0), torch.tensor([0]),
                                 torch.tensor([t]), *past)
        expected = draft(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_int8_exports_and_decodes(gemma, tmp_path):
    _, checkpoint, bundle, _ = gemma
    manifest = export_bundle(str(checkpoint), tmp_path / "int8", draft_layers=1,
                             precision="int8")
    for role in ("target", "draft"):
        # auto attention at int8: batched, which is what keeps speculation exact
        assert manifest["models"][role]["kv_layout"] == "bhsd-inplace"
        graph = onnx.load(str(tmp_path / "int8" / f"{role}.onnx")).graph
        assert any(n.op_type == "MatMulNBits" for n in graph.node)
    assert manifest["quantization"]["greedy_agreement"] >= 0.9
    fp32 = Generator.from_bundle(bundle)
    int8 = Generator.from_bundle(tmp_path / "int8")
    same = 0
    for prompt in PROMPTS:
        ref = fp32.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, use_draft=False)
        out = int8.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, use_draft=False)
        assert len(out.token_ids) == NEW_TOKENS
        same += int(np.array_equal(out.token_ids[:8], ref.token_ids[:8]))
        spec = int8.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, draft_tokens=2,
                             drafter="model")
        assert spec.token_ids == out.token_ids
        assert spec.stats["draft_calls"] > 0
    assert same >= 1  # int8 starts as fp32 does on at least one prompt


def test_fused_attention_matches_transformers(gemma, tmp_path):
    """fp32 with --attention fused: one GroupQueryAttention per layer, soft-capped
    (Gemma 2) and windowed, fed q and k the graph rotated with the layer kind's tables;
    the graphs match transformers and speculative decoding equals plain."""
    arch, checkpoint, _, _ = gemma
    config = AutoConfig.from_pretrained(checkpoint)
    assert not kernel_rotates(config)
    manifest = export_bundle(str(checkpoint), tmp_path / "b", draft_layers=1,
                             attention="fused", verify=True)
    for role in ("target", "draft"):
        report = manifest["verify"][role]
        assert report["ok"] and report["max_abs_logit_diff"] < 1e-4, report
        assert manifest["models"][role]["kv_layout"] == "bhsd-inplace"
    nodes = [n for n in onnx.load(str(tmp_path / "b" / "target.onnx")).graph.node
             if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == config.num_hidden_layers
    caps = {a.name: a for a in nodes[0].attribute}
    assert caps["do_rotary"].i == 0
    assert caps["softcap"].f == pytest.approx(config.attn_logit_softcapping or 0.0)
    _speculative_equals_plain(tmp_path / "b", 3)


def test_a_distilled_head_keeps_minus_infinity(tmp_path):
    """A draft scoring only its head tokens gives the others -inf, not -final_cap."""
    model = tiny_gemma("gemma2", layers=2)
    head = torch.tensor([3, 5, 7])
    attach_head(model, head)
    cfg = model.config
    past = [torch.zeros(1, cfg.num_key_value_heads, 4, cfg.head_dim) for _ in range(4)]
    with torch.no_grad():
        logits, *_ = wrap(model)(torch.tensor([[4, 6]]), torch.tensor([[0, 1]]),
                                 torch.tensor([0]), torch.tensor([1]), *past)
        expected = model(torch.tensor([[4, 6]])).logits[0, -1, head]
    others = torch.ones(cfg.vocab_size, dtype=torch.bool)
    others[head] = False
    assert torch.isneginf(logits[0, 0, others]).all()
    torch.testing.assert_close(logits[0, 0, head], expected, atol=1e-5, rtol=1e-5)


def test_configs_it_cannot_match_are_refused():
    cfg = tiny_gemma("gemma3_text", layers=2).config
    cfg.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="both directions"):
        check_gemma(cfg)
    cfg = tiny_gemma("gemma2", layers=2).config
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        check_gemma(cfg)

