"""`--verify`: the exported graph against transformers on the same inputs.

Two checks: the max abs logit difference over a prompt and 32 greedy steps, and the 32
greedy tokens themselves (graph with its KV cache vs transformers with its own cache).
A feature draft is checked against its own torch module (`verify_feature_draft`).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from specedge.export.drafts.feature import FeatureDraft, target_layer_outputs
from specedge.export.graph.families import model_dims
from specedge.export.graph.outputs import target_features
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import (
    FEATURES_IN,
    FEATURES_KEEP,
    FEATURES_OUT,
    KV_LAYOUT,
    KV_LAYOUT_IN_PLACE,
    ModelSpec,
)

DEFAULT_ATOL = 1e-3


def graph_features(graph: onnx.GraphProto) -> tuple[int, bool, bool]:
    """(features width H or 0, whether it reads features, whether it takes
    features_to_keep), from the graph's I/O."""
    out = [o for o in graph.output if o.name == FEATURES_OUT]
    width = out[0].type.tensor_type.shape.dim[2].dim_value if out else 0
    names = {i.name for i in graph.input}
    return width, FEATURES_IN in names, FEATURES_KEEP in names


def graph_attention(graph: onnx.GraphProto) -> str:
    """The graph's attention form (graph/attention.py): "fused" on GroupQueryAttention,
    "batched" on TensorScatter and Attention, else "portable"."""
    ops = {n.op_type for n in graph.node}
    return ("fused" if "GroupQueryAttention" in ops else
            "batched" if "TensorScatter" in ops else "portable")


def graph_kv_layout(graph: onnx.GraphProto) -> str:
    """The graph's KV layout: in place when its attention writes the cache (fused, batched)."""
    return KV_LAYOUT if graph_attention(graph) == "portable" else KV_LAYOUT_IN_PLACE


def graph_backend(path: Path, dims: dict) -> OrtCpuBackend:
    """An ort-cpu backend on a graph that is not in a bundle yet (dims: model_dims)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    features, reads, keeps = graph_features(graph)
    return OrtCpuBackend(ModelSpec(path=Path(path), dtype="float32",
                                   file_size=Path(path).stat().st_size, features=features,
                                   reads_features=reads, kv_layout=graph_kv_layout(graph),
                                   keeps_features=keeps, **dims))


def verify_feature_draft(draft: FeatureDraft, onnx_path: Path, prompt_ids: list[int],
                         steps: int = 32, atol: float = DEFAULT_ATOL, seed: int = 0) -> dict:
    """A feature draft's graph against its torch module, on features drawn at the target's
    scale: logits over the head tokens and predicted features, the prompt in one call and
    `steps` more pairs one at a time (the graph with its KV cache, torch on the whole
    sequence). Same report as `verify_graph`, greedy = argmax over the head."""
    backend = graph_backend(onnx_path, model_dims(draft))
    ids = list(prompt_ids) + [prompt_ids[i % len(prompt_ids)] for i in range(steps)]
    features = torch.randn(len(ids), draft.config.hidden_size,
                           generator=torch.Generator().manual_seed(seed)) * 2
    with torch.no_grad():
        predicted = draft.predict(torch.tensor([ids]), features.unsqueeze(0))[0]
        ref = draft.head_logits(predicted).numpy()
    head = draft.specedge_head_ids.numpy()
    cache = backend.new_cache(len(ids))
    n = len(prompt_ids)
    got = [backend.forward(cache, ids[:n], n, features[:n].numpy())[:, head]]
    feature_diff = float(np.abs(backend.features - predicted[:n].numpy()).max())
    for i in range(n, len(ids)):
        got.append(backend.forward(cache, ids[i:i + 1], 1, features[i:i + 1].numpy())[:, head])
        feature_diff = max(feature_diff, float(np.abs(backend.features[0] - predicted[i].numpy()
                                                      ).max()))
    got = np.concatenate(got)
    max_diff = max(float(np.abs(got - ref).max()), feature_diff)
    return _report(max_diff, atol, list(ref[n:].argmax(-1)), list(got[n:].argmax(-1)))


def _target_features(model: nn.Module, ids: list[int], reader) -> torch.Tensor:
    """What a target's graph should output as features over `ids` (graph/decoder.py
    `Decoder`), from the transformers model's own layers."""
    layers = getattr(reader, "feature_layers", ())
    out = target_layer_outputs(model, torch.tensor([ids]), None, layers, final=True)
    with torch.no_grad():
        return target_features(getattr(reader, "fuse", None), [out[i] for i in layers],
                               out["final"])[0]


