"""Reshapes that keep a tensor's batch dim as it is, as one ONNX Reshape node each.

Every graph has two dynamic leading dims, the batch B and the call's tokens T. A torch
reshape must name them, and a size read from a traced tensor becomes a Shape, Gather,
Unsqueeze and Concat chain in front of every Reshape: two reshapes a layer would add
eight nodes a layer, each a few microseconds of ONNX Runtime overhead on a small model.
ONNX's Reshape copies a dim from its input where the target shape says 0 (allowzero 0),
so `keep_batch(x, (-1, h, d))` is one Reshape with the constant shape [0, -1, h, d]; the
-1 takes the other dynamic dim (torch's exporter needs one beside a 0).
"""

from __future__ import annotations

import torch


class _KeepBatch(torch.autograd.Function):
    """x reshaped to [x.shape[0], *tail]; `symbolic` is the node the graph gets."""

    @staticmethod
    def forward(ctx, x, tail):
        return x.reshape(x.shape[0], *tail)

    @staticmethod
    def symbolic(g, x, tail):
        out = g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([0, *tail])))
        out.setType(x.type().with_sizes([None, *(None if s == -1 else s for s in tail)]))
        return out


def keep_batch(x: torch.Tensor, tail: tuple[int, ...]) -> torch.Tensor:
    """x [B, ...] -> [B, *tail], with exactly one -1 in `tail` (Python ints: module
    docstring)."""
    tail = tuple(int(s) for s in tail)
    if tail.count(-1) != 1:
        raise ValueError(f"keep_batch needs exactly one -1 in {tail}")
    return _KeepBatch.apply(x, tail)


def split_heads(x: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """[B, T, heads * d] -> [B, heads, T, d]."""
    return keep_batch(x, (-1, heads, d)).transpose(1, 2)


def merge_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, heads, T, d] -> [B, T, width], width = heads * d."""
    return keep_batch(x.transpose(1, 2), (-1, width))
