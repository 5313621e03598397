"""How many tokens to draft: a fixed K, or `auto`, which before every step picks the K in
[0, k_max] with the highest expected rate of tokens per second:

    rate(K) = E(K) / (K d + v(K + 1)),    E(K) = 1 + sum_{i=1..K} beta_1 beta_2 ... beta_i

beta_i is the acceptance rate at draft position i given positions 1..i-1 were accepted;
with one beta for every position, E(K) = (1 - beta^(K+1)) / (1 - beta) as in
docs/design.md#expected-tokens-per-call-and-ideal-speedup.
Per position, because acceptance is not i.i.d.: a prompt-lookup draft whose first token is
right is likely to be copying a real span (measured 0.19, 0.42, 0.61, 0.60 on chat prompts).
d is the seconds of one draft step, v(T) the seconds of a target step on T tokens (the call
and the choice of tokens from its rows). With v constant, rate(K) / rate(0) is the ideal
speedup of docs/design.md#expected-tokens-per-call-and-ideal-speedup with c = d / v. But a
(K+1)-token call costs more than a one-token
call, by a factor that depends on the CPU, the precision and the thread pool (SmolLM2 int8
on a 2-core CPU without AVX2: 1.1x at T = 2, 1.6x at T = 5, 2.3x at T = 9; fp32 1.1x-1.4x, see
scripts/experiments/bench_verify_cost.py), so auto measures v per T instead of assuming it
flat. K = 0 is plain decoding: auto falls back to it when no K pays, and a poor draft then
costs only the probes below. d is measured on steps whose draft kept pace with the loop: a draft
model that skipped steps (K = 0, a lookup draft, the prompt for a feature draft) first
takes in the tokens it missed, a one-off that, priced as a draft step, made d up to 2.6x
too high and kept K at 0 (drafting/__init__.py, `caught_up`).

The beta_i and d are measured over the recent steps of the same source of drafts (a
drafter's `source`: lookup+model has two, a lookup span and the model) and sampling mode,
v(T) over every source of that mode, across generations (`StepHistory`), so a new
generation starts from what the last ones measured instead of from a prior. A position's
counts decay each time it is examined again (a window of about HISTORY tries), so auto
follows a change of task within a generation, yet a position that auto stopped drafting
keeps what it last measured. Decaying them with every step instead left a model source at
K = 0 with the few tries of its probes and the prior, so an unlucky run of probes held it
there: on chat prompts, 70% of its steps at K = 0, 4-8% slower than a fixed K = 1
(docs/MEASUREMENTS.md, "Auto against the best fixed K").
Each beta_i is smoothed towards the rate pooled over positions, which is smoothed by a
prior. A T not measured yet is estimated linearly from the T that are. A K is only
measured where it is used, so every PROBE_EVERY steps auto tries one K more, and half-way
one K less, than its choice. K follows measured times, so with `auto` a seed fixes the
distribution but not the exact text of a sampled generation.

`Histories.record` and `Histories.seed` carry these measurements from one process to the
next through a file in the bundle (drafting/auto_k_file.py), so a new Generator drafts the K the
draft's known acceptance calls for from its first step. From the prior, two early misses
held the SmolLM2 int4 feature draft at K = 0 (plain decoding) until the next probe, for
most of a 96-token answer (docs/design.md#choosing-k-automatically).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from specedge.runtime.config import AUTO_MAX_K
from specedge.runtime.stats import examined_positions

# Python floats, not numpy: auto runs between two model calls on lists of AUTO_MAX_K, where
# every numpy call is cold and costs tens of microseconds (docs/MEASUREMENTS.md, "What a
# numpy call costs after a model call").
# Before anything is measured: a few pseudo-observations of a decent draft (beta = 0.7),
# a small draft cost and a moderate growth of the verification cost with T, so the first
# steps draft a moderate K and start measuring.
PRIOR_EXAMINED, PRIOR_ACCEPTED = 4.0, 2.8
PRIOR_C = 0.1          # d / v(1)
PRIOR_SLOPE = 0.15     # (v(T) - v(1)) / (v(1) (T - 1)) until two T are measured
POSITION_WEIGHT = 4.0  # pseudo-observations of the pooled rate in each position's rate
HISTORY = 64           # tries: a position's counts decay by 1 - 1 / HISTORY per try
SMOOTHING = 0.2        # weight of a new observation in the running cost estimates
# A probe drafts a K that the estimates rate lower, and usually is: a K = 2 or K = 0 step of
# the SmolLM2 feature draft yields about 0.8x the tokens per second of its K = 1. With
# acceptance counts kept per try, probing every 64 steps instead of 16 ran the bench's
# prompts 1-3% faster (docs/MEASUREMENTS.md, "Auto against the best fixed K").
PROBE_EVERY = 64


def rates(betas: Sequence[float], draft_cost: float, verify_cost: Sequence[float],
          k_max: int, others: int = 0) -> list[float]:
    """rate(K) for K = 0 .. k_max. betas[i - 1] is beta_i for i = 1 .. k_max;
    verify_cost[T] is v(T) for T = 1 .. k_max + 1 (index 0 unused), in the unit of
    `draft_cost`. `others`: rows that share the calls and take one token from each (a
    batch, drafting/batch_costs.py): rate(K) = (others + E(K)) / cost."""
    prefix = accumulate(betas[:k_max], lambda product, beta: product * beta)
    expected = list(accumulate(prefix, initial=1.0))
    return [(others + expected[k]) / (k * draft_cost + verify_cost[k + 1])
            for k in range(k_max + 1)]


def best_k(betas: Sequence[float], draft_cost: float, verify_cost: Sequence[float],
           k_max: int, others: int = 0) -> int:
    """The K in [0, k_max] with the highest rate(K) (`rates`; smallest K on ties)."""
    return _highest(rates(betas, draft_cost, verify_cost, k_max, others))


def piecewise(measured: dict[int, float], t_max: int, low: float, high: float
              ) -> list[float]:
    """Costs for T = 0 .. t_max from costs `measured` at some T (at least one): the
    measured one where there is one, the straight line between the two measured T around
    it, and `low` / `high` per token below the first and past the last."""
    ts = sorted(measured)
    costs = []
    for t in range(t_max + 1):
        j = bisect_left(ts, t)  # ts[j - 1] < t <= ts[j]
        if j == len(ts):
            costs.append(measured[ts[-1]] + high * (t - ts[-1]))
        elif ts[j] == t:
            costs.append(measured[t])
        elif j == 0:
            costs.append(measured[ts[0]] - low * (ts[0] - t))
        else:
            a, b = ts[j - 1], ts[j]
            costs.append(measured[a] + (t - a) / (b - a) * (measured[b] - measured[a]))
    return costs


def _highest(rate: list[float]) -> int:
    return max(range(len(rate)), key=lambda k: (rate[k], -k))


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


class StepHistory:
    """Recent steps of one source of drafts and sampling mode: running estimates of v(T)
    and d, in seconds, and acceptance counts per draft position that decay with each try.
    `verify` may be shared by the sources of one target and sampling mode: what a target
    step costs does not depend on who drafted its tokens, and pooled it is measured more
    often."""

    def __init__(self, verify: dict[int, float] | None = None) -> None:
        self.verify: dict[int, float] = {} if verify is None else verify
        self.draft: float | None = None
        self.tries = [0.0] * AUTO_MAX_K
        self.accepts = [0.0] * AUTO_MAX_K
        # The same counts without decay: what a stored record keeps of this source, so that
        # it describes every prompt measured and not only the last ones.
        self.total_tries = [0.0] * AUTO_MAX_K
        self.total_accepts = [0.0] * AUTO_MAX_K
        self.steps = 0

    def observe(self, drafted: int, accepted: int, seconds: float, draft_seconds: float = 0.0,
                draft_calls: int = 0) -> None:
        """One step: `draft_calls` draft steps proposed `drafted` tokens, the target step on
        drafted + 1 tokens took `seconds` and accepted `accepted` of them."""
        t = drafted + 1
        self.verify[t] = _smooth(self.verify.get(t), seconds)
        if draft_calls:
            self.draft = _smooth(self.draft, draft_seconds / draft_calls)
        keep = 1.0 - 1.0 / HISTORY
        for i in range(min(examined_positions(drafted, accepted), AUTO_MAX_K)):
            self.tries[i] = self.tries[i] * keep + 1.0
            self.accepts[i] = self.accepts[i] * keep + (i < accepted)
            self.total_tries[i] += 1.0
            self.total_accepts[i] += i < accepted
        self.steps += 1

    def seed_acceptance(self, tries: Sequence[float], accepts: Sequence[float]) -> None:
        """Start from stored counts per position, weighed as at most HISTORY tries each (a
        full window), so the steps measured from now on take over as they do from the
        prior."""
        for i, (n, a) in enumerate(zip(tries[:AUTO_MAX_K], accepts[:AUTO_MAX_K])):
            weight = min(n, HISTORY) / n if n > 0 else 0.0
            self.tries[i] = self.total_tries[i] = n * weight
            self.accepts[i] = self.total_accepts[i] = min(a, n) * weight

    def betas(self, k_max: int) -> list[float]:
        """beta_1 .. beta_k_max, smoothed as the module docstring says."""
        pooled = (sum(self.accepts) + PRIOR_ACCEPTED) / (sum(self.tries) + PRIOR_EXAMINED)
        return [min((a + POSITION_WEIGHT * pooled) / (n + POSITION_WEIGHT), 0.999)
                for a, n in zip(self.accepts[:k_max], self.tries[:k_max])]

    def verify_costs(self, t_max: int) -> list[float]:
        """v(T) for T = 0 .. t_max (v(0) unused): measured where it was, interpolated
        between measured T, extrapolated beyond them with the slope at that end (never
        falling with T), or from PRIOR_SLOPE while fewer than two T are measured."""
        ts = sorted(self.verify)
        vs = [self.verify[t] for t in ts]
        if len(ts) < 2:
            t0, v0 = (ts[0], vs[0]) if ts else (1, 1.0)
            one = v0 / (1.0 + PRIOR_SLOPE * (t0 - 1))
            return [one * (1.0 + PRIOR_SLOPE * (t - 1)) for t in range(t_max + 1)]
        low = max(0.0, (vs[1] - vs[0]) / (ts[1] - ts[0]))
        high = max(0.0, (vs[-1] - vs[-2]) / (ts[-1] - ts[-2]))
        costs = piecewise(self.verify, t_max, low, high)
        return [max(c, 0.5 * vs[0]) if t < ts[0] else c for t, c in enumerate(costs)]

    def draft_cost(self, verify_one: float) -> float:
        return self.draft if self.draft is not None else PRIOR_C * verify_one

    def others(self) -> int:
        """Rows that share this sequence's calls: none alone (drafting/batch_costs.py)."""
        return 0


