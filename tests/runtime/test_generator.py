"""The speculative loop on tiny exported models: greedy equality, exact sampling
distribution (two-sample test), drafters, stopping, streaming and statistics."""

from __future__ import annotations

import numpy as np
import pytest
from power_controls import resamples_from_p
from two_samples import two_sample_pvalue

from specedge.gpu_check.two_sample import first_tokens
from specedge.runtime import Generator, token_selection
from specedge.runtime.config import Sampling
from specedge.runtime.drafting import PromptLookupDrafter

PROMPTS = ["hello world", "the cat sat on the mat", "a, b, c!", "why?"]


@pytest.fixture(scope="module")
def gen(tiny_bundle):
    return Generator.from_bundle(tiny_bundle)


@pytest.fixture(scope="module")
def self_gen(tiny_self_draft_bundle):
    return Generator.from_bundle(tiny_self_draft_bundle)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "lookup+model"])
def test_greedy_speculative_equals_plain(gen, k, drafter):
    """Equal tokens prove something only where drafts were both accepted (the accepted ones
    are what the target did not compute one by one) and rejected (the correction replaces
    a draft): both must happen over the prompts."""
    accepted = rejected = 0
    for prompt in PROMPTS:
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=40, draft_tokens=k,
                            drafter=drafter)
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        assert plain.stats["draft_calls"] == 0 and plain.stats["tokens_per_target_call"] == 1
        accepted += spec.stats["accepted_tokens"]
        # Drafts after the first rejection of a step are never examined: drafted minus
        # accepted would count them as rejections.
        rejected += sum(spec.stats["position_tries"]) - spec.stats["accepted_tokens"]
        assert spec.stats["accepted_tokens"] <= spec.stats["drafted_tokens"]
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_host_cache_grows_between_steps_with_the_same_tokens(gen, monkeypatch):
    # The host cache starts with room for the prompt and grows by GROWTH_STEP rows (here
    # 8, so a generation grows it several times); the graph masks rows past the length, so
    # the tokens are those of a cache sized for the whole generation at once.
    from specedge.runtime import generator, kv_cache, loop

    want = {k: gen.generate("the cat sat on the mat", raw=True, max_new_tokens=40,
                            draft_tokens=k) for k in (1, 3)}
    for module in (generator, loop):
        monkeypatch.setattr(module, "GROWTH_STEP", 8)
    for k in (1, 3):
        got = gen.generate("the cat sat on the mat", raw=True, max_new_tokens=40,
                           draft_tokens=k)
        assert got.token_ids == want[k].token_ids
        prompt = len(gen.codec.encode("the cat sat on the mat"))
        assert gen._cache.capacity >= prompt + 40 - 1 > kv_cache.capacity_for(prompt, 8192, 8)


def test_draft_equal_to_target_accepts_everything(self_gen):
    out = self_gen.generate(prompt_ids=[1, 5, 6], max_new_tokens=41, draft_tokens=4,
                            drafter="model")
    s = out.stats
    assert s["stop_reason"] == "max_new_tokens"
    assert s["acceptance_rate"] == 1.0
    assert s["acceptance_per_position"] == [1.0] * 4
    assert s["tokens_per_target_call"] == 5.0  # K accepted + 1 bonus per call


def test_sampled_draft_equal_to_target_accepts_almost_everything(self_gen):
    """p == q: u * q < p holds for every u in [0, 1) up to float rounding between calls."""
    out = self_gen.generate(prompt_ids=[1, 5, 6], max_new_tokens=40, draft_tokens=4,
                            drafter="model", temperature=1.0, seed=3)
    assert out.stats["drafted_tokens"] > 20
    assert out.stats["acceptance_rate"] > 0.97


