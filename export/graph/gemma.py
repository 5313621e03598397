"""Gemma 2 and Gemma 3 text: portable attention only.

What sets them apart from the Llama family, each as transformers computes it
(models/gemma2/modeling_gemma2.py, models/gemma3/modeling_gemma3.py):

* the embedding is multiplied by sqrt(hidden_size) in the model's dtype, and every RMSNorm
  multiplies by (1 + w): both are the model's own modules, reused as they are;
* four norms per layer: before and after attention, before and after the MLP (gelu_tanh,
  the model's own activation);
* the query scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
* sliding layers (`layer_types`, which transformers derives from `sliding_window_pattern`
  when a config has only that) attend to the last `sliding_window` positions, the others to
  all of them: a mask per layer kind, built once per call (graph/attention.py). The cache
  keeps every row, so the bundle's context is the model's full one and a rollback stays a
  change of length;
* Gemma 2: attention logits soft-capped, tanh(s / cap) * cap, before the mask. Gemma 3's
  attention ignores `attn_logit_softcapping` (transformers does not pass it on), so the
  graph does too;
* Gemma 3: RMSNorm over each head of q and k before the rotation, and rotary tables per
  layer kind (`rope_local_base_freq` on sliding layers, the global base and its scaling on
  the others);
* both: final logits soft-capped with `final_logit_softcapping`.

ONNX Runtime's GroupQueryAttention cannot soft-cap attention logits in our setup, so Gemma
graphs get portable attention only (graph/families.py refuses `--attention fused`).
"""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.attention import attention_bias, cached_attention
from specedge.export.graph.families import layer_windows
from specedge.export.graph.outputs import last_positions, lm_head
from specedge.export.graph.rotary import rotary_tables, rotate

# Rope scalings whose tables the model's rotary embedding fixes at construction. "dynamic"
# and "longrope" change with the call, and Gemma's per-layer-kind rotary embedding is not
# one graph/rotary.py computes.
GEMMA_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap, Gemma's soft-capping; x as it is without a cap."""
    return x if not cap else torch.tanh(x / cap) * cap


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         past_k: torch.Tensor, past_v: torch.Tensor,
                         bias: tuple[torch.Tensor, torch.Tensor],
                         shape: tuple[int, int, int], cap: float | None) -> torch.Tensor:
    """`cached_attention` with the scores soft-capped before the mask is added (Gemma 2's
    eager_attention_forward). q already scaled; without a cap, `cached_attention` itself."""
    if not cap:
        return cached_attention(q, k, v, past_k, past_v, bias, shape)
    heads, kv_heads, d = shape
    capacity = bias[0].shape[-1]
    qg = q.reshape(1, kv_heads, -1, d)  # queries grouped per KV head, as cached_attention
    s_past = soft_cap(torch.matmul(qg, past_k.transpose(-1, -2)), cap) + bias[0]
    s_new = soft_cap(torch.matmul(qg, k.transpose(-1, -2)), cap) + bias[1]
    a = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
    out = torch.matmul(a[..., :capacity], past_v) + torch.matmul(a[..., capacity:], v)
    return out.reshape(1, heads, -1, d).transpose(1, 2).reshape(1, -1, heads * d)


def gemma_layer(layer: nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, ...],
                past_k: torch.Tensor, past_v: torch.Tensor,
                bias: tuple[torch.Tensor, torch.Tensor], cap: float | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Gemma 2 or Gemma 3 decoder layer over the cache: (x out, new K rows, new V rows).
    `cap`: the attention soft-cap (Gemma 2), or None."""
    attn = layer.self_attn
    cfg = attn.config
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).reshape(1, -1, heads, d).transpose(1, 2)
    k = attn.k_proj(h).reshape(1, -1, kv_heads, d).transpose(1, 2)
    v = attn.v_proj(h).reshape(1, -1, kv_heads, d).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Gemma 3: per-head RMSNorm before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotate(q, rotary) * attn.scaling, rotate(k, rotary)
    o = softcapped_attention(q, k, v, past_k, past_v, bias, (heads, kv_heads, d), cap)
    x = x + layer.post_attention_layernorm(attn.o_proj(o))
    x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    return x, k, v


def check_gemma(config) -> None:
    """ValueError for a Gemma config the graph would not compute as transformers does."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"this {config.model_type!r} model attends in both directions "
                         "(use_bidirectional_attention): it is an encoder, not a causal LM "
                         "that can be decoded; export a causal Gemma checkpoint")
    params = config.rope_parameters
    per_kind = params.values() if config.model_type == "gemma3_text" else [params]
    for rope in per_kind:
        kind = (rope or {}).get("rope_type", "default")
        if kind not in GEMMA_ROPE_TYPES:
            raise ValueError(f"rope scaling {kind!r} is not supported for "
                             f"{config.model_type!r} (supported: "
                             f"{', '.join(GEMMA_ROPE_TYPES)}): the graph's rotary tables "
                             "would not match transformers'")


class GemmaDecoder(nn.Module):
    """Gemma 2 and Gemma 3 text (module docstring), portable attention."""

    def __init__(self, model: nn.Module):
        super().__init__()
        check_gemma(model.config)
        self.model = model

    def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor,
                kinds: list[str]) -> dict[str, tuple[torch.Tensor, ...]]:
        """Rotary tables per layer kind, from the model's own rotary embedding: Gemma 3's
        takes the kind (its own base and scaling each), Gemma 2's is one for all layers."""
        base = self.model.model
        d = self.model.config.head_dim
        if self.model.config.model_type == "gemma3_text":
            return {kind: rotary_tables(*base.rotary_emb(x, position_ids, kind), d)
                    for kind in sorted(set(kinds))}
        tables = rotary_tables(*base.rotary_emb(x, position_ids), d)
        return dict.fromkeys(kinds, tables)

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        cfg = self.model.config
        base = self.model.model
        x = base.embed_tokens(input_ids)  # scaled by sqrt(hidden_size) in the model's dtype
        kinds = list(cfg.layer_types[:cfg.num_hidden_layers])
        windows = layer_windows(cfg)
        rotary = self._rotary(x, position_ids, kinds)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        # One mask per window size (full attention: None), shared by the layers that use it.
        biases = {w: attention_bias(past_length, past[0].shape[2], input_ids.shape[1], groups,
                                    x.dtype, w) for w in sorted(set(windows), key=str)}
        # transformers' Gemma 3 attention does not pass the soft-cap on (module docstring).
        cap = cfg.attn_logit_softcapping if cfg.model_type == "gemma2" else None
        presents = []
        for i, layer in enumerate(base.layers):
            x, k, v = gemma_layer(layer, x, rotary[kinds[i]], past[2 * i], past[2 * i + 1],
                                  biases[windows[i]], cap)
            presents += [k, v]
        x = base.norm(last_positions(x, logits_to_keep))
        logits = lm_head(self.model, x)
        capped = soft_cap(logits, cfg.final_logit_softcapping)
        if getattr(self.model, "specedge_head_ids", None) is not None:
            # Tokens outside a draft's head keep logit -inf (tanh would make it -cap).
            capped = torch.where(torch.isinf(logits), logits, capped)
        return (capped, *presents)
