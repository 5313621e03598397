"""What the loop asks of a drafter (docs/design.md#the-speculative-step, step 1).

A drafter proposes K tokens after the context, with their probabilities q. Three kinds
implement it: a draft model with its own KV cache (model.py), a feature draft that also
reads the target's hidden features (feature.py), and prompt lookup, alone or in front of a
model (lookup.py). `make_drafter` (drafting/__init__.py) picks one by name.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from specedge.runtime.config import Sampling


@runtime_checkable
class Drafter(Protocol):
    """A drafter, as `speculative_step`, `prefill` and `decode` (loop.py) use it."""

    name: str
    # Forward calls of the draft so far, for the draft cost ratio c.
    calls: int
    # How many tokens the first draft call of the last `propose` took in (0: no model
    # call). More than the last step's new tokens means the draft had fallen behind (the
    # prompt, steps at K = 0 or drafted by lookup): a one-off cost that auto K does not
    # count as the price of a draft step (drafting/auto_k.py).
    caught_up: int
    # True: `observe` must be given the target's features after every target call.
    needs_features: bool

    def start(self, prompt: list[int], capacity: int) -> None:
        """Begin a generation (a model drafter readies a cache of `capacity` rows, which
        takes in the prompt at the first draft step)."""

    def source(self, context: list[int]) -> str:
        """What will propose the next draft: lookup+model has two sources, and auto K keeps
        the acceptance and costs of each apart."""

    def propose(self, context: list[int], k: int, sampling: Sampling,
                rng: np.random.Generator, threshold: float = 0.0) -> tuple[list[int], object]:
        """Up to k token ids after `context`, and q: [k, vocab] processed draft
        probabilities (numpy rows, or their device address with device sampling), or None
        when q is one-hot (greedy drafting, or a model-free drafter: design.md step 6).

        A `threshold` > 0 stops drafting after the first token whose draft probability q(x)
        is below it: the tokens after a doubtful one are likely wasted. The doubtful token
        itself is kept: dropping a token because of its own value would make the proposal
        differ from q, and the acceptance test would no longer be exact when sampling.
        """

    def observe(self, features: np.ndarray, start: int) -> None:
        """The target's features for the positions from `start` on (only called when
        `needs_features`)."""

    def rollback(self, length: int) -> None:
        """Only the first `length` context tokens are still valid."""
