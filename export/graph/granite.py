"""Granite (IBM Granite 3.x): the Llama layout with four scalars from its config: the
embeddings times `embedding_multiplier`, each block's output times `residual_multiplier`
before it is added to the residual stream, attention scores scaled by
`attention_multiplier` instead of 1/sqrt(head size), and the logits divided by
`logits_scaling`."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.attention import (
    GroupQueryAttention,
    attention_bias,
    cached_attention,
    gqa_lengths,
)
from specedge.export.graph.llama import fused_weights, qkv_projection
from specedge.export.graph.outputs import last_positions, lm_head
from specedge.export.graph.rotary import (
    call_tables,
    gqa_positions,
    gqa_rotary_cache,
    rope_type,
    rotary_tables,
    rotate,
)


def gated_mlp(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A gated MLP (Llama's, Granite's, OLMo 2's, StableLM's): down(act(gate(h)) * up(h)),
    gate and up from one projection, so the graph runs one MatMul for the two."""
    gate_up = torch.nn.functional.linear(
        h, *fused_weights([mlp.gate_proj, mlp.up_proj], [1.0, 1.0]))
    gate, up = gate_up.split(mlp.gate_proj.weight.shape[0], dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


class GraniteDecoder(nn.Module):
    """Granite: pre-norm blocks, rotary positions, grouped-query attention, the four
    multipliers (module docstring). `fused`: attention on GroupQueryAttention."""

    def __init__(self, model: nn.Module, fused: bool = False):
        super().__init__()
        self.model = model
        self.fused = fused
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        rope_type(model.model.rotary_emb)  # raises for a scaling the graph cannot match
        if fused:
            self.rotary_cache = gqa_rotary_cache(model.model.rotary_emb, cfg)

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base, cfg = self.model.model, self.model.config
        x = base.embed_tokens(input_ids) * cfg.embedding_multiplier
        if self.fused:
            lengths = gqa_lengths(past_length, input_ids)
            rows = gqa_positions(base.rotary_emb, cfg, position_ids, past_length)
        else:
            rotary = rotary_tables(*call_tables(base.rotary_emb, position_ids, past_length),
                                   self.head_dim)
            bias = attention_bias(past_length, past[0].shape[2], input_ids.shape[1],
                                  self.heads // self.kv_heads, x.dtype)
        presents = []
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            if self.fused:
                o, k, v = GroupQueryAttention.apply(
                    qkv_projection(layer, x, 1.0), past[2 * i], past[2 * i + 1], *lengths,
                    *self.rotary_cache, rows, self.heads, self.kv_heads,
                    float(cfg.attention_multiplier), 0)
            else:
                o, k, v = self._attention(layer, x, rotary, past[2 * i], past[2 * i + 1], bias)
            x = x + attn.o_proj(o) * cfg.residual_multiplier
            x = x + gated_mlp(layer.mlp, layer.post_attention_layernorm(x)) \
                * cfg.residual_multiplier
            presents += [k, v]
        x = base.norm(last_positions(x, logits_to_keep))
        return (lm_head(self.model, x) / cfg.logits_scaling, *presents)

    def _attention(self, layer: nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, ...],
                   past_k: torch.Tensor, past_v: torch.Tensor,
                   bias: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Portable attention: (output [1, T, H D], new K rows, new V rows); the attention
        multiplier is folded into q's weights (it commutes with the rotation)."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qkv = qkv_projection(layer, x, self.model.config.attention_multiplier)
        qkv = qkv.reshape(1, -1, heads + 2 * kv_heads, d).transpose(1, 2)
        qk = rotate(qkv[:, :heads + kv_heads], rotary)
        k, v = qk[:, heads:], qkv[:, heads + kv_heads:]
        o = cached_attention(qk[:, :heads], k, v, past_k, past_v, bias, (heads, kv_heads, d))
        return o, k, v
