"""Training-time test (export/distill/unroll.py): each unrolled step's prediction is what the
draft computes when it drafts that many tokens from the target's features."""

from __future__ import annotations

import pytest
import torch

from specedge.export.distill.unroll import step_mask, unrolled_predictions
from specedge.export.drafts.feature import FeatureDraft
from specedge.export.sources import load_model


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def draft(request, tiny_checkpoints):
    """A feature draft of a Llama target, and of a Gemma 2 one, whose layer soft-caps its
    scores and so trains on transformers' eager attention with masks of its own."""
    if request.param == "gemma2":
        from tiny_models import tiny_gemma

        target = tiny_gemma("gemma2")
    else:
        target, _ = load_model(str(tiny_checkpoints["llama"]))
    torch.manual_seed(0)
    d = FeatureDraft(target, torch.arange(34))
    with torch.no_grad():  # a draft whose every branch does something, as a trained one's
        for p in d.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    return d.eval()


def test_step_mask_reads_the_verified_pairs_and_one_pair_of_each_earlier_step():
    length = 6
    assert torch.equal(step_mask(length, 0), torch.ones(length, length).tril().bool())
    m = step_mask(length, 2)  # columns: step 0's keys, step 1's, step 2's
    for r in range(length):
        assert m[r, :length].tolist() == [s <= r - 2 for s in range(length)]
        assert m[r, length:2 * length].nonzero().flatten().tolist() == ([r - 1] if r >= 1
                                                                          else [])
        assert m[r, 2 * length:].nonzero().flatten().tolist() == [r]


def test_step_zero_is_the_drafts_prediction_on_the_targets_features(draft):
    torch.manual_seed(1)
    ids = torch.randint(3, 34, (2, 9))
    features = torch.randn(2, 9, draft.config.hidden_size)
    with torch.no_grad():
        outs = unrolled_predictions(draft, ids, features, 1)
        assert torch.allclose(outs[0], draft.predict(ids, features), atol=1e-5)


def test_each_step_is_what_drafting_that_many_tokens_computes(draft):
    """From r0, drafting runs the pairs (f_0, x_1) .. (f_r0, x_{r0+1}) on the target's
    features, then (f^_{r0+1}, x_{r0+2}), ...: each on its own prediction at the pair before.
    Step j of the unrolled pass at r = r0 + j must equal the last prediction of that chain."""
    torch.manual_seed(2)
    length, steps = 10, 4
    ids = torch.randint(3, 34, (1, length))
    features = torch.randn(1, length, draft.config.hidden_size)
    with torch.no_grad():
        outs = unrolled_predictions(draft, ids, features, steps)
        for r0 in range(length - steps + 1):
            chain = features[:, :r0 + 1].clone()
            for j in range(steps):
                pred = draft.predict(ids[:, :r0 + j + 1], chain)
                assert torch.allclose(outs[j][0, r0 + j], pred[0, -1], rtol=1e-4,
                                      atol=1e-4), (r0, j)
                chain = torch.cat([chain, pred[:, -1:]], dim=1)


def test_unrolling_takes_one_step_or_more(draft):
    with pytest.raises(ValueError, match=">= 1"):
        unrolled_predictions(draft, torch.zeros(1, 3, dtype=torch.long),
                             torch.zeros(1, 3, draft.config.hidden_size), 0)


def test_the_corpus_loss_is_the_sum_over_examples_and_steps(draft):
    """losses.py `corpus_feature_loss`, all answer positions of a batch at once, against the
    sum written example by example: step 0's smooth L1 over the pairs, and each step's
    cross-entropy against the target's head over its answer positions, weighted 0.8 ** j."""
    from specedge.export.distill.losses import (
        STEP_WEIGHT,
        corpus_feature_loss,
        head_cross_entropy,
    )

    torch.manual_seed(3)
    hidden = draft.config.hidden_size
    batch = []
    for n, start in ((12, 4), (9, 1), (15, 0)):  # start 0: a one-token prompt
        batch.append({"ids": torch.randint(3, 34, (n + 1,), dtype=torch.int32),
                      "start": start, "answer": n - start,
                      "features": torch.randn(n, hidden).half()})
    steps = 3
    with torch.no_grad():
        loss, agree = corpus_feature_loss(draft, batch, steps)
        total, count, hits = 0.0, 0, [0] * steps
        for ex in batch:
            n, start, answer = len(ex["features"]), ex["start"], ex["answer"]
            f = ex["features"].float().unsqueeze(0)
            outs = unrolled_predictions(draft, ex["ids"][1:n + 1].long().unsqueeze(0), f, steps)
            total += torch.nn.functional.smooth_l1_loss(outs[0][0, :n - 1], f[0, 1:],
                                                        reduction="sum") / hidden
            target = draft.head_logits(f[0, start:start + answer])
            count += answer
            for j in range(steps):
                first = max(j, 1 - start)
                ce, h = head_cross_entropy(
                    draft.head_logits(outs[j][0, start - 1 + first:start - 1 + answer]),
                    target[first:])
                total += STEP_WEIGHT ** j * ce
                hits[j] += h
    assert loss.item() == pytest.approx(total.item() / count, rel=1e-4)
    assert agree[0] == pytest.approx(hits[0] / sum(ex["answer"] - max(0, 1 - ex["start"])
                                                   for ex in batch))
