"""Drafters propose K tokens after the context, with their probabilities q
(docs/design.md#the-speculative-step step 1).

`start(prompt, capacity)` begins a generation (a model drafter prefills the prompt).
`propose` returns (token ids, q) where q is [k, vocab] processed draft probabilities (numpy
rows, or their device address with device sampling), or None when q is one-hot (greedy
drafting, or a model-free drafter: docs/design.md#the-speculative-step step 6). A
`threshold` > 0 stops drafting after the first token whose draft probability q(x) is below
it: the tokens after a doubtful one are likely wasted. The doubtful token itself is kept:
dropping a token because of its own value would make the proposal differ from q, and the
acceptance test would no longer be exact when sampling.
`rollback(n)` tells the drafter that only the first n context tokens are still valid.
`source(context)` names what will propose the next draft (lookup+model has two sources):
auto keeps the acceptance and costs of each source apart (drafting/auto_k.py).
`calls` counts the drafter's forward calls, for the cost ratio c; `caught_up` is how many
tokens the first of them took in during the last `propose` (0: no model call): more than
the last step's new tokens means the draft had fallen behind (the prompt, steps at K = 0 or
drafted by lookup), a one-off cost that auto does not count as the price of a draft step
(drafting/auto_k.py). A drafter with `needs_features` is given the target's features after
every target call (`observe`).
"""

from __future__ import annotations

from specedge.runtime.drafting.feature import FeatureDrafter
from specedge.runtime.drafting.lookup import LookupThenModelDrafter, PromptLookupDrafter
from specedge.runtime.drafting.model import ModelDrafter

__all__ = ["FeatureDrafter", "LookupThenModelDrafter", "ModelDrafter", "PromptLookupDrafter",
           "make_drafter"]


def make_drafter(name: str, model: ModelDrafter | None):
    """The drafter called `name` (config.DRAFTERS), built on the bundle's draft model."""
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if model is None:
        raise ValueError("this bundle has no draft model: use drafter='prompt-lookup' "
                         "(--drafter prompt-lookup), use_draft=False (--no-draft), or "
                         "re-export with --draft / --draft-layers")
    if name == "lookup+model":
        return LookupThenModelDrafter(model)
    return model
