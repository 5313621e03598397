"""Several sequences decoded together (runtime/batch.py): a row of a call on several slots
equals the same call alone, and each sequence's output is its own, whatever shares its
steps: greedy tokens equal its plain decoding alone (at every precision on batched
attention, at fp32 on portable attention), sampled tokens follow the target's
distribution."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from model_calls import spy_calls
from power_controls import resamples_from_p
from two_samples import two_sample_pvalue

from specedge.export.bundle_writer import export_bundle
from specedge.gpu_check.two_sample import first_tokens
from specedge.runtime import Generator, token_selection
from specedge.runtime import batch as batch_module
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.batch import (
    PREFILL_CHUNK,
    BatchGenerator,
    BatchRequest,
    BatchSession,
    prefill_chunks,
)
from specedge.runtime.bundle import load_bundle
from specedge.runtime.config import GenerationConfig
from specedge.runtime.kv_cache import GROWTH_STEP, MAX_BATCHED_TOKENS, SlotCaches

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


@pytest.fixture(scope="module")
def batched_bundles(tiny_checkpoints, tiny_batched_bundle, tmp_path_factory) -> dict:
    """The same on batched attention (ONNX's Attention, the cache written in place), per
    precision; GPT-2 (no rotary, learned positions) at int8; heads of 16 (rotated by ONNX
    Runtime's RotaryEmbedding, not by the graph's own ops) at int4."""
    bundles = {"fp32": tiny_batched_bundle}
    for arch, precision in (("llama", "int8"), ("llama", "int4"), ("gpt2", "int8"),
                            ("llama-h16", "int4")):
        name = precision if arch == "llama" else f"{arch}-{precision}"
        bundles[name] = tmp_path_factory.mktemp("batch") / f"batched-{name}"
        export_bundle(str(tiny_checkpoints[arch]), bundles[name], draft_layers=1,
                      precision=precision, attention="batched")
    return bundles


@pytest.fixture(scope="module", params=[("portable", p) for p in ("fp32", "int8", "int4")]
                + [("batched", p) for p in ("fp32", "int8", "int4", "gpt2-int8",
                                            "llama-h16-int4")],
                ids=lambda p: "-".join(p))
def batchable(request, portable_bundles, batched_bundles):
    form, name = request.param
    return (portable_bundles if form == "portable" else batched_bundles)[name]


@pytest.fixture(scope="module")
def gen(portable_bundles):
    return Generator.from_bundle(portable_bundles["fp32"])


def test_rows_of_one_call_equal_the_same_calls_alone(batchable):
    """Three slots at different lengths, T = 1, 2 and 4 padded to 4, and a slot in the
    range without a row: each row's logits and K/V rows equal a call of that row alone
    with T = 4 (its tokens padded the same way) bit for bit, and the idle slot keeps its
    rows and length (a batched graph writes the padding past them)."""
    spec = load_bundle(batchable).target
    backend = OrtCpuBackend(spec)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, spec.vocab_size, n).tolist() for n in (5, 9, 3, 7)]
    rows = {0: [11], 1: [12, 13], 3: [14, 15, 16, 17]}
    caches = SlotCaches(spec.num_layers, spec.num_kv_heads, spec.head_dim, 32, 4,
                        spare=MAX_BATCHED_TOKENS)
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
    kept = len(prompts[2])
    assert caches.slots[2].length == kept
    assert np.array_equal(caches.slots[2].planes[..., :kept, :], idle[..., :kept, :])


def test_call_shape_bindings_stay_within_their_memory_budget(tiny_batched_bundle):
    """Each call shape (first slot, rows, tokens) binds buffers of its own; past the
    backend's budget the least recently used go, and a shape met again binds anew and
    computes what it did."""
    spec = load_bundle(tiny_batched_bundle).target
    backend = OrtCpuBackend(spec)
    caches = SlotCaches(spec.num_layers, spec.num_kv_heads, spec.head_dim, 64, 4,
                        spare=MAX_BATCHED_TOKENS)
    shapes = [{0: [5], 1: [6]}, {0: [5, 6, 7]}, {1: [8], 2: [9, 10], 3: [11]},
              {0: [5], 1: [6]}]
    backend.forward_slots(caches, 0, shapes[0])
    one = backend.slot_bindings_nbytes
    backend.slot_binding_bytes = 2 * one  # room for two small shapes, not for all three
    got = []
    for rows in shapes:
        for slot in caches.slots:
            slot.rollback(0)
        out = backend.forward_slots(caches, min(rows), rows)
        got.append({s: out[s].copy() for s in rows})
        # Within the budget, or the one binding the call needs.
        assert (backend.slot_bindings_nbytes <= backend.slot_binding_bytes
                or len(backend._slot_bindings) == 1)
    assert len(backend._slot_bindings) < 3  # of the three shapes met
    for s in shapes[0]:
        assert np.array_equal(got[0][s], got[3][s])


def test_a_row_does_not_depend_on_the_slots_capacity(batchable):
    """The graph attends over every row of the capacity, masked past each row's length,
    so the session may raise and cut the capacity between calls (`_run_group`): the same
    rows at capacities 32, 64 and 160 give the same logits bit for bit."""
    spec = load_bundle(batchable).target
    backend = OrtCpuBackend(spec)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, spec.vocab_size, n).tolist() for n in (12, 29)]
    got = []
    for capacity in (32, 64, 160):
        caches = SlotCaches(spec.num_layers, spec.num_kv_heads, spec.head_dim, capacity, 2,
                            spare=MAX_BATCHED_TOKENS)
        backend.forget_bindings()
        prefill = [backend.forward(caches.slots[s], p, 1).copy() for s, p in enumerate(prompts)]
        rows = backend.forward_slots(caches, 0, {0: [7, 8, 9], 1: [10]})
        got.append([*prefill, rows[0].copy(), rows[1].copy()])
    for other in got[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got[0], other))


def test_one_token_rows_on_a_batched_target_equal_plain_steps_alone(batched_bundles):
    """A call of one token a row on a batched target, three rows, runs unpadded: each
    row's logits equal that sequence's plain step alone (run as two tokens) bit for bit,
    at int4, because the graph's attention never takes its one-query path."""
    spec = load_bundle(batched_bundles["int4"]).target
    backend = OrtCpuBackend(spec)
    assert backend.one_token_as_two
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, spec.vocab_size, n).tolist() for n in (6, 4, 11)]
    caches = SlotCaches(spec.num_layers, spec.num_kv_heads, spec.head_dim, 32, 3,
                        spare=MAX_BATCHED_TOKENS)
    for slot, prompt in enumerate(prompts):
        backend.forward(caches.slots[slot], prompt, 1)
    got = backend.forward_slots(caches, 0, {0: [21], 1: [22], 2: [23]})
    for slot, token in enumerate((21, 22, 23)):
        alone = backend.new_cache(32)
        backend.forward(alone, prompts[slot], 1)
        assert np.array_equal(got[slot], backend.forward(alone, [token], 1))
        assert caches.slots[slot].length == len(prompts[slot]) + 1


