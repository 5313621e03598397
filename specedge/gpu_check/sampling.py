"""GPU parity check of the on-device sampling kernels
(runtime/backends/kernels/sampling.cu).

The GPU check (gpu_check.py) calls ``run(memory)`` with a CUDA device-memory object
(runtime/backends/memory.py) and stores the JSON-able dict it returns. The host
reference is the specification, and every check compares the kernels with it:

- greedy: ``DeviceSampler.verify_greedy`` == ``speculative.verify_greedy``, exactly, on random
  logits with planted argmax ties, vocab 49152 and 128256, K in {0, 1, 4, 8};
- process: ``DeviceSampler.process`` vs ``sampling.process_logits``: max |p_dev - p_host|
  (float32 vs float64) must stay below 1e-5, except on cases within 1e-5 of a top-p
  boundary (some rank j has |e(j) - top_p| < 1e-5, where float32 weights may keep or drop
  one more token); those are counted and reported, not judged;
- invalid rows: NaN / +inf / all -inf logits make ``sample`` and ``verify_greedy`` raise,
  as the host does;
- sample: chi-square goodness of fit of the drawn tokens against p (a small support inside
  the largest vocabulary), and no draw outside the support;
- verify_sampled, with a draft q and with one-hot q: chi-square goodness of fit of the first
  emitted token against the target row p_1 (docs/design.md#the-speculative-step step 3: it follows
  p_1 exactly, whatever
  the draft), a chi-square two-sample test of (n_accepted, token) against the host's
  ``verify_sampled``, and token-for-token agreement with a numpy transcription of the
  kernel's uniform layout fed the same uniforms.

Statistical tests are seeded and run at significance ``alpha`` each. Timings are host wall
clock per call: the launch plus the small copies the call makes (the logits are already on
the device).
"""

from __future__ import annotations

import math
import time
import traceback
from collections import Counter

import numpy as np
from scipy.stats import chisquare

from specedge.gpu_check.two_sample import two_sample_test
from specedge.runtime.backends.device_sampling import (
    THREADS,
    DeviceSampler,
    sampled_verify_reference,
)
from specedge.runtime.config import Sampling
from specedge.runtime.sampling import process_logits
from specedge.runtime.speculative import verify_greedy, verify_sampled

VOCABS = (49152, 128256)
KS = (0, 1, 4, 8)
ALPHA = 1e-3
PROB_TOLERANCE = 1e-5
BOUNDARY = 1e-5  # a top-p case this close to a mass boundary is reported, not judged
SAME_UNIFORM_TRIALS = 2000
SETTINGS = (
    Sampling(0.7),
    Sampling(1.0, top_k=50),
    Sampling(1.0, top_p=0.9),
    Sampling(0.8, top_k=40, top_p=0.95),
    Sampling(1.3, top_p=0.5),
    Sampling(0.6, top_k=1),
    Sampling(1.0, top_k=1000, top_p=0.99),
    Sampling(2.0, top_p=0.999),
)


def run(memory, *, seed: int = 0, alpha: float = ALPHA, greedy_cases: int = 200,
        draws: int = 20000, vocabs: tuple[int, ...] = VOCABS, sampler=None) -> dict:
    """Run every check; returns a JSON-able report with ``status`` ("pass" / "fail", as
    the GPU check expects of each part) and ``passed`` at the top.

    ``sampler`` (a loaded :class:`DeviceSampler`) is built from ``memory`` when None.
    A failing section is reported (with its traceback) and the others still run.
    """
    report: dict = {"threads": THREADS, "seed": seed, "alpha": alpha}
    own = sampler is None
    try:
        t0 = time.perf_counter()
        sampler = sampler or DeviceSampler(memory, max_draft=max(KS))
        report["load_seconds"] = time.perf_counter() - t0  # NVRTC compile + module load
        report["arch"] = sampler.arch
    except Exception:
        report.update(status="fail", passed=False, error=traceback.format_exc())
        return report
    try:
        bufs = _Buffers(memory, rows=max(KS) + 1, vocab=max(vocabs))
    except Exception:
        if own:
            sampler.close()
        report.update(status="fail", passed=False, error=traceback.format_exc())
        return report
    try:
        sections = {
            "greedy": lambda rng: _check_greedy(sampler, bufs, rng, greedy_cases, vocabs),
            "process": lambda rng: _check_process(sampler, bufs, rng, vocabs),
            "invalid_rows": lambda rng: _check_invalid_rows(sampler, bufs, max(vocabs)),
            "sample": lambda rng: _check_sample(sampler, bufs, rng, draws, alpha, max(vocabs)),
            "verify_sampled": lambda rng: _check_verify_sampled(
                sampler, bufs, rng, draws, alpha, max(vocabs), one_hot=False),
            "verify_sampled_one_hot": lambda rng: _check_verify_sampled(
                sampler, bufs, rng, draws, alpha, max(vocabs), one_hot=True),
        }
        for i, (name, check) in enumerate(sections.items()):
            try:  # each section its own seeded stream: reproducible one by one
                report[name] = _jsonable(check(np.random.default_rng([seed, i])))
            except Exception:  # report it and carry on: one device run shows every check
                report[name] = {"passed": False, "error": traceback.format_exc()}
    finally:
        bufs.close()
        if own:
            sampler.close()
    report["passed"] = all(report[name]["passed"] for name in sections)
    report["status"] = "pass" if report["passed"] else "fail"
    return report