# (settings, tokens counted). A draft whose q is under the threshold is kept and ends the
# drafting, so with one draft (two tokens counted) the threshold would change nothing; its
# case counts three tokens: t2 and t3 are the verified first and second drafts, or what
# replaced them.
SAMPLED_SETTINGS = [
    (dict(temperature=1.0, drafter="model"), 2),
    (dict(temperature=0.7, top_k=8, top_p=0.9, drafter="model"), 2),
    (dict(temperature=1.0, draft_threshold=0.3, drafter="model"), 3),
    (dict(temperature=1.0, drafter="lookup+model", prompt_ids=(1, 4, 12, 9, 1, 4)), 2),
]


@pytest.mark.parametrize("sampling,count", SAMPLED_SETTINGS,
                         ids=["T1", "T0.7-topk-topp", "threshold", "lookup+model"])
def test_speculative_and_plain_sample_the_same_first_tokens(gen, sampling, count,
                                                             monkeypatch):
    """Two-sample chi-square on the joint of the first `count` generated tokens.

    N = 1500 generations per arm: plain with seeds 0 .. 1499, speculative (K = 2) with seeds
    10000 .. 11499; alpha = 0.001; cells with fewer than 10 draws in both arms together
    are pooled. The draft is the target's first layer, so p != q and rejections and
    residual draws really happen (asserted: at least 100 rejected drafts in the speculative
    arm). With lookup+model the prompt ends in "1 4", which it holds earlier followed by
    "12 9": when t1 is 12 (p = 0.62) lookup drafts t2 (9), otherwise the model does (both
    asserted to happen in at least 100 generations).

    Power control, at the same N, seeds and alpha: the speculative arm run with a verifier
    that replaces a rejected draft by a draw from p instead of the residual
    (`resamples_from_p`) must be rejected. On these settings its p-values are 2e-13 to
    2e-9 (the correct arm's 0.18 to 0.86); a bug half that size (a draw from half p, half
    the residual) gives p = 0.004 at T = 1, which this N does not detect.
    """
    arm = {k: v for k, v in sampling.items() if k != "drafter"}
    plain = first_tokens(gen, 1500, 0, count, use_draft=False, **arm)
    stats: list[dict] = []
    spec = first_tokens(gen, 1500, 10_000, count, draft_tokens=2, stats=stats, **sampling)
    rejected = sum(sum(s["position_tries"]) - s["accepted_tokens"] for s in stats)
    assert rejected >= 100, f"{rejected} rejected drafts: the residual is hardly drawn"
    if "draft_threshold" in sampling:
        # Without the threshold the first step drafts 2 tokens; one drafted token in all
        # means the threshold cut the first step's drafts after one.
        assert sum(s["drafted_tokens"] == 1 for s in stats) >= 100
    if sampling["drafter"] == "lookup+model":
        lookup = sum(c for tokens, c in spec.items() if tokens[0] == 12)
        assert 100 <= lookup <= 1400, f"lookup drafted in {lookup} of 1500 generations"
    assert two_sample_pvalue(plain, spec) > 0.001
    monkeypatch.setattr(token_selection, "verify_sampled", resamples_from_p)
    wrong = first_tokens(gen, 1500, 10_000, count, draft_tokens=2, **sampling)
    assert two_sample_pvalue(plain, wrong) < 0.001


def test_two_sample_test_refuses_a_single_outcome():
    """Everything on one outcome (a setting that makes the output deterministic) leaves the
    chi-square no degree of freedom: it would pass any sampler, so it is refused; rare
    outcomes pooled into one cell of 10 or more draws still make a second cell."""
    from collections import Counter

    from specedge.gpu_check.two_sample import two_sample_test

    with pytest.raises(ValueError, match="fewer than two outcomes"):
        two_sample_test(Counter({(3, 4): 1500}), Counter({(3, 4): 1497, (5, 6): 3}))
    rare = Counter({(3, 4): 1490, **{(5, i): 1 for i in range(10)}})
    assert two_sample_test(rare, Counter({(3, 4): 1500}))[2].shape == (2, 2)


