"""`specedge distill --corpus` on a tiny target: the target's features recomputed from the
corpus and cached, unrolled training, and drafts that export and decode exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specedge.export.bundle_writer import export_bundle
from specedge.export.distill.config import DistillConfig
from specedge.export.distill.corpus import CorpusSettings, read_corpus, read_shards
from specedge.export.distill.grow import grow_corpus
from specedge.export.distill.teacher import answer_head_ids, corpus_examples
from specedge.export.distill.train import distill
from specedge.export.sources import load_model
from specedge.runtime import Generator


@pytest.fixture(scope="module")
def tiny_corpus(tiny_batched_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "c"
    grow_corpus(out, tiny_batched_bundle, CorpusSettings(new_tokens=24, shard_prompts=16),
                answer_tokens_goal=600, max_batch=4, threads=1)
    return out


def config(checkpoints, corpus, **kw) -> DistillConfig:
    return DistillConfig(**{"target": str(checkpoints["llama"]), "head_tokens": 16,
                            "epochs": 2, "batch": 8, "corpus": str(corpus), **kw})


@pytest.fixture(scope="module")
def corpus_feature_draft(tiny_checkpoints, tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "feature"
    cfg = config(tiny_checkpoints, tiny_corpus, kind="feature", unroll=2, feature_layers=[0])
    return out, cfg, distill(out, cfg)


def test_teacher_features_are_the_targets_at_every_position_but_the_last(
        tiny_checkpoints, tiny_corpus, tmp_path):
    target, _ = load_model(str(tiny_checkpoints["llama"]))
    shards = read_shards(tiny_corpus)
    examples = corpus_examples(target, shards, (0,), tmp_path, batch_tokens=64)
    assert len(examples) == sum(len(s) for s in shards)
    for i in (0, 5, len(examples) - 1):
        ex = examples[i]
        ids = ex["ids"].long().unsqueeze(0)
        with torch.no_grad():
            out = target.model(input_ids=ids, output_hidden_states=True)
        n = len(ex["ids"]) - 1
        assert ex["features"].shape == (n, target.config.hidden_size)
        assert torch.allclose(ex["features"].float(), out.last_hidden_state[0, :n], atol=2e-2)
        assert torch.allclose(ex["layer_features"].float(), out.hidden_states[1][0, :n],
                              atol=2e-2)
        assert ex["start"] + 1 + ex["answer"] == len(ex["ids"])
    # A second call reads the cached files and makes none anew.
    made = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.npy")}
    assert len(made) == len(shards)
    corpus_examples(target, shards, (0,), tmp_path, batch_tokens=64)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.npy")} == made


def test_a_feature_draft_trained_on_the_corpus_reports_each_drafting_step(
        corpus_feature_draft, tiny_corpus):
    _, cfg, meta = corpus_feature_draft
    report = meta["report"]
    assert len(report["val_step_agreement"]) == 3
    assert all(0 <= a <= 1 for a in report["val_step_agreement"])
    assert report["val_top1_agreement"] == pytest.approx(report["val_step_agreement"][0])
    assert meta["answer_tokens"] == meta["corpus"]["answer_tokens"] >= 600
    assert meta["config"]["unroll"] == 2 and meta["feature_layers"] == [0]


@pytest.mark.parametrize("kind", ["feature", "model"])
def test_corpus_drafts_export_and_decode_as_plain(kind, corpus_feature_draft, tiny_checkpoints,
                                                  tiny_corpus, tmp_path):
    if kind == "feature":
        folder = corpus_feature_draft[0]
    else:
        folder = tmp_path / "model-draft"
        distill(folder, config(tiny_checkpoints, tiny_corpus, kind="model", layers=1))
    export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", draft=str(folder),
                  verify=True)
    gen = Generator.from_bundle(tmp_path / "b")
    drafted = 0
    for prompt in ("hello world", "the cat sat"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=24, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=24, draft_tokens=2,
                            drafter="model")
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats["drafted_tokens"]
    assert drafted > 0


def test_the_head_is_the_answers_most_used_tokens(tiny_corpus):
    rows = read_corpus(tiny_corpus)
    head = answer_head_ids(rows, 5, 34)
    counts = np.bincount(np.concatenate([r.answer for r in rows]), minlength=34)
    assert head.tolist() == sorted(head.tolist())
    assert min(counts[head.numpy()]) >= max(np.delete(counts, head.numpy()))


def test_corpus_tokens_takes_the_first_shards(tiny_checkpoints, tiny_corpus, tmp_path):
    first = read_shards(tiny_corpus)[0]
    tokens = sum(len(r.answer) for r in first)
    meta = distill(tmp_path / "d", config(tiny_checkpoints, tiny_corpus, kind="model",
                                          layers=1, corpus_tokens=tokens, epochs=1))
    assert meta["answer_tokens"] == tokens


def test_unroll_is_for_feature_drafts_on_a_corpus(tiny_checkpoints, tiny_corpus, tmp_path):
    with pytest.raises(ValueError, match="--unroll"):
        distill(tmp_path / "d", config(tiny_checkpoints, tiny_corpus, kind="model", unroll=2))


def test_bf16_training_runs_and_records_its_setting(tiny_checkpoints, tiny_corpus, tmp_path):
    """--train-dtype bf16: the products under bfloat16 autocast, the weights saved as ever;
    a finite held-out loss, and the setting in the draft's metadata."""
    meta = distill(tmp_path / "d", config(tiny_checkpoints, tiny_corpus, kind="feature",
                                          unroll=2, train_dtype="bf16", epochs=1))
    assert meta["config"]["train_dtype"] == "bf16"
    assert torch.isfinite(torch.tensor(meta["report"]["val_loss"]))
    with pytest.raises(ValueError, match="--train-dtype"):
        distill(tmp_path / "e", config(tiny_checkpoints, tiny_corpus, train_dtype="fp16"))
