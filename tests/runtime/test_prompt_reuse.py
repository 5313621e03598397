"""One generation after another on a Generator: on a batched graph (which computes a row
alike in every call) the target's rows of the last generation that start the next prompt
stay, or come back from the prompt store, and its prefill runs only the rest, with the
tokens and rows of a fresh generation; other graphs, and a generation that failed, start
from nothing."""

from __future__ import annotations

import numpy as np
import pytest
from model_calls import spy_calls

from specedge.runtime import Generator
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.prefix_store import PrefixStore


def target_calls(calls: list[tuple[str, int]]) -> list[int]:
    """The tokens of each target call among `spy_calls`'s."""
    return [n for role, n in calls if role == "target"]


@pytest.mark.parametrize("form", ["batched", "fused"])
def test_a_second_turn_prefills_past_the_first(form, tiny_batched_bundle, tiny_fused_bundle,
                                              monkeypatch):
    gen = Generator.from_bundle(tiny_batched_bundle if form == "batched" else tiny_fused_bundle)
    fresh = Generator.from_bundle(tiny_batched_bundle if form == "batched" else
                                  tiny_fused_bundle)
    first = gen.encode_prompt("the cat sat on the mat", raw=True)
    answer = gen.generate(prompt_ids=first, max_new_tokens=10, drafter="model",
                          draft_tokens=2).token_ids
    second = first + answer + gen.encode_prompt(" and then", raw=True)
    calls = spy_calls(monkeypatch, gen, ("forward",))
    got = gen.generate(prompt_ids=second, max_new_tokens=16, drafter="model", draft_tokens=2)
    held = len(first) + len(answer) - 1  # the last token has no row yet
    sizes = target_calls(calls)
    assert sizes[0] == (len(second) - held if form == "batched" else len(second))
    monkeypatch.undo()
    want = fresh.generate(prompt_ids=second, max_new_tokens=16, drafter="model", draft_tokens=2)
    assert got.token_ids == want.token_ids
    n = len(second)
    np.testing.assert_array_equal(gen._cache.planes[..., :n, :], fresh._cache.planes[..., :n, :])


def test_a_generation_that_failed_leaves_nothing_to_reuse(tiny_batched_bundle, monkeypatch):
    """Its prompt's rows overwrote the earlier ones: the next prompt, which starts like the
    earlier generation, runs whole."""
    gen = Generator.from_bundle(tiny_batched_bundle)
    first = gen.encode_prompt("one two three four five", raw=True)
    gen.generate(prompt_ids=first, max_new_tokens=8, use_draft=False)
    forward = OrtCpuBackend.forward

    def fail_after_prefill(self, cache, token_ids, *args, **kwargs):
        if cache.length > 0 and self is gen.target:
            raise RuntimeError("a step failed")
        return forward(self, cache, token_ids, *args, **kwargs)

    monkeypatch.setattr(OrtCpuBackend, "forward", fail_after_prefill)
    with pytest.raises(RuntimeError, match="a step failed"):
        gen.generate(prompt_ids=gen.encode_prompt("zz yy xx ww", raw=True),
                     max_new_tokens=8, use_draft=False)
    monkeypatch.undo()
    calls = spy_calls(monkeypatch, gen, ("forward",))
    again = first + gen.encode_prompt(" six", raw=True)
    got = gen.generate(prompt_ids=again, max_new_tokens=8, use_draft=False).token_ids
    assert target_calls(calls)[0] == len(again)
    monkeypatch.undo()
    assert got == Generator.from_bundle(tiny_batched_bundle).generate(
        prompt_ids=again, max_new_tokens=8, use_draft=False).token_ids


@pytest.mark.parametrize("budget", [2**26, 0])
def test_conversations_taking_turns_find_their_rows_in_the_store(budget, tiny_batched_bundle,
                                                                 monkeypatch):
    """A's rows, overwritten by B's prompt, go to the prompt store and come back for A's
    next turn: its prefill runs only the new tokens, with the tokens and rows of a fresh
    generation. Without a budget the store keeps nothing and the turn runs whole."""
    gen = Generator.from_bundle(tiny_batched_bundle)
    gen.prompt_store = PrefixStore(budget)
    a = gen.encode_prompt("the cat sat on the mat and looked at the dog in the garden "
                          "while the sun went down over the hill", raw=True)
    b = gen.encode_prompt("seven wizards quietly judge boxing matches in the old hall "
                          "of the castle by the river", raw=True)
    assert len(a) >= 16 and a[0] != b[0]
    answer = gen.generate(prompt_ids=a, max_new_tokens=8, use_draft=False).token_ids
    gen.generate(prompt_ids=b, max_new_tokens=8, use_draft=False)
    turn = a + answer + gen.encode_prompt(" and then", raw=True)
    calls = spy_calls(monkeypatch, gen, ("forward",))
    got = gen.generate(prompt_ids=turn, max_new_tokens=12, drafter="model", draft_tokens=2)
    held = len(a) + len(answer) - 1  # the last token has no row yet
    assert target_calls(calls)[0] == (len(turn) - held if budget else len(turn))
    monkeypatch.undo()
    fresh = Generator.from_bundle(tiny_batched_bundle)
    want = fresh.generate(prompt_ids=turn, max_new_tokens=12, drafter="model", draft_tokens=2)
    assert got.token_ids == want.token_ids
    n = len(turn)
    np.testing.assert_array_equal(gen._cache.planes[..., :n, :], fresh._cache.planes[..., :n, :])
