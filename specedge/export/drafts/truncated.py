"""The draft model: a given checkpoint with the target's tokenizer, or the target's first N
layers (with its final norm and head), so that a bundle always has a draft."""

from __future__ import annotations

import copy

import torch
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


def check_mlp_width(config, width: int | None) -> None:
    """A distilled draft's MLP may be narrower than the target's, not wider (None: as wide)."""
    full = config.intermediate_size
    if width is not None and (isinstance(width, bool) or not 1 <= width <= full):
        raise ValueError(f"--mlp-width must be in [1, {full}] for this target (the width of "
                         f"its MLP), got {width!r}")


def copy_layer(mine: nn.Module, theirs: nn.Module) -> None:
    """Load the target's decoder layer `theirs` into the draft's layer `mine`.

    A narrower draft MLP keeps the target's neurons j with the largest
    ||gate_j|| ||up_j|| ||down_j|| (magnitude pruning): neuron j adds
    down_j silu(gate_j . x) (up_j . x), and |silu(z)| <= |z|, so that product bounds what it
    can add for an input of a given norm.
    """
    state = theirs.state_dict()
    mlp = theirs.mlp
    width = mine.mlp.down_proj.in_features
    if width < mlp.down_proj.in_features:
        size = (mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1)
                * mlp.down_proj.weight.norm(dim=0))
        keep = torch.topk(size, width).indices.sort().values
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            state[name] = state[name][keep]
        state["mlp.down_proj.weight"] = state["mlp.down_proj.weight"][:, keep]
    mine.load_state_dict(state)


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


def make_draft(target, layers: int, mlp_width: int | None = None):
    """A `layers`-layer model of the target's width, initialised from target layers; its
    MLPs `mlp_width` neurons wide (None: as wide as the target's)."""
    from transformers import AutoModelForCausalLM

    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = layers
    check_mlp_width(config, mlp_width)
    config.intermediate_size = mlp_width or config.intermediate_size
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    config.tie_word_embeddings = True
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for mine, theirs in zip(draft.model.layers, target.model.layers):
        copy_layer(mine, theirs)
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    # The target's embedding table, shared and frozen; the tied head reads the same rows.
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.lm_head.weight = draft.model.embed_tokens.weight
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def attach_head(draft, head_ids: torch.Tensor) -> None:
    """Mark the draft's output head as covering only `head_ids` (see export/graph/outputs.py)."""
    draft.register_buffer("specedge_head_ids", head_ids.long(), persistent=False)
