"""`specedge corpus` on a tiny batched bundle: shards that resume, answers that are the
bundle's own plain decoding, requests that are new and away from the held-out prompts, code
requests made from earlier answers and from the target's own words, and the shard format
read back as written."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from specedge.export.distill import grow
from specedge.export.distill.corpus import (
    KINDS,
    CorpusSettings,
    Row,
    answer_tokens,
    new_meta,
    read_corpus,
    read_shard,
    shard_path,
    shard_paths,
    summary,
    write_meta,
    write_shard,
)
from specedge.export.distill.draft_folder import tokenizer_digest
from specedge.export.distill.grow import (
    CorpusGrower,
    grow_corpus,
    held_out_requests,
    normalized,
    self_request,
)
from specedge.export.distill.prompts import (
    CODE_EDITS,
    CODE_OPENINGS,
    code_blocks,
    code_edit_request,
    pool_requests,
)
from specedge.export.distill.self_prompts import close_to, content_words
from specedge.runtime import GenerationConfig, Generator

SETTINGS = CorpusSettings(new_tokens=12, shard_prompts=8, seed=3)


@pytest.fixture(scope="module")
def corpus(tiny_batched_bundle, tmp_path_factory):
    """Two shards, then a third added by a second run."""
    out = tmp_path_factory.mktemp("corpus") / "c"
    first = grow_corpus(out, tiny_batched_bundle, SETTINGS, answer_tokens_goal=100,
                        max_batch=4, threads=1)
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in shard_paths(out)]
    second = grow_corpus(out, tiny_batched_bundle, SETTINGS,
                         answer_tokens_goal=first["answer_tokens"] + 1, max_batch=4, threads=1)
    return out, first, second, digests


def test_a_second_run_appends_a_shard_and_keeps_the_first_ones(corpus):
    out, first, second, digests = corpus
    assert first["answer_tokens"] >= 100
    assert second["shards"] == first["shards"] + 1
    paths = shard_paths(out)
    assert len(paths) == second["shards"]
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths[:len(digests)]] == digests
    rows = read_corpus(out)
    assert len(rows) == second["rows"] == SETTINGS.shard_prompts * second["shards"]
    assert answer_tokens(rows) == second["answer_tokens"]


def test_greedy_answers_are_the_bundles_plain_decoding_alone(corpus, tiny_batched_bundle):
    out = corpus[0]
    rows = read_corpus(out)
    gen = Generator.from_bundle(tiny_batched_bundle, threads=1)
    greedy = [r for r in rows if r.temperature == 0]
    assert len(greedy) >= 8
    for r in greedy:
        assert list(r.ids[:r.prompt_len]) == gen.codec.encode_chat(
            [{"role": "user", "content": r.request}])
        alone = gen.generate(prompt_ids=r.ids[:r.prompt_len].tolist(), max_new_tokens=12,
                             use_draft=False)
        assert list(r.answer) == alone.token_ids
        assert r.ended == (alone.stop_reason == "eos")
        assert len(r.answer) <= SETTINGS.new_tokens


def test_requests_are_new_mixed_and_away_from_the_held_out_prompts(corpus):
    rows = read_corpus(corpus[0])
    keys = [normalized(r.request) for r in rows]
    assert len(set(keys)) == len(keys)
    held_out = [content_words(r) for r in held_out_requests()]
    assert not [r.request for r in rows if close_to(r.request, held_out)]
    kinds = summary(rows)["rows_by_kind"]
    # The tiny model seldom ends a turn within a request's tokens (its EOS is rare), and only
    # after a request's first words: its shards fill with the template, question and code
    # requests, and with code requests it finished from their opening.
    assert {"template", "question", "code"} <= set(kinds) <= {*KINDS} - {"self"}, kinds
    assert all(r.request.startswith(CODE_OPENINGS) for r in rows if r.kind == "code-self")
    # Each shard samples about a quarter of its answers: at least one across the corpus.
    assert 0 < summary(rows)["sampled_rows"] < len(rows)


def test_a_self_written_request_must_end_its_turn_in_a_few_plain_words():
    eos, special = {2}, {1, 2}
    decode = {(7, 8, 9): "Tell me a joke", (7,): "Hi", (7, 1, 8): "x"}.__getitem__

    def request(ids):
        return self_request(ids, eos, special, lambda i: decode(tuple(i)))

    assert request([7, 8, 9, 2]) == "Tell me a joke"
    assert request([7, 8, 9]) is None  # still writing when its tokens ran out
    assert request([7, 2]) is None  # one word
    assert request([7, 1, 8, 2]) is None  # another special token inside
    assert request([]) is None


def test_a_corpus_refuses_other_settings(corpus, tiny_batched_bundle):
    with pytest.raises(ValueError, match="other settings"):
        grow_corpus(corpus[0], tiny_batched_bundle, replace(SETTINGS, new_tokens=13),
                    answer_tokens_goal=10**6, max_batch=4, threads=1)


def test_a_missing_shard_is_named(tmp_path):
    rows = [Row(np.arange(5, dtype=np.int32), 2, True, 0.0, "self", "hi there you")]
    write_shard(tmp_path / "shard-0001.npz", rows, {}, vocab_size=100)
    with pytest.raises(ValueError, match="shard-0000.npz"):
        shard_paths(tmp_path)


@pytest.mark.parametrize("vocab_size", [1000, 70_000])
def test_shards_read_back_as_written(tmp_path, vocab_size):
    rng = np.random.default_rng(0)
    rows = [Row(rng.integers(0, vocab_size, size=n).astype(np.int32), p, bool(n % 2),
                0.7 * (n % 3 == 0), KINDS[n % len(KINDS)], f"request {n} é")
            for n, p in ((9, 4), (3, 1), (17, 10), (6, 6))]
    path = tmp_path / "shard-0000.npz"
    write_shard(path, rows, {"x": 1}, vocab_size)
    back = read_shard(path)
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        assert np.array_equal(a.ids, b.ids) and a.prompt_len == b.prompt_len
        assert (a.ended, a.kind, a.request) == (b.ended, b.kind, b.request)
        assert b.temperature == pytest.approx(a.temperature)


def test_read_corpus_with_a_token_budget_takes_whole_first_shards(corpus):
    out = corpus[0]
    shards = [read_shard(p) for p in shard_paths(out)]
    two = answer_tokens(shards[0] + shards[1])
    assert len(read_corpus(out, max_tokens=two)) == len(shards[0]) + len(shards[1])
    assert len(read_corpus(out, max_tokens=two - 1)) == len(shards[0])
    assert len(read_corpus(out, max_tokens=1)) == len(shards[0])  # at least one shard


def test_pool_requests_mix_the_kinds_from_the_start():
    pool = pool_requests(0)
    assert [k for k, _ in pool[:6]] == ["template", "question", "code"] * 2
    assert len({r for _, r in pool}) == len(pool)
    assert pool == pool_requests(0) and pool != pool_requests(1)


def test_sampled_answers_follow_their_seed(corpus, tiny_batched_bundle):
    """A sampled row is the bundle's sampled decoding alone under the seed the corpus gave
    it: the shard's seed plus the row's place, so that a shard made again is the same."""
    out = corpus[0]
    rows = read_shard(shard_paths(out)[0])
    gen = Generator.from_bundle(tiny_batched_bundle, threads=1)
    seed = (SETTINGS.seed * 1_000_003 + 0) * 10_000 + 5_000
    sampled = [(i, r) for i, r in enumerate(rows) if r.temperature > 0]
    for i, r in sampled:
        alone = gen.generate(prompt_ids=r.ids[:r.prompt_len].tolist(), config=GenerationConfig(
            max_new_tokens=12, temperature=SETTINGS.temperature, seed=seed + i,
            use_draft=False))
        assert list(r.answer) == alone.token_ids


def test_code_blocks_are_the_fenced_ones_of_a_few_lines():
    answer = ("Here:\n```python\ndef f(x):\n    y = x + 1\n    return y\n```\nand\n"
              "```\none line\n```\nthen\n```go\n" + "x++\n" * 31 + "```")
    assert code_blocks(answer) == [("python", "def f(x):\n    y = x + 1\n    return y")]
    rng = random.Random(0)
    for _ in range(200):
        request = code_edit_request("python", "a\nb\nc", rng)
        first, code = request.split("\n\n", 1)
        assert code == "```python\na\nb\nc\n```"
        assert "{lang}" not in first and "in Python:" not in first  # never into its own language
        assert any(first == e or "{lang}" in e for e in CODE_EDITS)


class CharCodec:
    """Text as code points: the tiny bundle's tokenizer has no backticks or newlines, and
    these tests need code blocks that read back as written."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


