"""Feature drafts for targets beyond the Llama family: Phi-3, Granite, OLMo2, StableLM
(tiny_models.py `tiny_more`), Gemma 2 and 3 (`tiny_gemma`: sliding windows, soft-capped
scores and logits, Gemma 3's rotary table per layer kind) and GPT-2 (learned positions, no
rotary), each family's features on.
`specedge distill --kind feature` trains one (on answers made in the run, or through a
corpus: `specedge corpus`, then `distill --corpus` with unrolled steps), training's layer
computes what the draft's graph module computes, its graph passes --verify against its
torch module (fused, batched and portable attention), and speculative decoding with it
equals plain decoding."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    GEMMA_ARCHITECTURES,
    MORE_ARCHITECTURES,
    save_tiny_gemma,
    save_tiny_more,
    tiny_gemma,
    tiny_more,
)

from specedge.export.bundle_writer import export_bundle
from specedge.export.distill.config import DistillConfig
from specedge.export.distill.corpus import CorpusSettings
from specedge.export.distill.grow import grow_corpus
from specedge.export.distill.train import distill
from specedge.export.drafts.feature import FeatureDraft
from specedge.gpu_check.tiny_checkpoints import save_tiny, tiny_model
from specedge.runtime import Generator

PROMPTS = ([1, 5, 6, 7, 8, 9, 10, 11, 4, 4], list(range(3, 30)))
SEEDS = {"granite": 2, "stablelm": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("feature-families")
    more = {arch: save_tiny_more(root / arch, arch, seed=SEEDS.get(arch, 0))
            for arch in MORE_ARCHITECTURES}
    return {**more, **{arch: save_tiny_gemma(root / arch, arch) for arch in GEMMA_ARCHITECTURES},
            "gpt2": save_tiny(root / "gpt2", "gpt2")}


def spec_equals_plain(bundle) -> int:
    """Asserts greedy speculative == plain on PROMPTS with the feature draft at K = 2;
    returns the draft tokens accepted."""
    gen = Generator.from_bundle(bundle)
    accepted = 0
    for ids in PROMPTS:
        plain = gen.generate(prompt_ids=ids, max_new_tokens=24, use_draft=False)
        spec = gen.generate(prompt_ids=ids, max_new_tokens=24, draft_tokens=2,
                            drafter="model")
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats["accepted_tokens"]
    return accepted


@pytest.mark.parametrize("arch", [*MORE_ARCHITECTURES, *GEMMA_ARCHITECTURES, "gpt2"])
def test_training_computes_what_the_drafts_graph_module_computes(arch):
    """`predict` (training: the family's transformers layer) and `forward` (the graph: the
    family's export module over the same layer) give the same f^_{r+1} for every pair, so
    a draft runs what it was trained to. Gemma 2 soft-caps its scores, which transformers'
    sdpa refuses, Gemma 3's rotary has a table per layer kind, and GPT-2's positions are
    learned, added to the pairs' embeddings."""
    target = (tiny_gemma(arch) if arch in GEMMA_ARCHITECTURES
              else tiny_model("gpt2") if arch == "gpt2" else tiny_more(arch))
    torch.manual_seed(0)
    draft = FeatureDraft(target, torch.arange(20))
    with torch.no_grad():  # every branch doing something, as a trained draft's
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    draft.eval()
    length, cfg = 12, draft.config
    ids = torch.randint(3, 30, (2, length))
    features = torch.randn(2, length, cfg.hidden_size)
    heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    empty = torch.zeros(2, heads, 0, cfg.hidden_size // cfg.num_attention_heads
                        if arch == "gpt2" else draft.layer.self_attn.head_dim)
    with torch.no_grad():
        logits, _, _, out = draft(ids, torch.arange(length).expand(2, -1),
                                  torch.zeros(2, dtype=torch.long), torch.tensor([length]),
                                  empty, empty, features)
        torch.testing.assert_close(draft.predict(ids, features), out, rtol=1e-4, atol=1e-4)
        # The head as the target's (Granite's scale, Gemma's soft-cap), -inf outside the
        # head tokens.
        reference = target.lm_head(out)[..., :20] / getattr(cfg, "logits_scaling", 1.0)
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            reference = torch.tanh(reference / cap) * cap
        torch.testing.assert_close(draft.head_logits(out), reference)
        assert torch.equal(logits[..., :20], draft.head_logits(out))
        assert torch.isinf(logits[..., 20:]).all()


@pytest.mark.parametrize("arch, attention", [("phi3", "fused"), ("stablelm", "portable"),
                                             ("gemma2", "fused"), ("gpt2", "portable")])
def test_a_distilled_feature_draft_verifies_and_decodes_as_plain(arch, attention, checkpoints,
                                                                 tmp_path):
    draft = tmp_path / "draft"
    distill(draft, DistillConfig(target=str(checkpoints[arch]), kind="feature", head_tokens=16,
                                 prompts=32, new_tokens=16, generate_batch=16, epochs=2,
                                 batch=8, feature_layers=[0]))
    manifest = export_bundle(str(checkpoints[arch]), tmp_path / "b", draft=str(draft),
                             verify=True, attention=attention)
    assert manifest["verify"]["draft"]["ok"] and manifest["verify"]["target"]["ok"]
    assert spec_equals_plain(tmp_path / "b") > 0  # else equality would hold trivially


@pytest.mark.parametrize("arch, attention", [("olmo2", "fused"), ("granite", "portable"),
                                             ("gemma3_text", "batched")])
def test_the_corpus_path_trains_a_feature_draft_for_other_families(arch, attention,
                                                                   checkpoints, tmp_path):
    """`specedge corpus` on a batched bundle of the target, then `distill --corpus` with
    unrolled steps: the whole recipe, on families other than SmolLM2's."""
    batched = tmp_path / "batched"
    export_bundle(str(checkpoints[arch]), batched, attention="batched")
    corpus = tmp_path / "corpus"
    grow_corpus(corpus, batched, CorpusSettings(new_tokens=16, shard_prompts=16),
                answer_tokens_goal=300, max_batch=4, threads=1)
    draft = tmp_path / "draft"
    meta = distill(draft, DistillConfig(target=str(checkpoints[arch]), kind="feature",
                                        head_tokens=16, epochs=2, batch=8,
                                        corpus=str(corpus), unroll=2, feature_layers=[0]))
    assert len(meta["report"]["val_step_agreement"]) == 3
    manifest = export_bundle(str(checkpoints[arch]), tmp_path / "b", draft=str(draft),
                             verify=True, attention=attention)
    assert manifest["verify"]["draft"]["ok"] and manifest["verify"]["target"]["ok"]
    assert spec_equals_plain(tmp_path / "b") > 0


def test_a_gpt2_draft_keeps_its_mlp_whole():
    with pytest.raises(ValueError, match="leave --mlp-width out"):
        FeatureDraft(tiny_model("gpt2"), torch.arange(8), mlp_width=16)


def test_granite_drafts_score_their_head_as_the_target_does(checkpoints):
    """Granite divides its logits by `logits_scaling`: a feature draft's head does too, so
    that its q and the target's p are alike on the same features."""
    target = tiny_more("granite", seed=SEEDS["granite"])
    assert target.config.logits_scaling != 1.0
    draft = FeatureDraft(target, torch.arange(target.config.vocab_size))
    f = torch.randn(3, target.config.hidden_size)
    assert torch.allclose(draft.head_logits(f), target.lm_head(f) / target.config.logits_scaling,
                          atol=1e-5)
