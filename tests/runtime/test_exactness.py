"""Statistical exactness of speculative sampling (docs/design.md#why-the-output-is-exact).

Claim under test: whatever the draft distribution q, the token emitted by
``verify_sampled`` is distributed exactly as the target distribution p (steps 3, 4, 6),
and a multi-token step produces the same joint distribution as plain sampling.

Method: for each case, simulate N_DRAWS steps with the real ``verify_sampled`` (no
vectorised re-implementation), count the emitted tokens and run a chi-square
goodness-of-fit test against p. A token with p = 0 must never appear; that is asserted
exactly, apart from the chi-square. All cases form one family with alpha = 0.001,
Bonferroni-corrected (ALPHA_EACH = 0.001 / number of chi-square tests), so a correct
implementation fails this file with probability below 0.1%, and every random stream
is seeded, so a given run is deterministic anyway.

Power is demonstrated, not assumed: the negative controls run deliberately wrong
samplers through the very same helpers and require p-values below ALPHA_EACH, one of them
a shift of 0.02-0.05 per token. A chi-square needs two tokens it can expect draws in: a p
with two or more possible tokens must give two cells with an expected count of
MIN_EXPECTED or more (asserted); a one-hot p is tested exactly by the zero-probability
check (4 of the 14 composed cases, where top-p keeps one token).

Sizes: N_DRAWS = 12000 draws per test (twice that for the two-token joint), 74 chi-square
tests, ALPHA_EACH = 0.001 / 74 = 1.4e-5, each test seeded with its own
np.random.default_rng (1000, 2000, 3000 + case index, 4000; the controls 5 and 6). The
file takes about 30 s on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
from scipy import stats

from specedge.runtime.probs import sample
from specedge.runtime.sampling import process_logits
from specedge.runtime.speculative import residual, verify_sampled

# Draws per chi-square test. At this N a sampler that moves 0.02-0.05 of probability
# between tokens gets a p-value far below ALPHA_EACH; the negative controls below check
# this for real wrong samplers.
N_DRAWS = 12000
ALPHA_FAMILY = 1e-3
MIN_EXPECTED = 5.0  # usual chi-square validity rule: pool cells expected below this

Verifier = Callable[
    [Sequence[int], np.ndarray | None, np.ndarray, np.random.Generator], tuple[int, int]
]


# --------------------------------------------------------------------------- cases


def _pair_cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, p, q) pairs over V in 3..8: random Dirichlet plus hand-built edge cases."""
    rng = np.random.default_rng(20240611)
    cases = []
    # Independent p and q. Concentration 0.1 gives probabilities down to ~1e-20, which
    # are pooled by the chi-square helper but still exercise tiny p(x) / q(x) ratios.
    for conc in (0.1, 0.3, 1.0):
        for vocab in range(3, 9):
            for rep in range(2):
                p = rng.dirichlet(np.full(vocab, conc))
                q = rng.dirichlet(np.full(vocab, conc))
                # All but a sliver on one token (the sliver expected < MIN_EXPECTED times
                # in N_DRAWS): no test at this N could see what a sampler does with it.
                if (p * N_DRAWS >= MIN_EXPECTED).sum() >= 2:
                    cases.append((f"dirichlet{conc}-V{vocab}-{rep}", p, q))
    # A draft that resembles the target, as a trained draft would.
    for vocab in range(3, 9):
        p = rng.dirichlet(np.full(vocab, 0.5))
        q = 0.7 * p + 0.3 * rng.dirichlet(np.ones(vocab))
        cases.append((f"correlated-V{vocab}", p, q))

    q_equal = rng.dirichlet(np.ones(5))
    cases += [
        ("p-equals-q", q_equal, q_equal.copy()),
        ("p-equals-q-uniform", np.full(3, 1 / 3), np.full(3, 1 / 3)),
        ("disjoint", np.array([0.5, 0.5, 0, 0, 0]), np.array([0, 0, 0.2, 0.3, 0.5])),
        ("disjoint-interleaved", np.tile([0.25, 0.0], 4), np.tile([0.0, 0.25], 4)),
        ("q-tiny-where-p-large", np.array([0.7, 0.2, 0.1]), np.array([1e-9, 0.5, 0.5 - 1e-9])),
        (
            "p-and-q-tiny",
            np.array([1e-7, 0.6, 0.4 - 1e-7, 0.0]),
            np.array([1e-9, 0.3, 0.3, 0.4 - 1e-9]),
        ),
        ("p-zero-on-likely-draft", np.array([0, 0.5, 0.3, 0.2]), np.array([0.9, 0.05, 0.03, 0.02])),
        ("q-one-hot-p-positive", np.array([0.2, 0.5, 0.3]), np.array([0.0, 1.0, 0.0])),
        ("q-one-hot-p-zero", np.array([0.0, 0.6, 0.4]), np.array([1.0, 0.0, 0.0])),
        ("p-one-hot", np.array([0.0, 0.0, 1.0, 0.0]), np.array([0.3, 0.3, 0.4, 0.0])),
        # The pairs the negative controls below use: the correct sampler must pass them.
        ("reversed", np.array([0.6, 0.3, 0.1]), np.array([0.1, 0.3, 0.6])),
        ("mild", np.array([0.5, 0.3, 0.2]), np.array([0.3, 0.3, 0.4])),
    ]
    return cases


