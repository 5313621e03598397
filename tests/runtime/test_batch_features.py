"""Feature drafts in batches (runtime/batch.py): the target's features and the draft's
feature inputs go per row through the calls the sequences share, so that each sequence's
feature drafter reads the target's features of its own positions, greedy output equals
plain decoding alone, and a prompt that continues an earlier sequence reuses the rows both
models kept of it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from model_calls import spy_calls
from test_batch import PROMPTS, assert_six_sequences_equal_plain_decoding_alone, run_to_end

from specedge.export.bundle_writer import export_bundle
from specedge.runtime import Generator
from specedge.runtime.batch import BatchGenerator, BatchRequest
from specedge.runtime.config import GenerationConfig
from specedge.runtime.drafting import FeatureDrafter


@pytest.fixture(scope="module", params=["fp32", "int4"])
def feature_batched(request, feature_draft, tiny_checkpoints, tmp_path_factory) -> Generator:
    """The tiny Llama with its distilled feature draft, both on batched attention."""
    out = tmp_path_factory.mktemp("feature-batched") / request.param
    export_bundle(str(tiny_checkpoints["llama"]), out, draft=str(feature_draft[0]),
                  precision=request.param, attention="batched")
    return Generator.from_bundle(out)


def test_each_greedy_sequence_equals_its_plain_decoding_alone(feature_batched):
    assert_six_sequences_equal_plain_decoding_alone(feature_batched)


def test_a_feature_draft_reads_the_targets_features_of_its_own_positions(
        feature_batched, monkeypatch):
    """Every row a feature drafter takes in (its catch-up) is the target's feature at that
    position, as the target computes it over the context alone (to 1e-4: rows of other
    calls), never a zero row of positions the batch did not compute, nor a companion's.
    Checked for three sequences together, then for a prompt that continues the first one,
    whose slot kept rows of both models."""
    gen = feature_batched
    read: list[tuple[list[int], int, np.ndarray]] = []
    real = FeatureDrafter._catch_up

    def catch_up(self, context):
        first, last = self.cache.length, len(context) - 1
        read.append((list(context), first, self.target_features[first:last].copy()))
        return real(self, context)

    monkeypatch.setattr(FeatureDrafter, "_catch_up", catch_up)
    batcher = BatchGenerator(gen, 3)
    session = batcher.session
    config = GenerationConfig(max_new_tokens=16, drafter="model", draft_tokens=2)
    prompts = [gen.encode_prompt(p, raw=True) for p in PROMPTS[1:4]]
    answers = batcher.generate([BatchRequest(prompt_ids=p, config=config) for p in prompts])
    second = prompts[0] + answers[0].token_ids + gen.encode_prompt(PROMPTS[4], raw=True)
    calls = spy_calls(monkeypatch, gen)
    got = run_to_end(session, second, replace(config, max_new_tokens=20))
    assert calls[0][0] == "target" and calls[0][1] < len(second)  # its kept rows reused
    assert any(role == "draft" for role, _ in calls)
    monkeypatch.undo()
    assert got == gen.generate(prompt_ids=second, max_new_tokens=20,
                                         use_draft=False).token_ids
    assert len(read) > 10
    gen.target.keep_features = True
    for context, first, rows in read:
        cache = gen.target.new_cache(len(context) + 2)
        gen.target.forward(cache, context, 1)
        expected = gen.target.features[first:len(context) - 1]
        assert np.all(np.abs(rows).max(axis=1) > 0)
        np.testing.assert_allclose(rows, expected, atol=1e-4)


def test_a_sequence_that_does_not_draft_with_the_features_keeps_all_the_targets_rows(
        feature_batched, monkeypatch):
    """Only a sequence that drafts with the feature draft needs the target's features of
    the positions past the draft's kept rows; one decoding plainly (or by prompt lookup)
    reuses every row of the target that its slot kept, and equals plain decoding alone."""
    gen = feature_batched
    session = BatchGenerator(gen, 2).session
    first = gen.encode_prompt(PROMPTS[1], raw=True)
    answer = run_to_end(session, first, GenerationConfig(max_new_tokens=12, drafter="model",
                                                         draft_tokens=2))
    second = first + answer + gen.encode_prompt(PROMPTS[3], raw=True)
    calls = spy_calls(monkeypatch, gen)
    got = run_to_end(session, second, GenerationConfig(max_new_tokens=16, use_draft=False))
    held = len(first) + len(answer) - 1  # the last token has no row yet
    assert calls[0] == ("target", len(second) - held)
    monkeypatch.undo()
    assert got == gen.generate(prompt_ids=second, max_new_tokens=16, use_draft=False).token_ids
