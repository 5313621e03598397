"""`--verify`: the exported graph against transformers on the same inputs.

Two checks: the max abs logit difference over a prompt and 32 greedy steps, and the 32
greedy tokens themselves (graph with its KV cache vs transformers with its own cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from specedge.runtime.backends import OrtCpuBackend
from specedge.runtime.bundle import ModelSpec

from .graph import model_dims

DEFAULT_ATOL = 1e-3


def graph_backend(path: Path, dims: dict) -> OrtCpuBackend:
    """An ort-cpu backend on a graph that is not in a bundle yet (dims: model_dims)."""
    return OrtCpuBackend(ModelSpec(path=Path(path), dtype="float32",
                                   file_size=Path(path).stat().st_size, **dims))


def verify_graph(model: nn.Module, onnx_path: Path, prompt_ids: list[int], steps: int = 32,
                 atol: float = DEFAULT_ATOL) -> dict:
    """Compare graph and model; returns a report dict with `ok`."""
    backend = graph_backend(onnx_path, model_dims(model))
    cache = backend.new_cache(len(prompt_ids) + steps)

    # A distilled draft only scores its head tokens (the graph gives the rest -inf).
    head = getattr(model, "specedge_head_ids", None)
    cols = slice(None) if head is None else head.numpy()
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
    ref = out.logits[0].numpy()[:, cols]
    got = backend.forward(cache, prompt_ids, len(prompt_ids))[:, cols]
    max_diff = float(np.abs(got - ref).max())
    vocab_id = (lambda i: int(i)) if head is None else (lambda i: int(head[i]))

    ref_tokens, graph_tokens = [], []
    past = out.past_key_values
    ref_next, graph_next = vocab_id(np.argmax(ref[-1])), vocab_id(np.argmax(got[-1]))
    for _ in range(steps):
        ref_tokens.append(ref_next)
        graph_tokens.append(graph_next)
        with torch.no_grad():
            out = model(torch.tensor([[ref_next]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        ref_logits = out.logits[0, -1].numpy()[cols]
        # Feed the graph the reference token so both see the same inputs at every step.
        got = backend.forward(cache, [ref_next], 1)[-1][cols]
        max_diff = max(max_diff, float(np.abs(got - ref_logits).max()))
        ref_next, graph_next = vocab_id(np.argmax(ref_logits)), vocab_id(np.argmax(got))
    matches = sum(a == b for a, b in zip(ref_tokens, graph_tokens))
    return {"max_abs_logit_diff": max_diff, "atol": atol, "greedy_steps": steps,
            "greedy_matches": matches,
            "ok": bool(max_diff <= atol and matches == steps)}