class _Buffers:
    """Device buffers for the checks: logits, target probs p, draft probs q."""

    def __init__(self, memory, rows: int, vocab: int):
        self.memory = memory
        nbytes = 4 * rows * vocab
        self.logits, self.p, self.q = (memory.alloc(nbytes) for _ in range(3))

    def put(self, ptr: int, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array, dtype=np.float32)
        self.memory.upload(ptr, a)
        self.memory.synchronize()  # `a` must outlive the copy; timings exclude it

    def get(self, ptr: int, shape: tuple[int, int]) -> np.ndarray:
        out = np.empty(shape, np.float32)
        self.memory.download(ptr, out)
        return out

    def close(self) -> None:
        for ptr in (self.logits, self.p, self.q):
            self.memory.free(ptr)


def _check_greedy(sampler, bufs, rng, cases, vocabs) -> dict:
    mismatches, examples, times, tied_rows = 0, [], [], 0
    for c in range(cases):
        vocab, k = vocabs[c % len(vocabs)], KS[(c // len(vocabs)) % len(KS)]
        logits = _tied_logits(rng, k + 1, vocab)
        best = logits.max(axis=-1, keepdims=True)
        ties = [np.flatnonzero(row == b) for row, b in zip(logits, best)]
        tied_rows += sum(t.size > 1 for t in ties)
        draft = []
        for i in range(k):
            r = rng.random()
            if r < 0.75:
                draft.append(int(ties[i][0]))  # the lowest-id argmax: accepted
            elif r < 0.9 and ties[i].size > 1:
                draft.append(int(ties[i][-1]))  # a tied argmax, higher id: rejected
            else:
                draft.append(int(rng.integers(vocab)))
        bufs.put(bufs.logits, logits)
        t0 = time.perf_counter()
        got = sampler.verify_greedy(bufs.logits, draft, vocab)
        times.append(time.perf_counter() - t0)
        want = verify_greedy(draft, logits)
        if got != want:
            mismatches += 1
            if len(examples) < 5:
                examples.append({"vocab": vocab, "k": k, "draft": draft, "device": got,
                                 "host": want})
    return {"passed": mismatches == 0, "cases": cases, "rows_with_argmax_ties": tied_rows,
            "mismatches": mismatches, "examples": examples, "timing": _timing(times)}


def _check_process(sampler, bufs, rng, vocabs) -> dict:
    rows = 5
    judged = {"cases": 0, "max_abs_diff": 0.0, "support_mismatches": 0, "max_row_sum_error": 0.0}
    near = {"cases": 0, "max_abs_diff": 0.0, "support_mismatches": 0}
    failures, times = [], {v: [] for v in vocabs}
    for vocab in vocabs:
        for s in SETTINGS:
            for kind in ("lm", "ties", "masked"):
                logits = _case_logits(rng, kind, rows, vocab)
                bufs.put(bufs.logits, logits)
                t0 = time.perf_counter()
                sampler.process(bufs.logits, rows, vocab, s, bufs.p)
                bufs.memory.synchronize()
                times[vocab].append(time.perf_counter() - t0)
                dev = bufs.get(bufs.p, (rows, vocab)).astype(np.float64)
                host = process_logits(logits, s.temperature, s.top_k, s.top_p)
                diff = float(np.abs(dev - host).max())
                # float32 exp underflows near 1e-45: a token the host gives 1e-40 may be 0.
                support = int(((host > 1e-30) & (dev == 0)).sum() + ((dev > 0) & (host == 0)).sum())
                bucket = near if _top_p_margin(logits, s) < BOUNDARY else judged
                bucket["cases"] += 1
                bucket["max_abs_diff"] = max(bucket["max_abs_diff"], diff)
                bucket["support_mismatches"] += support
                if bucket is judged:
                    sum_error = float(np.abs(dev.sum(axis=-1) - 1.0).max())
                    judged["max_row_sum_error"] = max(judged["max_row_sum_error"], sum_error)
                    if diff >= PROB_TOLERANCE or support or sum_error >= PROB_TOLERANCE:
                        failures.append({"vocab": vocab, "sampling": repr(s), "kind": kind,
                                         "max_abs_diff": diff, "support_mismatches": support})
    return {"passed": judged["cases"] > 0 and not failures, "rows_per_case": rows,
            "tolerance": PROB_TOLERANCE, "judged": judged, "near_top_p_boundary": near,
            "failures": failures[:5], "failed_cases": len(failures),
            "timing": {str(v): _timing(t) for v, t in times.items()}}


def _check_invalid_rows(sampler, bufs, vocab) -> dict:
    """NaN, +inf and all -inf rows: the host raises ValueError, so must the device path."""
    logits = np.zeros((4, vocab), np.float32)
    logits[1, 7], logits[2, 9], logits[3] = np.nan, np.inf, -np.inf
    bufs.put(bufs.logits, logits)
    sampler.process(bufs.logits, 4, vocab, Sampling(1.0), bufs.p)
    out = {"row0_sums_to_one": bool(abs(bufs.get(bufs.p, (4, vocab))[0].sum() - 1) < 1e-5)}
    for name, call in (
        ("sample", lambda: sampler.sample(bufs.p, 4, vocab, [0.5] * 4)),
        ("verify_greedy", lambda: sampler.verify_greedy(bufs.logits, [0, 0, 0], vocab)),
    ):
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    out["passed"] = (out["row0_sums_to_one"] and "[1, 2, 3]" in out["sample"]
                     and out["verify_greedy"] != "no error")
    return out


def _check_sample(sampler, bufs, rng, draws, alpha, vocab) -> dict:
    support = _spread_ids(rng, vocab, 12)
    p = np.zeros(vocab, np.float32)
    p[support] = rng.uniform(0.5, 1.5, support.size)
    p /= p.sum()
    bufs.put(bufs.p, p[None])
    counts, times = Counter(), []
    for _ in range(draws):
        u = rng.random(1)
        t0 = time.perf_counter()
        counts[sampler.sample(bufs.p, 1, vocab, u)[0]] += 1
        times.append(time.perf_counter() - t0)
    target = p.astype(np.float64) / p.astype(np.float64).sum()
    fit = _goodness_of_fit(counts, support, target, alpha)
    return {"passed": fit["passed"], "vocab": vocab, "support": support.tolist(),
            "draws": draws, "goodness_of_fit": fit, "timing": _timing(times)}


def _check_verify_sampled(sampler, bufs, rng, draws, alpha, vocab, one_hot) -> dict:
    k = 4
    ids = _spread_ids(rng, vocab, 16)
    p = _rows_on(rng, ids, k + 1, vocab, 10)  # supports overlap partly: p > 0 = q and back
    q = _rows_on(rng, ids, k, vocab, 10)
    bufs.put(bufs.p, p)
    bufs.put(bufs.q, q)
    p64, q64 = p.astype(np.float64), q.astype(np.float64)
    # Draft token distributions: q itself, or (one-hot: any fixed rule) uniform over ids.
    draft_probs = [np.full(ids.size, 1 / ids.size) if one_hot else q64[i, ids] / q64[i, ids].sum()
                   for i in range(k)]

    def draft() -> list[int]:
        return [int(ids[rng.choice(ids.size, p=d)]) for d in draft_probs]

    q_ptr, q_host = (None, None) if one_hot else (bufs.q, q64)
    device, first, times, mismatches = Counter(), Counter(), [], 0
    for trial in range(draws):
        x = draft()
        u = _peek_uniforms(rng, k + 1) if trial < SAME_UNIFORM_TRIALS else None
        t0 = time.perf_counter()
        n, token = sampler.verify_sampled(bufs.p, q_ptr, x, vocab, rng)
        times.append(time.perf_counter() - t0)
        device[n, token] += 1
        first[x[0] if n > 0 else token] += 1
        if u is not None:
            mismatches += sampled_verify_reference(x, q_host, p64, u) != (n, token)
    host = Counter(verify_sampled(draft(), q_host, p64, rng) for _ in range(draws))
    fit = _goodness_of_fit(first, np.flatnonzero(p64[0]), p64[0] / p64[0].sum(), alpha)
    two = _two_sample(device, host, alpha)
    same = {"trials": min(draws, SAME_UNIFORM_TRIALS), "mismatches": int(mismatches)}
    mean_n = {"device": _mean_accepted(device), "host": _mean_accepted(host)}
    return {"passed": fit["passed"] and two["passed"] and mismatches == 0,
            "q": "one-hot (model-free draft)" if one_hot else "draft probabilities",
            "vocab": vocab, "k": k, "draws": draws, "first_token_vs_p1": fit,
            "two_sample_vs_host": two, "same_uniforms_vs_numpy_layout": same,
            "mean_accepted": mean_n, "timing": _timing(times)}


def _peek_uniforms(rng: np.random.Generator, n: int) -> np.ndarray:
    """The next n ``rng.random()`` values, without consuming them."""
    twin = np.random.Generator(type(rng.bit_generator)())
    twin.bit_generator.state = rng.bit_generator.state
    return twin.random(n)


def _goodness_of_fit(counts: Counter, support: np.ndarray, target: np.ndarray,
                     alpha: float) -> dict:
    observed = np.array([counts[int(t)] for t in support], dtype=np.float64)
    outside = int(sum(counts.values()) - observed.sum())
    out = {"cells": int(support.size), "outside_support": outside, "alpha": alpha}
    if outside or observed.sum() == 0:
        return {**out, "passed": False}
    expected = target[support] / target[support].sum() * observed.sum()
    stat, pvalue = chisquare(observed, expected)
    return {**out, "statistic": float(stat), "pvalue": float(pvalue),
            "min_expected": float(expected.min()), "passed": bool(pvalue > alpha)}


def _two_sample(a: Counter, b: Counter, alpha: float) -> dict:
    stat, pvalue, table = two_sample_test(a, b)
    return {"statistic": stat, "pvalue": pvalue, "cells": int(table.shape[1]),
            "draws": [int(table[0].sum()), int(table[1].sum())], "alpha": alpha,
            "passed": bool(pvalue > alpha)}


def _top_p_margin(logits: np.ndarray, s: Sampling) -> float:
    """min over rows and ranks j of |e(j) - top_p| (e: host mass ranked above j)."""
    if s.top_p >= 1.0:
        return math.inf
    x = logits.astype(np.float64) / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[:, -s.top_k, None]
        x = np.where(x < kth, -np.inf, x)
    margin = math.inf
    for row in x:
        e = np.exp(row - row.max())
        e /= e.sum()
        ranked = e[np.argsort(row, kind="stable")[::-1]]
        above = np.cumsum(ranked) - ranked
        margin = min(margin, float(np.abs(above - s.top_p).min()))
    return margin


def _case_logits(rng, kind: str, rows: int, vocab: int) -> np.ndarray:
    if kind == "ties":
        return _tied_logits(rng, rows, vocab)
    # LM-like: a noisy floor and a few dozen strong candidates, so top-p boundaries fall
    # between well separated masses (a flat row has ~1e-5 gaps, as small as float32 error).
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 2
    for row in logits:
        row[rng.choice(vocab, 32, replace=False)] += rng.uniform(8, 16, 32).astype(np.float32)
    if kind == "masked":  # -inf entries (banned tokens, a partial draft head) stay masked
        logits[rng.random((rows, vocab)) < 0.4] = -np.inf
        logits[:, 0] = 1.0
    return logits


def _tied_logits(rng, rows: int, vocab: int) -> np.ndarray:
    """Random logits with exact ties: copies of the row max, or a whole row rounded."""
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 3
    for row in logits:
        if rng.random() < 0.5:
            row[rng.integers(vocab, size=2)] = row.max()
        if rng.random() < 0.2:
            row[:] = np.round(row)
    return logits


def _spread_ids(rng, vocab: int, n: int) -> np.ndarray:
    """n sorted token ids across the vocabulary, including both ends (chunk edges)."""
    inner = rng.choice(np.arange(1, vocab - 1), n - 2, replace=False)
    return np.sort(np.concatenate([[0, vocab - 1], inner]))


def _rows_on(rng, ids: np.ndarray, rows: int, vocab: int, size: int) -> np.ndarray:
    """float32 distributions, each on `size` random tokens of `ids`, masses in [0.5, 1.5]."""
    out = np.zeros((rows, vocab), np.float32)
    for row in out:
        row[rng.choice(ids, size, replace=False)] = rng.uniform(0.5, 1.5, size)
        row /= row.sum()
    return out


def _mean_accepted(outcomes: Counter) -> float:
    return sum(n * c for (n, _), c in outcomes.items()) / max(1, sum(outcomes.values()))


def _timing(seconds: list[float]) -> dict:
    if not seconds:
        return {"calls": 0}
    us = np.array(seconds) * 1e6
    return {"calls": len(us), "median_us": float(np.median(us)),
            "p90_us": float(np.percentile(us, 90)), "mean_us": float(us.mean())}


def _jsonable(value):
    """numpy scalars and tuples -> plain Python, for json.dump."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
