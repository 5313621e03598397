"""OLMo 2: the Llama layout with the norms moved after each block (the attention's and the
MLP's outputs are normalized before they are added to the residual stream; nothing
normalizes a block's input) and RMSNorm on q and k over the whole projection (all heads
together, before rotary; with fused attention too, since GroupQueryAttention's rotary comes
after them)."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.decoder import Decoder
from specedge.export.graph.projections import fused_weights, gated_mlp


class Olmo2Decoder(Decoder):
    """OLMo 2: post-norm blocks, q/k norms (module docstring)."""

    @staticmethod
    def attention_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def qkv(layer: nn.Module, h: torch.Tensor, q_scale: float) -> torch.Tensor:
        """q and k normalized over all their heads, q then scaled (after the norm, which
        would undo a scale in the weights)."""
        attn = layer.self_attn
        q_width, kv_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        q, k, v = torch.nn.functional.linear(
            h, *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [1.0] * 3)
        ).split([q_width, kv_width, kv_width], dim=-1)
        q = attn.q_norm(q) * q_scale if q_scale != 1.0 else attn.q_norm(q)
        return torch.cat([q, attn.k_norm(k), v], dim=-1)

    @staticmethod
    def residual(layer: nn.Module, x: torch.Tensor, h: torch.Tensor,
                 o: torch.Tensor) -> torch.Tensor:
        x = x + layer.post_attention_layernorm(layer.self_attn.o_proj(o))
        return x + layer.post_feedforward_layernorm(gated_mlp(layer.mlp, x))
