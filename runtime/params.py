"""Generation settings and their validation: every bad value is a ValueError that names the
value and the allowed range."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from .sampling import SparseProbs, process_row, sample

DRAFTERS = ("model", "prompt-lookup", "lookup+model")
DEFAULT_DRAFTER = "lookup+model"  # matched or beat the model alone in every bench category


@dataclass(frozen=True)
class Sampling:
    """Temperature 0 is greedy; otherwise HF order: temperature, top-k, top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: np.ndarray) -> SparseProbs:
        """One row of logits [V], processed (runtime/sampling.py), as its support."""
        return process_row(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One token from one row of logits: argmax when greedy, else a draw from probs."""
        if self.greedy:
            x = int(np.argmax(logits))
            if not math.isfinite(logits[x]):
                raise ValueError("the model returned logits with no finite maximum (all "
                                 "masked or NaN): check the bundle's graphs")
            return x
        return sample(self.probs(logits), rng)


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


# The shipped SmolLM2 drafts accept about a third of sampled tokens, where K = 1 is the best
# fixed K (feature draft, int8, T 0.7 / top-p 0.9, 16 prompts x 2, interleaved: K=1 1.08x,
# K=2 0.92x, K=3 0.75x of plain decoding): a deeper default made sampling slower than plain.
SAMPLED_DEFAULT_K = 1


def check_draft_tokens(value: object, greedy: bool) -> tuple[int, bool]:
    """(K, auto): an integer K >= 1, or "auto" (K chosen up to AUTO_MAX_K as it runs).

    None is the default: auto when greedy, where the tokens do not depend on K; a fixed
    SAMPLED_DEFAULT_K when sampling, since auto's K follows measured times and a seed would
    then fix the distribution but not the text.
    """
    from .draft_length import AUTO_MAX_K

    if value is None:
        value = "auto" if greedy else SAMPLED_DEFAULT_K
    if value == "auto":
        return AUTO_MAX_K, True
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"draft_tokens must be an integer >= 1 or 'auto', got {value!r}")
    return int(value), False


def check_threshold(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"draft_threshold must be in [0, 1) (0 = off), got {value!r}")
    return float(value)


def check_drafter(drafter: str) -> str:
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
    return drafter


def check_seed(seed: object) -> int | None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 (or None for a random seed), "
                         f"got {seed!r}")
    return seed


def check_stop(stop: object) -> list[str]:
    """None, one string, or a list of strings; empty strings are ignored."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    return [s for s in stop if s]


def check_token_ids(ids: object, vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt_ids must be a list of integers, got {ids!r}")
    ids = list(ids)
    if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
        raise ValueError(f"prompt_ids must be a list of integers, got {ids[:8]!r}")
    bad = [int(i) for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids must be in [0, {vocab_size}), got {bad[:5]}")
    return [int(i) for i in ids]


def check_threads(threads: int | None) -> int | None:
    limit = 4 * (os.cpu_count() or 1)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= limit):
        raise ValueError(f"threads must be an integer in [1, {limit}] (or None for all "
                         f"cores), got {threads!r}")
    return threads
