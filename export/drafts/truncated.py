"""The draft model: a given checkpoint with the target's tokenizer, or the target's first N
layers (with its final norm and head), so that a bundle always has a draft; and the head
subset such a draft scores at large vocabularies (`head_subset_ids`, `limit_draft_head`)."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable

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
    """A copy of `target` keeping only its first `layers` decoder layers.

    The layers it drops are detached from `target` while it is copied, so that the copy
    costs the draft's size, not the target's (a 1B-parameter target is 5 GB of fp32)."""
    check_draft_layers(target.config, layers)
    stack = target.transformer if target.config.model_type == "gpt2" else target.model
    name = "h" if target.config.model_type == "gpt2" else "layers"
    everything = getattr(stack, name)
    setattr(stack, name, everything[:layers])
    try:
        draft = copy.deepcopy(target)
    finally:
        setattr(stack, name, everything)
    if target.config.model_type == "gpt2":
        draft.config.n_layer = layers
    else:
        draft.config.num_hidden_layers = layers
        if getattr(draft.config, "layer_types", None):
            draft.config.layer_types = draft.config.layer_types[:layers]
    return draft


def check_mlp_width(config, width: int | None) -> None:
    """A distilled draft's MLP may be narrower than the target's, not wider (None: as wide)."""
    if width is None:
        return
    full = getattr(config, "intermediate_size", None)
    if full is None:  # GPT-2's MLP: no gated neurons to keep
        raise ValueError("--mlp-width keeps the neurons of a gated MLP; this target's draft "
                         "keeps its MLP whole: leave --mlp-width out")
    if isinstance(width, bool) or not 1 <= width <= full:
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
    if not hasattr(mlp, "down_proj"):  # not a gated MLP (GPT-2): kept whole
        mine.load_state_dict(state)
        return
    width = mine.mlp.down_proj.in_features
    if width < mlp.down_proj.in_features:
        size = (mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1)
                * mlp.down_proj.weight.norm(dim=0))
        keep = torch.topk(size, width).indices.sort().values
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            state[name] = state[name][keep]
        state["mlp.down_proj.weight"] = state["mlp.down_proj.weight"][:, keep]
    mine.load_state_dict(state)


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_size(tokenizer) -> int:
    """1 + the largest id the tokenizer gives a token (added tokens included): the ids a text
    can hold. An embedding may have more rows (checkpoints pad it, e.g. Qwen2.5's sizes to
    multiples of 64 or 128, each size its own way); those rows are no token."""
    return max(tokenizer.get_vocab().values()) + 1


def check_same_vocabulary(target_config, target_tok, draft_config, draft_tok) -> None:
    """Refuse a draft whose token ids do not mean the same as the target's.

    Decided by the tokenizers: every token of the target's has the same id in the draft's,
    the draft's has no other token among those ids, and bos, eos and pad are the same ids.
    The embedding sizes (`vocab_size`) may differ: only the tokenizer's ids must fit both
    (`fit_draft_vocabulary` then gives the draft the target's size)."""
    tokens = tokenizer_size(target_tok)
    target_vocab = target_tok.get_vocab()
    draft_vocab = {t: i for t, i in draft_tok.get_vocab().items() if i < tokens}
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()),
                        key=lambda item: item[1])[:3]
        raise ValueError("the draft's tokenizer maps tokens to different ids than the "
                         f"target's (for example {', '.join(f'{t!r} -> {i}' for t, i in differ)}"
                         "): speculative decoding needs a draft with the target's tokenizer")
    for name in SPECIAL_TOKENS:
        mine, theirs = getattr(draft_tok, name, None), getattr(target_tok, name, None)
        if mine != theirs:
            raise ValueError(f"the draft's tokenizer has {name} {mine} where the target's has "
                             f"{theirs}: speculative decoding needs a draft with the "
                             "target's tokenizer and its special tokens")
    for role, config in (("target", target_config), ("draft", draft_config)):
        if config.vocab_size < tokens:
            raise ValueError(f"the {role}'s embedding has {config.vocab_size} rows but its "
                             f"tokenizer uses ids up to {tokens - 1}: the checkpoint is "
                             "inconsistent; give a checkpoint whose tokenizer fits its model")


def fit_draft_vocabulary(draft: nn.Module, vocab_size: int, tokens: int) -> None:
    """Give a checkpoint draft the target's embedding size `vocab_size`, and let its graph
    score only the tokenizer's `tokens` ids, in place.

    The bundle's graphs must output the same number of logits (the runtime compares the
    target's and the draft's rows column by column), so the draft's embedding and head are
    cut (or padded) to the target's size; the rows cut are beyond the tokenizer
    (`check_same_vocabulary`), so no token is lost. Rows beyond the tokenizer, the draft's
    own padding or rows added here, are no token: they are masked, not cut, through the
    head-token mechanism of distilled drafts (export/graph/outputs.py), so their logits are
    -inf, their probability 0, and the draft never proposes such an id."""
    if draft.config.vocab_size != vocab_size:
        draft.resize_token_embeddings(vocab_size, mean_resizing=False)
    if tokens < vocab_size:
        attach_head(draft, torch.arange(tokens))


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


