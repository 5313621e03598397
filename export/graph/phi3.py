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

from specedge.export.graph.attention import (
    GroupQueryAttention,
    attention_bias,
    cached_attention,
    gqa_lengths,
)
from specedge.export.graph.families import layer_windows
from specedge.export.graph.outputs import last_positions, lm_head
from specedge.export.graph.rotary import (
    call_tables,
    gqa_positions,
    gqa_rotary_cache,
    partial_rotary_tables,
    rope_type,
    rotary_dim,
    rotate,
)


class Phi3Decoder(nn.Module):
    """Phi-3 family: pre-norm blocks, fused q|k|v and gate|up projections, partial rotary.
    `fused`: attention on GroupQueryAttention (attention.py)."""

    def __init__(self, model: nn.Module, fused: bool = False):
        super().__init__()
        self.model = model
        self.fused = fused
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.rotary_dim = rotary_dim(model.model.rotary_emb)
        self.windows = layer_windows(cfg)
        rope_type(model.model.rotary_emb)  # raises for a scaling the graph cannot match
        if fused:
            self.rotary_cache = gqa_rotary_cache(model.model.rotary_emb, cfg)

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base = self.model.model
        x = base.embed_tokens(input_ids)
        if self.fused:
            lengths = gqa_lengths(past_length, input_ids)
            rows = gqa_positions(base.rotary_emb, self.model.config, position_ids,
                                 past_length)
        else:
            rotary = partial_rotary_tables(
                *call_tables(base.rotary_emb, position_ids, past_length), self.rotary_dim,
                self.head_dim)
            # One mask per distinct window, shared by the layers that have it.
            biases = {w: attention_bias(past_length, past[0].shape[2], input_ids.shape[1],
                                        self.heads // self.kv_heads, x.dtype, w)
                      for w in set(self.windows)}
        presents = []
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            if self.fused:
                o, k, v = GroupQueryAttention.apply(
                    attn.qkv_proj(h), past[2 * i], past[2 * i + 1], *lengths,
                    *self.rotary_cache, rows, self.heads, self.kv_heads,
                    float(attn.scaling), int(self.windows[i] or 0))
            else:
                o, k, v = self._attention(attn, h, rotary, past[2 * i], past[2 * i + 1],
                                          biases[self.windows[i]])
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            presents += [k, v]
        x = base.norm(last_positions(x, logits_to_keep))
        return (lm_head(self.model, x), *presents)

    def _attention(self, attn: nn.Module, h: torch.Tensor, rotary: tuple[torch.Tensor, ...],
                   past_k: torch.Tensor, past_v: torch.Tensor,
                   bias: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Portable attention: (output [1, T, H D], new K rows, new V rows). The attention
        scale is folded into q's rows of the fused weight (it commutes with the rotation)."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        w = attn.qkv_proj.weight
        weight = torch.cat([w[:heads * d] * attn.scaling, w[heads * d:]])
        qkv = torch.nn.functional.linear(h, weight)
        qkv = qkv.reshape(1, -1, heads + 2 * kv_heads, d).transpose(1, 2)
        qk = rotate(qkv[:, :heads + kv_heads], rotary)
        k, v = qk[:, heads:], qkv[:, heads + kv_heads:]
        o = cached_attention(qk[:, :heads], k, v, past_k, past_v, bias, (heads, kv_heads, d))
        return o, k, v
