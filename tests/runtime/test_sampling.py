"""Unit tests for runtime/sampling.py and runtime/speculative.py on hand-built inputs.

Statistical claims (the emitted token follows p) live in test_exactness.py; here every
expectation is exact or a certainty (an event of probability 0 or 1 checked many times).
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime.probs import SparseProbs, as_sparse, sample
from specedge.runtime.sampling import process_logits, process_row
from specedge.runtime.speculative import residual, verify_greedy, verify_sampled


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def hf_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Straight transcription of HF's Temperature -> TopK -> TopP warpers, then softmax.

    TopK: ``scores < topk(scores, k)[..., -1]`` removed. TopP: ascending sort, cumulative
    softmax, remove ``cum <= 1 - top_p``, keep the last. Stable sort for a defined tie
    order. Full sorts everywhere: slow and obviously right.
    """
    x = np.array(logits, dtype=np.float64, ndmin=2) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(x, axis=-1, kind="stable")
        cum = np.cumsum(softmax(np.take_along_axis(x, order, axis=-1)), axis=-1)
        remove_sorted = cum <= 1.0 - top_p
        remove_sorted[:, -1] = False
        remove = np.empty_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        x = np.where(remove, -np.inf, x)
    return softmax(x).reshape(np.shape(logits))


class FixedUniform:
    """Stand-in for np.random.Generator whose ``random()`` returns preset values."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


# --------------------------------------------------------------------------- process_logits


def test_output_shape_dtype_and_normalisation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 17)).astype(np.float32)
    probs = process_logits(logits, 0.8, top_k=5, top_p=0.9)
    assert probs.shape == (3, 17) and probs.dtype == np.float64
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    one = process_logits(logits[1], 0.8, top_k=5, top_p=0.9)
    assert one.shape == (17,)
    np.testing.assert_array_equal(one, probs[1])


def test_input_is_not_modified():
    logits = np.array([1.0, 2.0, 3.0])
    process_logits(logits, 0.5, top_k=2, top_p=0.5)
    np.testing.assert_array_equal(logits, [1.0, 2.0, 3.0])


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 2.0, 10.0])
def test_temperature_divides_logits(temperature):
    logits = np.random.default_rng(1).normal(size=(4, 50)) * 3
    np.testing.assert_allclose(
        process_logits(logits, temperature), softmax(logits / temperature), rtol=1e-12, atol=0
    )


def test_temperature_sharpens_and_flattens():
    logits = np.array([2.0, 1.0, 0.0, -1.0])

    def entropy(p: np.ndarray) -> float:
        return float(-(p * np.log(p)).sum())

    cold, plain, hot = (process_logits(logits, t) for t in (0.5, 1.0, 2.0))
    assert entropy(cold) < entropy(plain) < entropy(hot)


def test_huge_logits_and_tiny_temperature_are_stable():
    probs = process_logits(np.array([1e4, 1e4 - 1.0, -1e4]), 1.0)
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs[:2], softmax(np.array([0.0, -1.0])), rtol=1e-12)
    # l / T would overflow to +inf; the max-shift keeps it a one-hot at the argmax.
    probs = process_logits(np.array([1.0, 3.0, 2.0]), 1e-308)
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0])


def test_top_k_keeps_k_largest():
    logits = np.array([0.5, 3.0, -1.0, 2.0, 1.0])
    probs = process_logits(logits, 1.0, top_k=2)
    expected = np.zeros(5)
    expected[[1, 3]] = softmax(np.array([3.0, 2.0]))
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=0)


def test_top_k_keeps_ties_at_the_boundary():
    # HF removes scores < k-th largest, so every token tied with the k-th value survives.
    logits = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    probs = process_logits(logits, 1.0, top_k=2)
    np.testing.assert_allclose(probs, [0, 1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-12, atol=0)
    probs = process_logits(np.array([5.0, 2.0, 2.0, 1.0]), 1.0, top_k=2)
    assert (probs > 0).tolist() == [True, True, True, False]


def test_top_k_one_is_argmax_unless_tied():
    logits = np.array([0.1, 0.7, 0.3])
    np.testing.assert_array_equal(process_logits(logits, 0.7, top_k=1), [0.0, 1.0, 0.0])
    np.testing.assert_allclose(
        process_logits(np.array([0.7, 0.1, 0.7]), 1.0, top_k=1), [0.5, 0.0, 0.5]
    )


@pytest.mark.parametrize("top_k", [0, 6, 7, 1000])
def test_top_k_zero_or_at_least_vocab_is_a_no_op(top_k):
    logits = np.random.default_rng(2).normal(size=(2, 6))
    np.testing.assert_allclose(
        process_logits(logits, 0.9, top_k=top_k), softmax(logits / 0.9), rtol=1e-12, atol=0
    )


def test_top_p_hand_computed():
    # probs [0.5, 0.3, 0.15, 0.05], top_p 0.75: ascending cum = [0.05, 0.2, 0.5, 1.0];
    # drop cum <= 0.25, i.e. the 0.05 and 0.15 tokens.
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(
        process_logits(logits, 1.0, top_p=0.75), [0.5 / 0.8, 0.3 / 0.8, 0, 0], rtol=1e-12
    )
    # top_p 0.4: drop cum <= 0.6 -> only the 0.5 token survives.
    np.testing.assert_array_equal(process_logits(logits, 1.0, top_p=0.4), [1.0, 0, 0, 0])


@pytest.mark.parametrize("top_p", [0.0, 1e-12, 1e-6])
def test_tiny_top_p_keeps_only_argmax(top_p):
    logits = np.random.default_rng(3).normal(size=(5, 300))
    probs = process_logits(logits, 1.3, top_p=top_p)
    expected = np.zeros_like(probs)
    expected[np.arange(5), logits.argmax(axis=-1)] = 1.0
    np.testing.assert_array_equal(probs, expected)


@pytest.mark.parametrize(
    ("vocab", "scale", "temperature", "top_k", "top_p"),
    [
        (10, 1.0, 0.7, 0, 0.9),
        (10, 1.0, 0.7, 5, 0.9),
        (50, 3.0, 1.0, 0, 0.5),
        (50, 3.0, 1.0, 20, 0.95),
        (2000, 2.0, 0.8, 0, 0.9),  # few candidates: the threshold path
        (3000, 0.3, 2.0, 0, 0.999),  # flat: candidates are most of the row, full sort
        (49152, 4.0, 0.7, 0, 0.9),  # an LM-sized row
        (3000, 4.0, 0.6, 100, 0.8),
        (3000, 4.0, 0.6, 2999, 0.3),
    ],
)
def test_matches_hf_reference_on_random_logits(vocab, scale, temperature, top_k, top_p):
    rng = np.random.default_rng(vocab + top_k)
    for _ in range(20):
        logits = rng.normal(size=(int(rng.integers(1, 10)), vocab)) * scale
        got = process_logits(logits, temperature, top_k=top_k, top_p=top_p)
        want = hf_reference(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_matches_hf_reference_with_ties_and_masks():
    # Coarsely rounded logits make ties everywhere; masked entries and every top-k /
    # top-p setting on small vocabularies: the stable tie order must agree too.
    rng = np.random.default_rng(4)
    for _ in range(500):
        vocab = int(rng.integers(2, 30))
        logits = np.round(rng.normal(size=(int(rng.integers(1, 5)), vocab)) * 2)
        logits[rng.random(logits.shape) < 0.2] = -np.inf
        logits[:, 0] = np.where(np.isfinite(logits).any(axis=1), logits[:, 0], 0.0)
        temperature = float(rng.choice([0.3, 1.0, 1.7]))
        top_k = int(rng.integers(0, vocab + 2))
        top_p = float(rng.choice([0.0, 0.3, 0.5, 0.9, 1.0]))
        got = process_logits(logits, temperature, top_k=top_k, top_p=top_p)
        want = hf_reference(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_matches_hf_reference_with_ties_among_the_candidates():
    # A large, peaked row whose top tokens tie (logits rounded to 0.5): the candidate set
    # of the threshold path must keep or drop each tie whole, as a full stable sort does.
    rng = np.random.default_rng(5)
    for top_p in (0.3, 0.8, 0.95):
        logits = np.round(rng.normal(size=(3, 49152)) * 3 * 2) / 2
        logits[:, rng.integers(0, 49152, 40)] += 10
        got = process_logits(logits, 0.8, top_p=top_p)
        want = hf_reference(logits, 0.8, 0, top_p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("top", [[0.6, 0.35],            # the narrow candidates decide
                                 [0.5] + [0.45 / 300] * 300,  # too few: the wider bound
                                 [0.9 / 200] * 200])      # none holds 1/128 of Z
def test_top_p_candidate_bounds_from_narrow_to_wide(top):
    # Top-p sorts the tokens above a bound and widens it until they cover top_p Z
    # (sampling._nucleus): each of these rows stops at another bound, two with a tie of
    # hundreds of tokens across the nucleus's edge; all must match the full sort.
    vocab = 49152
    probs = np.concatenate([top, np.full(vocab - len(top), (1 - sum(top)) / (vocab - len(top)))])
    logits = np.log(probs)[np.random.default_rng(6).permutation(vocab)]
    for temperature in (1.0, 0.7):
        got = process_logits(logits, temperature, top_p=0.9)
        want = hf_reference(logits, temperature, 0, 0.9)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_order_temperature_before_top_p():
    # probs [0.6, 0.3, 0.1], top_p 0.8. At T = 1 top-p keeps {0, 1}; after T = 0.25 the
    # distribution is [0.94, 0.059, 0.0007], cum = [0.0007, 0.06, 1] <= 0.2 -> only {0}.
    # The opposite order (top-p, then temperature) would keep two tokens.
    logits = np.log([0.6, 0.3, 0.1])
    assert (process_logits(logits, 1.0, top_p=0.8) > 0).tolist() == [True, True, False]
    np.testing.assert_array_equal(process_logits(logits, 0.25, top_p=0.8), [1.0, 0.0, 0.0])


def test_order_top_k_before_top_p():
    # probs [0.4, 0.3, 0.2, 0.1]. HF order: top-k 2 -> [0.571, 0.429]; top-p 0.5 drops
    # cum 0.429 <= 0.5 -> only token 0. Top-p first would keep {0, 1}.
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    np.testing.assert_array_equal(process_logits(logits, 1.0, top_k=2, top_p=0.5), [1, 0, 0, 0])
    np.testing.assert_allclose(
        process_logits(logits, 1.0, top_k=2, top_p=0.7), [0.4 / 0.7, 0.3 / 0.7, 0, 0]
    )


def test_full_composition_against_manual_steps():
    logits = np.array([2.0, 1.5, 1.2, 0.3, -0.5, -2.0, 0.9, 1.9])
    t_scaled = logits / 0.7
    kth = np.sort(t_scaled)[-5]
    after_k = np.where(t_scaled < kth, -np.inf, t_scaled)
    np.testing.assert_allclose(
        process_logits(logits, 0.7, top_k=5, top_p=0.9), hf_reference(after_k, 1.0, 0, 0.9)
    )


def test_minus_inf_logits_are_masked():
    logits = np.array([-np.inf, 1.0, -np.inf, 0.0])
    probs = process_logits(logits, 0.5)
    assert probs[0] == 0.0 and probs[2] == 0.0
    np.testing.assert_allclose(probs[[1, 3]], softmax(np.array([2.0, 0.0])))
    # Fewer unmasked tokens than top_k: nothing more to drop, masks stay.
    np.testing.assert_array_equal(process_logits(logits, 1.0, top_k=3) > 0, [0, 1, 0, 1])
    np.testing.assert_array_equal(process_logits(logits, 1.0, top_p=0.5) > 0, [0, 1, 0, 0])


def test_mostly_masked_rows():
    # Large vocabularies with a narrow allow-list take the compacted top-k path.
    rng = np.random.default_rng(5)
    logits = np.full((3, 5000), -np.inf)
    allowed = [rng.choice(5000, size=n, replace=False) for n in (40, 7, 300)]
    for row, cols in enumerate(allowed):
        logits[row, cols] = rng.normal(size=cols.size)
    for top_k, top_p in [(10, 1.0), (10, 0.8), (0, 0.8), (500, 0.95)]:
        got = process_logits(logits, 0.9, top_k=top_k, top_p=top_p)
        want = hf_reference(logits, 0.9, top_k, top_p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)
    # A distilled draft's head: a sixth of the vocabulary, rounded logits (ties), top-p only.
    head = np.full((2, 6000), -np.inf)
    for row in range(2):
        cols = rng.choice(6000, size=1000, replace=False)
        head[row, cols] = np.round(rng.normal(size=1000) * 3)
    for top_p in (0.3, 0.9, 0.99):
        got = process_logits(head, 0.7, top_p=top_p)
        want = hf_reference(head, 0.7, 0, top_p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_float32_logits_match_the_reference_on_their_values():
    # Backends return float32 rows; top-p then reads them without a float64 copy.
    rng = np.random.default_rng(6)
    for top_k, top_p in [(0, 0.9), (0, 0.5), (0, 0.999), (50, 0.9)]:
        logits = (rng.normal(size=(4, 49152)) * 4).astype(np.float32)
        got = process_logits(logits, 0.7, top_k=top_k, top_p=top_p)
        want = hf_reference(logits.astype(np.float64), 0.7, top_k, top_p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)
        np.testing.assert_array_equal(got[1], process_logits(logits[1], 0.7, top_k, top_p))


@pytest.mark.parametrize("small", [0, 10**9])
def test_python_and_numpy_walks_of_short_rows_agree_bit_for_bit(monkeypatch, small):
    # Top-p ranks and sums short candidate lists, and sample walks short supports, in plain
    # Python floats (sampling.SMALL); longer ones in numpy. Forcing every list down one
    # path or the other must give the same probabilities and the same draws, ties included.
    from specedge.runtime import sampling

    rng = np.random.default_rng(11)
    logits = np.round(rng.normal(size=(6, 5000)) * 6) / 2  # ties everywhere
    logits[:, rng.integers(0, 5000, 30)] += 8
    rows = [(logits, 0.8, 0.9), (logits.astype(np.float32), 0.7, 0.5),
            (logits * 0.05, 1.0, 0.95)]  # flat: hundreds of candidates
    want = [process_logits(x, t, top_p=p) for x, t, p in rows]
    draws = [[sample(as_sparse(r), np.random.default_rng(j)) for j, r in enumerate(w)]
             for w in want]
    monkeypatch.setattr(sampling, "SMALL", small)
    for (x, t, p), w, d in zip(rows, want, draws):
        got = process_logits(x, t, top_p=p)
        np.testing.assert_array_equal(got, w)
        assert [sample(as_sparse(r), np.random.default_rng(j))
                for j, r in enumerate(got)] == d
        for r in got:
            sparse = as_sparse(r)
            for tok in (int(sparse.ids[0]), int(sparse.ids[-1]), 4999, 0):
                assert sparse.at(tok) == r[tok]


def test_float16_logits_keep_every_candidate():
    # The candidates' cut is compared in the row's dtype; float16 rounds it most coarsely.
    rng = np.random.default_rng(12)
    logits = (rng.normal(size=(4, 49152)) * 4).astype(np.float16)
    for top_p in (0.9, 0.999):
        got = process_logits(logits, 0.7, top_p=top_p)
        want = hf_reference(logits.astype(np.float64), 0.7, 0, top_p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_integer_logits_are_read_as_floats():
    for top_p in (1.0, 0.9):
        np.testing.assert_allclose(process_logits([1, 2, 3], 1.0, top_p=top_p),
                                   hf_reference(np.array([1.0, 2.0, 3.0]), 1.0, 0, top_p))


def test_top_p_decisions_too_close_for_the_estimate_use_the_exact_total(monkeypatch):
    # p = [0.45, 0.45, 0.1 - 1e-7, 1e-7 spread over many tokens], top_p = 0.9: the third
    # token's mass above, 0.9 Z, sits within the float32 estimate's tolerance of top_p Z,
    # so the exact float64 total must decide, as the reference does.
    from specedge.runtime import sampling

    calls = []
    nucleus = sampling._nucleus
    monkeypatch.setattr(sampling, "_nucleus",
                        lambda *a: calls.append(a[-1]) or nucleus(*a))
    tail = 2000
    probs = np.concatenate([[0.45, 0.45, 0.1 - 1e-7], np.full(tail, 1e-7 / tail)])
    for eps in (0.0, 1e-9, -1e-9):
        logits = np.log(probs * np.exp(np.r_[0, 0, eps, np.zeros(tail)]))
        calls.clear()
        got = process_logits(logits, 1.0, top_p=0.9)
        assert calls == [1e-5, 0.0]  # the estimate could not decide; the exact path did
        want = hf_reference(logits, 1.0, 0, 0.9)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_all_masked_row_raises():
    logits = np.zeros((3, 4))
    logits[1] = -np.inf
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] are all-masked"):
        process_logits(logits, 1.0)
    with pytest.raises(ValueError, match="all-masked"):
        process_logits(np.full(5, -np.inf), 0.7, top_k=2, top_p=0.9)


def test_nan_and_plus_inf_raise():
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] contain NaN"):
        process_logits(np.array([[0.0, np.nan, 1.0], [0.0, 1.0, 2.0]]), 1.0)
    with pytest.raises(ValueError, match="NaN"):
        process_logits(np.array([np.nan, -np.inf]), 1.0)
    with pytest.raises(ValueError, match=r"\+inf"):
        process_logits(np.array([0.0, np.inf]), 1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": -0.1}, "top_p"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        process_logits(np.zeros(4), **kwargs)


def test_bad_shape_raises():
    with pytest.raises(ValueError, match="shape"):
        process_logits(np.zeros((2, 2, 2)), 1.0)


# --------------------------------------------------------------------------- sample


def test_sample_never_draws_zero_probability_tokens():
    p = np.array([0.0, 0.25, 0.0, 0.0, 0.5, 0.0, 0.25, 0.0])
    rng = np.random.default_rng(6)
    draws = np.array([sample(p, rng) for _ in range(10_000)])
    counts = np.bincount(draws, minlength=p.size)
    assert counts[p == 0].sum() == 0
    assert (counts[p > 0] > 2000).all()


def test_sample_extreme_uniforms_land_on_nonzero_tokens():
    p = np.array([0.0, 0.0, 0.3, 0.7, 0.0, 0.0])
    largest_u = np.nextafter(1.0, 0.0)
    assert sample(p, FixedUniform(0.0)) == 2
    assert sample(p, FixedUniform(largest_u)) == 3
    assert sample(np.array([0.0, 1e-300, 0.0]), FixedUniform(largest_u)) == 1
    # Unnormalised input is fine: the target point is scaled by the total.
    assert sample(np.array([0.0, 2.0, 6.0, 0.0]), FixedUniform(0.26)) == 2


def test_sample_uses_exactly_one_uniform():
    p = np.array([0.2, 0.5, 0.3])
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    sample(p, a)
    b.random()
    assert a.random() == b.random()


@pytest.mark.parametrize(
    "probs", [np.zeros(3), np.array([0.5, np.nan]), np.ones((2, 2)) / 4, np.array([])]
)
def test_sample_rejects_invalid_input(probs):
    with pytest.raises(ValueError):
        sample(probs, np.random.default_rng(0))


# --------------------------------------------------------------------------- residual


def test_residual_is_normalised_positive_part():
    p = np.array([0.5, 0.2, 0.2, 0.1])
    q = np.array([0.1, 0.4, 0.2, 0.3])
    np.testing.assert_allclose(residual(p, q), [1.0, 0, 0, 0])
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.2, 0.1, 0.3, 0.4])
    np.testing.assert_allclose(residual(p, q), [0.6, 0.4, 0, 0])


def test_residual_of_equal_distributions_is_p():
    p = np.array([0.1, 0.6, 0.3])
    np.testing.assert_array_equal(residual(p, p.copy()), p)


def test_residual_disjoint_supports_is_p():
    p = np.array([0.7, 0.3, 0.0, 0.0])
    q = np.array([0.0, 0.0, 0.4, 0.6])
    np.testing.assert_allclose(residual(p, q), p, rtol=1e-15)


def test_residual_support_inside_p_after_filtering():
    rng = np.random.default_rng(8)
    for _ in range(200):
        logits = rng.normal(size=12)
        p = process_logits(logits, 0.7, top_k=4, top_p=0.9)
        q = process_logits(logits + rng.normal(size=12), 0.7, top_k=4, top_p=0.9)
        r = residual(p, q)
        assert (r[p == 0] == 0).all()
        assert abs(r.sum() - 1.0) < 1e-12


# --------------------------------------------------------------------------- verify_greedy


def test_verify_greedy_k0_is_bonus_argmax():
    assert verify_greedy([], np.array([[0.1, 0.9, 0.3]])) == (0, 1)


def test_verify_greedy_full_accept_gives_bonus():
    logits = np.eye(5)[[3, 1, 4, 2]]  # argmaxes 3, 1, 4 | bonus 2
    assert verify_greedy([3, 1, 4], logits) == (3, 2)


@pytest.mark.parametrize(("drafts", "expected"), [([0, 1, 4], (0, 3)), ([3, 0, 4], (1, 1))])
def test_verify_greedy_first_mismatch_gives_correction(drafts, expected):
    logits = np.eye(5)[[3, 1, 4, 2]]
    assert verify_greedy(drafts, logits) == expected


def test_verify_greedy_tie_takes_lowest_id():
    logits = np.array([[0.0, 2.0, 2.0], [1.0, 1.0, 0.0]])
    assert verify_greedy([2], logits) == (0, 1)
    assert verify_greedy([1], logits) == (1, 0)
    assert verify_greedy(np.array([1]), logits) == (1, 0)


def test_verify_greedy_rejects_bad_rows_and_shapes():
    with pytest.raises(ValueError, match="shape"):
        verify_greedy([1, 2], np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        verify_greedy([0], np.array([[1.0, 0.0], [np.nan, 0.0]]))
    with pytest.raises(ValueError, match="all-masked"):
        verify_greedy([], np.full((1, 3), -np.inf))


# --------------------------------------------------------------------------- verify_sampled


def test_verify_sampled_p_equals_q_always_accepts():
    rng = np.random.default_rng(9)
    q = np.random.default_rng(10).dirichlet(np.ones(6), size=3)
    p = np.vstack([q, np.full((1, 6), 1 / 6)])
    for _ in range(2000):
        drafts = [int(rng.integers(6)) for _ in range(3)]
        assert verify_sampled(drafts, q, p, rng)[0] == 3


def test_verify_sampled_disjoint_supports_always_rejects_at_zero():
    p = np.array([[0.6, 0.4, 0.0, 0.0], [0.25] * 4])
    q = np.array([[0.0, 0.0, 0.5, 0.5]])
    rng = np.random.default_rng(11)
    out = [verify_sampled([int(rng.integers(2, 4))], q, p, rng) for _ in range(2000)]
    assert {n for n, _ in out} == {0}
    assert {t for _, t in out} == {0, 1}  # the residual is p itself


def test_verify_sampled_tiny_q_accepts():
    # p(x) / q(x) = 3e11: accepted for every u in [0, 1), including the largest one.
    p = np.array([[0.2, 0.3, 0.5], [1 / 3] * 3])
    q = np.array([[1e-12, 0.5, 0.5 - 1e-12]])
    assert verify_sampled([0], q, p, FixedUniform(np.nextafter(1.0, 0.0), 0.5)) == (1, 1)
    rng = np.random.default_rng(12)
    assert all(verify_sampled([0], q, p, rng)[0] == 1 for _ in range(2000))


def test_verify_sampled_never_accepts_token_removed_by_filtering():
    logits = np.array([3.0, 2.5, 2.0, 1.0, 0.5, 0.0])
    p_row = process_logits(logits, 0.7, top_k=3, top_p=0.9)
    q_row = process_logits(logits[::-1].copy(), 0.7)  # the draft loves token 5
    assert p_row[5] == 0.0 and q_row[5] > 0.5
    p = np.vstack([p_row, p_row])
    rng = np.random.default_rng(13)
    for q in (q_row[None], None):
        for _ in range(2000):
            n, tok = verify_sampled([5], q, p, rng)
            assert n == 0 and p_row[tok] > 0
    # Even the smallest uniform cannot accept it.
    assert verify_sampled([5], q_row[None], p, FixedUniform(0.0, 0.5))[0] == 0


@pytest.mark.parametrize("q", [np.array([[0.9, 0.05, 0.05]]), None])
def test_kernel_twin_never_accepts_a_zero_probability_draft_at_u_zero(q):
    """The kernels' numpy twin (device_sampling.sampled_verify_reference, the reference of
    specedge/gpu_check/sampling.py) accepts iff u * q(x) < p(x), strictly: at u = 0, which
    rng.random() can return, a token the target gives p(x) = 0 must still be rejected."""
    from specedge.runtime.backends.device_sampling import sampled_verify_reference

    p = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    n, token = sampled_verify_reference([0], q, p, np.array([0.0, 0.0]))
    assert n == 0 and p[0, token] > 0


def test_verify_sampled_k0_samples_the_bonus_row():
    p = np.array([[0.0, 0.0, 1.0]])
    rng = np.random.default_rng(14)
    assert verify_sampled([], None, p, rng) == (0, 2)
    assert verify_sampled([], np.zeros((0, 3)), p, rng) == (0, 2)


def test_verify_sampled_one_hot_none_matches_explicit_one_hot():
    rng = np.random.default_rng(15)
    vocab, k = 7, 4
    for seed in range(300):
        p = rng.dirichlet(np.full(vocab, 0.5), size=k + 1)
        drafts = rng.integers(vocab, size=k).tolist()
        one_hot = np.eye(vocab)[drafts]
        got_none = verify_sampled(drafts, None, p, np.random.default_rng(seed))
        got_explicit = verify_sampled(drafts, one_hot, p, np.random.default_rng(seed))
        assert got_none == got_explicit


def test_verify_sampled_uniform_budget():
    # One uniform per examined draft plus one for the emitted sample.
    p = np.array([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.2, 0.8]])
    q = p[:3].copy()
    a, b = np.random.default_rng(16), np.random.default_rng(16)
    assert verify_sampled([0, 1, 0], q, p, a)[0] == 3
    b.random(4)
    assert a.random() == b.random()

    p = np.array([[1.0, 0.0], [0.5, 0.5]])
    a, b = np.random.default_rng(17), np.random.default_rng(17)
    assert verify_sampled([1], np.array([[0.0, 1.0]]), p, a) == (0, 0)
    b.random(2)
    assert a.random() == b.random()


def test_verify_sampled_reads_rows_on_demand():
    # Rows given as a sequence are read in order and no further than needed, with the same
    # result and uniforms as the array.
    class Rows:
        def __init__(self, rows):
            self.rows, self.read = rows, set()

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            self.read.add(i)
            return self.rows[i]

    rng = np.random.default_rng(21)
    for seed in range(200):
        p = rng.dirichlet(np.full(6, 0.5), size=4)
        q = rng.dirichlet(np.full(6, 0.5), size=3)
        drafts = rng.integers(6, size=3).tolist()
        rows = Rows(p)
        got = verify_sampled(drafts, list(q), rows, np.random.default_rng(seed))
        assert got == verify_sampled(drafts, q, p, np.random.default_rng(seed))
        assert rows.read == set(range(got[0] + 1))


def test_verify_sampled_is_reproducible():
    rng = np.random.default_rng(18)
    p = rng.dirichlet(np.ones(9), size=5)
    q = rng.dirichlet(np.ones(9), size=4)
    drafts = [1, 5, 2, 7]
    runs = [
        [verify_sampled(drafts, q, p, g) for _ in range(50)]
        for g in (np.random.default_rng(19), np.random.default_rng(19))
    ]
    assert runs[0] == runs[1]


def test_verify_sampled_validates_inputs():
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="p_probs"):
        verify_sampled([0, 1], None, p, np.random.default_rng(0))
    with pytest.raises(ValueError, match="q_probs"):
        verify_sampled([0], np.full((1, 4), 0.25), p, np.random.default_rng(0))
    with pytest.raises(ValueError, match="draft token -1"):
        verify_sampled([-1], None, p, np.random.default_rng(0))
    with pytest.raises(ValueError, match="draft token 3"):
        verify_sampled([3], None, p, np.random.default_rng(0))


# --------------------------------------------------------------------------- SparseProbs


def lm_like_rows(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """float32 rows shaped like a language model's: a few large logits over a long tail,
    some rows with a masked part (a draft head over part of the vocabulary)."""
    rows = rng.normal(scale=2.0, size=(n, vocab))
    rows[:, :8] += rng.normal(scale=4.0, size=(n, 8)) + 8.0
    rows[::3, vocab // 2:] = -np.inf
    return rng.permuted(rows, axis=1).astype(np.float32)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(0.7, 0, 0.9), (1.3, 0, 0.5), (0.7, 40, 0.9), (0.7, 40, 1.0),
                          (0.9, 0, 1.0), (0.7, 0, 0.0)])
def test_process_row_is_process_logits_as_its_support(temperature, top_k, top_p):
    rows = lm_like_rows(np.random.default_rng(30), 40, 3000)
    for row in rows:
        dense = process_logits(row, temperature, top_k, top_p)
        sparse = process_row(row, temperature, top_k, top_p)
        assert sparse.vocab == row.size and (np.diff(sparse.ids) > 0).all()
        np.testing.assert_array_equal(sparse.dense(), dense)
        assert set(sparse.ids.tolist()) == set(np.flatnonzero(dense).tolist())
        np.testing.assert_array_equal(sparse.at(np.arange(row.size)), dense)


def test_process_row_validates_like_process_logits():
    with pytest.raises(ValueError, match="one row"):
        process_row(np.zeros((2, 4)), 1.0, top_p=0.9)
    with pytest.raises(ValueError, match="temperature"):
        process_row(np.zeros(4), 0.0, top_p=0.9)
    with pytest.raises(ValueError, match="all-masked"):
        process_row(np.full(4, -np.inf), 1.0, top_p=0.9)


def test_sparse_probs_at_and_as_sparse():
    sp = as_sparse(np.array([0.0, 0.25, 0.0, 0.75, 0.0]))
    np.testing.assert_array_equal(sp.ids, [1, 3])
    assert sp.at(3) == 0.75 and sp.at(4) == 0.0 and sp.at(0) == 0.0
    np.testing.assert_array_equal(sp.at(np.array([4, 1, 2])), [0.0, 0.25, 0.0])
    assert as_sparse(sp) is sp
    empty = SparseProbs(np.zeros(0, np.int64), np.zeros(0), 5)
    assert empty.at(2) == 0.0
    with pytest.raises(ValueError):
        sample(empty, np.random.default_rng(0))


def test_sparse_rows_draw_the_same_tokens_as_dense_rows():
    # sample, residual and verify_sampled on supports give the dense rows' results: the
    # same token for the same uniforms, so the exactness tests on dense rows cover them.
    rng = np.random.default_rng(31)
    rows = lm_like_rows(rng, 60, 2000)
    for seed in range(0, 60, 3):
        p = [process_row(r, 0.8, 0, 0.95) for r in rows[seed:seed + 3]]
        q = [process_row(r + rng.normal(scale=1.0, size=r.size).astype(np.float32), 0.8, 0,
                         0.95) for r in rows[seed:seed + 2]]
        pd, qd = [x.dense() for x in p], [x.dense() for x in q]
        for r_sparse, r_dense in ((residual(p[0], q[0]), residual(pd[0], qd[0])),
                                  (residual(p[0], qd[0]), residual(pd[0], qd[0])),
                                  (residual(p[0], p[0]), pd[0])):
            assert isinstance(r_sparse, SparseProbs)
            np.testing.assert_allclose(r_sparse.dense(), r_dense, rtol=1e-12, atol=1e-300)
        for s in range(20):
            assert sample(p[0], np.random.default_rng(s)) == sample(pd[0],
                                                                   np.random.default_rng(s))
            drafts = [sample(q[0], np.random.default_rng(s)),
                      sample(q[1], np.random.default_rng(s + 1))]
            for one_hot in (False, True):
                qs, qds = (None, None) if one_hot else (q, qd)
                got = verify_sampled(drafts, qs, p, np.random.default_rng(seed * 100 + s))
                assert got == verify_sampled(drafts, qds, pd,
                                             np.random.default_rng(seed * 100 + s))


# --------------------------------------------------------------------------- large vocabularies


def large_vocab_rows(rng: np.random.Generator, vocab: int) -> list[np.ndarray]:
    """float32 rows of a 128k-262k vocabulary, each shaped to take another path: peaked over
    a long normal tail (most of the row within top-p's float32 estimate), a flatter one whose
    nucleus holds thousands of tokens, a draft that scores 16384 tokens (the rest -inf), and
    coarse ties at the top."""
    peaked = rng.normal(0.0, 2.5, vocab)
    peaked[rng.choice(vocab, 20, replace=False)] += 6 + rng.exponential(4.0, 20)
    flat = rng.normal(0.0, 2.5, vocab)
    flat[rng.choice(vocab, 5, replace=False)] += 9
    draft = np.full(vocab, -np.inf)
    head = rng.choice(vocab, 16384, replace=False)
    draft[head] = rng.normal(0.0, 2.5, head.size)
    draft[head[:10]] += 10
    ties = np.round(rng.normal(0.0, 2.0, vocab) * 2) / 2
    ties[rng.choice(vocab, 60, replace=False)] = ties.max() + 4
    return [r.astype(np.float32) for r in (peaked, flat, draft, ties)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(0.8, 0, 1.0), (0.8, 50, 1.0), (1.3, 1000, 1.0), (0.8, 0, 0.95),
                          (0.6, 0, 0.5), (0.8, 50, 0.95)])
def test_large_vocabulary_rows_match_the_reference(temperature, top_k, top_p):
    # process_row's own paths at V = 131072 (temperature alone on a full support, top-k from
    # the k largest logits, top-p over the whole row) against HF's warpers, and bit for bit
    # against process_logits where that is the plain dense computation.
    for row in large_vocab_rows(np.random.default_rng(40), 131072):
        got = process_row(row, temperature, top_k, top_p)
        want = hf_reference(row.astype(np.float64), temperature, top_k, top_p)
        np.testing.assert_array_equal(got.ids, np.flatnonzero(want))
        np.testing.assert_allclose(got.dense(), want, rtol=1e-9, atol=1e-15)
        if top_p == 1.0:
            np.testing.assert_array_equal(got.dense(), process_logits(row, temperature, top_k))


def test_top_k_of_logits_near_zero_against_a_large_max_keeps_ties():
    # (l - m) / T may round two float32 logits far below |m| together; such a row goes down
    # process_logits' path, which keeps both (a tie at the k-th value).
    row = np.zeros(5000, np.float32)
    row[:3] = [30.0, 2e-16, 1e-16]  # 30 - 2e-16 == 30 - 1e-16 in float64
    row[3:] = -np.linspace(1.0, 5.0, 4997, dtype=np.float32)
    for k in (2, 3):
        got = process_row(row, 0.5, k)
        np.testing.assert_array_equal(got.dense(), process_logits(row, 0.5, k))
        assert got.ids.tolist() == [0, 1, 2]


def test_full_support_rows_draw_and_verify_as_dense_rows():
    # Temperature alone keeps every token; such a row answers at(), residual(), sample()
    # and verify_sampled() as its dense row does, bit for bit, with sparse or full q.
    rng = np.random.default_rng(41)
    rows = lm_like_rows(rng, 12, 4000)[1::3]  # no masked part: full supports
    p = [process_row(r, 0.9) for r in rows]
    assert all(x.ids.size == 4000 for x in p)
    q_full = [process_row(r + rng.normal(size=r.size).astype(np.float32), 0.9) for r in rows]
    q_top = [process_row(r, 0.9, 0, 0.8) for r in rows]
    for i in range(len(rows) - 1):
        pd = p[i].dense()
        np.testing.assert_array_equal(p[i].at(np.arange(4000)), pd)
        assert p[i].at(17) == pd[17] and isinstance(p[i].at(17), float)
        for q in (q_full[i], q_top[i]):
            np.testing.assert_array_equal(residual(p[i], q).dense(), residual(pd, q.dense()))
        for s in range(10):
            assert sample(p[i], np.random.default_rng(s)) == sample(pd, np.random.default_rng(s))
            for qs in (q_full, q_top):
                pair = qs[i:i + 2]
                drafts = [sample(x, np.random.default_rng(s + j)) for j, x in enumerate(pair)]
                rows_p = p[i:i + 3] if i + 3 <= len(p) else [*p[i:], p[0]]
                got = verify_sampled(drafts, pair, rows_p, np.random.default_rng(s))
                assert got == verify_sampled(drafts, [x.dense() for x in pair],
                                             [x.dense() for x in rows_p],
                                             np.random.default_rng(s))


def test_top_p_sorts_a_few_hundred_tokens_when_narrow_falls_just_short(monkeypatch):
    # At V = 262144 the bound (1 - top_p) Z / V takes in most of a long tail; a nucleus of a
    # few hundred tokens that NARROW's candidates do not cover is found at NARROW^2 instead,
    # without sorting the tail.
    from specedge.runtime import sampling

    vocab = 262144
    rng = np.random.default_rng(42)
    # a tail of 0.085 over half the vocabulary: each token above (1 - top_p) / V
    half = (vocab - 301) // 2
    tail = np.concatenate([rng.uniform(0.8, 1.2, half) * 0.085 / half,
                           rng.uniform(0.0, 1.0, vocab - 301 - half) * 1e-9])
    probs = np.concatenate([[0.5], np.full(300, 0.415 / 300), tail])
    logits = np.log(probs / probs.sum())[rng.permutation(vocab)].astype(np.float32)
    want = hf_reference(logits.astype(np.float64), 1.0, 0, 0.9)
    sorted_sizes = []
    real_argsort = np.argsort

    def argsort(a, *args, **kwargs):
        sorted_sizes.append(np.size(a))
        return real_argsort(a, *args, **kwargs)

    monkeypatch.setattr(sampling.np, "argsort", argsort)
    got = process_row(logits, 1.0, 0, 0.9)
    monkeypatch.undo()
    np.testing.assert_array_equal(got.ids, np.flatnonzero(want))
    np.testing.assert_allclose(got.dense(), want, rtol=1e-9, atol=1e-15)
    assert max(sorted_sizes, default=0) <= 1000, sorted_sizes


@pytest.mark.parametrize("kwargs", [dict(top_k=-1), dict(top_k=-1, top_p=1.0),
                                    dict(temperature=0.0), dict(top_p=1.5)])
def test_process_row_refuses_bad_settings_on_every_path(kwargs):
    # Temperature alone and top-k alone have paths of their own in process_row; each
    # refuses what process_logits refuses.
    settings = dict(temperature=0.8, top_k=0, top_p=1.0) | kwargs
    row = np.linspace(-3.0, 3.0, 400, dtype=np.float32)
    with pytest.raises(ValueError):
        process_logits(row, **settings)
    with pytest.raises(ValueError):
        process_row(row, **settings)


def test_top_k_candidates_hold_the_k_largest():
    # Top-k partitions only the values above a threshold taken from every 64th value
    # (sampling._above_kth); they must include the k largest, ties at the k-th too, or be
    # the whole row when the sample misleads (here: the largest values on sampled positions).
    from specedge.runtime.sampling import _above_kth

    rng = np.random.default_rng(43)
    for k in (1, 50, 1000):
        for row in (rng.normal(size=262144).astype(np.float32),
                    np.round(rng.normal(size=131072) * 2).astype(np.float32)):
            got = _above_kth(row, k)
            assert got.size >= k and got.size < row.size
            kth = np.partition(row, row.size - k)[row.size - k]
            assert np.count_nonzero(got >= kth) == np.count_nonzero(row >= kth)
    row = np.zeros(262144, np.float32)
    row[::64] = 1.0  # the sample sees only these: its threshold passes 4096 of them
    assert _above_kth(row, 5000) is row