def test_default_draft_length_is_auto_when_greedy_and_fixed_when_sampling(gen):
    """Greedy tokens do not depend on K, so the default adapts it; sampled tokens do (for
    a seed), so the default keeps K fixed and a seed fixes the text."""
    from specedge.runtime.config import SAMPLED_DEFAULT_K

    assert gen.generate("hello", raw=True, max_new_tokens=8).stats["draft_tokens_k"] == "auto"
    sampled = gen.generate("hello", raw=True, max_new_tokens=8, temperature=0.8)
    assert sampled.stats["draft_tokens_k"] == SAMPLED_DEFAULT_K


def test_sampling_is_reproducible_with_a_seed(gen):
    a = gen.generate("hello", raw=True, temperature=0.9, seed=5, max_new_tokens=30)
    b = gen.generate("hello", raw=True, temperature=0.9, seed=5, max_new_tokens=30)
    c = gen.generate("hello", raw=True, temperature=0.9, seed=6, max_new_tokens=30)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stream_pieces_join_to_the_text(gen):
    pieces = list(gen.stream("the cat", raw=True, max_new_tokens=30))
    assert "".join(pieces) == gen.last_result.text
    assert len(pieces) > 1


def test_chat_template_is_applied(gen):
    chat = gen.generate("hi", max_new_tokens=3)
    same = gen.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=3)
    manual = gen.generate(prompt_ids=gen.codec.encode("<s>user: hi\n<s>assistant: "),
                          max_new_tokens=3)
    assert chat.token_ids == same.token_ids == manual.token_ids
    assert gen.codec.encode_chat([{"role": "user", "content": "hi"}]) == \
        gen.codec.encode("<s>user: hi\n<s>assistant: ")


def test_stops_at_eos(gen):
    """Find a prompt whose greedy continuation hits EOS (id 2) and check the stop."""
    eos_runs = []
    for prompt in ["a", "b", "c", "hello", "why", "the end.", "ok!", "yes", "no"]:
        out = gen.generate(prompt, raw=True, max_new_tokens=200, temperature=1.0, seed=1)
        if out.stop_reason == "eos":
            eos_runs.append(out)
    assert eos_runs, "no sampled run reached EOS in 200 tokens"
    for out in eos_runs:
        assert out.token_ids[-1] == 2 and 2 not in out.token_ids[:-1]
        assert out.stats["stop_reason"] == "eos"


def test_stops_at_a_stop_string(gen):
    full = gen.generate("the cat", raw=True, max_new_tokens=60)
    stop = full.text[10:12]
    out = gen.generate("the cat", raw=True, max_new_tokens=60, stop=[stop])
    assert out.stop_reason == "stop_string"
    assert out.text == full.text[:full.text.find(stop)]
    pieces = list(gen.stream("the cat", raw=True, max_new_tokens=60, stop=[stop]))
    assert "".join(pieces) == out.text


def test_max_new_tokens_is_exact(gen):
    """The budget ends the generation: the stop reason is asserted first (an EOS stop would
    make the length check vacuous), for K up to 9, where the loop must cap K at the tokens
    left."""
    for k in (1, 4, 9):
        out = gen.generate("hello", raw=True, max_new_tokens=13, draft_tokens=k)
        assert out.stop_reason == "max_new_tokens", (k, out.stop_reason, out.token_ids)
        assert out.stats["stop_reason"] == "max_new_tokens"
        assert len(out.token_ids) == 13
        assert out.stats["drafted_tokens"] > 0