def grower_on(folder, bundle, answers=()):
    """A CorpusGrower on `folder` whose codec is CharCodec, after planting a shard of rows
    answering `answers` ((kind, text, temperature) each) there."""
    gen = Generator.from_bundle(bundle, threads=1)
    if answers:
        rows = [Row(np.array([1] + CharCodec().encode(text), np.int32), 1, True, t, kind,
                    f"request {i}") for i, (kind, text, t) in enumerate(answers)]
        write_meta(folder, new_meta("tiny", tokenizer_digest(gen.codec.tokenizer), SETTINGS))
        write_shard(shard_path(folder, 0), rows, {}, 1 << 17)
    grower = CorpusGrower(folder, gen, SETTINGS, 2, "tiny")
    grower.gen = SimpleNamespace(codec=CharCodec())
    return grower


def test_code_edit_requests_take_code_from_earlier_greedy_answers(tiny_batched_bundle,
                                                                 tmp_path):
    fenced = "```{}\nline one {}\nline two\nline three\n```"
    answers = [("self", f"See:\n{fenced.format('python', i)}\nDone.", 0.0) for i in range(6)]
    answers += [("self", fenced.format("go", "sampled"), 0.7),  # sampled: not a source
                ("code-edit", fenced.format("c", "edit"), 0.0),  # an edit's own answer: not
                ("question", "No code in this answer at all. " * 10, 0.0)]
    grower = grower_on(tmp_path, tiny_batched_bundle, answers)
    edits = grower.code_edits(4, random.Random(1))
    assert len(edits) == 4 and {k for k, _ in edits} == {"code-edit"}
    sources = {"```python" + fenced.format("", i)[3:] for i in range(6)}
    for _, request in edits:
        assert request.split("\n\n", 1)[1] in sources
    # Asked again, the same blocks make requests of other edits, never one already taken.
    again = grower.code_edits(10, random.Random(2))
    assert len(again) == 6 and not set(again) & set(edits)
    # A summary is never made of an answer to a code request, nor of one holding code.
    summaries = grower.summaries(8, random.Random(3))
    assert [r for _, r in summaries] and all("No code" in r for _, r in summaries)


def test_code_requests_the_target_finishes_start_with_their_opening(tiny_batched_bundle,
                                                                    tmp_path, monkeypatch):
    """Try i starts from the user-turn header and opening i (mod the openings), and the kept
    request is the opening and the target's continuation, under the kind asked for."""
    grower = grower_on(tmp_path, tiny_batched_bundle)
    codec, eos = grower.gen.codec, min(grower.eos)
    openings = ("Write a Go function that", "In Python, how can I")
    seen = []

    def answer(session, jobs, on_done=None):
        seen.extend(ids for ids, _ in jobs)
        return [SimpleNamespace(token_ids=codec.encode(f" sorts {i} numbers by size") + [eos])
                for i in range(len(jobs))]

    monkeypatch.setattr(grow, "answer_jobs", answer)
    picked = grower.self_written(3, seed=0, openings=openings, kind="code-self")
    assert seen == [codec.encode(grower.header + openings[i % 2]) for i in range(6)]
    assert picked == [("code-self", f"{openings[i % 2]} sorts {i} numbers by size")
                      for i in range(3)]