def auto_k(history: StepHistory, k_max: int = AUTO_MAX_K) -> int:
    """best_k for the acceptance and costs in `history`, with a probe of K + 1 or K - 1 on
    every PROBE_EVERY / 2-th step. In a batch (`others` > 0) K + 1 is probed only where it
    would pay were every draft accepted: a probe there pads every row of the call and has
    the draft take in the whole context in a call the others wait for, and at four rows of
    SmolLM2 int4 (a 2-token call 1.36x a 1-token one) no acceptance makes K = 1 pay: its
    probes cost the batch 6% of its tokens a second and raised its inter-token p99 from 22
    to 34 ms (docs/MEASUREMENTS.md, "What probing costs a batch"). Alone, a probe costs one
    sequence one step and also re-measures the v(T) and d it is priced with, which one
    slow call can inflate, so it stays."""
    verify = history.verify_costs(k_max + 1)
    draft, others = history.draft_cost(verify[1]), history.others()
    rate = rates(history.betas(k_max), draft, verify, k_max, others)
    k = _highest(rate)
    if history.steps % PROBE_EVERY == PROBE_EVERY // 2:
        up = min(k + 1, k_max)
        if others and (others + up + 1) / (up * draft + verify[up + 1]) <= rate[k]:
            return k
        return up
    if history.steps and history.steps % PROBE_EVERY == 0:
        return max(k - 1, 0)
    return k


