"""Several sequences decoded together (runtime/batch.py): a row of a call on several slots
equals the same call alone, and each sequence's output is its own, whatever shares its
steps: greedy tokens equal its plain decoding alone, sampled tokens follow the target's
distribution."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from power_controls import resamples_from_p

from specedge.export.bundle_writer import export_bundle
from specedge.gpu_check.two_sample import first_tokens, two_sample_pvalue
from specedge.runtime import Generator, token_selection
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.batch import BatchGenerator, BatchRequest
from specedge.runtime.bundle import load_bundle
from specedge.runtime.config import GenerationConfig
from specedge.runtime.kv_cache import SlotCaches

PROMPTS = ["hello world", "the cat sat on the mat and the cat sat on the", "a, b, c!", "why?",
           "one two three one two", "zzz"]


@pytest.fixture(scope="module")
def portable_bundles(tiny_checkpoints, tmp_path_factory) -> dict:
    """The tiny Llama with its first layer as the draft, portable attention, per
    precision."""
    bundles = {}
    for precision in ("fp32", "int8", "int4"):
        bundles[precision] = tmp_path_factory.mktemp("batch") / precision
        export_bundle(str(tiny_checkpoints["llama"]), bundles[precision], draft_layers=1,
                      precision=precision, attention="portable")
    return bundles


@pytest.fixture(scope="module", params=["fp32", "int8", "int4"])
def portable(request, portable_bundles):
    return portable_bundles[request.param]


@pytest.fixture(scope="module")
def gen(portable_bundles):
    return Generator.from_bundle(portable_bundles["fp32"])


def test_rows_of_one_call_equal_the_same_calls_alone(portable):
    """Three slots at different lengths, T = 1, 2 and 4 padded to 4, and a slot in the
    range without a row: each row's logits and K/V rows equal a call of that row alone
    with T = 4 (its tokens padded the same way) bit for bit, and the idle slot keeps its
    rows and length."""
    spec = load_bundle(portable).target
    backend = OrtCpuBackend(spec)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, spec.vocab_size, n).tolist() for n in (5, 9, 3, 7)]
    rows = {0: [11], 1: [12, 13], 3: [14, 15, 16, 17]}
    caches = SlotCaches(spec.num_layers, spec.num_kv_heads, spec.head_dim, 32, 4)
    for slot, prompt in enumerate(prompts):
        backend.forward(caches.slots[slot], prompt, 1)
    idle = caches.slots[2].planes.copy()
    got = backend.forward_slots(caches, 0, rows)
    for slot, tokens in rows.items():
        alone = backend.new_cache(32)
        backend.forward(alone, prompts[slot], 1)
        padded = tokens + [tokens[-1]] * (4 - len(tokens))
        want = backend.forward(alone, padded, 4)[:len(tokens)]
        assert np.array_equal(got[slot], want)
        n = len(prompts[slot]) + len(tokens)
        assert caches.slots[slot].length == n
        assert np.array_equal(caches.slots[slot].planes[..., :n, :],
                              alone.planes[..., :n, :])
    assert caches.slots[2].length == len(prompts[2])
    assert np.array_equal(caches.slots[2].planes, idle)


CONFIGS = [dict(max_new_tokens=30, use_draft=False),
           dict(max_new_tokens=40, drafter="prompt-lookup", draft_tokens=3),
           dict(max_new_tokens=25, drafter="model", draft_tokens=2),
           dict(max_new_tokens=35, drafter="model", draft_tokens="auto"),
           dict(max_new_tokens=12, drafter="lookup+model", draft_tokens=4),
           dict(max_new_tokens=3, drafter="model", draft_tokens=1)]


def test_each_greedy_sequence_equals_its_plain_decoding_alone(gen):
    """Six sequences, each with its own drafter, K and length, so that rows join calls
    with different numbers of tokens and leave at different steps; drafts are both
    accepted and rejected. fp32: a portable int8 graph computes a row alike in calls of
    the same T only (docs/design.md, "Batch invariance of quantized graphs"), which the
    row test above checks, while padding changes a row's T."""
    alone = [gen.generate(p, raw=True, max_new_tokens=c["max_new_tokens"], use_draft=False)
             for p, c in zip(PROMPTS, CONFIGS)]
    batch = BatchGenerator(gen, max_batch=6).generate(
        [BatchRequest(prompt=p, raw=True, config=GenerationConfig(**c))
         for p, c in zip(PROMPTS, CONFIGS)])
    for a, b, c in zip(alone, batch, CONFIGS):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert len(b.token_ids) == c["max_new_tokens"] and b.stop_reason == "max_new_tokens"
    drafted = sum(b.stats["drafted_tokens"] for b in batch)
    accepted = sum(b.stats["accepted_tokens"] for b in batch)
    assert 0 < accepted < drafted