def test_stats_are_consistent(gen):
    s = gen.generate("the cat sat", raw=True, max_new_tokens=50, draft_tokens=3,
                     drafter="model").stats
    for key in ("tokens_generated", "target_calls", "draft_calls", "acceptance_rate",
                "acceptance_per_position", "tokens_per_target_call", "time_draft_s",
                "time_target_s", "time_sampling_s", "time_other_s", "draft_cost_ratio_c",
                "ideal_speedup", "draft_tokens_k"):
        assert key in s
    assert s["draft_tokens_k"] == 3
    assert s["accepted_tokens"] <= s["drafted_tokens"] <= 3 * s["target_calls"]
    assert s["tokens_generated"] - 1 == s["target_calls"] + s["accepted_tokens"]
    assert 0 <= s["acceptance_rate"] <= 1 and len(s["acceptance_per_position"]) == 3
    assert s["draft_calls"] == s["drafted_tokens"]
    assert s["draft_cost_ratio_c"] > 0
    parts = sum(s[k] for k in ("time_prefill_s", "time_draft_s", "time_target_s",
                               "time_sampling_s", "time_other_s"))
    assert parts == pytest.approx(s["time_total_s"], rel=1e-6)


def test_lookup_then_model_uses_lookup_only_for_matches_of_two_tokens_or_more():
    from specedge.runtime.drafting import LookupThenModelDrafter

    class FakeModel:
        name, calls = "model", 0

        def start(self, prompt, capacity):
            pass

        def propose(self, context, k, sampling, rng, threshold=0.0):
            self.calls += 1
            return [99] * k, "q rows"

    d = LookupThenModelDrafter(FakeModel())
    rng = np.random.default_rng(0)
    context = [5, 6, 7, 8, 1, 5, 6]
    assert d.source(context) == "lookup+model/lookup"   # auto's history for this step
    assert d.propose(context, 2, Sampling(), rng) == ([7, 8], None)
    assert d.calls == 1
    # Only a one-token match ("6"): the model drafts, with its own q.
    context = [5, 6, 7, 8, 1, 6]
    assert d.source(context) == "lookup+model/model"
    assert d.propose(context, 2, Sampling(), rng) == ([99, 99], "q rows")
    assert d.calls == 2 and d.model.calls == 1
    # A new generation whose context has the last one's length: the match is found anew.
    d.start([1, 2, 3], 64)
    assert d.source([1, 2, 3, 4, 1, 2]) == "lookup+model/lookup"


def test_auto_keeps_lookup_and_model_drafts_apart(gen, monkeypatch):
    """A lookup that matched two tokens and the draft model are accepted at different
    rates per position: auto measures them as two sources, each counting only its own
    steps, with one v(T) (the target's cost does not depend on who drafted), and the
    tokens stay exact. Which K auto picks follows measured times, so the test records the
    steps each source observed and the T it verified, and checks the counts against them."""
    from specedge.runtime.drafting.auto_k import StepHistory

    verified: dict[int, set[int]] = {}
    observed: dict[int, list[tuple[int, int]]] = {}
    observe = StepHistory.observe

    def recording(self, drafted, accepted, *args, **kwargs):
        verified.setdefault(id(self), set()).add(drafted + 1)
        observed.setdefault(id(self), []).append((drafted, accepted))
        return observe(self, drafted, accepted, *args, **kwargs)

    monkeypatch.setattr(StepHistory, "observe", recording)
    prompt = "the cat sat on the mat and the cat sat on the"
    plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
    gen._histories.clear()
    # The records go with the histories: a new history may take a freed one's id().
    verified.clear()
    observed.clear()
    spec = gen.generate(prompt, raw=True, max_new_tokens=40, drafter="lookup+model",
                        draft_tokens="auto")
    assert spec.token_ids == plain.token_ids
    lookup = gen._histories["lookup+model/lookup", True]
    model = gen._histories["lookup+model/model", True]
    assert lookup.steps > 0 and model.steps > 0
    assert lookup.steps + model.steps == spec.stats["target_calls"]
    assert lookup.verify is model.verify
    assert set(lookup.verify) == verified[id(lookup)] | verified[id(model)]
    for history in (lookup, model):
        mine = observed[id(history)]
        assert len(mine) == history.steps
        assert history.total_tries[0] == sum(drafted > 0 for drafted, _ in mine)
        assert history.total_accepts[0] == sum(accepted > 0 for _, accepted in mine)


