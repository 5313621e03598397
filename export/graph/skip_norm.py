"""The residual add and the RMSNorm after it as one node: ONNX Runtime's
com.microsoft SkipSimplifiedLayerNormalization, for graphs that run on ONNX Runtime's CPU
(fused attention).

A pre-norm decoder adds each block's output to the residual stream and normalizes the sum
for the next block. ONNX Runtime fuses the RMSNorm pattern into one node by itself, but not
the add before it: its fusion needs the sum to have no other reader, and the residual stream
always has one (the next add). The node below returns both the normalized sum and the sum,
so one node does what took two.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (LlamaRMSNorm): x / sqrt(mean(x^2) + eps) * weight, in fp32."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


class SkipRMSNorm(torch.autograd.Function):
    """(rms_norm(x + skip), x + skip) for x, skip [B, T, H] and the norm's weight [H]
    (`hidden`: H, a Python int for the graph's declared shapes).

    `forward` is the same math in torch (what tracing runs); `symbolic` is the node the
    graph gets, whose outputs are (normalized, mean, inverse std, sum): the middle two are
    left unread."""

    @staticmethod
    def forward(ctx, x, skip, weight, eps, hidden):
        total = x + skip
        return rms_norm(total, weight, eps), total

    @staticmethod
    def symbolic(g, x, skip, weight, eps, hidden):
        normed, mean, inv_std, total = g.op("com.microsoft::SkipSimplifiedLayerNormalization",
                                            x, skip, weight, epsilon_f=eps, outputs=4)
        # The exporter cannot infer a contrib operator's output shapes: without them the
        # shapes after the first layer (logits, features) would be unknown in the graph.
        shape = x.type().with_sizes([None, None, hidden])
        normed.setType(shape)
        total.setType(shape)
        mean.setType(x.type().with_sizes([None, None, 1]))
        inv_std.setType(x.type().with_sizes([None, None, 1]))
        return normed, total


def skip_rms_norm(x: torch.Tensor, skip: torch.Tensor, norm: torch.nn.Module
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + skip), x + skip) in one node, `norm` a transformers RMSNorm module."""
    return SkipRMSNorm.apply(x, skip, norm.weight, float(norm.variance_epsilon),
                             int(norm.weight.shape[0]))
