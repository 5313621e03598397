"""What a decoder graph outputs: the logits of the last `logits_to_keep` positions only, and
for a target read by a feature draft, its features."""

from __future__ import annotations

import torch
from torch import nn


def last_positions(hidden: torch.Tensor, logits_to_keep: torch.Tensor) -> torch.Tensor:
    t = hidden.shape[1]
    start = t - logits_to_keep[0]
    return hidden[:, start:]


def lm_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [B, N, vocab] of hidden [B, N, H], through a 2-D product, so that
    `share_tied_head` (graph/trace.py) applies; the shape back once per graph."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    # The vocabulary as a Python int, so that the graph declares the logits' width.
    rows, vocab = hidden.shape[:2], int(model.config.vocab_size)
    head_ids = getattr(model, "specedge_head_ids", None)
    if head_ids is None:
        return model.lm_head(flat).reshape(*rows, int(model.lm_head.weight.shape[0]))
    # A distilled draft scores only its head tokens; the others get logit -inf, q = 0.
    small = torch.nn.functional.linear(flat, model.lm_head.weight[head_ids])
    full = torch.full((flat.shape[0], vocab), float("-inf"))
    return full.scatter(1, head_ids.expand(flat.shape[0], -1), small).reshape(*rows, vocab)


def target_features(fuse: nn.Module | None, layer_outputs: list[torch.Tensor],
                    final: torch.Tensor) -> torch.Tensor:
    """The f_r a feature draft reads: the final norm's output, or with the draft's `fuse`,
    fuse([rms(h^(a)); ...; final]) over the outputs of its `feature_layers`
    (export/drafts/feature.py)."""
    if fuse is None:
        return final
    return fuse(torch.cat([*map(_rms, layer_outputs), final], dim=-1))


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMS norm: earlier layers' outputs differ in scale from the final one."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
