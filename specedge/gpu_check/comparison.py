"""How the GPU check compares an engine with 'ort-cpu' (`compare_generators`).

2 prompts x 4 greedy settings (plain, model draft, lookup then model, prompt lookup) of 32
tokens each give the first divergence of each case; ort-cpu's plain tokens, fed to both
target graphs one at a time, give per-position logits: the greedy agreement rate, the first
disagreement, and the largest |logit difference|, also in units of the standard deviation of
ort-cpu's logits in that row (logits have no common scale across models: a bound in logits
would be loose for one model and tight for another). The verdict:
  fp32 (same arithmetic, another summation order): every case's tokens identical to
      ort-cpu's, and logits within 1e-3 row std (fp32 kernels differ by ~1e-6 of it).
  fp16, tf32 (10-bit mantissa) and bf16 (7-bit): fp16 rounds near-ties the other way, so
      equal tokens are not expected. Pass when the logits are within the tolerance (fp16,
      tf32: 0.25 row std; bf16: 1.0) and every case leaves ort-cpu's tokens only at a near
      tie: a position where ort-cpu's logit for its own token exceeds its logit for the
      engine's by at most twice the tolerance (each of the two may move by the tolerance).
      Why 0.25: SmolLM2-135M in fp16 (fp32 accumulation) is within 0.05 row std of fp32 on
      94 positions, the tiny bundle's fp16 graph within 0.02; a lost KV row moves SmolLM2's
      logits by 6.8 row std. bf16's rounding unit is 8x fp16's: ~0.4 expected, 1.0 allowed.
"""

from __future__ import annotations

import numpy as np

TINY_PROMPTS = ["hello world", "the cat sat on the mat"]
GREEDY_SETTINGS = (dict(use_draft=False), dict(draft_tokens=3, drafter="model"),
                   dict(draft_tokens=3, drafter="lookup+model"),
                   dict(draft_tokens=2, drafter="prompt-lookup"))
NEW_TOKENS = 32
ALPHA = 1e-3
# Largest |logit difference| from ort-cpu, in units of the standard deviation of ort-cpu's
# logits in that row, per engine precision; the reasons are in the docstring.
LOGIT_TOLERANCES = {"fp32": 1e-3, "tf32": 0.25, "fp16": 0.25, "bf16": 1.0}
TOLERANCE_REASON = (
    "largest |logit - ort-cpu logit| over the row's standard deviation of ort-cpu logits. "
    "fp32: the same arithmetic in another order (~1e-6), so greedy tokens must be identical. "
    "fp16 / tf32 (10-bit mantissa): 0.25, 5x what fp16 does to SmolLM2-135M (0.05; a lost KV "
    "row: 6.8); bf16 (rounding unit 8x fp16's): 1.0. Reduced precisions flip near-ties, so "
    "their tokens may leave ort-cpu's where ort-cpu's margin between the two tokens is at "
    "most twice the tolerance.")


