"""Auto K for sequences decoded together (runtime/batch.py): the costs of a model call as a
function of the batch, so that each sequence drafts the K that pays for the whole batch.

In a batch of B sequences every target call carries B rows, padded to the longest row's T
tokens, and every draft call B rows: a sequence that drafts K tokens makes every row of the
call pay for K + 1, while the others' rows, if they draft nothing, still give one token
each. Priced that way, the batch decodes

    rate_B(K) = (B - 1 + E(K)) / (K d(B) + v(B, K + 1))

tokens a second with this sequence at K (E(K) as in auto_k.py): auto_k.py's `best_k` with
`others` = B - 1 and the costs of B-row calls, d(B) of a draft call and v(B, T) of a target
call. It is cautious where the others draft too (their padding is then paid already, and
this sequence's draft costs less than priced), so a sequence drafts only where drafting
pays even if it alone pads the call.

A call costs about a fixed part plus a part per token-row: on SmolLM2 int4, 2 cores, a
4-row call of one token each 1.4x a one-row call of two, of three each 2.5x
(docs/MEASUREMENTS.md, "Batched attention and batched serving"). So

    v(B, T) = a + b B T,    d(B) = a' + b' B

each fitted by least squares to the calls the batch ran, the older ones weighing less (a
window of about HISTORY calls). As B grows, B T grows faster than the fixed part, drafting
pays less, and K falls, to 0 where no K pays. Until calls of two sizes have been seen, a
sequence uses its own measurements (auto_k.py `StepHistory`).

The line is a poor fit at small T: a one-row call of two tokens costs about what one of
one token does (SmolLM2 int4, 2 cores: 10.4 against 10.3 ms; the line says about 12), and
a two-row call of two tokens more than the line says (21.9 against about 18 ms). So v(B,
T) is the running mean of the calls of that very shape where the batch ran them (`seen`),
between two measured T of the same B a straight line through them, and beyond them the
fit's slope from the nearest: auto prices the K it drafts from what those calls cost, and
the line only fills in the shapes not run yet.
"""

from __future__ import annotations

from collections.abc import Callable

from specedge.runtime.drafting.auto_k import (
    HISTORY,
    SMOOTHING,
    Histories,
    StepHistory,
    piecewise,
)


class LinearCost:
    """seconds ~ fixed + per_unit * units, fitted to decayed running sums."""

    def __init__(self) -> None:
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, units: float, seconds: float) -> None:
        keep = 1.0 - 1.0 / HISTORY
        self.n = self.n * keep + 1.0
        self.x = self.x * keep + units
        self.y = self.y * keep + seconds
        self.xx = self.xx * keep + units * units
        self.xy = self.xy * keep + units * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_unit), or None until calls of at least two sizes were seen. The
        per-unit part is never negative: a call never costs less for more tokens."""
        spread = self.n * self.xx - self.x * self.x
        if spread <= 1e-9 * max(1.0, self.n * self.xx):
            return None
        slope = max(0.0, (self.n * self.xy - self.x * self.y) / spread)
        return (self.y - slope * self.x) / self.n, slope

    def __call__(self, units: float) -> float | None:
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, slope = fitted
        return max(fixed + slope * units, 1e-9)


class BatchCosts:
    """The target's and the draft's call costs of one batch session (`LinearCost` each, in
    token-rows: B T for a target call, B for a draft call of one token a row), and the
    target's measured cost of each call shape (`seen[B][T]`, seconds)."""

    def __init__(self) -> None:
        self.target = LinearCost()
        self.draft = LinearCost()
        self.seen: dict[int, dict[int, float]] = {}

    def observe(self, target: bool, rows: int, tokens: int, seconds: float) -> None:
        """A batched call of `rows` rows padded to `tokens` tokens took `seconds`."""
        if not target:
            self.draft.observe(rows * tokens, seconds)
            return
        self.target.observe(rows * tokens, seconds)
        shape = self.seen.setdefault(rows, {})
        old = shape.get(tokens)
        shape[tokens] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def verify(self, rows: int, t_max: int) -> list[float] | None:
        """v(rows, T) for T = 0 .. t_max (index 0 unused; module docstring), never falling
        with T, or None until the line is fitted."""
        fitted = self.target.fit()
        if fitted is None:
            return None
        fixed, per_row = fitted
        slope = per_row * rows
        seen = self.seen.get(rows)
        costs = (piecewise(seen, t_max, slope, slope) if seen
                 else [fixed + slope * t for t in range(t_max + 1)])
        for t in range(1, t_max + 1):
            costs[t] = max(costs[t], costs[t - 1] if t > 1 else 0.0, 1e-9)
        costs[0] = costs[1]
        return costs


class BatchStepHistory(StepHistory):
    """A sequence's StepHistory in a batch: its own acceptance, and the batch's call costs
    at the batch's current size (`rows()`), once they are fitted."""

    def __init__(self, costs: BatchCosts, rows: Callable[[], int],
                 verify: dict[int, float] | None = None):
        super().__init__(verify)
        self.costs, self.rows = costs, rows

    def verify_costs(self, t_max: int) -> list[float]:
        batch = self.costs.verify(self.rows(), t_max)
        return batch if batch is not None else super().verify_costs(t_max)

    def draft_cost(self, verify_one: float) -> float:
        """A model draft's steps at the batch's draft call cost; a source that has measured
        no model draft step (prompt lookup) keeps the price it has alone."""
        batch = self.costs.draft(self.rows())
        if batch is None or not self.draft:
            return super().draft_cost(verify_one)
        return batch

    def others(self) -> int:
        return self.rows() - 1 if self.costs.target.fit() is not None else 0


class BatchHistories(Histories):
    """The Histories of a batch session: each (source, sampling mode) a BatchStepHistory on
    the session's `costs`, at `rows()` sequences."""

    def __init__(self, costs: BatchCosts, rows: Callable[[], int]) -> None:
        super().__init__()
        self.costs, self.rows = costs, rows

    def new_history(self, verify: dict[int, float]) -> StepHistory:
        return BatchStepHistory(self.costs, self.rows, verify)
