"""Generation settings and their validation: every bad value is a ValueError that names the
value and the allowed range. `GenerationConfig` groups the settings of one generation and
validates them in one place."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from specedge.runtime.probs import SparseProbs, sample
from specedge.runtime.sampling import process_row_with_checked_settings

DRAFTERS = ("model", "prompt-lookup", "lookup+model")
# `draft_tokens="auto"` picks K in [0, AUTO_MAX_K] before every step (drafting/auto_k.py).
AUTO_MAX_K = 8
# A fixed K beyond this drafts tokens no draft gets accepted (acceptance decays with the
# position), while each one still costs a draft call and a row of the verification.
MAX_DRAFT_TOKENS = 32
DEFAULT_DRAFTER = "lookup+model"  # matched or beat the model alone in every bench category
# Whether ONNX Runtime's intra-op threads spin while they wait for work: True, False, or
# "auto": spin while other processes leave the CPUs idle (runtime/cpu_load.py). On a 2-core
# EPYC, spinning decoded 1.3x faster on a quiet machine, and not spinning 1.2-2.3x faster
# with other processes on the cores; auto is the faster of the two in either case
# (docs/design.md#threads).
DEFAULT_SPINNING = "auto"


@dataclass(frozen=True)
class Sampling:
    """Temperature 0 is greedy; otherwise HF order: temperature, top-k, top-p.

    The settings are checked here, once, when they are made; the logit processing
    (runtime/sampling.py) and the device kernels take them as checked."""

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
        """One row of logits [V], processed (runtime/sampling.py), as its support. Sampled
        settings only: when greedy, the token is the argmax (`pick`)."""
        return process_row_with_checked_settings(logits, self.temperature, self.top_k,
                                                 self.top_p)

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


# When sampling, a draft whose tokens are accepted about a third of the time (the shipped
# SmolLM2 drafts) is fastest at K = 1; a deeper default made sampling slower than plain
# decoding (docs/MEASUREMENTS.md, "Sampled decoding and K").
SAMPLED_DEFAULT_K = 1


def check_draft_tokens(value: object, greedy: bool) -> tuple[int, bool]:
    """(K, auto): an integer K >= 1, or "auto" (K chosen up to AUTO_MAX_K as it runs).

    None is the default: auto when greedy, where the tokens do not depend on K; a fixed
    SAMPLED_DEFAULT_K when sampling, since auto's K follows measured times and a seed would
    then fix the distribution but not the text.
    """
    if value is None:
        value = "auto" if greedy else SAMPLED_DEFAULT_K
    if value == "auto":
        return AUTO_MAX_K, True
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 1 <= value <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] or "
                         f"'auto', got {value!r}")
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


def check_text(text: str, what: str) -> str:
    """`text` if it is Unicode the tokenizer can take: no lone surrogate (what JSON's
    "\\ud800" or a command line's invalid UTF-8 bytes become in Python)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: character {e.start} is "
                         f"{text[e.start]!r}, a lone surrogate (invalid UTF-8 or a lone "
                         "\\uD800-\\uDFFF escape); send UTF-8 text") from None
    return text


# Stop strings are searched for in the new text after every step, so their number and length
# bound that work: OpenAI's API takes 4; these leave room for templates with many end markers.
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256


def check_stop(stop: object) -> list[str]:
    """None, one string, or a list of up to MAX_STOP_STRINGS strings of up to
    MAX_STOP_LENGTH characters; empty strings are ignored."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {short_repr(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                         "allowed")
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_LENGTH:
            raise ValueError(f"stop string {i} has {len(s)} characters; at most "
                             f"{MAX_STOP_LENGTH} are allowed")
        check_text(s, f"stop string {i}")
    return [s for s in stop if s]


def short_repr(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters for a message."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[:limit - 3] + "..."


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


def check_spinning(spinning: object) -> bool | str:
    """Whether ONNX Runtime's intra-op threads spin while they wait for work (its session
    option `session.intra_op.allow_spinning`): True, False or "auto" (DEFAULT_SPINNING)."""
    if not (isinstance(spinning, bool) or spinning == "auto"):
        raise ValueError(f"spinning must be True, False or 'auto' (whether ONNX Runtime's "
                         f"threads spin while they wait for work), got {spinning!r}")
    return spinning


@dataclass(frozen=True)
class GenerationConfig:
    """The settings of one generation, validated when the config is made.

    `temperature=0` is greedy; `top_k=0` and `top_p=1` are off. `draft_tokens` is K, or
    "auto" to pick K as generation runs (K then follows measured times, so a seed fixes the
    distribution but not the exact sampled text); None (the default) is auto when greedy
    and SAMPLED_DEFAULT_K when sampling. `draft_threshold` stops drafting after a token
    whose draft probability is below it. `use_draft=False` is plain target-only decoding in
    the same loop. `stop` is a string or a list of strings that end the text.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    draft_tokens: int | str | None = None
    use_draft: bool = True
    drafter: str = DEFAULT_DRAFTER
    draft_threshold: float = 0.0
    stop: str | Sequence[str] | None = None
    # Derived when the config is made:
    sampling: Sampling = field(init=False, repr=False, compare=False)
    k_max: int = field(init=False, repr=False, compare=False)  # largest K; 0: no drafting
    auto: bool = field(init=False, repr=False, compare=False)  # K picked before each step
    stops: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: the checked values replace the given ones
        set_field(self, "max_new_tokens", check_positive_int("max_new_tokens", self.max_new_tokens))
        sampling = Sampling(self.temperature, self.top_k, self.top_p)
        k_max, auto = check_draft_tokens(self.draft_tokens, sampling.greedy)
        set_field(self, "draft_threshold", check_threshold(self.draft_threshold))
        set_field(self, "drafter", check_drafter(self.drafter))
        set_field(self, "stops", tuple(check_stop(self.stop)))
        set_field(self, "seed", check_seed(self.seed))
        if not self.use_draft:
            k_max, auto = 0, False
        set_field(self, "sampling", sampling)
        set_field(self, "k_max", k_max)
        set_field(self, "auto", auto)

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        """The names a config is made from (the keyword arguments of `Generator.stream`)."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def of(cls, config: GenerationConfig | None = None, **settings) -> GenerationConfig:
        """`config` with `settings` replacing its values (the defaults without a config;
        `config` itself, already checked, without settings); an unknown setting is a
        TypeError that lists the known ones."""
        unknown = sorted(set(settings) - set(cls.settings()))
        if unknown:
            raise TypeError(f"unknown generation setting(s) {', '.join(unknown)}; the settings "
                            f"are {', '.join(cls.settings())}")
        if config is None:
            return cls(**settings)
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
        if not settings:
            return config
        base = {name: getattr(config, name) for name in cls.settings()}
        return cls(**(base | settings))