def logit_tolerance(precision: str) -> float:
    if precision not in LOGIT_TOLERANCES:
        raise ValueError(f"no logit tolerance is stated for precision {precision!r}; "
                         f"gpu_check compares {', '.join(LOGIT_TOLERANCES)} engines")
    return LOGIT_TOLERANCES[precision]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (where the shorter one ends, if it
    is a prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_report(ref_rows: np.ndarray, dev_rows: np.ndarray, tokens: list[int]) -> dict:
    """How far an engine's logits [N, V] are from ort-cpu's at the same N positions, where
    `tokens` are ort-cpu's greedy tokens (the argmax of each of its rows)."""
    ref_rows, dev_rows = np.asarray(ref_rows, np.float64), np.asarray(dev_rows, np.float64)
    diff = np.abs(dev_rows - ref_rows)
    agree = dev_rows.argmax(axis=1) == np.asarray(tokens)
    return {"positions": len(tokens), "greedy_agreement": float(agree.mean()),
            "first_disagreement": None if agree.all() else int(np.argmin(agree)),
            "max_logit_diff": float(diff.max()),
            "max_logit_diff_in_row_std": float((diff.max(axis=1) / ref_rows.std(axis=1)).max())}


def margin_in_row_std(row: np.ndarray, token: int, other: int) -> float:
    """How much `row` prefers `token` to `other`, in units of the row's standard deviation."""
    row = np.asarray(row, np.float64)
    return float((row[token] - row[other]) / row.std())


def verdict(precision: str, logits: dict, divergences: list[dict]) -> tuple[str, list[str]]:
    """("pass" or "fail", the reasons for a fail) of one engine against ort-cpu: logits
    within the precision's tolerance and, in fp32, no case leaving ort-cpu's tokens; in a
    reduced precision, cases leaving them only at a near tie (`near_tie`)."""
    tolerance, reasons = logit_tolerance(precision), []
    if not logits["max_logit_diff_in_row_std"] <= tolerance:
        reasons.append(f"logits {logits['max_logit_diff_in_row_std']:.3g} row std from "
                       f"ort-cpu's, more than the {precision} tolerance {tolerance}")
    for case in divergences:
        if precision == "fp32" or not case["near_tie"]:
            reasons.append(f"{case['prompt']!r} {case['settings']}: tokens leave ort-cpu's at "
                           f"position {case['first_divergence']}"
                           + ("" if precision == "fp32" else
                              f", where ort-cpu prefers its token by "
                              f"{case['ort_cpu_margin_in_row_std']} row std (more than "
                              f"twice the tolerance: not a near tie)"))
    return ("fail" if reasons else "pass"), reasons


def _cache(backend, tokens: int):
    from specedge.runtime.kv_cache import capacity_for

    return backend.new_cache(capacity_for(tokens, backend.spec.max_context))


def _close(cache) -> None:
    close = getattr(cache, "close", None)  # device caches hold device memory
    if close is not None:
        close()


def teacher_forced_rows(backend, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """The backend's logits [len(tokens), V] for each of `tokens` after `prompt_ids`: the
    prompt in one call, then `tokens` one at a time (row i predicts tokens[i])."""
    cache = _cache(backend, len(prompt_ids) + len(tokens))
    rows = [np.array(backend.forward(cache, prompt_ids, 1)[-1], np.float64)]
    rows += [np.array(backend.forward(cache, [t], 1)[-1], np.float64) for t in tokens[:-1]]
    _close(cache)
    return np.stack(rows)


def _row_after(backend, ids: list[int]) -> np.ndarray:
    cache = _cache(backend, len(ids))
    row = np.array(backend.forward(cache, ids, 1)[-1], np.float64)
    _close(cache)
    return row


def compare_generators(ref, dev, precision: str = "fp32", sampled_draws: int = 0) -> dict:
    """An engine (`dev`, a Generator) against ort-cpu (`ref`) at an engine `precision`, as
    the module docstring says. With `sampled_draws`, the first two sampled tokens must also
    follow the same distribution (two-sample chi-square, that many generations per arm,
    seeds 0.. and 10000.., alpha ALPHA)."""
    from specedge.gpu_check.two_sample import (  # scipy: imported here
        first_two_tokens,
        two_sample_test,
    )

    tolerance = logit_tolerance(precision)
    cases, equal, speeds, divergences, rows = 0, 0, [], [], ([], [], [])
    for prompt in TINY_PROMPTS:
        prompt_ids, plain = ref.codec.encode(prompt), None
        for settings in GREEDY_SETTINGS:
            a = ref.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, **settings)
            b = dev.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, **settings)
            if settings is GREEDY_SETTINGS[0]:  # plain decoding: the path both are fed
                plain = a.token_ids
            cases += 1
            speeds.append(b.stats.get("tokens_per_second"))
            d = first_divergence(a.token_ids, b.token_ids)
            if d is None:
                equal += 1
                continue
            case = {"prompt": prompt, "settings": settings, "first_divergence": d,
                    "ort_cpu_margin_in_row_std": None, "near_tie": False}
            if d < min(len(a.token_ids), len(b.token_ids)):
                row = _row_after(ref.target, prompt_ids + a.token_ids[:d])
                margin = margin_in_row_std(row, a.token_ids[d], b.token_ids[d])
                case.update(ort_cpu_margin_in_row_std=round(margin, 4),
                            near_tie=margin <= 2 * tolerance)
            divergences.append(case)
        rows[0].append(teacher_forced_rows(ref.target, prompt_ids, plain))
        rows[1].append(teacher_forced_rows(dev.target, prompt_ids, plain))
        rows[2].append(plain)
    logits = logit_report(np.concatenate(rows[0]), np.concatenate(rows[1]),
                          sum(rows[2], []))
    logits["first_disagreement"] = {  # per prompt: a position in its continuation
        prompt: logit_report(r, d, t)["first_disagreement"]
        for prompt, r, d, t in zip(TINY_PROMPTS, *rows)}
    status, reasons = verdict(precision, logits, divergences)
    report = {"status": status, "precision": precision,
              "rule": ("greedy tokens identical to ort-cpu's" if precision == "fp32" else
                       "greedy tokens may leave ort-cpu's only at near ties") +
                      f"; logits within {tolerance} row std",
              "tolerance": {"max_logit_diff_in_row_std": tolerance,
                            "near_tie_margin_in_row_std": 2 * tolerance,
                            "reason": TOLERANCE_REASON},
              "greedy_cases": cases, "identical_to_ort_cpu": equal,
              "first_divergence": min((c["first_divergence"] for c in divergences),
                                      default=None),
              "divergences": divergences, "teacher_forced_logits": logits,
              "tokens_per_second": speeds}
    if reasons:
        report["failures"] = reasons
    if sampled_draws:
        kwargs = dict(draft_tokens=3, temperature=0.8, top_p=0.9, drafter="model")
        stat, pvalue, _ = two_sample_test(first_two_tokens(ref, sampled_draws, 0, **kwargs),
                                          first_two_tokens(dev, sampled_draws, 10_000,
                                                           **kwargs))
        report["sampled_first_two_tokens"] = {"draws_per_arm": sampled_draws, "alpha": ALPHA,
                                              "statistic": stat, "pvalue": pvalue}
        if not pvalue > ALPHA:
            report["status"] = "fail"
    return report