class Histories:
    """The StepHistory of each (source of drafts, greedy), kept across generations so that a
    new generation starts from what the last ones measured. Drafts, and the choice of
    tokens from K + 1 rows, differ by source and sampling mode (drafting/__init__.py,
    `source`); v(T) is shared by the sources of one sampling mode."""

    def __init__(self) -> None:
        self._steps: dict[tuple[str, bool], StepHistory] = {}
        self._verify: dict[bool, dict[int, float]] = {}

    def __getitem__(self, key: tuple[str, bool]) -> StepHistory:
        return self._steps[key]

    def clear(self) -> None:
        self._steps.clear()
        self._verify.clear()

    def record(self) -> dict:
        """What has been measured, as plain JSON-able data: per (source, sampling mode) its
        acceptance counts per position (undecayed) and d; per sampling mode v(T)."""
        return {
            "acceptance": [{"source": source, "greedy": greedy, "steps": h.steps,
                            "tries": h.total_tries, "accepts": h.total_accepts}
                           for (source, greedy), h in self._steps.items() if h.steps],
            "draft_seconds": [{"source": source, "greedy": greedy, "seconds": h.draft}
                              for (source, greedy), h in self._steps.items()
                              if h.draft is not None],
            "verify_seconds": [{"greedy": greedy, "tokens": t, "seconds": v}
                               for greedy, costs in self._verify.items()
                               for t, v in sorted(costs.items())],
        }

    def seed(self, record: dict, costs: bool = True) -> None:
        """Start from a `record` (as `record` returns it): acceptance always, since it is a
        property of the draft and the prompts; d and v(T) only with `costs`, when they were
        measured on this machine and backend."""
        for entry in record.get("acceptance", ()):
            self.of(entry["source"], entry["greedy"]).seed_acceptance(entry["tries"],
                                                                      entry["accepts"])
        if not costs:
            return
        for entry in record.get("draft_seconds", ()):
            self.of(entry["source"], entry["greedy"]).draft = entry["seconds"]
        for entry in record.get("verify_seconds", ()):
            self._verify.setdefault(entry["greedy"], {})[entry["tokens"]] = entry["seconds"]

    def of(self, source: str, greedy: bool) -> StepHistory:
        history = self._steps.get((source, greedy))
        if history is None:
            history = self._steps[source, greedy] = self.new_history(
                self._verify.setdefault(greedy, {}))
        return history

    def new_history(self, verify: dict[int, float]) -> StepHistory:
        """The StepHistory of a new (source, sampling mode), sharing the mode's v(T)."""
        return StepHistory(verify)
