"""GPT-2: learned positions, LayerNorm, fused qkv (Conv1D), portable attention only."""

from __future__ import annotations

from torch import nn

from specedge.export.graph.attention import attention_bias, cached_attention
from specedge.export.graph.outputs import last_positions, lm_head


class GPT2Decoder(nn.Module):
    """GPT-2: learned positions, fused QKV (Conv1D), LayerNorm, one KV head per query head."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base = self.model.transformer
        x = base.wte(input_ids) + base.wpe(position_ids)
        bias = attention_bias(past_length, past[0].shape[2], input_ids.shape[1], 1, x.dtype)
        presents = []
        for i, block in enumerate(base.h):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(x)).split(attn.embed_dim, dim=2)
            q, k, v = (z.reshape(1, -1, attn.num_heads, attn.head_dim).transpose(1, 2)
                       for z in (q, k, v))
            scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
            if attn.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            o = cached_attention(q * scale, k, v, past[2 * i], past[2 * i + 1], bias,
                                 (attn.num_heads, attn.num_heads, attn.head_dim))
            x = x + attn.c_proj(o)
            x = x + block.mlp(block.ln_2(x))
            presents += [k, v]
        x = base.ln_f(last_positions(x, logits_to_keep))
        return (lm_head(self.model, x), *presents)
