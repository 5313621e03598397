"""Rows of earlier sequences kept in host memory, so that a later prompt that starts the same
way copies them instead of computing them (batch.py).

A batch slot keeps the rows of the sequence that last ran in it, and a new sequence's
prompt that parts from them overwrites them; so the session stores them here as their
sequence ends (one generation after another: before a new prompt overwrites them): per
model the K/V rows [0, n) of the slot, [2 * layers, kv_heads, n, head_dim], under the n
tokens they were computed from. A prompt that starts
with an entry's tokens gets the rows copied into its slot (a few milliseconds for a
hundred tokens of SmolLM2, 46 KB a token, against ~1.8 ms a token to compute them on two
cores) and computes only the rest. What llama.cpp's server does with `--cache-ram`.

The store holds at most `budget` bytes, the least recently used entries going first; an
entry whose tokens start another's is dropped for the longer one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Fewer tokens than this are not worth an entry: a chat template's system prompt is more.
MIN_TOKENS = 16


@dataclass
class Entry:
    """The tokens of a sequence and each model's rows computed from their start: `rows[i]`
    [2 * layers, kv_heads, n_i, head_dim], n_i <= len(tokens) (None: the model has none)."""

    tokens: tuple[int, ...]
    rows: list[np.ndarray | None]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows if r is not None)


def shared_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """How many first tokens a and b have in common."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixStore:
    """Entries of earlier sequences' rows (module docstring), `budget` bytes at most."""

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"the prefix store's budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.nbytes = 0

    def longest(self, prompt: list[int]) -> tuple[int, Entry | None]:
        """The entry that shares the most first tokens with `prompt`, and how many."""
        best, found = 0, None
        for entry in self.entries.values():
            n = shared_prefix(prompt, entry.tokens)
            if n > best:
                best, found = n, entry
        if found is not None:
            self.entries.move_to_end(found.tokens)
        return best, found

    def wants(self, tokens: list[int] | tuple[int, ...], nbytes: int) -> bool:
        """Whether `add` would store `nbytes` of rows under `tokens`: enough tokens, rows
        that fit the budget, and no entry that already holds as much of them (checked
        before copying: a store of 0 bytes copies nothing)."""
        key = tuple(tokens)
        return (len(key) >= MIN_TOKENS and nbytes <= self.budget
                and all(shared_prefix(key, old.tokens) < len(key)
                        for old in self.entries.values()))

    def add(self, tokens: list[int], rows: list[np.ndarray | None], copy: bool = True) -> bool:
        """Store `rows` under `tokens` (copies of them; the arrays themselves with `copy`
        false, for a caller that copied them already) if the store `wants` them; entries
        that `tokens` continue go. Returns whether it was stored."""
        key = tuple(tokens)
        if not self.wants(key, sum(r.nbytes for r in rows if r is not None)):
            return False
        for old in list(self.entries.values()):
            if shared_prefix(key, old.tokens) == len(old.tokens):
                self._drop(old.tokens)
        entry = Entry(key, [r.copy() if copy and r is not None else r for r in rows])
        while self.nbytes + entry.nbytes > self.budget:
            self._drop(next(iter(self.entries)))
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        return True

    def exchange(self, held: list[int], rows: list[np.ndarray | None], prompt: list[int]
                 ) -> tuple[int, Entry | None]:
        """Before `prompt` runs over rows computed from `held` (`rows` as `add` takes
        them): store them unless the prompt starts with all of `held`, then return the entry
        that shares more first tokens with the prompt than `held` does, and how many ((0,
        None): none does). What a batch slot (batch.py) and one generation after another
        (generator.py) do with their rows before a new prompt."""
        have = shared_prefix(prompt, held)
        if have < len(held):
            self.add(held, rows)
        n, entry = self.longest(prompt)
        return (n, entry) if entry is not None and n > have else (0, None)

    def _drop(self, key: tuple[int, ...]) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
