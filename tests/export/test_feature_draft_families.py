"""Feature drafts for targets beyond the Llama family: Phi-3, Granite, OLMo2 and StableLM
(tiny_models.py `tiny_more`, each family's features on). `specedge distill --kind feature`
trains one (Phi-3 and StableLM on answers made in the run, OLMo2 and Granite through a
corpus: `specedge corpus`, then `distill --corpus` with unrolled steps), its graph passes
--verify against its torch module (fused attention for two, portable for two), and
speculative decoding with it equals plain decoding. Gemma and GPT-2 targets are refused with
a message."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MORE_ARCHITECTURES, save_tiny_more, tiny_more

from specedge.export.bundle_writer import export_bundle
from specedge.export.distill.config import DistillConfig
from specedge.export.distill.corpus import CorpusSettings
from specedge.export.distill.grow import grow_corpus
from specedge.export.distill.train import distill
from specedge.export.drafts.feature import FeatureDraft
from specedge.runtime import Generator

PROMPTS = ([1, 5, 6, 7, 8, 9, 10, 11, 4, 4], list(range(3, 30)))
SEEDS = {"granite": 2, "stablelm": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("feature-families")
    return {arch: save_tiny_more(root / arch, arch, seed=SEEDS.get(arch, 0))
            for arch in MORE_ARCHITECTURES}


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


@pytest.mark.parametrize("arch, attention", [("phi3", "fused"), ("stablelm", "portable")])
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


@pytest.mark.parametrize("arch, attention", [("olmo2", "fused"), ("granite", "portable")])
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


@pytest.mark.parametrize("arch", ["gemma2", "gpt2"])
def test_feature_drafts_refuse_the_families_they_do_not_take(arch):
    from tiny_models import tiny_gemma

    from specedge.gpu_check.tiny_checkpoints import tiny_model

    target = tiny_gemma(arch) if arch == "gemma2" else tiny_model("gpt2")
    with pytest.raises(ValueError, match="feature drafts take a target of the families"):
        FeatureDraft(target, torch.arange(8))


def test_granite_drafts_score_their_head_as_the_target_does(checkpoints):
    """Granite divides its logits by `logits_scaling`: a feature draft's head does too, so
    that its q and the target's p are alike on the same features."""
    target = tiny_more("granite", seed=SEEDS["granite"])
    assert target.config.logits_scaling != 1.0
    draft = FeatureDraft(target, torch.arange(target.config.vocab_size))
    f = torch.randn(3, target.config.hidden_size)
    assert torch.allclose(draft.head_logits(f), target.lm_head(f) / target.config.logits_scaling,
                          atol=1e-5)