CONFIGS = [dict(max_new_tokens=30, use_draft=False),
           dict(max_new_tokens=40, drafter="prompt-lookup", draft_tokens=3),
           dict(max_new_tokens=25, drafter="model", draft_tokens=2),
           dict(max_new_tokens=35, drafter="model", draft_tokens="auto"),
           dict(max_new_tokens=12, drafter="lookup+model", draft_tokens=4),
           dict(max_new_tokens=3, drafter="model", draft_tokens=1)]


@pytest.fixture(scope="module", params=["portable-fp32", "batched-fp32", "batched-int8",
                                        "batched-int4", "batched-gpt2-int8",
                                        "batched-llama-h16-int4"])
def exact(request, gen, batched_bundles):
    """The Generators whose batched greedy output equals plain decoding alone: fp32 on
    either attention, int8 and int4 on batched attention only (a portable quantized graph
    computes a row alike in calls of the same T only, docs/design.md, "Batch invariance of
    quantized graphs", which the row test above checks, while padding changes a row's T)."""
    form, name = request.param.split("-", 1)
    return gen if form == "portable" else Generator.from_bundle(batched_bundles[name])


def assert_six_sequences_equal_plain_decoding_alone(gen: Generator) -> None:
    """Six sequences, each with its own drafter, K and length, so that rows join calls
    with different numbers of tokens and leave at different steps: each one's greedy
    tokens equal its plain decoding alone, and the draft model's drafts are both accepted
    and rejected."""
    alone = [gen.generate(p, raw=True, max_new_tokens=c["max_new_tokens"], use_draft=False)
             for p, c in zip(PROMPTS, CONFIGS)]
    batch = BatchGenerator(gen, max_batch=6).generate(
        [BatchRequest(prompt=p, raw=True, config=GenerationConfig(**c))
         for p, c in zip(PROMPTS, CONFIGS)])
    for a, b, c in zip(alone, batch, CONFIGS):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert len(b.token_ids) == c["max_new_tokens"] and b.stop_reason == "max_new_tokens"
    modelled = [b for b, c in zip(batch, CONFIGS) if "model" in c.get("drafter", "")]
    drafted = sum(b.stats["drafted_tokens"] for b in modelled)
    accepted = sum(b.stats["accepted_tokens"] for b in modelled)
    assert 0 < accepted < drafted