def test_prompt_lookup_proposes_the_continuation_of_the_last_match():
    d = PromptLookupDrafter(max_ngram=3)
    rng = np.random.default_rng(0)
    ids, q = d.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3, Sampling(), rng)
    assert ids == [8, 9, 1] and q is None
    ids, _ = d.propose([1, 2, 3, 1, 2, 4, 1, 2], 2, Sampling(), rng)
    assert ids == [4, 1]  # the most recent match of "1 2"
    assert d.propose([1, 2, 3], 3, Sampling(), rng)[0] == []


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 3), (2, 3), (1, 1), (2, 5)])
def test_prompt_lookup_match_is_the_latest_longest_window_match(min_ngram, max_ngram):
    """Against the definition, on 2000 random contexts over 4 tokens (seeded): for n from
    max_ngram down, the latest window of n tokens of context[:-1] equal to the context's
    last n; the continuation starts after it."""
    from numpy.lib.stride_tricks import sliding_window_view

    def reference(tokens):
        for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                return int(hits[-1] + n)
        return None

    d = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(2000):
        tokens = rng.integers(0, 4, rng.integers(1, 30))
        assert d.match(list(tokens)) == reference(tokens), tokens
        found += reference(tokens) is not None
    assert 500 < found < 1900   # both outcomes are exercised (986 to 1732 of 2000)


def test_best_k_with_flat_verification_cost_maximises_the_ideal_speedup():
    """v(T) = 1 for every T: rate(K) / rate(0) is the ideal speedup with c = d, and K = 0
    (plain decoding, speedup 1) is chosen only when no K beats it."""
    from specedge.runtime.drafting.auto_k import best_k
    from specedge.runtime.stats import ideal_speedup

    flat = [1.0] * 10
    for beta in (0.05, 0.1, 0.5, 0.8, 0.95):
        for c in (0.0, 0.05, 0.3, 1.0):
            k = best_k([beta] * 8, c, flat, 8)
            speedups = [1.0] + [ideal_speedup(beta, j, c) for j in range(1, 9)]
            assert speedups[k] == max(speedups)
    assert best_k([0.95] * 8, 0.01, flat, 8) == 8   # a cheap, accurate draft drafts long
    assert best_k([0.2] * 8, 0.1, flat, 8) == 1     # a poor one drafts one token
    assert best_k([0.05] * 8, 1.0, flat, 8) == 0    # a useless one is not run at all


def test_best_k_counts_the_cost_of_longer_verification():
    """The measured case of a 2-core CPU: int8 verification costs 1 + 0.16 (T - 1) of a
    one-token step; a draft accepted 25% of the time at c = 0.1 then loses at every K,
    while a flat-cost model would draft."""
    from specedge.runtime.drafting.auto_k import best_k

    growing = [1.0 + 0.16 * (t - 1) for t in range(10)]
    assert best_k([0.25] * 8, 0.1, [1.0] * 10, 8) >= 1
    assert best_k([0.25] * 8, 0.1, growing, 8) == 0
    assert best_k([0.8] * 8, 0.05, growing, 8) < best_k([0.8] * 8, 0.05, [1.0] * 10, 8)


def test_best_k_uses_the_acceptance_of_each_position():
    """E(K) = 1 + sum_i beta_1 ... beta_i: a draft weak at the first position but strong
    after it (prompt lookup copying a span) is worth a long K, or none; one i.i.d. rate
    with the same pooled value would pick a short K."""
    from specedge.runtime.drafting.auto_k import best_k

    growing = [1.0 + 0.15 * (t - 1) for t in range(10)]
    assert best_k([0.6] + [0.95] * 7, 0.0, growing, 8) == 8
    assert best_k([0.6] * 8, 0.0, growing, 8) == 2
    assert best_k([0.1] + [0.95] * 7, 0.0, growing, 8) == 0


