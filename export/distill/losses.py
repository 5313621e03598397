"""What a draft is trained to minimise: cross-entropy of its head against the target's
distribution (its renormalised top-k, or over the head tokens from its features), plus EAGLE's
feature regression (the feature draft), over unrolled drafting steps on a corpus."""

from __future__ import annotations

import torch

from specedge.export.distill.unroll import unrolled_predictions
from specedge.export.drafts.feature import FeatureDraft
from specedge.export.graph.outputs import target_features


def head_columns(head_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token id -> column of the draft's head, -1 for tokens outside it."""
    to_head = torch.full((vocab_size,), -1, dtype=torch.long)
    to_head[head_ids] = torch.arange(len(head_ids))
    return to_head


def top_k_cross_entropy(head_logits: torch.Tensor, ex: dict, to_head: torch.Tensor
                        ) -> tuple[torch.Tensor, int]:
    """Sum over one answer's positions of the cross-entropy of the draft's head distribution
    against the target's renormalised top-k, and how often the two argmaxes agree."""
    logq = torch.log_softmax(head_logits, dim=-1)
    cols = to_head[ex["top_ids"].long()]
    p = torch.where(cols >= 0, ex["top_logp"].float().exp(), torch.zeros(()))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return -(p * logq.gather(1, cols.clamp_min(0))).sum(), int((logq.argmax(-1) ==
                                                                 cols[:, 0]).sum())


def _model_hidden(draft, batch: list[dict]) -> torch.Tensor:
    """A model draft's last hidden states [B, width, H] over the examples' ids, padded at
    the end (attention is causal: the padding changes nothing before it)."""
    width = max(len(ex["ids"]) for ex in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for b, ex in enumerate(batch):
        ids[b, :len(ex["ids"])] = ex["ids"].long()
        mask[b, :len(ex["ids"])] = 1
    return draft.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _loss(draft, head_ids: torch.Tensor, batch: list[dict]) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the draft's head distribution against the target's top-k."""
    hidden = _model_hidden(draft, batch)
    to_head = head_columns(head_ids, draft.config.vocab_size)
    head_w = draft.model.embed_tokens.weight[head_ids]
    total, agree, count = 0.0, 0, 0
    for b, ex in enumerate(batch):
        n = len(ex["top_ids"])
        ce, hits = top_k_cross_entropy(hidden[b, ex["start"]:ex["start"] + n] @ head_w.T, ex,
                                       to_head)
        total, agree, count = total + ce, agree + hits, count + n
    return total / count, agree / count


def draft_loss(draft, head_ids: torch.Tensor, batch: list[dict], steps: int = 1
               ) -> tuple[torch.Tensor, float]:
    """Training loss and top-1 agreement of either kind of draft on a batch: of generated
    examples (data.py, with the target's top-k) or of corpus examples (teacher.py, with its
    features), a feature draft's unrolled over `steps` drafting steps on corpus examples
    (its first step's agreement)."""
    corpus = "top_ids" not in batch[0]
    if isinstance(draft, FeatureDraft):
        if corpus:
            loss, agree = corpus_feature_loss(draft, batch, steps)
            return loss, agree[0]
        return feature_loss(draft, batch)
    return corpus_model_loss(draft, head_ids, batch) if corpus else _loss(draft, head_ids,
                                                                          batch)


def feature_loss(draft: FeatureDraft, batch: list[dict]) -> tuple[torch.Tensor, float]:
    """Distillation loss of a feature draft on a batch of target answers (export/distill/).

    Pair r of an example is (f_r, x_{r+1}); its prediction f^_{r+1} is scored twice:
    * smooth L1 against the target's f_{r+1} (EAGLE's regression term), and
    * cross-entropy of softmax(W_head f^_{r+1}) against the target's top-k distribution at
      answer positions (what acceptance depends on).
    A second pass feeds the first pass's predictions in place of the target's features (as
    in drafting, where step 2 onward reads f^), so the draft learns to read its own output
    too. Returns the loss and the first pass's top-1 agreement with the target.
    """
    width = max(len(ex["features"]) for ex in batch)
    hidden = draft.config.hidden_size
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    final = torch.zeros(len(batch), width, hidden)
    for b, ex in enumerate(batch):
        n = len(ex["features"])
        ids[b, :n] = ex["ids"][1:n + 1].long()
        final[b, :n] = ex["features"].float()
    fuse, layer_outputs = getattr(draft, "fuse", None), []  # no fuse: the final features
    if fuse is not None:
        layers = torch.zeros(len(batch), width, fuse.in_features - hidden)
        for b, ex in enumerate(batch):
            layers[b, :len(ex["features"])] = ex["layer_features"].float()
        layer_outputs = list(layers.split(hidden, dim=-1))
    features = target_features(fuse, layer_outputs, final)
    first = draft.predict(ids, features)
    second = draft.predict(ids[:, 1:], first[:, :-1])
    to_head = head_columns(draft.specedge_head_ids, draft.config.vocab_size)
    total, agree, count, pairs = 0.0, 0, 0, 0
    for b, ex in enumerate(batch):
        n, start, answer = len(ex["features"]), ex["start"], len(ex["top_ids"])
        # fuse is learned: the regression aims at its output, not through it.
        target = features[b, 1:n].detach()
        total = total + torch.nn.functional.smooth_l1_loss(
            first[b, :n - 1], target, reduction="sum") / hidden
        total = total + 0.5 * torch.nn.functional.smooth_l1_loss(
            second[b, :n - 2], target[1:], reduction="sum") / hidden
        pairs += n - 1
        # f^_{r+1} predicts the answer token at r + 2; answer i is drawn at start + i.
        ce, hits = top_k_cross_entropy(draft.head_logits(first[b, start - 1:start - 1 + answer]),
                                       ex, to_head)
        total, agree, count = total + ce, agree + hits, count + answer
        ce2, _ = top_k_cross_entropy(draft.head_logits(second[b, start - 2:start - 2 + answer]),
                                     ex, to_head)
        total = total + 0.5 * ce2
    return total / count, agree / count


# Unrolled steps' weights in the loss (EAGLE-3's 0.8 ** step): later steps count less, as a
# later draft token is reached less often.
STEP_WEIGHT = 0.8


def head_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor
                       ) -> tuple[torch.Tensor, int]:
    """Sum over positions of the cross-entropy of the draft's head distribution against the
    target's renormalised over the same head tokens, and how often their argmaxes agree.
    Both [positions, head tokens]."""
    logq = torch.log_softmax(draft_logits, dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    return -(p * logq).sum(), int((logq.argmax(-1) == target_logits.argmax(-1)).sum())


def _padded(batch: list[dict], key: str, width: int) -> torch.Tensor:
    """`ex[key]` [n, D] of each example, zero-padded at the end to [B, width, D], float."""
    first = batch[0][key]
    out = torch.zeros(len(batch), width, first.shape[-1])
    for b, ex in enumerate(batch):
        out[b, :len(ex[key])] = ex[key].float()
    return out


def corpus_feature_loss(draft: FeatureDraft, batch: list[dict], steps: int
                        ) -> tuple[torch.Tensor, list[float]]:
    """Loss of a feature draft on corpus examples (teacher.py), unrolled over `steps`
    drafting steps (unroll.py); and its top-1 agreement with the target at each step.

    Step j's prediction at pair r, f^_{r+1} from r0 = r - j, is scored by the cross-entropy
    of softmax(W_head f^_{r+1}) against the target's softmax(W_head f_{r+1}) over the head
    tokens, at the answer positions where r - j >= start - 1 (drafting starts once the
    prompt is read), weighted STEP_WEIGHT ** j; step 0's also by smooth L1 against the
    target's (fused) f_{r+1}, EAGLE's regression term. Divided by step 0's positions."""
    width = max(len(ex["features"]) for ex in batch)
    hidden = draft.config.hidden_size
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for b, ex in enumerate(batch):
        n = len(ex["features"])
        ids[b, :n] = ex["ids"][1:n + 1].long()
    final = _padded(batch, "features", width)
    fuse, layer_outputs = getattr(draft, "fuse", None), []
    if fuse is not None:
        layer_outputs = list(_padded(batch, "layer_features", width).split(hidden, dim=-1))
    features = target_features(fuse, layer_outputs, final)
    outs = unrolled_predictions(draft, ids, features, steps)
    # The regression over every example's pairs r = 0 .. n - 2 (the padding left out).
    lengths = torch.tensor([len(ex["features"]) for ex in batch])
    pairs = torch.arange(width - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)  # [B, W - 1]
    total = torch.nn.functional.smooth_l1_loss(
        outs[0][:, :-1][pairs], features[:, 1:].detach()[pairs], reduction="sum") / hidden
    # Every answer position of the batch at once: example b's answer token i is predicted
    # by pair r = start - 1 + i, from the target's distribution at position start + i.
    rows, answer = [], []
    for b, ex in enumerate(batch):
        rows.append(torch.full((ex["answer"],), b))
        answer.append(torch.arange(ex["answer"]))
    rows, answer = torch.cat(rows), torch.cat(answer)
    start = torch.tensor([ex["start"] for ex in batch])[rows]
    with torch.no_grad():  # the target's head on its features
        target_logits = draft.head_logits(final[rows, start + answer])
    agree, counted = [0] * steps, [0] * steps
    for j, out in enumerate(outs):
        # Step j needs r - j >= start - 1 (i >= j), and pair -1 does not exist.
        keep = (answer >= j) & (start - 1 + answer >= 0)
        if not keep.any():
            break
        ce, hits = head_cross_entropy(
            draft.head_logits(out[rows[keep], (start - 1 + answer)[keep]]),
            target_logits[keep])
        total = total + STEP_WEIGHT ** j * ce
        agree[j], counted[j] = hits, int(keep.sum())
    return total / max(len(rows), 1), [a / max(c, 1) for a, c in zip(agree, counted)]


def corpus_model_loss(draft, head_ids: torch.Tensor, batch: list[dict]
                      ) -> tuple[torch.Tensor, float]:
    """A model draft's loss on corpus examples: head_cross_entropy at each answer position
    against the target's distribution over the head tokens, from its features."""
    hidden = _model_hidden(draft, batch)
    head_w = draft.model.embed_tokens.weight[head_ids]
    total, agree, count = 0.0, 0, 0
    for b, ex in enumerate(batch):
        start, answer = ex["start"], ex["answer"]
        with torch.no_grad():
            target_logits = ex["features"][start:start + answer].float() @ head_w.T
        ce, hits = head_cross_entropy(hidden[b, start:start + answer] @ head_w.T,
                                      target_logits)
        total, agree, count = total + ce, agree + hits, count + answer
    return total / max(count, 1), agree / max(count, 1)