def test_each_greedy_sequence_equals_its_plain_decoding_alone(exact):
    assert_six_sequences_equal_plain_decoding_alone(exact)


def wait_until_running(session: BatchSession, n: int) -> None:
    """Called by a sequence's consumer between two pieces: wait until `n` sequences have
    joined, so that the next step meets the newcomer's, however slowly its thread starts
    (a tiny model decodes a hundred tokens alone in well under a second)."""
    deadline = time.monotonic() + 60
    while session.meeting.running < n and time.monotonic() < deadline:
        time.sleep(0.005)


def test_long_prompts_run_in_chunks_and_stay_exact(batched_bundles, monkeypatch):
    """On a batched int4 bundle, a prompt of 100 tokens that arrives while another
    sequence decodes runs in calls of PREFILL_CHUNK tokens and a last one of 4
    (`prefill_chunks`; its draft's in calls twice as long, the draft having half the
    target's layers),
    each on a row of its own in a meeting of its own; both sequences' greedy tokens equal their
    plain decoding alone, whose prompt ran in one call, also past the slots' first capacity
    (GROWTH_STEP rows), which the session raises for every slot between two calls. A
    prompt with nobody else running runs whole, and so does one on a portable graph (which
    computes a chunk otherwise than the whole prompt)."""
    gen = Generator.from_bundle(batched_bundles["int4"])
    long_prompt = np.random.default_rng(3).integers(3, 34, 100).tolist()
    n = 2 * GROWTH_STEP  # 100 + n rows: the capacity raised three times
    first_ids = gen.encode_prompt(PROMPTS[1], raw=True)
    alone = [gen.generate(prompt_ids=first_ids, max_new_tokens=n, use_draft=False),
             gen.generate(prompt_ids=long_prompt, max_new_tokens=n, use_draft=False)]
    calls = spy_calls(monkeypatch, gen, ("forward",))
    session, results, started = BatchSession(gen, 2), [None, None], threading.Event()

    def run(i: int, ids: list[int], config: GenerationConfig) -> None:
        pieces = session.run(ids, config)
        try:
            while True:
                next(pieces)
                if i == 0 and not started.is_set():
                    started.set()  # the first sequence decodes: the second arrives now
                    wait_until_running(session, 2)
        except StopIteration as done:
            results[i] = done.value

    threads = [threading.Thread(target=run, args=(0, first_ids, GenerationConfig(
        max_new_tokens=n, use_draft=False)))]
    threads[0].start()
    assert started.wait(60)
    threads.append(threading.Thread(target=run, args=(1, long_prompt, GenerationConfig(
        max_new_tokens=n, drafter="model", draft_tokens=2))))
    threads[1].start()
    for t in threads:
        t.join(120)
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    sizes = [n for role, n in calls if role == "target"]
    assert prefill_chunks(100, 1, chunked=True) == [PREFILL_CHUNK] * (96 // PREFILL_CHUNK) + [4]
    assert Counter(sizes)[PREFILL_CHUNK] == 96 // PREFILL_CHUNK and 4 in sizes
    assert 100 not in sizes
    # The draft (1 layer of the target's 2) takes its prompt in chunks twice as long.
    assert [m.chunk_tokens for m in session.models] == [PREFILL_CHUNK, 2 * PREFILL_CHUNK]
    drafts = [n for role, n in calls if role == "draft"]
    assert max(drafts) == 2 * PREFILL_CHUNK and PREFILL_CHUNK not in drafts
    assert sizes[0] == len(first_ids)  # nobody else running: one call
    assert prefill_chunks(100, 1, chunked=False) == [100]
    # No chunk is longer than PREFILL_CHUNK, and none is one token (another kernel path).
    for n in range(1, 80):
        sizes = prefill_chunks(n, 1, chunked=True)
        assert sum(sizes) == n and max(sizes) <= PREFILL_CHUNK
        assert len(sizes) == 1 or min(sizes) >= 2
    assert prefill_chunks(17, 1, chunked=True, size=16) == [15, 2]
    assert prefill_chunks(17, 1, chunked=True, size=8) == [8, 7, 2]
    assert prefill_chunks(32, 1, chunked=True, size=16) == [16, 16]
    assert prefill_chunks(40, 4, chunked=True) == [40]  # a verification


def run_to_end(session: BatchSession, ids: list[int], config: GenerationConfig) -> list[int]:
    return run_to_end_of(session.run(ids, config))


def run_to_end_of(pieces) -> list[int]:
    """The token ids of a sequence's generation, its pieces run to the end."""
    try:
        while True:
            next(pieces)
    except StopIteration as done:
        return done.value.token_ids


@pytest.mark.parametrize("form", ["batched-int4", "batched-fp32", "portable-fp32"])
def test_a_prompt_that_continues_an_earlier_sequence_runs_past_its_rows(
        form, gen, batched_bundles, monkeypatch):
    """A conversation's second turn (the first prompt, its answer, and more) after the
    first in one session: on a batched graph it takes the slot that holds the first
    sequence's rows (of its prompt and answer, all but the last token) and its prompt's
    calls run only the tokens past them, on the target and on the draft, with greedy
    tokens equal to its plain decoding alone; a third prompt sharing nothing with them runs
    whole on the other slot. A portable graph, which computes a split prompt otherwise than
    the whole, always runs the whole prompt."""
    if form != "portable-fp32":
        gen = Generator.from_bundle(batched_bundles[form.split("-", 1)[1]])
    first = gen.encode_prompt(PROMPTS[1], raw=True)
    session = BatchSession(gen, 2)
    calls = spy_calls(monkeypatch, gen)
    config = GenerationConfig(max_new_tokens=20, drafter="model", draft_tokens=2)
    answer = run_to_end(session, first, replace(config, max_new_tokens=12))
    second = first + answer + gen.encode_prompt(PROMPTS[3], raw=True)
    calls.clear()
    got = run_to_end(session, second, config)
    batched = form != "portable-fp32"
    held = len(first) + len(answer) - 1  # the last token has no row yet
    assert calls[0] == ("target", len(second) - held if batched else len(second))
    # The draft's rows: as far as its last accepted draft. It takes the prompt in at its
    # first draft step, with the first token.
    first_draft = next(n for role, n in calls if role == "draft")
    if batched:
        assert first_draft <= len(second) - len(first) + 1
    else:
        assert first_draft == len(second) + 1
    other = np.random.default_rng(7).integers(3, 34, 30).tolist()
    calls.clear()
    run_to_end(session, other, GenerationConfig(max_new_tokens=4, use_draft=False))
    assert calls[0] == ("target", len(other))
    monkeypatch.undo()
    assert got == gen.generate(prompt_ids=second, max_new_tokens=20, use_draft=False).token_ids
    if batched:  # the prompt's rows kept in its slot: those of its plain decoding alone
        np.testing.assert_array_equal(session.models[0].caches.planes[:, 0, :, :len(second)],
                                      gen._cache.planes[:, 0, :, :len(second)])


def test_a_drafts_kept_rows_stay_counted_until_its_first_draft_step(batched_bundles):
    """The draft takes a prompt in at its first draft step, which may come many steps after
    the first token (lookup drafts, auto K at 0). Until then the draft's rows that its slot
    kept of the prompt's start stay counted, so that the others' calls write their padding
    past them and a resize of the slots copies them; counted from 0, a resize lost them and
    the first draft step then asked for more rows than the cut capacity held. A resize
    while the draft waits keeps them bit for bit, and the greedy tokens equal plain
    decoding alone."""
    gen = Generator.from_bundle(batched_bundles["int4"])
    session = BatchSession(gen, 2)
    config = GenerationConfig(max_new_tokens=12, drafter="model", draft_tokens=2)
    first = gen.encode_prompt(PROMPTS[1], raw=True)
    answer = run_to_end(session, first, config)
    second = first + answer + gen.encode_prompt(PROMPTS[3], raw=True)
    draft = session.models[1].caches
    slot = next(s for s, kept in session.models[0].kept.items() if kept[:len(first)] == first)
    held = draft.slots[slot].length
    rows = draft.planes[:, slot, :, :held].copy()
    assert held > len(first)
    pieces = session.run(second, replace(config, max_new_tokens=20))
    next(pieces)  # the first token: the target has read the prompt, the draft has started
    assert draft.slots[slot].length == held
    draft.resize(draft.capacity + GROWTH_STEP)
    session.models[1].backend.forget_bindings()
    np.testing.assert_array_equal(draft.planes[:, slot, :, :held], rows)
    try:
        while True:
            next(pieces)
    except StopIteration as done:
        tokens = done.value.token_ids
    assert tokens == gen.generate(prompt_ids=second, max_new_tokens=20,
                                  use_draft=False).token_ids


@pytest.mark.parametrize("store", ["store", "no store"])
def test_rows_a_slot_gave_up_come_back_from_the_store(store, batched_bundles, monkeypatch):
    """One slot: a conversation's first turn, then an unrelated prompt (each sequence's
    rows go to the host-memory store as it ends), then the conversation's second turn:
    its target and draft rows are copied back from the store and only the rest of its
    prompt runs, with greedy tokens equal to its plain decoding alone; a session without a
    store (0 bytes) runs it whole."""
    gen = Generator.from_bundle(batched_bundles["int4"])
    session = BatchSession(gen, 1, store_bytes=batch_module.PREFIX_STORE_BYTES
                           if store == "store" else 0)
    config = GenerationConfig(max_new_tokens=20, drafter="model", draft_tokens=2)
    first = gen.encode_prompt(PROMPTS[1], raw=True)
    answer = run_to_end(session, first, replace(config, max_new_tokens=12))
    run_to_end(session, np.random.default_rng(8).integers(3, 34, 40).tolist(),
               replace(config, max_new_tokens=6))
    assert len(session.store.entries) == (2 if store == "store" else 0)
    second = first + answer + gen.encode_prompt(PROMPTS[3], raw=True)
    calls = spy_calls(monkeypatch, gen)
    got = run_to_end(session, second, config)
    held = len(first) + len(answer) - 1
    first_draft = next(n for role, n in calls if role == "draft")
    if store == "store":
        assert calls[0] == ("target", len(second) - held)
        assert first_draft <= len(second) - len(first) + 1
    else:
        assert calls[0] == ("target", len(second)) and first_draft == len(second) + 1
    monkeypatch.undo()
    assert got == gen.generate(prompt_ids=second, max_new_tokens=20, use_draft=False).token_ids
    # The prompt's rows in the slot are the rows of its plain decoding alone, bit for bit.
    np.testing.assert_array_equal(session.models[0].caches.planes[:, 0, :, :len(second)],
                                  gen._cache.planes[:, 0, :, :len(second)])


def test_a_sequence_that_ends_stores_its_rows_while_the_others_decode(batched_bundles,
                                                                      monkeypatch):
    """A sequence's rows go to the store once it has left the batch, before its slot is
    free again: the sequence still running keeps calling the model during the copy (it
    would wait for the copy if it were made while the ended one still counted as running).
    The stored rows are the slot's, and both outputs stay their plain decoding alone."""
    from specedge.runtime.prefix_store import PrefixStore

    gen = Generator.from_bundle(batched_bundles["fp32"])
    session = BatchSession(gen, 2)
    calls = spy_calls(monkeypatch, gen, ("forward_slots",))
    add, seen = PrefixStore.add, []

    def watched_add(self, tokens, rows, copy=True):
        before = len(calls)
        deadline = time.monotonic() + 20
        while session.meeting.running and len(calls) == before and \
                time.monotonic() < deadline:
            time.sleep(0.01)  # the running sequence's calls go on meanwhile
        seen.append((session.meeting.running, len(calls) - before, len(session._free)))
        return add(self, tokens, rows, copy)

    monkeypatch.setattr(PrefixStore, "add", watched_add)
    running, started, results = PROMPTS[2] * 3, threading.Event(), {}

    def decode(name: str, prompt: str, n: int, signal: threading.Event | None) -> None:
        pieces = session.run(gen.encode_prompt(prompt, raw=True),
                             GenerationConfig(max_new_tokens=n, use_draft=False))
        try:
            while True:
                next(pieces)
                if signal is not None and not signal.is_set():
                    signal.set()
                    # From B's joining on, every step of A's meets one of B's, so B (its
                    # prompt and 10 tokens) ends long before A's 120 tokens.
                    wait_until_running(session, 2)
        except StopIteration as done:
            results[name] = done.value.token_ids

    a = threading.Thread(target=decode, args=("a", running, 120, started))
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=decode, args=("b", PROMPTS[1], 10, None))
    b.start()
    b.join(120)
    # B left (one running), A called meanwhile, B's slot not yet free (none of 2 is).
    assert seen and seen[0][0] == 1 and seen[0][1] > 0 and seen[0][2] == 0, seen
    a.join(120)
    monkeypatch.undo()
    b_ids = gen.encode_prompt(PROMPTS[1], raw=True)
    entry = session.store.entries[tuple(b_ids + results["b"][:-1])]
    slot = next(s for s, kept in session.models[0].kept.items() if kept[:len(b_ids)] == b_ids)
    n = entry.rows[0].shape[2]
    np.testing.assert_array_equal(entry.rows[0], session.models[0].caches.planes[:, slot, :, :n])
    for name, prompt, n in (("a", running, 120), ("b", PROMPTS[1], 10)):
        assert results[name] == gen.generate(prompt, raw=True, max_new_tokens=n,
                                             use_draft=False).token_ids