def test_history_counts_acceptance_per_position_with_decay():
    from specedge.runtime.drafting.auto_k import HISTORY, StepHistory

    history = StepHistory()
    for _ in range(50):
        history.observe(drafted=3, accepted=0, seconds=0.01)
        history.observe(drafted=3, accepted=3, seconds=0.01)
    betas = history.betas(4)
    decay = 1 - 1 / HISTORY
    # Position 1 was examined every step and accepted every other one; its counts decay
    # with each try. Positions 2 and 3 were examined (and accepted) on every other step.
    tries = sum(decay ** a for a in range(100))
    accepts = sum(decay ** a for a in range(0, 100, 2))
    assert history.tries[0] == pytest.approx(tries)
    assert history.accepts[0] == pytest.approx(accepts)
    assert history.tries[1] == pytest.approx(sum(decay ** a for a in range(50)))
    assert history.accepts[1] == history.tries[1]
    pooled = (sum(history.accepts) + 2.8) / (sum(history.tries) + 4)
    assert betas[0] == pytest.approx((accepts + 4 * pooled) / (tries + 4))
    assert betas[1] > 0.95 and betas[2] > 0.95
    assert betas[3] == pytest.approx(pooled)   # never tried: the pooled rate


def test_history_keeps_the_acceptance_of_a_position_no_longer_drafted():
    """Steps at K = 0 examine no position: beta_1 stays what the last tries measured
    instead of sliding to the prior, and the next tries move it at the rate of one try
    in HISTORY."""
    from specedge.runtime.drafting.auto_k import HISTORY, StepHistory

    history = StepHistory()
    for step in range(300):
        history.observe(drafted=1, accepted=step % 3 == 0, seconds=0.01)
    before = history.betas(1)[0]
    assert 0.3 < before < 0.37
    for _ in range(500):
        history.observe(drafted=0, accepted=0, seconds=0.01)
    assert history.betas(1)[0] == before
    history.observe(drafted=1, accepted=1, seconds=0.01)
    assert before < history.betas(1)[0] < before + 1.5 / HISTORY


def test_history_measures_interpolates_and_extrapolates_costs():
    from specedge.runtime.drafting.auto_k import PRIOR_C, PRIOR_SLOPE, SMOOTHING, StepHistory

    costs = StepHistory()
    prior = costs.verify_costs(4)
    assert prior[1:] == pytest.approx([1 + PRIOR_SLOPE * t for t in range(4)])
    assert costs.draft_cost(2.0) == pytest.approx(PRIOR_C * 2.0)
    costs.observe(2, 0, 0.013, draft_seconds=0.004, draft_calls=2)
    assert costs.draft == pytest.approx(0.002)
    # One T measured: the prior's shape through it.
    assert costs.verify_costs(3)[1] == pytest.approx(0.013 / (1 + 2 * PRIOR_SLOPE))
    costs.observe(4, 0, 0.017)
    costs.observe(0, 0, 0.010)
    v = costs.verify_costs(7)
    assert v[1] == pytest.approx(0.010) and v[3] == pytest.approx(0.013)
    assert v[2] == pytest.approx(0.0115) and v[4] == pytest.approx(0.015)   # between
    assert v[7] == pytest.approx(0.021)                # beyond: the slope of the last two
    costs.observe(0, 0, 0.020)
    assert costs.verify_costs(1)[1] == pytest.approx(0.010 + SMOOTHING * 0.010)
    falling = StepHistory()
    falling.observe(1, 0, 0.02)
    falling.observe(2, 0, 0.01)   # noise: v must not fall with T, nor collapse below it
    assert falling.verify_costs(5)[5] == pytest.approx(0.01)
    assert falling.verify_costs(5)[1] == pytest.approx(0.02)


@pytest.mark.parametrize("setting", [dict(draft_tokens="auto"),
                                     dict(draft_tokens=6, draft_threshold=0.5),
                                     dict(draft_tokens="auto", draft_threshold=0.3)])
