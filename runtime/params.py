"""Generation settings and their validation: every bad value is a ValueError that names the
value and the allowed range."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .sampling import process_logits, sample

DRAFTERS = ("model", "prompt-lookup")


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

    def probs(self, logits: np.ndarray) -> np.ndarray:
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One token from one row of logits: argmax when greedy, else a draw from probs."""
        if self.greedy:
            return int(np.argmax(logits))
        return sample(self.probs(logits), rng)


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_drafter(drafter: str) -> str:
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
    return drafter
