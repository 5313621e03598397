"""Batched decoding on real weights: the README's bundle (SmolLM2-135M-Instruct, int4, the
shipped feature draft, batched attention by default), four requests in one BatchSession with
their own drafters and K, three joining while the first streams, one ending on a stop string,
one on its end-of-sequence token, the others crossing their slot's capacity step
(kv_cache.GROWTH_STEP rows); each gives the token ids, text and stop reason of the same
request alone."""

from __future__ import annotations

import threading

import pytest

from specedge.runtime import GenerationConfig, Generator
from specedge.runtime.batch import BatchSession
from specedge.runtime.kv_cache import GROWTH_STEP


def chat(gen: Generator, text: str) -> list[int]:
    return gen.encode_prompt(messages=[{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def gen(smollm2_int4_feature_bundle) -> Generator:
    return Generator.from_bundle(smollm2_int4_feature_bundle, threads=2)


def test_requests_joining_a_stream_end_as_they_would_alone(gen):
    prompts = [chat(gen, "Why do leaves change colour in autumn?"),
               chat(gen, "Write a Python function that reverses a list."),
               chat(gen, "Explain what a compiler does."),
               chat(gen, "Is the sun a star? Answer yes or no.")]
    configs = [GenerationConfig(max_new_tokens=72),
               GenerationConfig(max_new_tokens=64, drafter="model", draft_tokens=2),
               GenerationConfig(max_new_tokens=64, drafter="prompt-lookup"),
               GenerationConfig(max_new_tokens=48, use_draft=False)]
    # The third ends on a stop string: a word from the middle of its answer alone.
    words = gen.generate(prompt_ids=prompts[2], config=configs[2]).text.split()
    configs[2] = GenerationConfig.of(configs[2], stop=words[len(words) // 2])
    alone = [gen.generate(prompt_ids=p, config=c) for p, c in zip(prompts, configs)]
    # What the requests were chosen for.
    assert alone[2].stop_reason == "stop_string"
    assert alone[3].stop_reason == "eos"
    for p, a in zip(prompts[:2], alone[:2]):
        assert len(p) < GROWTH_STEP < len(p) + len(a.token_ids)

    session = BatchSession(gen, 4)
    results: list = [None] * 4
    streaming = threading.Event()
    first_still_running = []

    def run(i: int) -> None:
        pieces = session.run(prompts[i], configs[i])
        n = 0
        try:
            while True:
                next(pieces)
                n += 1
                if i == 0 and n == 8:
                    streaming.set()
        except StopIteration as done:
            results[i] = done.value

    first = threading.Thread(target=run, args=(0,))
    first.start()
    assert streaming.wait(120)
    others = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 3)]
    first_still_running.append(results[0] is None)
    for t in others:
        t.start()
    for t in (first, *others):
        t.join(300)
    assert first_still_running == [True]  # they joined while it streamed
    for i, (r, a) in enumerate(zip(results, alone)):
        assert r is not None, f"request {i} did not finish"
        assert (r.token_ids, r.text, r.stop_reason) == (a.token_ids, a.text, a.stop_reason), i
    # Their steps met in target calls of several rows: a batch, not turns.
    assert max(session.costs.seen) >= 3, session.costs.seen
