"""Timing and acceptance bookkeeping, and the figures
docs/design.md#expected-tokens-per-call-and-ideal-speedup asks the runtime to report.

With i.i.d. acceptance rate beta, K drafts and draft cost c (one draft call / one target
call), the expected tokens per target call is (1 - beta^(K+1)) / (1 - beta) and the ideal
speedup over plain decoding is (1 - beta^(K+1)) / ((1 - beta)(1 + cK)).

beta is estimated as accepted / examined: a step examines draft tokens up to and including
the first rejection; the drafts after it are never tested, so counting them (accepted /
drafted, reported as `draft_kept_fraction`) would bias beta low. Per-position acceptance is
likewise conditional: accepted at position i / examined at position i.

`next_token_nll` measures quality rather than speed: the log-likelihood of a text under a
model's logits, from which `specedge bench` (bench/perplexity.py) and the export's
quantization report (export/quantize.py) both compute perplexity. It lives in the runtime,
the one package both of them import, and works on the numpy logits a backend returns.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np


class StepClock:
    """Accumulates seconds per phase and acceptance counts per draft position."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.end = self.start
        self.seconds: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = defaultdict(float)  # seconds of each phase's last run
        self.calls: dict[str, int] = defaultdict(int)
        self.draft_calls = 0
        self.drafted = 0
        self.accepted = 0
        self.examined = 0
        self.model_start = 0.0  # seconds inside the backends when decoding starts...
        self.model_end = 0.0    # ...and after the last decode step
        self.position_tries: list[int] = []
        self.position_accepts: list[int] = []

    @contextmanager
    def time(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.last[phase] = time.perf_counter() - t0
            self.seconds[phase] += self.last[phase]
            self.calls[phase] += 1

    def record_step(self, drafted: int, accepted: int) -> None:
        """Positions 0 .. min(drafted, accepted + 1) - 1 were examined, the first `accepted`
        of them accepted."""
        examined = examined_positions(drafted, accepted)
        grow = drafted - len(self.position_tries)
        if grow > 0:
            self.position_tries += [0] * grow
            self.position_accepts += [0] * grow
        for i in range(examined):
            self.position_tries[i] += 1
        for i in range(accepted):
            self.position_accepts[i] += 1
        self.drafted += drafted
        self.accepted += accepted
        self.examined += examined

    def finish(self) -> None:
        self.end = time.perf_counter()


def examined_positions(drafted: int, accepted: int) -> int:
    """Draft positions tested by a step: up to and including the first rejection."""
    return min(drafted, accepted + 1)


def expected_tokens_per_call(beta: float, k: float) -> float:
    """(1 - beta^(K+1)) / (1 - beta), the limit K + 1 at beta = 1."""
    if beta >= 1.0:
        return k + 1.0
    return (1.0 - beta ** (k + 1)) / (1.0 - beta)


def ideal_speedup(beta: float, k: float, c: float) -> float:
    """(1 - beta^(K+1)) / ((1 - beta)(1 + cK))."""
    return expected_tokens_per_call(beta, k) / (1.0 + c * k)


TOTALS = ("tokens_generated", "target_calls", "draft_calls", "drafted_tokens",
          "accepted_tokens", "time_total_s", "time_prefill_s", "time_draft_s",
          "time_target_s", "time_model_decode_s")


def rates(t: dict, generations: int = 1) -> dict:
    """The reported rates from totals (the `TOTALS` keys plus per-position `position_tries`
    and `position_accepts`) of one generation or summed over several: over several, each
    rate is a ratio of sums, not a mean of ratios."""
    decode = t["time_total_s"] - t["time_prefill_s"]
    calls = t["target_calls"]
    # The first token of each generation comes from its prefill call.
    decoded = t["tokens_generated"] - generations
    tries, accepts = t["position_tries"], t["position_accepts"]
    examined = sum(tries)
    beta = t["accepted_tokens"] / examined if examined else 0.0
    target_step = t["time_target_s"] / calls if calls else 0.0
    draft_step = t["time_draft_s"] / t["draft_calls"] if t["draft_calls"] else 0.0
    c = draft_step / target_step if target_step else 0.0
    # K in the formula is the mean drafted per call: a threshold, prompt lookup or the end
    # of the budget draft fewer than the K asked for.
    mean_k = t["drafted_tokens"] / calls if calls else 0.0
    return {
        "mean_draft_tokens": mean_k,
        "acceptance_rate": beta,
        "draft_kept_fraction": t["accepted_tokens"] / t["drafted_tokens"]
        if t["drafted_tokens"] else 0.0,
        "acceptance_per_position": [a / n if n else 0.0 for a, n in zip(accepts, tries)],
        "tokens_per_target_call": decoded / calls if calls else 0.0,
        # Decode steps only: time spent outside the backends (sampling, bookkeeping, Python).
        "outside_model_share": 1.0 - t["time_model_decode_s"] / decode
        if decode > 0 and calls else 0.0,
        "decode_tokens_per_second": decoded / decode if decode > 0 else 0.0,
        "draft_cost_ratio_c": c,
        "ideal_speedup": ideal_speedup(beta, mean_k, c) if mean_k else 1.0,
    }


def summarize(clock: StepClock, tokens: int, k: int | str, drafter: str, backend: str,
              stop_reason: str) -> dict:
    """The statistics dict; `k` is the fixed K, "auto", or 0 for plain decoding."""
    s = clock.seconds
    total = clock.end - clock.start
    target_calls = clock.calls["target"]
    measured = [s["prefill"], s["draft"], s["target"], s["sampling"]]
    totals = {
        "tokens_generated": tokens,
        "target_calls": target_calls,
        "draft_calls": clock.draft_calls,
        "drafted_tokens": clock.drafted,
        "accepted_tokens": clock.accepted,
        "position_tries": list(clock.position_tries),
        "position_accepts": list(clock.position_accepts),
        "time_total_s": total,
        "time_prefill_s": s["prefill"],
        "time_draft_s": s["draft"],
        "time_target_s": s["target"],
        "time_sampling_s": s["sampling"],
        "time_other_s": max(0.0, total - sum(measured)),
        "time_model_decode_s": clock.model_end - clock.model_start if target_calls else 0.0,
    }
    return {"stop_reason": stop_reason, "backend": backend, "drafter": drafter,
            "draft_tokens_k": k, **totals, **rates(totals),
            "tokens_per_second": tokens / total if total > 0 else 0.0}


def next_token_nll(logits: np.ndarray, next_ids: Sequence[int]) -> float:
    """Negative log-likelihood in nats of a text's tokens under a model: the sum over rows i
    of ``-log softmax(logits[i])[next_ids[i]]``, with ``logits`` [len(next_ids), V] the
    model's rows at the positions before those tokens. Computed in float64, each row shifted
    by its maximum so that ``exp`` never overflows. The quality figure of `specedge bench`
    and of the export's quantization report (perplexity) is ``exp`` of its mean."""
    x = np.array(logits, dtype=np.float64)  # a copy: the caller's logits stay as they are
    x -= x.max(axis=-1, keepdims=True)
    picked = x[np.arange(len(next_ids)), next_ids]
    return float(-(picked - np.log(np.exp(x).sum(axis=-1))).sum())
