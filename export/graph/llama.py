"""The Llama family (Llama, Mistral, Qwen2, Qwen3): decoder layers in the portable and the
fused attention form, and the target's features for a feature draft.

Within the family: Mistral, Qwen2 and Qwen3 may have sliding-window layers
(graph/families.py `layer_windows`); Qwen3 normalizes q and k per head (RMSNorm over the
head size) before rotary, and its head size comes from its config."""

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
    rope_type,
    rotary_tables,
    rotate,
)


def fused_weights(linears: list[nn.Module], scales: list[float]) -> tuple[torch.Tensor, ...]:
    """One projection for several that read the same input: weights (and biases) stacked
    along the output axis, so the graph runs one MatMul where the model runs several."""
    weight = torch.cat([m.weight * s for m, s in zip(linears, scales)])
    if all(m.bias is None for m in linears):
        return weight, None
    return weight, torch.cat([m.bias * s if m.bias is not None else
                              torch.zeros(m.weight.shape[0]) for m, s in zip(linears, scales)])


def llama_bias(config, past_length: torch.Tensor, past_k: torch.Tensor,
               input_ids: torch.Tensor, dtype: torch.dtype,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_bias` for a Llama-family config's query grouping (`window`: a sliding
    window's)."""
    groups = config.num_attention_heads // config.num_key_value_heads
    return attention_bias(past_length, past_k.shape[2], input_ids.shape[1], groups, dtype,
                          window)


def qkv_projection(layer: nn.Module, x: torch.Tensor, q_scale: float) -> torch.Tensor:
    """q|k|v [1, T, (H + 2 Hkv) D] from one projection (the exporter folds the stacked
    weights into one constant), q scaled by `q_scale`, unrotated. With per-head q and k
    norms (Qwen3) those are applied, and the scale after them."""
    attn = layer.self_attn
    if getattr(attn, "q_norm", None) is None:
        return torch.nn.functional.linear(
            layer.input_layernorm(x),
            *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [q_scale, 1.0, 1.0]))
    d = attn.head_dim
    heads, kv_heads = attn.q_proj.weight.shape[0] // d, attn.k_proj.weight.shape[0] // d
    qkv = torch.nn.functional.linear(
        layer.input_layernorm(x),
        *fused_weights([attn.q_proj, attn.k_proj, attn.v_proj], [1.0] * 3))
    q, k, v = qkv.reshape(1, -1, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads],
                                                                dim=2)
    q = attn.q_norm(q) * q_scale if q_scale != 1.0 else attn.q_norm(q)
    return torch.cat([q, attn.k_norm(k), v], dim=2).reshape(1, -1, (heads + 2 * kv_heads) * d)


def _mlp_block(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x + MLP(norm(x)), gate and up from one projection."""
    mlp = layer.mlp
    gate, up = torch.nn.functional.linear(
        layer.post_attention_layernorm(x), *fused_weights([mlp.gate_proj, mlp.up_proj], [1.0, 1.0])
    ).split(mlp.gate_proj.weight.shape[0], dim=-1)
    return x + mlp.down_proj(mlp.act_fn(gate) * up)


def llama_layer(layer: nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, ...],
                past_k: torch.Tensor, past_v: torch.Tensor,
                bias: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Llama-family decoder layer over the cache: (x out, new K rows, new V rows).

    The attention scale is folded into q's weights, which commutes with the rotation.
    """
    attn = layer.self_attn
    d = attn.head_dim
    q_width, kv_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    heads, kv_heads = q_width // d, kv_width // d
    qkv = qkv_projection(layer, x, attn.scaling)
    qkv = qkv.reshape(1, -1, heads + 2 * kv_heads, d).transpose(1, 2)
    qk = rotate(qkv[:, :heads + kv_heads], rotary)
    k, v = qk[:, heads:], qkv[:, heads + kv_heads:]
    o = cached_attention(qk[:, :heads], k, v, past_k, past_v, bias, (heads, kv_heads, d))
    return _mlp_block(layer, x + attn.o_proj(o)), k, v


def llama_layer_fused(layer: nn.Module, x: torch.Tensor, past_k: torch.Tensor,
                      past_v: torch.Tensor, lengths: tuple[torch.Tensor, torch.Tensor],
                      rotary_cache: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                      window: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`llama_layer` on GroupQueryAttention: (x out, K buffer, V buffer), the buffers
    written in place. lengths: (seqlens_k, total); rotary_cache: (cos, sin) tables;
    positions: their rows for this call (rotary.py `gqa_positions`); window: the layer's
    sliding window, if any."""
    attn = layer.self_attn
    # Read from the config: a size read from a weight is a traced value while tracing, and
    # the tracer cannot make a node attribute of it.
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    o, present_k, present_v = GroupQueryAttention.apply(
        qkv_projection(layer, x, 1.0), past_k, past_v, *lengths, *rotary_cache, positions, heads,
        kv_heads, float(attn.scaling), int(window or 0))
    return _mlp_block(layer, x + attn.o_proj(o)), present_k, present_v


def target_features(fuse: nn.Module | None, layer_outputs: list[torch.Tensor],
                    final: torch.Tensor) -> torch.Tensor:
    """The f_r a feature draft reads: the final norm's output, or with the draft's `fuse`,
    fuse([rms(h^(a)); ...; final]) over the outputs of its `feature_layers`
    (export/drafts/feature.py)."""
    if fuse is None:
        return final
    return fuse(torch.cat([*map(_rms, layer_outputs), final], dim=-1))


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMS norm: earlier layers' outputs differ in scale from the final one."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaFamilyDecoder(nn.Module):
    """Llama, Mistral, Qwen2 and Qwen3: pre-norm blocks, rotary positions, grouped-query
    attention, sliding windows where the config has them (module docstring).

    `features`: also output, at every input position, the f_r a feature draft reads
    (export/drafts/feature.py): True for the final norm's output (the vectors the head
    reads), or the feature draft itself, whose `fuse` may mix earlier layers' outputs (its
    `feature_layers`) in: `target_features`.
    `fused`: attention on GroupQueryAttention, KV layout "bhsd-inplace" (module docstring).
    """

    def __init__(self, model: nn.Module, features: bool | nn.Module = False,
                 fused: bool = False):
        super().__init__()
        self.model = model
        self.features = bool(features)
        self.feature_layers = getattr(features, "feature_layers", ())
        self.fuse = getattr(features, "fuse", None)
        self.fused = fused
        self.windows = layer_windows(model.config)
        rope_type(model.model.rotary_emb)  # raises for a scaling the graph cannot match
        if fused:
            self.rotary_cache = gqa_rotary_cache(model.model.rotary_emb, model.config)

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base = self.model.model
        x = base.embed_tokens(input_ids)
        presents, layer_outputs = [], []
        if self.fused:
            lengths = gqa_lengths(past_length, input_ids)
            rows = gqa_positions(base.rotary_emb, self.model.config, position_ids,
                                 past_length)
        else:
            rotary = rotary_tables(*call_tables(base.rotary_emb, position_ids, past_length),
                                   base.layers[0].self_attn.head_dim)
            # One mask per distinct window, shared by the layers that have it (in layer
            # order, so that the graph is the same on every export).
            biases = {w: llama_bias(self.model.config, past_length, past[0], input_ids,
                                    x.dtype, w) for w in dict.fromkeys(self.windows)}
        for i, layer in enumerate(base.layers):
            if self.fused:
                x, k, v = llama_layer_fused(layer, x, past[2 * i], past[2 * i + 1], lengths,
                                            self.rotary_cache, rows, self.windows[i])
            else:
                x, k, v = llama_layer(layer, x, rotary, past[2 * i], past[2 * i + 1],
                                      biases[self.windows[i]])
            presents += [k, v]
            if i in self.feature_layers:
                layer_outputs.append(x)
        if not self.features:
            x = base.norm(last_positions(x, logits_to_keep))
            return (lm_head(self.model, x), *presents)
        final = base.norm(x)
        return (lm_head(self.model, last_positions(final, logits_to_keep)), *presents,
                target_features(self.fuse, layer_outputs, final))