# Settings for the composed cases: mostly the brief's (0.7, 5, 0.9), plus a few others.
_COMPOSED_SETTINGS = [(0.7, 5, 0.9)] * 8 + [(1.3, 0, 0.8), (0.5, 3, 1.0), (1.0, 8, 0.7)] * 2


def _composed_cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """p and q from process_logits on random logits over V = 10 (temperature/top-k/top-p)."""
    rng = np.random.default_rng(77)
    cases = []
    for i, (temperature, top_k, top_p) in enumerate(_COMPOSED_SETTINGS):
        target = rng.normal(size=10) * 2.0
        # Mostly a noisy copy of the target (a realistic draft); every fourth independent.
        draft = rng.normal(size=10) * 2.0 if i % 4 == 3 else target + rng.normal(size=10)
        p = process_logits(target, temperature, top_k=top_k, top_p=top_p)
        q = process_logits(draft, temperature, top_k=top_k, top_p=top_p)
        cases.append((f"T{temperature}-k{top_k}-p{top_p}-{i}", p, q))
    return cases


def _one_hot_cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, p, proposal): model-free drafts, x ~ proposal, verified with q_probs=None."""
    rng = np.random.default_rng(99)
    p = rng.dirichlet(np.full(6, 0.5))
    p[4] = 0.0
    p /= p.sum()

    def fixed(x: int) -> np.ndarray:
        return np.eye(6)[x]

    return [
        ("fixed-argmax", p, fixed(int(np.argmax(p)))),
        ("fixed-least-likely-nonzero", p, fixed(int(np.argmin(np.where(p > 0, p, 2.0))))),
        ("fixed-p-zero", p, fixed(4)),
        ("uniform-proposal", p, np.full(6, 1 / 6)),
        ("dirichlet-proposal", p, rng.dirichlet(np.full(6, 0.3))),
        ("proposal-is-p", p, p.copy()),
    ]


PAIR_CASES = _pair_cases()
COMPOSED_CASES = _composed_cases()
ONE_HOT_CASES = _one_hot_cases()
N_CHI2_TESTS = len(PAIR_CASES) + len(COMPOSED_CASES) + len(ONE_HOT_CASES) + 1  # + joint
ALPHA_EACH = ALPHA_FAMILY / N_CHI2_TESTS


# --------------------------------------------------------------------------- helpers


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value of ``counts`` against ``probs`` (chi-square, or binomial).

    - A count on a token with ``probs == 0`` is an impossible event: p-value 0.
    - Zero-probability tokens are then left out (they carry no degree of freedom).
    - Cells with expected count below MIN_EXPECTED are pooled, smallest first, into one
      cell that grows until it reaches MIN_EXPECTED too, but never into the last cell.
    - Two cells with one still below MIN_EXPECTED (all mass but a sliver on one token):
      the chi-square approximation is invalid, but two cells are a binomial, tested
      exactly. One cell (a single possible token): nothing to test, p-value 1.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    support = probs > 0
    if counts[~support].any():
        return 0.0
    n = counts.sum()
    expected = probs[support] / probs[support].sum() * n
    observed = counts[support]
    order = np.argsort(expected, kind="stable")
    expected, observed = expected[order], observed[order]
    n_pool = int((expected < MIN_EXPECTED).sum())
    while 0 < n_pool < expected.size - 1 and expected[:n_pool].sum() < MIN_EXPECTED:
        n_pool += 1
    if n_pool > 1:
        expected = np.r_[expected[:n_pool].sum(), expected[n_pool:]]
        observed = np.r_[observed[:n_pool].sum(), observed[n_pool:]]
    if expected.size < 2:
        return 1.0
    if expected.size == 2 and expected.min() < MIN_EXPECTED:
        return float(stats.binomtest(int(observed[0]), int(n), expected[0] / n).pvalue)
    return float(stats.chisquare(observed, expected).pvalue)


def first_token_counts(
    verify: Verifier,
    p: np.ndarray,
    proposal: np.ndarray,
    n: int,
    rng: np.random.Generator,
    *,
    one_hot: bool = False,
) -> np.ndarray:
    """Counts of the first emitted token over ``n`` K = 1 steps.

    Each step drafts ``x ~ proposal`` and calls ``verify([x], q, [p, bonus], rng)``; the
    first emitted token is ``x`` if accepted, else the returned correction. ``q`` is
    ``proposal`` itself, or None (model-free draft) with ``one_hot=True``. The bonus row
    never influences the first token, so it is an arbitrary uniform row.
    """
    vocab = p.size
    p_rows = np.vstack([p, np.full(vocab, 1.0 / vocab)])
    q_rows = None if one_hot else proposal[None, :]
    # Drafts are drawn up front from the same generator: they are independent of the
    # uniforms the verifier draws later, as in the real loop.
    drafts = rng.choice(vocab, size=n, p=proposal)
    counts = np.zeros(vocab, dtype=np.int64)
    for x in drafts.tolist():
        n_accepted, token = verify([x], q_rows, p_rows, rng)
        counts[x if n_accepted else token] += 1
    return counts


def assert_follows(counts: np.ndarray, p: np.ndarray) -> None:
    """Positive check: no impossible token, and the chi-square does not reject p.

    A one-hot p is tested exactly by the first check; any other p must give the
    chi-square two cells with an expected count of MIN_EXPECTED or more, or it would pass
    whatever the sampler did.
    """
    assert counts[p == 0].sum() == 0, f"emitted zero-probability tokens: {counts[p == 0]}"
    populated = int((p / p.sum() * counts.sum() >= MIN_EXPECTED).sum())
    assert (p > 0).sum() == 1 or populated >= 2, (
        f"p {np.round(p, 6).tolist()} leaves the chi-square {populated} cell(s) with an "
        f"expected count of {MIN_EXPECTED} or more at N = {counts.sum()}: it has no power")
    pvalue = gof_pvalue(counts, p)
    assert pvalue >= ALPHA_EACH, (
        f"counts {counts.tolist()} do not follow p {np.round(p, 4).tolist()}: "
        f"chi-square p-value {pvalue:.3g} < {ALPHA_EACH:.3g}"
    )


# --------------------------------------------------------------------------- positive


@pytest.mark.parametrize(
    ("seed", "p", "q"),
    [(i, p, q) for i, (_, p, q) in enumerate(PAIR_CASES)],
    ids=[name for name, _, _ in PAIR_CASES],
)
def test_first_token_follows_p(seed, p, q):
    # N = N_DRAWS, alpha = ALPHA_EACH, rng seeded with 1000 + case index.
    counts = first_token_counts(verify_sampled, p, q, N_DRAWS, np.random.default_rng(1000 + seed))
    assert_follows(counts, p)


@pytest.mark.parametrize(
    ("seed", "p", "q"),
    [(i, p, q) for i, (_, p, q) in enumerate(COMPOSED_CASES)],
    ids=[name for name, _, _ in COMPOSED_CASES],
)
def test_first_token_follows_p_with_temperature_top_k_top_p(seed, p, q):
    # N = N_DRAWS, alpha = ALPHA_EACH, rng seeded with 2000 + case index.
    counts = first_token_counts(verify_sampled, p, q, N_DRAWS, np.random.default_rng(2000 + seed))
    assert_follows(counts, p)


def test_composed_cases_cover_filtered_draft_tokens():
    # The composed family must include the edge case "p(x) == 0 after top-k/top-p while
    # the draft likes x", or the test above would not exercise it; and top-p must leave
    # most of its cases more than one token, or they would only test the support.
    assert any(((p == 0) & (q > 0.05)).any() for _, p, q in COMPOSED_CASES)
    spread = [name for name, p, _ in COMPOSED_CASES
              if (p * N_DRAWS >= MIN_EXPECTED).sum() >= 2]
    assert len(spread) >= 10, spread


@pytest.mark.parametrize(
    ("seed", "p", "proposal"),
    [(i, p, r) for i, (_, p, r) in enumerate(ONE_HOT_CASES)],
    ids=[name for name, _, _ in ONE_HOT_CASES],
)
def test_model_free_draft_first_token_follows_p(seed, p, proposal):
    # docs/design.md#the-speculative-step step 6 (q one-hot at x): for ANY way of choosing x
    # independent of the
    # verifier's uniforms, P(emit t) = sum_x r(x) [p(x) 1{t=x} + (1 - p(x)) p(t) 1{t!=x}
    # / (1 - p(x))] = p(t). N = N_DRAWS, alpha = ALPHA_EACH, seed 3000 + case index.
    rng = np.random.default_rng(3000 + seed)
    counts = first_token_counts(verify_sampled, p, proposal, N_DRAWS, rng, one_hot=True)
    assert_follows(counts, p)


# Two-token step over V = 4, hand-built. Zeros on purpose: p1 forbids token 2, which the
# draft proposes 20% of the time; p2(.|0) forbids 3; q2(.|1) is one-hot.
Q1 = np.array([0.4, 0.3, 0.2, 0.1])
Q2 = np.array(
    [
        [0.1, 0.2, 0.3, 0.4],
        [0.0, 1.0, 0.0, 0.0],
        [0.25, 0.25, 0.25, 0.25],
        [0.7, 0.1, 0.1, 0.1],
    ]
)
P1 = np.array([0.1, 0.5, 0.0, 0.4])
P2 = np.array(
    [
        [0.6, 0.3, 0.1, 0.0],
        [0.2, 0.2, 0.3, 0.3],
        [0.1, 0.1, 0.1, 0.7],
        [0.05, 0.45, 0.45, 0.05],
    ]
)
P3 = np.array([0.1, 0.2, 0.3, 0.4])  # p3(.|t1, t2): only ever the bonus, never counted


def test_two_token_joint_distribution():
    # K = 2: x1 ~ q1, x2 ~ q2(.|x1); target rows p1, p2(.|x1), p3(.|x1, x2). If the step
    # emitted one token t1 (rejection at position 0), t2 comes from the next plain step,
    # t2 ~ p2(.|t1). The pair must follow p1(t1) p2(t2|t1) over the 16 cells.
    # N = 2 * N_DRAWS (16 cells), alpha = ALPHA_EACH, seed 4000.
    rng = np.random.default_rng(4000)
    n = 2 * N_DRAWS
    counts = np.zeros((4, 4), dtype=np.int64)
    for _ in range(n):
        x1 = int(rng.choice(4, p=Q1))
        x2 = int(rng.choice(4, p=Q2[x1]))
        q_rows = np.vstack([Q1, Q2[x1]])
        p_rows = np.vstack([P1, P2[x1], P3])
        n_accepted, token = verify_sampled([x1, x2], q_rows, p_rows, rng)
        emitted = [x1, x2][:n_accepted] + [token]
        if len(emitted) == 1:
            emitted.append(sample(P2[emitted[0]], rng))
        counts[emitted[0], emitted[1]] += 1
    joint = P1[:, None] * P2
    assert_follows(counts.ravel(), joint.ravel())


# --------------------------------------------------------------------------- negative


def _resample_from_p(draft_ids, q_probs, p_probs, rng):
    """WRONG: correct acceptance, but a rejection resamples from p, not the residual."""
    x = draft_ids[0]
    if rng.random() * q_probs[0, x] < p_probs[0, x]:
        return 1, sample(p_probs[1], rng)
    return 0, sample(p_probs[0], rng)


def _always_accept(draft_ids, q_probs, p_probs, rng):
    """WRONG: trusts the draft (emits x ~ q)."""
    rng.random()
    return 1, sample(p_probs[1], rng)


def _inverted_ratio(draft_ids, q_probs, p_probs, rng):
    """WRONG: accepts with min(1, q(x)/p(x)) instead of min(1, p(x)/q(x))."""
    x = draft_ids[0]
    if rng.random() * p_probs[0, x] < q_probs[0, x]:
        return 1, sample(p_probs[1], rng)
    return 0, sample(residual(p_probs[0], q_probs[0]), rng)


NEGATIVE_P = np.array([0.6, 0.3, 0.1])
NEGATIVE_Q = np.array([0.1, 0.3, 0.6])


@pytest.mark.parametrize("wrong", [_resample_from_p, _always_accept, _inverted_ratio])
def test_negative_control_wrong_sampler_is_rejected(wrong):
    # Same helpers, same N = N_DRAWS, same ALPHA_EACH as the positive tests, on the
    # "reversed" pair that the correct sampler passes above. These samplers emit
    # [0.4, 0.45, 0.15], q = [0.1, 0.3, 0.6] and q again instead of p = [0.6, 0.3, 0.1].
    counts = first_token_counts(wrong, NEGATIVE_P, NEGATIVE_Q, N_DRAWS, np.random.default_rng(5))
    assert gof_pvalue(counts, NEGATIVE_P) < ALPHA_EACH


def test_negative_control_subtle_error_is_rejected():
    # A milder bug: a rejection resamples from the average of p and the residual. The
    # emitted distribution moves by TV/2 * (p - residual); for the "mild" pair (TV = 0.2,
    # residual = [1, 0, 0]) it is [0.45, 0.33, 0.22] instead of [0.5, 0.3, 0.2], a shift
    # of 0.02-0.05 per token, which the same helpers at N = N_DRAWS must detect at
    # ALPHA_EACH (the correct sampler passes this pair in test_first_token_follows_p).
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.3, 0.3, 0.4])

    def half_residual(draft_ids, q_probs, p_probs, rng):
        x = draft_ids[0]
        if rng.random() * q_probs[0, x] < p_probs[0, x]:
            return 1, sample(p_probs[1], rng)
        return 0, sample(0.5 * p_probs[0] + 0.5 * residual(p_probs[0], q_probs[0]), rng)

    counts = first_token_counts(half_residual, p, q, N_DRAWS, np.random.default_rng(6))
    assert gof_pvalue(counts, p) < ALPHA_EACH


# --------------------------------------------------------------------------- the helper itself


def test_gof_pvalue_helper_edge_cases():
    p = np.array([0.5, 0.5, 0.0])
    assert gof_pvalue(np.array([50, 50, 1]), p) == 0.0  # impossible token observed
    assert gof_pvalue(np.array([50, 50, 0]), p) == pytest.approx(1.0)
    assert gof_pvalue(np.array([10, 0, 0]), np.array([1.0, 0.0, 0.0])) == 1.0
    # Tiny cells are pooled: 1e-9 expected counts do not blow the statistic up.
    tiny = np.array([0.5 - 1e-9, 0.5, 1e-9])
    assert gof_pvalue(np.array([500, 500, 0]), tiny) > 0.5
    assert gof_pvalue(np.array([500, 499, 1]), tiny) > 0.5
    assert gof_pvalue(np.array([900, 100, 0]), tiny) < 1e-12
    # All but a sliver on one token: exact binomial on the sliver.
    sliver = np.array([1e-6, 1 - 2e-6, 1e-6])
    assert gof_pvalue(np.array([0, 10_000, 0]), sliver) == pytest.approx(1.0)
    assert gof_pvalue(np.array([2, 9_995, 3]), sliver) < 1e-9