def test_stop_strings_and_eos_end_one_sequence_only(gen):
    """A sequence that meets its stop string ends there, with the text `generate` gives
    it alone; its companion runs to its own end."""
    first = gen.generate(PROMPTS[0], raw=True, max_new_tokens=20, use_draft=False)
    stop = first.text[4:7]
    alone = gen.generate(PROMPTS[0], raw=True, max_new_tokens=20, use_draft=False,
                         stop=[stop])
    batch = BatchGenerator(gen, 2).generate([
        BatchRequest(prompt=PROMPTS[0], raw=True,
                     config=GenerationConfig(max_new_tokens=20, stop=(stop,),
                                             drafter="model", draft_tokens=2)),
        BatchRequest(prompt=PROMPTS[1], raw=True,
                     config=GenerationConfig(max_new_tokens=30, drafter="model"))])
    assert batch[0].stop_reason == "stop_string" and batch[0].text == alone.text
    assert batch[0].token_ids == alone.token_ids
    assert len(batch[1].token_ids) == 30


def _batched_first_tokens(gen, n: int, seed0: int, count: int) -> Counter:
    """Counts of the first `count` tokens of n sampled sequences (seeds seed0 ..), decoded
    in batches of 4: two of them and two companions (one greedy with prompt lookup, one
    sampled at another temperature), so that every step of theirs is shared."""
    batcher, tuples = BatchGenerator(gen, 4), Counter()
    spec = GenerationConfig(max_new_tokens=count + 1, temperature=1.0, drafter="model",
                            draft_tokens=2)
    for i in range(0, n, 2):
        results = batcher.generate([
            BatchRequest(prompt_ids=(1, 10, 7), config=GenerationConfig.of(spec, seed=seed0 + i)),
            BatchRequest(prompt=PROMPTS[1], raw=True,
                         config=GenerationConfig(max_new_tokens=6, drafter="prompt-lookup")),
            BatchRequest(prompt_ids=(1, 10, 7),
                         config=GenerationConfig.of(spec, seed=seed0 + i + 1)),
            BatchRequest(prompt=PROMPTS[2], raw=True,
                         config=GenerationConfig(max_new_tokens=5, temperature=0.6,
                                                 seed=i, drafter="model"))])
        for r in (results[0], results[2]):
            tuples[tuple(r.token_ids[:count])] += 1
    return tuples


def test_sampled_sequences_with_companions_follow_the_target(gen, monkeypatch):
    """Two-sample chi-square on the joint of the first 2 tokens: N = 1500 plain
    generations alone (seeds 0 .. 1499) against 1500 speculative ones (K = 2, model draft,
    seeds 10000 .. 11499) decoded two to a batch of four with companions; alpha = 0.001,
    cells under 10 draws pooled. Power control at the same N, seeds and alpha: the batched
    arm with a verifier that draws a rejected draft's replacement from p instead of the
    residual is rejected."""
    plain = first_tokens(gen, 1500, 0, 2, use_draft=False, temperature=1.0)
    assert two_sample_pvalue(plain, _batched_first_tokens(gen, 1500, 10_000, 2)) > 0.001
    monkeypatch.setattr(token_selection, "verify_sampled", resamples_from_p)
    assert two_sample_pvalue(plain, _batched_first_tokens(gen, 1500, 10_000, 2)) < 0.001


def test_batches_refuse_what_they_cannot_run(tiny_fused_bundle, gen):
    fused = Generator.from_bundle(tiny_fused_bundle)
    with pytest.raises(ValueError, match="--attention portable"):
        BatchGenerator(fused)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        BatchGenerator(gen, 0)
    batcher = BatchGenerator(gen, 2)
    with pytest.raises(ValueError, match="exceed max_batch=2"):
        batcher.generate([BatchRequest(prompt="a", raw=True)] * 3)
    with pytest.raises(ValueError, match="exceeds the bundle's context"):
        batcher.generate([BatchRequest(prompt="a", raw=True),
                          BatchRequest(prompt="a", raw=True,
                                       config=GenerationConfig(max_new_tokens=10_000))])
    assert batcher.generate([]) == []


def test_an_error_in_one_sequence_reaches_the_caller_and_frees_the_others(gen, monkeypatch):
    """A sequence whose draft fails in the middle of its loop raises on the caller's
    thread once its companion (plain decoding) has finished; nothing hangs, and the
    generator runs the next batch."""
    from specedge.runtime.drafting import ModelDrafter

    def broken(self, *args, **kwargs):
        raise RuntimeError("draft failed")

    batcher = BatchGenerator(gen, 2)
    requests = [BatchRequest(prompt="a", raw=True, config=GenerationConfig(drafter="model")),
                BatchRequest(prompt="b", raw=True,
                             config=GenerationConfig(max_new_tokens=8, use_draft=False))]
    with monkeypatch.context() as patch:
        patch.setattr(ModelDrafter, "propose", broken)
        with pytest.raises(RuntimeError, match="draft failed"):
            batcher.generate(requests)
    results = batcher.generate(requests)
    assert len(results[1].token_ids) == 8 and results[0].stats["drafted_tokens"] > 0
