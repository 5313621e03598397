"""StableLM (StableLM 2, StableLM-3B-4E1T): LayerNorm with a bias instead of RMSNorm, rotary
over the first `partial_rotary_factor` of each head (0.25 by default), optional q/k/v
biases, optional per-head LayerNorm on q and k (`qk_layernorm`), and with
`use_parallel_residual` attention and MLP reading the same normalized input and added to
the residual stream together."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.decoder import Decoder, attention_shape
from specedge.export.graph.projections import fused_weights, gated_mlp, qkv_projection
from specedge.export.graph.reshape import merge_heads, split_heads


class StableLmDecoder(Decoder):
    """StableLM: the skeleton's layout with per-head q/k LayerNorms and a parallel residual
    where the config has them (module docstring)."""

    @staticmethod
    def qkv(layer: nn.Module, h: torch.Tensor, q_scale: float) -> torch.Tensor:
        """q scaled by `q_scale`: folded into q's weights, or with per-head LayerNorms
        applied after them (a LayerNorm would undo a scale in the weights)."""
        attn = layer.self_attn
        heads, kv_heads, d = attention_shape(attn)
        if not attn.qk_layernorm:
            return qkv_projection(attn, h, q_scale)
        qkv = torch.nn.functional.linear(
            h, *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [1.0] * 3))
        x = split_heads(qkv, heads + 2 * kv_heads, d)
        q = attn.q_layernorm(x[:, :heads])
        q = q * q_scale if q_scale != 1.0 else q
        k = attn.k_layernorm(x[:, heads:heads + kv_heads])
        x = torch.cat([q, k, x[:, heads + kv_heads:]], dim=1)
        return merge_heads(x, (heads + 2 * kv_heads) * d)

    @staticmethod
    def residual(layer: nn.Module, x: torch.Tensor, h: torch.Tensor,
                 o: torch.Tensor) -> torch.Tensor:
        if not layer.use_parallel_residual:
            return Decoder.residual(layer, x, h, o)
        return x + layer.self_attn.o_proj(o) + gated_mlp(layer.mlp, h)
