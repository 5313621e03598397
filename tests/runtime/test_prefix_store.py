"""The host-memory store of earlier sequences' rows (runtime/prefix_store.py): the entry
that shares the longest start with a prompt, one entry for a sequence and its
continuations, the least recently used going first past the budget."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime.prefix_store import MIN_TOKENS, PrefixStore, shared_prefix


def rows(n: int, value: float = 1.0) -> np.ndarray:
    """A model's rows for n tokens: [2 * layers, kv_heads, n, head_dim]."""
    return np.full((4, 2, n, 8), value, np.float32)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_shared_prefix_counts_the_common_start():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([1, 2], [1, 2, 3]) == 2
    assert shared_prefix([], [1]) == 0 and shared_prefix([7], [8]) == 0


def test_the_longest_shared_start_wins_and_rows_are_copies():
    store = PrefixStore(2**20)
    a, b = tokens(20), tokens(10) + tokens(30, 100)
    source = rows(20, 1.0)
    assert store.add(a, [source, None])
    source[:] = 5.0  # the store kept its own copy
    assert store.add(b, [rows(40, 2.0), rows(35, 3.0)])
    n, entry = store.longest(tokens(18) + [999])
    assert n == 18 and entry.tokens == tuple(a)
    assert entry.rows[1] is None and float(entry.rows[0].max()) == 1.0
    n, entry = store.longest(tokens(10) + tokens(5, 100))
    assert n == 15 and entry.tokens == tuple(b) and entry.rows[1].shape[2] == 35
    assert store.longest(tokens(5, 500)) == (0, None)


def test_a_sequence_and_its_continuation_keep_one_entry():
    store = PrefixStore(2**20)
    assert store.add(tokens(20), [rows(20)])
    assert store.add(tokens(30), [rows(30)])  # continues the first: it replaces it
    assert list(store.entries) == [tuple(tokens(30))]
    assert not store.add(tokens(25), [rows(25)])  # held already, within the longer one
    assert store.nbytes == rows(30).nbytes


def test_wants_says_what_add_would_store_and_add_takes_copies_as_they_are():
    """A caller that copies outside a lock (batch.py) asks first, then hands its copies."""
    store = PrefixStore(2**20)
    assert store.wants(tokens(20), rows(20).nbytes)
    assert not store.wants(tokens(MIN_TOKENS - 1), 1)
    assert not store.wants(tokens(20), 2**20 + 1)
    copied = rows(20)
    assert store.add(tokens(20), [copied, None], copy=False)
    assert store.entries[tuple(tokens(20))].rows[0] is copied
    assert not store.wants(tokens(20), copied.nbytes) and not store.wants(tokens(18), 1)
    assert store.wants(tokens(30), rows(30).nbytes)  # a continuation: it would replace it
    assert not PrefixStore(0).wants(tokens(20), 1)


def test_past_the_budget_the_least_recently_used_go_first():
    one = rows(20).nbytes
    store = PrefixStore(2 * one)
    first, second, third = tokens(20, 0), tokens(20, 100), tokens(20, 200)
    assert store.add(first, [rows(20)]) and store.add(second, [rows(20)])
    store.longest(first)  # used: the second is now the least recent
    assert store.add(third, [rows(20)])
    assert set(store.entries) == {tuple(first), tuple(third)} and store.nbytes == 2 * one
    assert not store.add(tokens(40, 300), [rows(40), rows(40)])  # more than the budget
    assert not store.add(tokens(MIN_TOKENS - 1, 400), [rows(MIN_TOKENS - 1)])
    with pytest.raises(ValueError, match="budget must be >= 0"):
        PrefixStore(-1)


def test_exchange_stores_what_a_prompt_overwrites_and_finds_only_more_than_it_keeps():
    store = PrefixStore(2**20)
    a = tokens(30)
    # The prompt continues all of a: nothing is overwritten, nothing stored.
    assert store.exchange(a, [rows(30)], a + [500]) == (0, None) and not store.entries
    # A prompt that parts from a after 5 tokens: a's rows go in; none starts it further.
    other = tokens(5) + tokens(20, 200)
    assert store.exchange(a, [rows(30)], other) == (0, None)
    assert list(store.entries) == [tuple(a)]
    # Back to a's conversation, over other's rows: a's entry shares 30, other's rows 5.
    n, entry = store.exchange(other, [rows(25, 2.0)], a + [600])
    assert (n, entry.tokens) == (30, tuple(a)) and len(store.entries) == 2
    # The rows held share as much with the prompt as the store's best: no entry.
    assert store.exchange(a, [rows(30)], a + [700]) == (0, None)
