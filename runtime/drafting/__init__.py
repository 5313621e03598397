"""Drafting: what proposes tokens and how many.

The drafters: the `Drafter` protocol (drafter.py), the draft model (model.py), the feature
draft (feature.py), prompt lookup and lookup-then-model (lookup.py), and `make_drafter`, which
builds the one a generation asks for (config.DRAFTERS) on the bundle's draft model.

The K policy, how many tokens to draft at each step: auto K (auto_k.py: the expected gain of
each K from measured acceptance and call costs), the measurements kept with a bundle
(auto_k_file.py), and a batch's call costs (batch_costs.py). It lives beside the drafters
because it prices what they propose: it reads their acceptance and their calls' costs."""

from __future__ import annotations

from specedge.runtime.drafting.drafter import Drafter
from specedge.runtime.drafting.feature import FeatureDrafter
from specedge.runtime.drafting.lookup import LookupThenModelDrafter, PromptLookupDrafter
from specedge.runtime.drafting.model import ModelDrafter

__all__ = ["Drafter", "FeatureDrafter", "LookupThenModelDrafter", "ModelDrafter",
           "PromptLookupDrafter", "make_drafter"]


def make_drafter(name: str, model: ModelDrafter | None) -> Drafter:
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
