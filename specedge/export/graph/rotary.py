"""Rotary position embeddings: the tables for the positions of a call, and their use."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.families import model_dims_of


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, d: int) -> tuple[torch.Tensor, ...]:
    """(cos, signed sin, permutation) for `rotate`, built once per call from the model's
    rotary embedding [1, T, d]: HF's rotate_half(x) = cat(-x2, x1) = x[..., perm] * sign."""
    half = d // 2
    perm = torch.cat([torch.arange(half, 2 * half), torch.arange(half)])
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin.dtype)
    return cos.unsqueeze(1), (sin * sign).unsqueeze(1), perm


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Rotary positions, x * cos + rotate_half(x) * sin, as one Gather and three
    elementwise ops."""
    cos, signed_sin, perm = tables
    return x * cos + x[..., perm] * signed_sin


def gqa_rotary_cache(rotary_emb: nn.Module, config) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupQueryAttention's rotary tables (cos, sin) [max_context, D/2] from a Hugging
    Face rotary embedding: the first half of its tables (the two halves are equal)."""
    dims = model_dims_of(config)
    d, positions = dims["head_dim"], torch.arange(dims["max_context"]).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0, :, :d // 2].contiguous(), sin[0, :, :d // 2].contiguous()
