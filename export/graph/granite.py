"""Granite (IBM Granite 3.x): the Llama layout with four scalars from its config: the
embeddings times `embedding_multiplier`, each block's output times `residual_multiplier`
before it is added to the residual stream, attention scores scaled by
`attention_multiplier` instead of 1/sqrt(head size) (transformers' attention scaling, which
the decoder skeleton folds into q's projection or hands to GroupQueryAttention), and the
logits divided by `logits_scaling`."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.decoder import Decoder
from specedge.export.graph.outputs import lm_head
from specedge.export.graph.projections import gated_mlp


class GraniteDecoder(Decoder):
    """Granite: the skeleton's Llama layout with the four multipliers (module docstring)."""

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids) * self.model.config.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head(self.model, hidden) / self.model.config.logits_scaling

    @staticmethod
    def residual(layer: nn.Module, x: torch.Tensor, h: torch.Tensor,
                 o: torch.Tensor) -> torch.Tensor:
        multiplier = layer.self_attn.config.residual_multiplier
        x = x + layer.self_attn.o_proj(o) * multiplier
        return x + gated_mlp(layer.mlp, layer.post_attention_layernorm(x)) * multiplier