# Sequences decoded together (`compare_batch`): each prompt with its own greedy settings, so
# that rows of one call carry different numbers of drafted tokens and end at different steps.
BATCH_CASES = [("hello world", dict(draft_tokens=3, drafter="model")),
               ("the cat sat on the mat", dict(draft_tokens=2, drafter="model")),
               ("a, b, c!", dict(use_draft=False)),
               ("why?", dict(draft_tokens=4, drafter="lookup+model"))]


def compare_batch(ref, dev) -> dict:
    """Sequences decoded together on `dev` (runtime/batch.py, all of BATCH_CASES at once)
    against each one's plain decoding alone on ort-cpu (`ref`): an fp32 engine computes a
    row as ort-cpu does, whatever shares its call, so the greedy tokens must be identical."""
    from specedge.runtime.batch import BatchGenerator, BatchRequest
    from specedge.runtime.config import GenerationConfig

    alone = [ref.generate(p, raw=True, max_new_tokens=NEW_TOKENS, use_draft=False).token_ids
             for p, _ in BATCH_CASES]
    out = BatchGenerator(dev, len(BATCH_CASES)).generate(
        [BatchRequest(prompt=p, raw=True,
                      config=GenerationConfig(max_new_tokens=NEW_TOKENS, **settings))
         for p, settings in BATCH_CASES])
    divergences = {p: first_divergence(a, b.token_ids)
                   for (p, _), a, b in zip(BATCH_CASES, alone, out)}
    failed = {p: d for p, d in divergences.items() if d is not None}
    return {"status": "fail" if failed else "pass", "sequences": len(BATCH_CASES),
            "rule": "fp32: each sequence's greedy tokens identical to its plain decoding "
                    "alone on ort-cpu",
            "first_divergence": failed,
            "accepted_of_drafted": [sum(b.stats["accepted_tokens"] for b in out),
                                    sum(b.stats["drafted_tokens"] for b in out)]}
