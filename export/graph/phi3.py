"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama layout with q|k|v and gate|up each stored as
one projection, rotary over the first `partial_rotary_factor` of each head (Phi-4-mini:
0.75), LongRoPE scaling and, where the config has one, a sliding window in every layer
(Phi-3-mini-4k).

LongRoPE: transformers rotates a Phi-3 sequence with the short factors while it is at most
`original_max_position_embeddings` long (4096 for Phi-3.5-mini and Phi-4-mini), and once
it grows past that, generation recomputes the whole cache with the long factors
(Phi3ForCausalLM.prepare_inputs_for_generation), so every earlier key changes. A bundle's
cache only grows and rolls back, it is never recomputed, so the bundle's context stops at
that length (graph/families.py `phi3_context`), where the graph is exact: every position
it can see uses the short factors (graph/rotary.py `call_tables`).
"""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.decoder import Decoder
from specedge.export.graph.families import layer_windows


class Phi3Decoder(Decoder):
    """Phi-3 family: the model's own q|k|v and gate|up projections, sliding windows where
    the config has one (module docstring)."""

    def sliding_windows(self) -> list[int | None]:
        return layer_windows(self.model.config)

    @staticmethod
    def qkv(layer: nn.Module, h: torch.Tensor, q_scale: float) -> torch.Tensor:
        """The model's q|k|v projection, with `q_scale` folded into q's rows of its
        weight."""
        attn = layer.self_attn
        if q_scale == 1.0:
            return attn.qkv_proj(h)
        w = attn.qkv_proj.weight
        q_rows = attn.config.num_attention_heads * attn.head_dim
        return torch.nn.functional.linear(h, torch.cat([w[:q_rows] * q_scale, w[q_rows:]]))

    @staticmethod
    def residual(layer: nn.Module, x: torch.Tensor, h: torch.Tensor,
                 o: torch.Tensor) -> torch.Tensor:
        x = x + layer.self_attn.o_proj(o)
        return x + layer.mlp(layer.post_attention_layernorm(x))