def test_adaptive_drafting_stays_exact(gen, setting):
    for prompt in PROMPTS:
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=40, drafter="model", **setting)
        assert spec.token_ids == plain.token_ids
    s = spec.stats
    assert s["draft_calls"] >= s["drafted_tokens"]
    assert s["mean_draft_tokens"] == pytest.approx(s["drafted_tokens"] / s["target_calls"])


def test_auto_without_a_drafter_is_plain_decoding(gen):
    plain = gen.generate("hello", raw=True, max_new_tokens=20, use_draft=False)
    auto = gen.generate("hello", raw=True, max_new_tokens=20, use_draft=False,
                        draft_tokens="auto")
    assert auto.token_ids == plain.token_ids and auto.stats["draft_calls"] == 0


def test_acceptance_counts_only_examined_drafts():
    """beta = accepted / examined: drafts after the first rejection are never tested."""
    from specedge.runtime.stats import StepClock

    clock = StepClock()
    clock.record_step(drafted=4, accepted=1)   # examined 2 (accept, reject)
    clock.record_step(drafted=4, accepted=4)   # examined 4
    clock.record_step(drafted=2, accepted=0)   # examined 1
    assert (clock.accepted, clock.examined, clock.drafted) == (5, 7, 10)
    assert clock.position_tries == [3, 2, 1, 1]
    assert clock.position_accepts == [2, 1, 1, 1]


def test_auto_k_reads_the_measured_acceptance_and_cost_and_probes():
    from specedge.runtime.drafting.auto_k import PROBE_EVERY, StepHistory, auto_k

    history = StepHistory()
    assert 1 <= auto_k(history) <= 8  # the priors alone draft
    for t in range(1, 10):                          # flat verification cost, c = 0.01
        history.observe(t - 1, t - 1, 0.010, draft_seconds=0.0001, draft_calls=1)
    for _ in range(40):
        history.observe(8, 8, 0.010, draft_seconds=0.0008, draft_calls=8)
    history.steps = 1
    assert auto_k(history) == 8
    for _ in range(300):                            # a poor, costly draft
        history.observe(1, 0, 0.010, draft_seconds=0.2, draft_calls=1)
    history.steps = 1
    assert auto_k(history) == 0
    history.steps = PROBE_EVERY // 2
    assert auto_k(history) == 1      # the probe keeps measuring acceptance
    history.steps = PROBE_EVERY
    assert auto_k(history) == 0      # K - 1, floored at plain decoding


def test_auto_starts_a_generation_from_what_the_last_ones_measured():
    from specedge.runtime.drafting.auto_k import StepHistory, auto_k

    history = StepHistory()
    history.verify = {t: 0.010 * (1 + 0.15 * (t - 1)) for t in range(1, 10)}
    history.draft = 0.001
    first = auto_k(history)          # no acceptance measured: the prior, beta = 0.7
    for _ in range(64):              # one generation of a draft rejected at once
        history.observe(2, 0, 0.0115, draft_seconds=0.001, draft_calls=2)
    history.steps = 1
    assert first >= 2 and auto_k(history) == 0


def test_auto_falls_back_to_plain_decoding_when_no_draft_pays(gen, monkeypatch):
    """Verification made to look costly: auto then decodes almost only with K = 0 (the
    probes aside), and the tokens are still the target's."""
    from specedge.runtime.drafting.auto_k import PROBE_EVERY, StepHistory

    plain = gen.generate("the cat sat", raw=True, max_new_tokens=48, use_draft=False)
    history = StepHistory()
    history.verify = {1: 0.001, 2: 1.0, 3: 2.0}
    history.draft = 0.001
    monkeypatch.setitem(gen._histories._steps, ("model", True), history)
    staged, observe = dict(history.verify), history.observe

    def keep_staged_costs(*args, **kwargs):
        observe(*args, **kwargs)
        history.verify, history.draft = dict(staged), 0.001

    monkeypatch.setattr(history, "observe", keep_staged_costs)
    auto = gen.generate("the cat sat", raw=True, max_new_tokens=48, draft_tokens="auto",
                        drafter="model")
    assert auto.token_ids == plain.token_ids
    assert 1 <= auto.stats["drafted_tokens"] <= 47 // (PROBE_EVERY // 2) + 1


