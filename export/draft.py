"""The draft model: a given checkpoint with the target's tokenizer, or the target's first N
layers (with its final norm and head), so that a bundle always has a draft."""

from __future__ import annotations

import copy

from torch import nn


def num_layers(config) -> int:
    return config.n_layer if config.model_type == "gpt2" else config.num_hidden_layers


def check_draft_layers(config, layers: int) -> None:
    total = num_layers(config)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ValueError(f"--draft-layers must be in [1, {total - 1}] for this "
                         f"{total}-layer target, got {layers!r}")


def truncated_draft(target: nn.Module, layers: int) -> nn.Module:
    """A copy of `target` keeping only its first `layers` decoder layers."""
    check_draft_layers(target.config, layers)
    draft = copy.deepcopy(target)
    if target.config.model_type == "gpt2":
        draft.transformer.h = draft.transformer.h[:layers]
        draft.config.n_layer = layers
    else:
        draft.model.layers = draft.model.layers[:layers]
        draft.config.num_hidden_layers = layers
        if getattr(draft.config, "layer_types", None):
            draft.config.layer_types = draft.config.layer_types[:layers]
    return draft


def check_same_vocabulary(target_config, target_tok, draft_config, draft_tok) -> None:
    """Refuse a draft whose token ids do not mean the same as the target's."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft_config.vocab_size} tokens) differs "
                         f"from the target's ({target_config.vocab_size}): speculative "
                         "decoding needs a draft with the target's tokenizer")
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError("the draft's tokenizer maps tokens to different ids than the "
                         "target's: speculative decoding needs a draft with the target's "
                         "tokenizer")
