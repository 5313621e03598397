"""StableLM (StableLM 2, StableLM-3B-4E1T): LayerNorm with a bias instead of RMSNorm, rotary
over the first `partial_rotary_factor` of each head (0.25 by default), optional q/k/v
biases, optional per-head LayerNorm on q and k (`qk_layernorm`), and with
`use_parallel_residual` attention and MLP reading the same normalized input and added to
the residual stream together."""

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
    partial_rotary_tables,
    rope_type,
    rotary_dim,
    rotate,
)


class StableLmDecoder(nn.Module):
    """StableLM: pre-norm blocks (LayerNorm), partial rotary, grouped-query attention,
    parallel or sequential residual (module docstring). `fused`: attention on
    GroupQueryAttention."""

    def __init__(self, model: nn.Module, fused: bool = False):
        super().__init__()
        self.model = model
        self.fused = fused
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.rotary_dim = rotary_dim(model.model.rotary_emb)
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
            bias = attention_bias(past_length, past[0].shape[2], input_ids.shape[1],
                                  self.heads // self.kv_heads, x.dtype)
        presents = []
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            if self.fused:
                o, k, v = GroupQueryAttention.apply(
                    self._qkv(attn, h, 1.0), past[2 * i], past[2 * i + 1], *lengths,
                    *self.rotary_cache, rows, self.heads, self.kv_heads,
                    float(attn.scaling), 0)
            else:
                o, k, v = self._attention(attn, h, rotary, past[2 * i], past[2 * i + 1], bias)
            if layer.use_parallel_residual:
                x = x + attn.o_proj(o) + gated_mlp(layer.mlp, h)
            else:
                x = x + attn.o_proj(o)
                x = x + gated_mlp(layer.mlp, layer.post_attention_layernorm(x))
            presents += [k, v]
        x = base.norm(last_positions(x, logits_to_keep))
        return (lm_head(self.model, x), *presents)

    def _qkv(self, attn: nn.Module, h: torch.Tensor, q_scale: float) -> torch.Tensor:
        """q|k|v [1, T, (H + 2 Hkv) D] from one projection, unrotated, q scaled by
        `q_scale`: folded into q's weights, or with per-head LayerNorms applied after them
        (a LayerNorm would undo a scale in the weights)."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        if not attn.qk_layernorm:
            return torch.nn.functional.linear(
                h, *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [q_scale, 1.0, 1.0]))
        qkv = torch.nn.functional.linear(
            h, *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [1.0] * 3))
        x = qkv.reshape(1, -1, heads + 2 * kv_heads, d).transpose(1, 2)
        q = attn.q_layernorm(x[:, :heads])
        q = q * q_scale if q_scale != 1.0 else q
        k = attn.k_layernorm(x[:, heads:heads + kv_heads])
        x = torch.cat([q, k, x[:, heads + kv_heads:]], dim=1)
        return x.transpose(1, 2).reshape(1, -1, (heads + 2 * kv_heads) * d)

    def _attention(self, attn: nn.Module, h: torch.Tensor, rotary: tuple[torch.Tensor, ...],
                   past_k: torch.Tensor, past_v: torch.Tensor,
                   bias: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Portable attention: (output [1, T, H D], new K rows, new V rows)."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qkv = self._qkv(attn, h, attn.scaling)
        qkv = qkv.reshape(1, -1, heads + 2 * kv_heads, d).transpose(1, 2)
        qk = rotate(qkv[:, :heads + kv_heads], rotary)
        k, v = qk[:, heads:], qkv[:, heads + kv_heads:]
        o = cached_attention(qk[:, :heads], k, v, past_k, past_v, bias, (heads, kv_heads, d))
        return o, k, v
