"""One `Generator` shared by threads: generations are serialized, so every result equals the
one the same call gives alone; a stream left open on a thread cannot deadlock that thread; a
cancel event ends a generation after the step that is running."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specedge.runtime import Generator

PROMPTS = ["hello world", "the cat sat on the mat", "a, b, c!", "why?", "one two three",
           "xyz"]


@pytest.fixture(scope="module")
def gen(tiny_bundle):
    return Generator.from_bundle(tiny_bundle, threads=1)


def _settings(i: int) -> dict:
    # Greedy and sampled, several K and drafters, so that the calls leave different cache
    # lengths, drafter states and auto-K histories behind for the next one to trip on. Auto
    # K only when greedy: sampled text then depends on measured times (config.py).
    k = (1, 3, "auto")[i % 3]
    return dict(raw=True, max_new_tokens=24 + 3 * (i % 4), draft_tokens=k,
                drafter=("model", "lookup+model")[i % 2],
                temperature=0.8 if i % 2 and k != "auto" else 0.0, seed=i)


def test_threads_sharing_a_generator_get_their_sequential_results(gen):
    calls = [(PROMPTS[i % len(PROMPTS)], _settings(i)) for i in range(24)]
    alone = [gen.generate(p, **s) for p, s in calls]
    with ThreadPoolExecutor(max_workers=6) as pool:
        together = list(pool.map(lambda c: gen.generate(c[0], **c[1]), calls))
    for call, a, b in zip(calls, alone, together):
        assert b.token_ids == a.token_ids, call
        assert b.text == a.text


def test_streams_on_threads_join_to_their_sequential_texts(gen):
    calls = [(PROMPTS[i % len(PROMPTS)], _settings(i)) for i in range(8)]
    alone = [gen.generate(p, **s).text for p, s in calls]
    with ThreadPoolExecutor(max_workers=4) as pool:
        texts = list(pool.map(lambda c: "".join(gen.stream(c[0], **c[1])), calls))
    assert texts == alone


def test_a_second_generation_waits_for_an_open_stream_on_another_thread(gen):
    stream = gen.stream("hello world", raw=True, max_new_tokens=30)
    next(stream)  # the stream now holds the generator
    started, finished = threading.Event(), threading.Event()

    def other():
        started.set()
        gen.generate("why?", raw=True, max_new_tokens=5)
        finished.set()

    thread = threading.Thread(target=other)
    thread.start()
    started.wait(5)
    assert not finished.wait(0.5), "ran while the open stream held the generator"
    stream.close()
    assert finished.wait(30)
    thread.join()


def test_a_second_generation_on_the_thread_of_an_open_stream_is_refused(gen):
    stream = gen.stream("hello world", raw=True, max_new_tokens=30)
    next(stream)
    with pytest.raises(RuntimeError, match="already running on this thread"):
        gen.generate("why?", raw=True, max_new_tokens=5)
    stream.close()
    assert gen.generate("why?", raw=True, max_new_tokens=5).token_ids  # free again


def test_cancel_ends_the_generation_after_the_running_step(gen):
    full = gen.generate("the cat sat on the mat", raw=True, max_new_tokens=60, draft_tokens=2)
    cancel = threading.Event()
    pieces = []
    for piece in gen.stream("the cat sat on the mat", raw=True, max_new_tokens=60,
                            draft_tokens=2, cancel=cancel):
        pieces.append(piece)
        cancel.set()
    result = gen.last_result
    assert result.stop_reason == "cancelled"
    # The prefill's token, then at most one step (K = 2 drafts plus the target's token).
    assert 1 <= len(result.token_ids) <= 4
    assert result.token_ids == full.token_ids[:len(result.token_ids)]
    assert "".join(pieces) == result.text
    assert gen.generate("why?", raw=True, max_new_tokens=5).stop_reason != "cancelled"
