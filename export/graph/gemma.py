"""Gemma 2 and Gemma 3 text.

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

Fused attention (GroupQueryAttention) takes Gemma 2's soft-cap and the query scale as
attributes; the graph rotates q and k itself before the kernel, with the tables of each
layer's kind (the kernel's own rotary takes one set of tables, and heads of a multiple of
16 dims).
"""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.attention import soft_cap
from specedge.export.graph.decoder import (
    Decoder,
    FusedInputs,
    PortableInputs,
    attend,
    attention_shape,
)
from specedge.export.graph.families import layer_windows
from specedge.export.graph.outputs import lm_head
from specedge.export.graph.reshape import split_heads
from specedge.export.graph.rotary import rotary_tables, rotate

# Rope scalings whose tables the model's rotary embedding fixes at construction. "dynamic"
# and "longrope" change with the call, and Gemma's per-layer-kind rotary embedding is not
# one graph/rotary.py computes.
GEMMA_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


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


class GemmaDecoder(Decoder):
    """Gemma 2 and Gemma 3 text (module docstring)."""

    def sliding_windows(self) -> list[int | None]:
        return layer_windows(self.model.config)

    def prepare(self) -> None:
        check_gemma(self.model.config)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor,
               past_length: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Rotary tables per layer kind, from the model's own rotary embedding: Gemma 3's
        takes the kind (its own base and scaling each), Gemma 2's is one for all layers."""
        cfg = self.model.config
        base = self.model.model
        kinds = list(cfg.layer_types[:cfg.num_hidden_layers])
        if cfg.model_type == "gemma3_text":
            tables = {kind: rotary_tables(*base.rotary_emb(x, position_ids, kind), cfg.head_dim)
                      for kind in sorted(set(kinds))}
            return [tables[kind] for kind in kinds]
        return [rotary_tables(*base.rotary_emb(x, position_ids), cfg.head_dim)] * len(kinds)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = lm_head(self.model, hidden)
        capped = soft_cap(logits, self.model.config.final_logit_softcapping)
        if getattr(self.model, "specedge_head_ids", None) is not None:
            # Tokens outside a draft's head keep logit -inf (tanh would make it -cap).
            capped = torch.where(torch.isinf(logits), logits, capped)
        return capped

    @staticmethod
    def attention(layer: nn.Module, h: torch.Tensor, past_k: torch.Tensor,
                  past_v: torch.Tensor, inputs: PortableInputs | FusedInputs
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v from their own projections; Gemma 3's per-head q and k norms; the
        query scale after the rotation; Gemma 2's soft-capped scores."""
        attn = layer.self_attn
        shape = heads, kv_heads, d = attention_shape(attn)
        q = split_heads(attn.q_proj(h), heads, d)
        k = split_heads(attn.k_proj(h), kv_heads, d)
        v = split_heads(attn.v_proj(h), kv_heads, d)
        if hasattr(attn, "q_norm"):  # Gemma 3: per-head RMSNorm before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotate(q, inputs.rotary), rotate(k, inputs.rotary)
        # transformers' Gemma 3 attention does not pass the soft-cap on (module docstring).
        cap = attn.config.attn_logit_softcapping if attn.config.model_type == "gemma2" else None
        return attend(q, k, v, past_k, past_v, inputs, shape, attn.scaling, cap)

    @staticmethod
    def residual(layer: nn.Module, x: torch.Tensor, h: torch.Tensor,
                 o: torch.Tensor) -> torch.Tensor:
        """Four norms: after the attention, and before and after the MLP."""
        x = x + layer.post_attention_layernorm(layer.self_attn.o_proj(o))
        return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