# `--draft-head-tokens auto`: above AUTO_HEAD_VOCAB tokens a truncated or checkpoint draft
# scores AUTO_HEAD_TOKENS of them (docs/export.md, "Draft head subsets"). At 128256 tokens
# the head is most of a one-layer draft's call (0.89 of an int4 target call, 0.047 with
# 16384 tokens); on SmolLM2-135M (49152) 16384 tokens hold 93-95% of the target's greedy
# tokens, so a smaller vocabulary keeps every token: its draft's head costs less than that
# loss of reach is worth (docs/MEASUREMENTS.md, "Draft head subsets").
AUTO_HEAD_VOCAB = 65536
AUTO_HEAD_TOKENS = 16384


def check_draft_head_tokens(setting: object, vocab_size: int) -> None:
    """Refuse a `--draft-head-tokens` that is not an integer in [1, vocab_size], "all",
    "auto" or None (auto)."""
    if setting is None or setting in ("all", "auto"):
        return
    if isinstance(setting, bool) or not isinstance(setting, int) or not (
            1 <= setting <= vocab_size):
        raise ValueError(f"--draft-head-tokens must be an integer in [1, {vocab_size}] (the "
                         "target's vocabulary), 'all' or 'auto', got "
                         f"{setting!r}: give how many tokens the draft's head scores")


def draft_head_size(setting: int | str | None, vocab_size: int) -> int | None:
    """How many tokens the draft's head scores for a `--draft-head-tokens` setting (checked),
    or None for all of them."""
    check_draft_head_tokens(setting, vocab_size)
    if setting is None or setting == "auto":
        return AUTO_HEAD_TOKENS if vocab_size > AUTO_HEAD_VOCAB else None
    return None if setting == "all" or setting >= vocab_size else setting


def head_subset_ids(tokenizer, vocab_size: int, n: int,
                    always: Iterable[int] = ()) -> torch.Tensor:
    """The `n` token ids a draft's head scores, ascending (fewer when the tokenizer has fewer
    tokens), chosen without training data, in this order of priority:

    1. `always` (the bundle's end-of-sequence ids) and the tokenizer's special tokens: a
       draft must be able to propose the end of an answer and the chat template's tokens;
    2. the tokens of the bundled prompt set (specedge/prompts.jsonl: chat, passages, code),
       most frequent first;
    3. the lowest remaining ids: byte-level BPE vocabularies are in merge order, and the
       earliest merges are the most frequent pieces of the corpus the tokenizer was made on.

    Ids at or above the tokenizer's size are no token and never chosen. On SmolLM2-135M,
    whose ids are in merge order, 2 changes how many of the target's greedy tokens the
    subset holds by under 1.3 points (docs/MEASUREMENTS.md, "Draft head subsets"); it is
    there for tokenizers whose ids are not in frequency order.
    """
    from specedge.prompts import load_prompts

    tokens = min(vocab_size, tokenizer_size(tokenizer))
    special = [getattr(tokenizer, name, None) for name in SPECIAL_TOKENS]
    ranked = [*always, *(i for i in special if i is not None), *tokenizer.all_special_ids]
    counts = Counter()
    for prompt in load_prompts():
        counts.update(tokenizer(prompt["prompt"], add_special_tokens=False)["input_ids"])
    ranked += [i for i, _ in counts.most_common()]
    chosen = dict.fromkeys(i for i in ranked if 0 <= i < tokens)  # first n, in priority
    chosen = list(chosen)[:n]
    if len(chosen) < n:
        taken = set(chosen)
        chosen += [i for i in range(tokens) if i not in taken][:n - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def limit_draft_head(draft: nn.Module, ids: torch.Tensor) -> None:
    """Let `draft`'s head score only `ids` (the others get logit -inf, probability 0:
    export/graph/outputs.py), in place. A head already limited (a checkpoint draft whose
    embedding has rows beyond the tokenizer) keeps only the ids in both."""
    ids = torch.unique(torch.as_tensor(ids, dtype=torch.long))
    vocab = draft.config.vocab_size
    if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= vocab:
        raise ValueError(f"a draft's head ids must be non-empty and in [0, {vocab})")
    current = getattr(draft, "specedge_head_ids", None)
    if current is not None:
        ids = ids[torch.isin(ids, current)]
    if current is None and ids.numel() == vocab:
        return  # every token: the plain head
    attach_head(draft, ids)


def apply_draft_head(draft: nn.Module, tokenizer, n: int | None,
                     always: Iterable[int] = ()) -> None:
    """Limit a truncated or checkpoint draft's head to the `n` tokens `head_subset_ids`
    chooses (`n` as `draft_head_size` makes it of `--draft-head-tokens`; None: every token,
    the head as it is); `always`: ids it must score (the bundle's end-of-sequence ids)."""
    if n is not None:
        limit_draft_head(draft, head_subset_ids(tokenizer, draft.config.vocab_size, n, always))
