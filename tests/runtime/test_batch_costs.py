"""Auto K in a batch (runtime/drafting/batch_costs.py): call costs fitted as a fixed part
plus a part per token-row, and the K they make best falling as the batch grows."""

from __future__ import annotations

import pytest

from specedge.runtime.drafting.auto_k import PROBE_EVERY, StepHistory, auto_k, best_k
from specedge.runtime.drafting.batch_costs import BatchCosts, BatchHistories, LinearCost

# Target calls of SmolLM2 int4 on 2 cores (rows, tokens a row, ms), as measured for
# docs/MEASUREMENTS.md, and draft calls of 1.5 ms + 0.5 ms a row.
CALLS = [(1, 2, 18.5), (2, 1, 15.2), (4, 1, 20.5), (4, 2, 31.9), (4, 3, 36.5), (4, 4, 44.1),
         (8, 1, 36.3), (8, 2, 53.0), (8, 3, 72.0)]


def measured() -> BatchCosts:
    costs = BatchCosts()
    for rows, t, ms in CALLS:
        costs.observe(True, rows, t, ms / 1000)
    for rows in (1, 2, 4, 8):
        costs.observe(False, rows, 1, (1.5 + 0.5 * rows) / 1000)
    return costs


def test_a_linear_cost_is_fitted_from_two_sizes_on():
    cost = LinearCost()
    assert cost.fit() is None and cost(4) is None
    cost.observe(2, 0.010)
    cost.observe(2, 0.012)
    assert cost.fit() is None  # one size: no slope to fit
    cost.observe(6, 0.019)
    fixed, slope = cost.fit()
    assert slope == pytest.approx((0.019 - 0.011) / 4, rel=0.05)
    assert cost(10) == pytest.approx(fixed + 10 * slope)


def test_a_cost_never_falls_with_more_tokens():
    cost = LinearCost()
    cost.observe(1, 0.020)
    cost.observe(8, 0.010)  # noise: a bigger call measured faster
    assert cost.fit()[1] == 0.0
    assert cost(8) == cost(1)


def test_older_calls_weigh_less():
    """A change of machine load: the fit follows the recent calls."""
    cost = LinearCost()
    for _ in range(200):
        cost.observe(1, 0.010)
        cost.observe(4, 0.016)
    for _ in range(200):
        cost.observe(1, 0.020)
        cost.observe(4, 0.032)
    assert cost(1) == pytest.approx(0.020, rel=0.05)


@pytest.mark.parametrize("beta, draft, ks", [
    (0.4, True, [1, 0, 0, 0]), (0.6, True, [2, 0, 0, 0]), (0.9, True, [5, 0, 0, 0]),
    (0.6, False, [2, 0, 0, 0]), (0.9, False, [5, 3, 0, 0])])
def test_the_best_k_falls_as_the_batch_grows(beta, draft, ks):
    """With the measured costs, at batch sizes 1, 2, 4 and 8, the others' rows giving one
    token each: the K that gives the batch the most tokens a second, down to plain
    decoding where no K pays; a draft that costs no model call (prompt lookup) keeps
    drafting longer."""
    costs = measured()
    got = [best_k([beta] * 5, costs.draft(rows) if draft else 0.0, costs.verify(rows, 6), 5,
                  others=rows - 1)
           for rows in (1, 2, 4, 8)]
    assert got == ks


def test_the_others_rows_make_drafting_pay_less():
    """The same costs and acceptance: priced for the batch's rows, K is lower."""
    costs = measured()
    args = ([0.8] * 5, costs.draft(4), costs.verify(4, 6), 5)
    assert best_k(*args) == 2 and best_k(*args, others=3) == 0


def test_a_sequence_uses_the_batch_costs_once_fitted_and_its_own_before():
    costs, rows = BatchCosts(), [4]
    history = BatchHistories(costs, lambda: rows[0]).of("model", True)
    history.observe(2, 1, 0.050, 0.004, 2)  # the sequence's own step: v(3), d
    assert history.verify_costs(3)[3] == pytest.approx(0.050)
    assert history.draft_cost(1.0) == pytest.approx(0.002)
    assert history.others() == 0
    fitted = measured()
    costs.target, costs.draft, costs.seen = fitted.target, fitted.draft, fitted.seen
    assert history.verify_costs(3) == fitted.verify(4, 3)
    assert history.others() == 3
    rows[0] = 8
    assert history.verify_costs(3) == fitted.verify(8, 3)
    assert history.draft_cost(1.0) == fitted.draft(8)
    lookup = BatchHistories(costs, lambda: rows[0]).of("lookup", True)
    lookup.observe(2, 2, 0.050, 0.0, 0)  # no model draft step
    assert lookup.draft_cost(1.0) == StepHistory().draft_cost(1.0)


