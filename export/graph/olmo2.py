"""OLMo 2: the Llama layout with the norms moved after each block (the attention's and the
MLP's outputs are normalized before they are added to the residual stream; nothing
normalizes a block's input) and RMSNorm on q and k over the whole projection (all heads
together, before rotary)."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.attention import (
    GroupQueryAttention,
    attention_bias,
    cached_attention,
    gqa_lengths,
)
from specedge.export.graph.granite import gated_mlp
from specedge.export.graph.llama import fused_weights
from specedge.export.graph.outputs import last_positions, lm_head
from specedge.export.graph.rotary import (
    call_tables,
    gqa_positions,
    gqa_rotary_cache,
    rope_type,
    rotary_tables,
    rotate,
)


def olmo2_qkv(attn: nn.Module, x: torch.Tensor, q_scale: float) -> torch.Tensor:
    """q|k|v [1, T, (H + 2 Hkv) D] from one projection, q and k normalized over all their
    heads, q then scaled by `q_scale` (after the norm, which would undo a scale in the
    weights), unrotated."""
    q_width, kv_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    q, k, v = torch.nn.functional.linear(
        x, *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [1.0] * 3)
    ).split([q_width, kv_width, kv_width], dim=-1)
    q = attn.q_norm(q) * q_scale if q_scale != 1.0 else attn.q_norm(q)
    return torch.cat([q, attn.k_norm(k), v], dim=-1)


class Olmo2Decoder(nn.Module):
    """OLMo 2: post-norm blocks, q/k norms, rotary positions, grouped-query attention.
    `fused`: attention on GroupQueryAttention (the norms come before its rotary)."""

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
        base = self.model.model
        x = base.embed_tokens(input_ids)
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        if self.fused:
            lengths = gqa_lengths(past_length, input_ids)
            rows = gqa_positions(base.rotary_emb, self.model.config, position_ids,
                                 past_length)
        else:
            rotary = rotary_tables(*call_tables(base.rotary_emb, position_ids, past_length), d)
            bias = attention_bias(past_length, past[0].shape[2], input_ids.shape[1],
                                  heads // kv_heads, x.dtype)
        presents = []
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            if self.fused:
                o, k, v = GroupQueryAttention.apply(
                    olmo2_qkv(attn, x, 1.0), past[2 * i], past[2 * i + 1], *lengths,
                    *self.rotary_cache, rows, heads, kv_heads, float(attn.scaling), 0)
            else:
                qkv = olmo2_qkv(attn, x, attn.scaling)
                qkv = qkv.reshape(1, -1, heads + 2 * kv_heads, d).transpose(1, 2)
                qk = rotate(qkv[:, :heads + kv_heads], rotary)
                k, v = qk[:, heads:], qkv[:, heads + kv_heads:]
                o = cached_attention(qk[:, :heads], k, v, past[2 * i], past[2 * i + 1], bias,
                                     (heads, kv_heads, d))
            x = x + layer.post_attention_layernorm(attn.o_proj(o))
            x = x + layer.post_feedforward_layernorm(gated_mlp(layer.mlp, x))
            presents += [k, v]
        x = base.norm(last_positions(x, logits_to_keep))
        return (lm_head(self.model, x), *presents)
