"""What a decoder graph outputs: the logits of the last `logits_to_keep` positions only."""

from __future__ import annotations

import torch
from torch import nn


def last_positions(hidden: torch.Tensor, logits_to_keep: torch.Tensor) -> torch.Tensor:
    t = hidden.shape[1]
    start = t - logits_to_keep[0]
    return hidden[:, start:]


def lm_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    flat = hidden.reshape(-1, hidden.shape[-1])  # 2-D, so that `share_tied_head` applies
    head_ids = getattr(model, "specedge_head_ids", None)
    if head_ids is None:
        return model.lm_head(flat).unsqueeze(0)
    # A distilled draft scores only its head tokens; the others get logit -inf, q = 0.
    small = torch.nn.functional.linear(flat, model.lm_head.weight[head_ids])
    full = torch.full((flat.shape[0], model.config.vocab_size), float("-inf"))
    return full.scatter(1, head_ids.expand(flat.shape[0], -1), small).unsqueeze(0)