def test_capacity_is_cut_when_the_long_sequence_leaves(batched_bundles, monkeypatch):
    """A sequence of 180 rows raises the slots' capacity to 192; once it has left, the next
    sequence's first call cuts it back to what that one needs (64 rows), and its greedy
    tokens equal its plain decoding alone."""
    gen = Generator.from_bundle(batched_bundles["int4"])
    long_ids = np.random.default_rng(5).integers(3, 34, 170).tolist()
    short_ids = gen.encode_prompt(PROMPTS[0], raw=True)
    want = gen.generate(prompt_ids=short_ids, max_new_tokens=40, use_draft=False).token_ids
    capacities = []
    resize = SlotCaches.resize

    def spy(self, capacity):
        capacities.append(capacity)
        return resize(self, capacity)

    monkeypatch.setattr(SlotCaches, "resize", spy)
    session = BatchSession(gen, 2)

    def run(ids: list[int], n: int) -> list[int]:
        pieces = session.run(ids, GenerationConfig(max_new_tokens=n, use_draft=False))
        try:
            while True:
                next(pieces)
        except StopIteration as done:
            return done.value.token_ids

    run(long_ids, 10)
    assert capacities[-1] == 192, capacities
    capacities.clear()
    assert run(short_ids, 40) == want
    assert capacities == [GROWTH_STEP], capacities