@pytest.mark.parametrize("rows, probed", [(1, 1), (2, 1), (4, 0), (8, 0)])
def test_a_batch_probes_a_k_only_where_every_draft_accepted_would_pay(rows, probed):
    """The measured costs and a draft rejected at once, so auto decodes at K = 0: alone and
    at two rows the probe drafts K = 1 (were its drafts accepted, it would pay); at four and
    eight rows a 2-token call costs more than the token it could add to the batch's, so
    the probe step stays at K = 0 (as does the step that probes K - 1, floored at 0)."""
    costs, size = measured(), [rows]
    history = BatchHistories(costs, lambda: size[0]).of("model", True)
    for _ in range(200):
        history.observe(1, 0, 0.02, 0.002, 1)
    history.steps = 1
    assert auto_k(history) == 0
    history.steps = PROBE_EVERY // 2
    assert auto_k(history) == probed
    history.steps = PROBE_EVERY
    assert auto_k(history) == 0


def test_alone_a_probe_is_kept_even_where_no_acceptance_would_pay():
    """One sequence: the probe also re-measures the costs it is priced with (a slow call
    can inflate v(2)), so it drafts K + 1 whatever they say."""
    history = StepHistory()
    history.verify = {1: 0.010, 2: 0.030}
    history.draft = 0.002
    history.steps = PROBE_EVERY // 2
    assert auto_k(history) == 1


def test_a_call_shape_the_batch_ran_is_priced_at_what_it_cost():
    """v(B, T) is the measured cost of that shape where the batch ran it, a straight line
    between two measured T of the same B, the fitted slope past them, and the line for a B
    not run yet; never falling with T."""
    costs = measured()
    fixed, per_row = costs.target.fit()
    v4 = costs.verify(4, 6)
    assert v4[1:5] == pytest.approx([0.0205, 0.0319, 0.0365, 0.0441])
    assert v4[6] == pytest.approx(0.0441 + 2 * 4 * per_row)
    v1 = costs.verify(1, 3)
    assert v1[2] == pytest.approx(0.0185)
    assert v1[1] == pytest.approx(0.0185 - per_row) and v1[3] == pytest.approx(0.0185 + per_row)
    assert costs.verify(3, 2)[1:] == pytest.approx([fixed + 3 * per_row, fixed + 6 * per_row])
    costs.observe(True, 2, 3, 0.010)  # noise: a 3-token call measured below the 1-token one
    v2 = costs.verify(2, 4)
    assert v2[1] == pytest.approx(0.0152) and v2[2] == v2[3] == v2[1]
    assert all(a <= b for a, b in zip(v2[1:], v2[2:]))


def test_alone_in_a_batch_session_a_sequence_drafts_where_two_tokens_cost_what_one_does():
    """One-row calls of one and two tokens costing the same (10.3 and 10.4 ms, SmolLM2 int4
    on 2 cores) and four-row calls of one token 17.5 ms: the line through them prices a
    one-row call at 9.4 ms for one token and 11.9 for two, at which a draft accepted 3
    times in 10 at 1.5 ms a step would not pay; at the measured 10.3 and 10.4 ms it does."""
    costs = BatchCosts()
    for _ in range(20):
        for rows, t, ms in ((1, 1, 10.3), (1, 2, 10.4), (4, 1, 17.5)):
            costs.observe(True, rows, t, ms / 1000)
    fixed, per_row = costs.target.fit()
    line = [fixed + per_row * t for t in range(3)]
    assert line[1:] == pytest.approx([0.0094, 0.0119], abs=2e-4)
    assert best_k([0.3], 0.0015, line, 1) == 0
    assert best_k([0.3], 0.0015, costs.verify(1, 2), 1) == 1


def test_draft_calls_are_priced_by_their_token_rows():
    """A draft call of B rows of T tokens (a catch-up takes two or more) costs what B T
    one-token rows do: calls of several shapes whose seconds follow 1 ms + 2 ms a token-row
    give d(B) = 1 ms + 2 ms B, the cost of a drafting step of one token a row."""
    costs = BatchCosts()
    for rows, tokens in ((1, 1), (2, 2), (1, 3), (3, 1), (2, 3), (4, 1)):
        costs.observe(False, rows, tokens, 0.001 + 0.002 * rows * tokens)
    for rows in (1, 2, 4, 8):
        assert costs.draft(rows) == pytest.approx(0.001 + 0.002 * rows)
