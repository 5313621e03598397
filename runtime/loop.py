"""The speculative step and the decoding loop.

One step (docs/design.md#the-speculative-step):

    drafts, q = drafter.propose(context, k)          # 1. K draft tokens and q_1..q_K
    rows = target([last token] + drafts)             # 2. one call -> p_1..p_{K+1}
    n, token = selector.verify(rows, drafts, q)        # 3-6. accept n drafts, emit one more
    rollback both caches to the accepted rows        # rollback = set the length

Plain decoding is the same step with k = 0, so the baseline shares every line of the loop.
`decode` only iterates: it picks K, runs the step, records what it cost and accepted, and
yields the step: its new tokens, how many were drafted and accepted, and by what.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from specedge.runtime.backends import Backend, Cache
from specedge.runtime.config import GenerationConfig
from specedge.runtime.drafting import Drafter
from specedge.runtime.drafting.auto_k import Histories, auto_k
from specedge.runtime.kv_cache import GROWTH_STEP, capacity_for
from specedge.runtime.stats import StepClock
from specedge.runtime.token_selection import selector_for


@dataclass
class GenerationState:
    """What one generation's steps share. `cache` is the target's KV cache; a host cache
    is replaced by a larger one when a step would not fit (kv_cache.py, `grown`)."""

    target: Backend
    cache: Cache                   # the target's KV cache
    drafter: Drafter | None        # None: plain decoding
    config: GenerationConfig
    rng: np.random.Generator
    clock: StepClock
    limit: int                     # the largest cache this generation may need

    def __post_init__(self) -> None:
        self.selector = selector_for(self.target)


@dataclass(frozen=True)
class Step:
    """What one step did: `new` is the n accepted drafts and the target's own next token;
    `source` what drafted them (`Drafter.source`; "none" without a drafter, "prefill" for
    the prompt's call, which gives the first token)."""

    new: list[int]
    drafted: int
    accepted: int
    draft_calls: int
    source: str = "none"


def speculative_step(state: GenerationState, context: list[int], k: int,
                     source: str = "none") -> Step:
    """Draft up to k tokens after `context` (with `source`, the drafter's source for it),
    verify them with one target call, and roll both caches back to what was accepted."""
    drafter, sampling, clock = state.drafter, state.config.sampling, state.clock
    drafts, q, draft_calls = [], None, 0
    if drafter and k > 0:
        calls = drafter.calls
        with clock.time("draft"):
            drafts, q = drafter.propose(context, k, sampling, state.rng,
                                        state.config.draft_threshold)
        draft_calls = drafter.calls - calls
    rows_needed = state.cache.length + len(drafts) + 1
    # A sequence decoded with others keeps its cache slot, which the session grows when
    # the calls meet (batch.py); a cache sized for the whole generation never needs to.
    if rows_needed > state.cache.capacity and state.target.grows_cache:
        state.cache = state.cache.grown(capacity_for(rows_needed, state.limit, GROWTH_STEP))
    with clock.time("target"):
        rows = state.selector.call_model(state.target, state.cache, [context[-1], *drafts],
                                len(drafts) + 1)
        if drafter and drafter.needs_features:
            drafter.observe(state.target.features, len(context) - 1)
    with clock.time("sampling"):
        n, token = state.selector.verify(rows, drafts, q, sampling, state.rng)
    # Rows for context[-1] and the n accepted drafts stay; the rest is stale.
    state.cache.rollback(len(context) + n)
    if drafter:
        drafter.rollback(len(context) + n)
    return Step([*drafts[:n], token], len(drafts), n, draft_calls, source)


def prefill(state: GenerationState, prompt: list[int]) -> int:
    """Run the prompt through the target and choose the first token; the drafter only
    starts (a model draft takes the prompt in at its first draft step). The target's cache
    may hold rows for the prompt's first tokens already (an earlier generation's,
    generator.py): only the rest runs."""
    with state.clock.time("prefill"):
        start = state.cache.length
        rows = state.selector.call_model(state.target, state.cache, prompt[start:], 1)
        if state.drafter:
            state.drafter.start(prompt, state.limit)
            if state.drafter.needs_features:
                state.drafter.observe(state.target.features, start)
    with state.clock.time("sampling"):
        return state.selector.pick(rows, state.config.sampling, state.rng)


def decode(state: GenerationState, prompt: list[int], histories: Histories,
           model_seconds: Callable[[], float]) -> Iterator[Step]:
    """Yield each step (the prompt's call first), up to max_new_tokens tokens in all.
    `histories` carries auto's measurements across generations; `model_seconds()` is the
    time spent inside the backends so far, for the share of time outside them."""
    config, drafter, clock = state.config, state.drafter, state.clock
    max_new = config.max_new_tokens
    token = prefill(state, prompt)
    clock.model_start = model_seconds()
    context, new = [*prompt, token], [token]
    yield Step(new, 0, 0, 0, "prefill")
    generated = 1
    while generated < max_new:
        source = drafter.source(context) if drafter else "none"
        history = histories.of(source, config.sampling.greedy)
        # Never draft past max_new_tokens: the last slot is the target's own token.
        k = min(auto_k(history, config.k_max) if config.auto else config.k_max,
                max_new - generated - 1)
        step = speculative_step(state, context, k, source)
        clock.record_step(step.drafted, step.accepted)
        clock.draft_calls += step.draft_calls
        # A draft that took in more than the last step's tokens was catching up: not what a
        # draft step costs (drafting/__init__.py, `caught_up`), so it does not feed state.
        steady = step.draft_calls and drafter.caught_up <= len(new)
        history.observe(step.drafted, step.accepted,
                        clock.last["target"] + clock.last["sampling"], clock.last["draft"],
                        step.draft_calls if steady else 0)
        new = step.new
        context += new
        generated += len(new)
        clock.model_end = model_seconds()
        yield step
