"""The draft model: a given checkpoint with the target's tokenizer, or the target's first N
layers (with its final norm and head), so that a bundle always has a draft."""

from __future__ import annotations

import copy

from torch import nn


def truncated_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """A copy of `target` keeping only its first `num_layers` decoder layers."""
    cfg = target.config
    total = cfg.n_layer if cfg.model_type == "gpt2" else cfg.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"--draft-layers must be in [1, {total - 1}] for this "
                         f"{total}-layer target, got {num_layers}")
    draft = copy.deepcopy(target)
    if cfg.model_type == "gpt2":
        draft.transformer.h = draft.transformer.h[:num_layers]
        draft.config.n_layer = num_layers
    else:
        draft.model.layers = draft.model.layers[:num_layers]
        draft.config.num_hidden_layers = num_layers
        if getattr(draft.config, "layer_types", None):
            draft.config.layer_types = draft.config.layer_types[:num_layers]
    return draft


def check_same_vocabulary(target: nn.Module, target_tok, draft: nn.Module, draft_tok) -> None:
    """Refuse a draft whose token ids do not mean the same as the target's."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs "
                         f"from the target's ({target.config.vocab_size}): speculative "
                         "decoding needs a draft with the target's tokenizer")
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError("the draft's tokenizer maps tokens to different ids than the "
                         "target's: speculative decoding needs a draft with the target's "
                         "tokenizer")