def meeting_of_three(monkeypatch, record, streaming: tuple[int, ...] = (), tokens: int = 16):
    """A meeting of three sequences (slots 0, 1, 2) on a stand-in model whose groups of
    calls go to `record` (each answered with zero logits) instead of a backend; the slots in
    `streaming` have their first token out already, the others have prompts of `tokens`
    tokens: (the model, a function that runs a sequence's calls in turn and then leaves)."""

    def run_group(model, group, cost=None):
        record(group)
        for c in group:
            c.logits = np.zeros((c.keep, 4), np.float32)
        return 0

    monkeypatch.setattr(batch_module, "_run_group", run_group)
    model = object()
    meeting = batch_module._Meeting(target=model)
    for slot in range(3):
        meeting.join(slot, tokens)
        if slot in streaming:
            del meeting.reading[slot]
            meeting.streaming.add(slot)

    def sequence(calls: list[batch_module._Call]) -> None:
        for call in calls:
            meeting.call(call)
        meeting.leave(calls[0].slot)

    return model, sequence


def run_sequences(sequence, calls_of: dict[int, list]) -> None:
    threads = [threading.Thread(target=sequence, args=(calls,)) for calls in calls_of.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a sequence still waits on its call"


def shapes(groups) -> list[tuple[tuple[int, int], ...]]:
    """Each group of calls as its (slot, tokens) pairs."""
    return [tuple(sorted((c.slot, len(c.tokens)) for c in g)) for g in groups]


def test_a_meeting_runs_one_prompt_call_a_model_while_a_sequence_streams(monkeypatch):
    """Two prompts' calls and a streaming sequence's steps wait together: the meeting runs
    the step and one prompt, the other prompt with the next step, so that the step waits
    for one prompt call at a time."""
    groups = []
    model, sequence = meeting_of_three(monkeypatch, groups.append, streaming=(2,))
    run_sequences(sequence, {
        0: [batch_module._Call(model, 0, [1] * 16, 1, alone=True)],
        1: [batch_module._Call(model, 1, [1] * 16, 1, alone=True)],
        2: [batch_module._Call(model, 2, [1], 1) for _ in range(3)]})
    assert sorted(tuple(sorted(len(c.tokens) for c in g)) for g in groups) == \
        [(1,), (1, 16), (1, 16)], groups


def test_prompts_read_with_nobody_streaming_run_in_one_meeting_and_start_together(
        monkeypatch):
    """With no stream to hold up, every waiting prompt runs in the first meeting, and the
    three sequences' first steps meet in the next one."""
    groups = []
    model, sequence = meeting_of_three(monkeypatch, groups.append)
    run_sequences(sequence, {slot: [batch_module._Call(model, slot, [1] * (8 + slot), 1,
                                                       alone=True),
                                    batch_module._Call(model, slot, [1], 1)]
                             for slot in range(3)})
    assert shapes(groups) == [((0, 8), (1, 9), (2, 10)), ((0, 1), (1, 1), (2, 1))], groups


def test_a_first_token_waits_for_the_prompts_of_companions_that_came_with_it(monkeypatch):
    """Two prompts read one call a meeting beside a stream: the shorter one's first token
    is held until the longer one is read, so that its first step comes with the longer
    one's, not beside the longer one's chunks."""
    groups = []
    model, sequence = meeting_of_three(monkeypatch, groups.append, streaming=(2,))
    prompt = {slot: [batch_module._Call(model, slot, [1] * 8, 1, alone=True, chunk=n > 8)
                     for n in range(8 * chunks, 0, -8)]
              for slot, chunks in ((0, 1), (1, 2))}
    run_sequences(sequence, {
        **{slot: calls + [batch_module._Call(model, slot, [1], 1)]
           for slot, calls in prompt.items()},
        2: [batch_module._Call(model, 2, [1], 1) for _ in range(4)]})
    met = shapes(groups)
    assert sorted(met[:3]) == [((0, 8), (2, 1)), ((1, 8), (2, 1)), ((1, 8), (2, 1))], groups
    assert met[3:] == [((0, 1), (1, 1), (2, 1))], groups


def test_nobody_waits_for_a_long_prompt(monkeypatch):
    """A companion with more than TOGETHER_TOKENS tokens left does not hold a first token:
    the short prompt's first step comes beside the long one's next chunk."""
    groups = []
    model, sequence = meeting_of_three(monkeypatch, groups.append, streaming=(2,),
                                       tokens=batch_module.TOGETHER_TOKENS + 16)
    run_sequences(sequence, {
        0: [batch_module._Call(model, 0, [1] * 8, 1, alone=True),
            batch_module._Call(model, 0, [1], 1)],
        1: [batch_module._Call(model, 1, [1] * 8, 1, alone=True, chunk=True),
            batch_module._Call(model, 1, [1] * 8, 1, alone=True, chunk=True)],
        2: [batch_module._Call(model, 2, [1], 1) for _ in range(4)]})
    assert ((0, 1), (1, 8), (2, 1)) in shapes(groups), groups


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


def test_a_sequence_that_meets_eos_ends_there_and_its_companion_runs_on(portable_bundles,
                                                                         tmp_path):
    """The bundle's EOS made a token that one prompt's greedy answer reaches at its 6th
    token: in a batch that sequence ends there with stop reason "eos" and its tokens alone;
    its companion, which would go on past that token, runs to its own end."""
    import json
    import shutil

    plain = Generator.from_bundle(portable_bundles["fp32"])
    answer = plain.generate(PROMPTS[0], raw=True, max_new_tokens=20, use_draft=False)
    eos = answer.token_ids[5]
    bundle = tmp_path / "b"
    shutil.copytree(portable_bundles["fp32"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["tokenizer"]["eos_token_ids"] = [eos]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    gen = Generator.from_bundle(bundle)
    config = GenerationConfig(max_new_tokens=20, drafter="model", draft_tokens=2)
    alone = [gen.generate(p, raw=True, config=config) for p in PROMPTS[:2]]
    assert alone[0].stop_reason == "eos" and alone[0].token_ids[-1] == eos
    assert len(alone[0].token_ids) == answer.token_ids.index(eos) + 1
    assert alone[1].stop_reason != "eos" and len(alone[1].token_ids) == 20
    batch = BatchGenerator(gen, 2).generate([BatchRequest(prompt=p, raw=True, config=config)
                                             for p in PROMPTS[:2]])
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [r.stop_reason for r in batch] == [r.stop_reason for r in alone]


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


@pytest.mark.parametrize("form", ["portable-fp32", "batched-int4"])
def test_sampled_sequences_with_companions_follow_the_target(form, gen, batched_bundles,
                                                             monkeypatch):
    """Two-sample chi-square on the joint of the first 2 tokens: N = 1500 plain
    generations alone (seeds 0 .. 1499) against 1500 speculative ones (K = 2, model draft,
    seeds 10000 .. 11499) decoded two to a batch of four with companions; alpha = 0.001,
    cells under 10 draws pooled; on portable fp32 and batched int4 attention. Power control
    at the same N, seeds and alpha: the batched arm with a verifier that draws a rejected
    draft's replacement from p instead of the residual is rejected."""
    if form == "batched-int4":
        gen = Generator.from_bundle(batched_bundles["int4"])
    plain = first_tokens(gen, 1500, 0, 2, use_draft=False, temperature=1.0)
    assert two_sample_pvalue(plain, _batched_first_tokens(gen, 1500, 10_000, 2)) > 0.001
    monkeypatch.setattr(token_selection, "verify_sampled", resamples_from_p)
    assert two_sample_pvalue(plain, _batched_first_tokens(gen, 1500, 10_000, 2)) < 0.001


def test_batches_refuse_what_they_cannot_run(tiny_fused_bundle, gen):
    fused = Generator.from_bundle(tiny_fused_bundle)
    with pytest.raises(ValueError, match="GroupQueryAttention.*--attention batched"):
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


def test_a_failing_call_fails_its_own_sequence_alone(batched_bundles, monkeypatch):
    """A sequence streams; a second joins, and its prompt's first chunk, which meets the
    first sequence's step, fails in the model (a prompt chunk runs on a row of its own). The
    second ends with its error; the first finishes with its plain decoding alone's tokens,
    and the session serves the next sequence."""
    gen = Generator.from_bundle(batched_bundles["int4"])
    prompts = [gen.encode_prompt(p, raw=True) for p in PROMPTS[:2]]
    assert len(prompts[1]) > PREFILL_CHUNK  # read in chunks beside a stream
    config = GenerationConfig(max_new_tokens=24, drafter="model", draft_tokens=2)
    alone = gen.generate(prompt_ids=prompts[0], max_new_tokens=24, use_draft=False).token_ids
    session = BatchSession(gen, 2)
    real = OrtCpuBackend.forward

    def forward(self, cache, token_ids, *args, **kwargs):
        if cache.length == 0 and list(token_ids) == prompts[1][:len(token_ids)]:
            raise RuntimeError("the model failed on this prompt")
        return real(self, cache, token_ids, *args, **kwargs)

    monkeypatch.setattr(OrtCpuBackend, "forward", forward)
    streaming, results = threading.Event(), {}

    def first() -> None:
        pieces = session.run(prompts[0], config)
        next(pieces)
        streaming.set()
        wait_until_running(session, 2)  # its next step meets the second's first chunk
        results[0] = run_to_end_of(pieces)

    def second() -> None:
        streaming.wait(60)
        try:
            results[1] = run_to_end(session, prompts[1], config)
        except RuntimeError as e:
            results[1] = e

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert isinstance(results[1], RuntimeError) and "this prompt" in str(results[1])
    assert results[0] == alone
    monkeypatch.undo()
    assert run_to_end(session, prompts[0], config) == alone
    assert session.running == 0


def test_two_sequences_on_one_thread_raise_instead_of_waiting_for_ever(gen):
    """Iterated in turns on one thread, each of two sequences would wait for the other's
    call: the second to call learns why, the first goes on."""
    session = BatchSession(gen, 2)
    config = GenerationConfig(max_new_tokens=8, use_draft=False)
    first = session.run(gen.encode_prompt("hello world", raw=True), config)
    second = session.run(gen.encode_prompt("why?", raw=True), config)
    next(first)
    with pytest.raises(RuntimeError, match="on the same thread"):
        next(second)
    assert len(run_to_end_of(first)) == 8


def test_sampled_requests_in_a_batch_default_to_auto_k(gen):
    """A sampled request that leaves K to the default drafts with auto K in a batch, priced
    for the whole batch (its fixed K = 1 alone would pad every row of every call to two
    tokens); one that sets K keeps it; alone, the default stays K = 1."""
    sampled = GenerationConfig(max_new_tokens=6, temperature=0.8, seed=1)
    results = BatchGenerator(gen, 3).generate([
        BatchRequest(prompt=PROMPTS[0], raw=True, config=sampled),
        BatchRequest(prompt=PROMPTS[1], raw=True,
                     config=GenerationConfig.of(sampled, draft_tokens=2)),
        BatchRequest(prompt=PROMPTS[2], raw=True, config=GenerationConfig(max_new_tokens=6))])
    assert [r.stats["draft_tokens_k"] for r in results] == ["auto", 2, "auto"]
    alone = gen.generate(prompt=PROMPTS[0], raw=True, config=sampled)
    assert alone.stats["draft_tokens_k"] == 1
