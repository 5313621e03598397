"""Projections that read the same input, fused into one: q|k|v and gate|up each become one
MatMul in the graph where the model runs several (the exporter folds the stacked weights
into one constant)."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.reshape import keep_batch


def fused_weights(linears: list[nn.Module], scales: list[float]) -> tuple[torch.Tensor, ...]:
    """One projection for several that read the same input: weights (and biases) stacked
    along the output axis, so the graph runs one MatMul where the model runs several."""
    weight = torch.cat([m.weight * s for m, s in zip(linears, scales)])
    if all(m.bias is None for m in linears):
        return weight, None
    return weight, torch.cat([m.bias * s if m.bias is not None else
                              torch.zeros(m.weight.shape[0]) for m, s in zip(linears, scales)])


def qkv_projection(attn: nn.Module, h: torch.Tensor, q_scale: float) -> torch.Tensor:
    """q|k|v [B, T, (H + 2 Hkv) D] of the layer's normalized input `h` from one projection,
    q scaled by `q_scale`, unrotated (the Llama layout's q_proj, k_proj and v_proj). With
    per-head q and k norms (Qwen3) those are applied, and the scale after them."""
    if getattr(attn, "q_norm", None) is None:
        return torch.nn.functional.linear(
            h, *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [q_scale, 1.0, 1.0]))
    d = attn.head_dim
    heads, kv_heads = attn.q_proj.weight.shape[0] // d, attn.k_proj.weight.shape[0] // d
    qkv = torch.nn.functional.linear(
        h, *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [1.0] * 3))
    q, k, v = keep_batch(qkv, (-1, heads + 2 * kv_heads, d)).split(
        [heads, kv_heads, kv_heads], dim=2)
    q = attn.q_norm(q) * q_scale if q_scale != 1.0 else attn.q_norm(q)
    return keep_batch(torch.cat([q, attn.k_norm(k), v], dim=2),
                      (-1, (heads + 2 * kv_heads) * d))


def gated_mlp(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A gated MLP (Llama's, Granite's, OLMo 2's, StableLM's): down(act(gate(h)) * up(h)),
    gate and up from one projection, so the graph runs one MatMul for the two."""
    gate_up = torch.nn.functional.linear(
        h, *fused_weights([mlp.gate_proj, mlp.up_proj], [1.0, 1.0]))
    gate, up = gate_up.split(mlp.gate_proj.weight.shape[0], dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)