def verify_graph(model: nn.Module, onnx_path: Path, prompt_ids: list[int], steps: int = 32,
                 atol: float = DEFAULT_ATOL, features: bool | nn.Module = False) -> dict:
    """Compare graph and model; returns a report dict with `ok`. `features`: the graph's
    feature output too, as export_onnx was given it (True, or the feature draft)."""
    dims = model_dims(model)
    backend = graph_backend(onnx_path, dims)
    # A model with a short context: the prompt and the steps stay within it.
    prompt_ids = list(prompt_ids)[:max(1, dims["max_context"] - steps)]
    steps = min(steps, dims["max_context"] - len(prompt_ids))
    cache = backend.new_cache(len(prompt_ids) + steps)

    # A distilled draft only scores its head tokens (the graph gives the rest -inf).
    head = getattr(model, "specedge_head_ids", None)
    cols = slice(None) if head is None else head.numpy()
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids], dtype=torch.long), use_cache=True)
    ref = out.logits[0].numpy()[:, cols]
    got = backend.forward(cache, prompt_ids, len(prompt_ids))[:, cols]
    max_diff = float(np.abs(got - ref).max())
    if features:
        expected = _target_features(model, prompt_ids, features).numpy()
        max_diff = max(max_diff, float(np.abs(backend.features - expected).max()))
    vocab_id = (lambda i: int(i)) if head is None else (lambda i: int(head[i]))

    ref_tokens, graph_tokens = [], []
    # transformers renamed forward's `past_key_values` and the output's to `cache` (5.24; the
    # old names warn, inside the export's progress bar)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    past = out[cache_arg]
    ref_next, graph_next = vocab_id(np.argmax(ref[-1])), vocab_id(np.argmax(got[-1]))
    for _ in range(steps):
        ref_tokens.append(ref_next)
        graph_tokens.append(graph_next)
        with torch.no_grad():
            out = model(torch.tensor([[ref_next]]), use_cache=True, **{cache_arg: past})
        past = out[cache_arg]
        ref_logits = out.logits[0, -1].numpy()[cols]
        # Feed the graph the reference token so both see the same inputs at every step.
        got = backend.forward(cache, [ref_next], 1)[-1][cols]
        max_diff = max(max_diff, float(np.abs(got - ref_logits).max()))
        ref_next, graph_next = vocab_id(np.argmax(ref_logits)), vocab_id(np.argmax(got))
    return _report(max_diff, atol, ref_tokens, graph_tokens)


def _report(max_diff: float, atol: float, ref_tokens: list[int],
            graph_tokens: list[int]) -> dict:
    """The verify report of one graph. `first_greedy_mismatch`: the 0-based step where the
    graph's greedy token first differs from the reference's, or None."""
    same = [int(a) == int(b) for a, b in zip(ref_tokens, graph_tokens)]
    steps, matches = len(same), sum(same)
    return {"max_abs_logit_diff": max_diff, "atol": atol, "greedy_steps": steps,
            "greedy_matches": matches,
            "first_greedy_mismatch": same.index(False) if matches < steps else None,
            "ok": bool(max_diff <= atol and matches == steps)}


def verify_failure(role: str, report: dict) -> str:
    """A failed report in words: the largest logit difference and where greedy tokens part."""
    diff, atol = report["max_abs_logit_diff"], report["atol"]
    steps, first = report["greedy_steps"], report.get("first_greedy_mismatch")
    said = (f"--verify failed for the {role} graph: its logits differ from transformers' by "
            f"up to {diff:.3g}")
    said += f" (more than the allowed {atol:g})" if diff > atol else f" (within {atol:g})"
    if first is None:
        return said + f", though all {steps} greedy tokens match."
    return (said + f", and its greedy tokens part from transformers' at step {first + 1} of "
            f"{steps} ({report['greedy_matches']} of {steps} match).")
