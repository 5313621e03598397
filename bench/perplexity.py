"""Perplexity of a text under a model, the quality figure of `specedge bench`: every system
(this runtime, llama.cpp, transformers) is scored on the same text ids, so their numbers
compare."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specedge.runtime.stats import next_token_nll


def perplexity(logits: np.ndarray, ids: Sequence[int]) -> float:
    """``exp(-mean log softmax(logits[i])[ids[i + 1]])`` over i < len(ids) - 1: the
    perplexity of a text under a model, with ``logits`` [len(ids), V] the model's rows at
    the text's positions (the last one unused)."""
    n = len(ids) - 1
    if n < 1 or len(logits) < n:
        raise ValueError(f"perplexity needs 2 or more ids and a logit row for each, got "
                         f"{len(ids)} ids and {len(logits)} rows")
    return float(np.exp(next_token_nll(logits[:n], ids[1:]) / n))


def model_perplexity(backend, ids: Sequence[int]) -> float:
    """:func:`perplexity` of ``ids`` under a backend's graph, from one prefill call."""
    return perplexity(backend.forward(backend.new_cache(len(ids)), ids, len(ids)), ids)