def test_threshold_cuts_drafts_short(gen):
    full = gen.generate("the cat sat", raw=True, max_new_tokens=60, draft_tokens=6)
    cut = gen.generate("the cat sat", raw=True, max_new_tokens=60, draft_tokens=6,
                       draft_threshold=0.9)
    assert cut.stats["mean_draft_tokens"] < full.stats["mean_draft_tokens"]
    assert cut.token_ids == full.token_ids


def test_sessions_stop_spinning_after_a_run(gen):
    """Target and draft run one after the other: a pool that kept spinning after its run
    would take the cores the other session's run needs."""
    for backend in (gen.target, gen.draft):
        options = backend.session.get_session_options()
        assert options.get_session_config_entry("session.force_spinning_stop") == "1"


def test_a_generation_config_gives_what_its_keywords_give(gen):
    """`config=GenerationConfig(...)` and the same settings as keywords are one generation;
    keywords given with a config replace its values."""
    from specedge.runtime import GenerationConfig

    settings = dict(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7, draft_tokens=2,
                    stop="\n\n")
    config = GenerationConfig(**settings)
    by_keywords = gen.generate("the cat sat", raw=True, **settings)
    by_config = gen.generate("the cat sat", raw=True, config=config)
    assert by_config.token_ids == by_keywords.token_ids
    assert by_config.text == by_keywords.text
    greedy = gen.generate("the cat sat", raw=True, config=config, temperature=0.0)
    plain = gen.generate("the cat sat", raw=True, max_new_tokens=24, use_draft=False,
                         stop="\n\n")
    assert greedy.token_ids == plain.token_ids
    assert (config.sampling.greedy, config.k_max, config.auto) == (False, 2, False)


def test_a_generation_config_is_checked_when_it_is_made():
    from specedge.runtime import GenerationConfig

    with pytest.raises(ValueError, match="top_p must be in"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(ValueError, match="draft_tokens must be"):
        GenerationConfig(draft_tokens=0)
    assert GenerationConfig(use_draft=False, draft_tokens=4).k_max == 0
    assert GenerationConfig().auto and not GenerationConfig(temperature=0.5).auto
    assert GenerationConfig(stop="x").stops == ("x",)


def test_unknown_settings_and_bad_configs_are_type_errors(gen):
    with pytest.raises(TypeError, match="unknown generation setting.*max_tokens"):
        gen.generate("the cat sat", max_tokens=8)
    with pytest.raises(TypeError, match="config must be a GenerationConfig"):
        gen.generate("the cat sat", config={"max_new_tokens": 8})


def test_the_draft_model_takes_the_prompt_in_at_its_first_draft_step(gen, monkeypatch):
    """The first token waits for the target's prompt call only; the draft model runs the
    prompt and that token in one call when it first drafts, and a generation that never
    drafts never runs it."""
    from model_calls import spy_calls

    prompt = gen.encode_prompt("the cat sat on the mat", raw=True)
    calls = spy_calls(monkeypatch, gen, ("forward",))
    gen.generate(prompt_ids=prompt, max_new_tokens=6, drafter="model", draft_tokens=2)
    assert calls[0] == ("target", len(prompt))
    assert calls[1] == ("draft", len(prompt) + 1)
    calls.clear()
    gen.generate(prompt_ids=prompt, max_new_tokens=6, drafter="prompt-lookup", draft_tokens=2)
    assert calls and all(role == "target" for role, _ in calls)
