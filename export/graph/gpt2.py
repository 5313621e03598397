"""GPT-2: learned positions, LayerNorm, fused qkv (Conv1D), one KV head per query head, no
rotary."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.decoder import Decoder, FusedInputs, PortableInputs, attend
from specedge.export.graph.reshape import split_heads


class GPT2Decoder(Decoder):
    """GPT-2 on the decoder skeleton: its own module names, positions and attention."""

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.transformer.h

    def prepare(self) -> None:
        """Nothing to check or keep: no rotary."""

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        base = self.model.transformer
        return base.wte(input_ids) + base.wpe(position_ids)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor,
               past_length: torch.Tensor) -> list[None]:
        return [None] * len(self.layers)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.ln_f(x)

    @staticmethod
    def attention_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.ln_1(x)

    @staticmethod
    def attention(layer: nn.Module, h: torch.Tensor, past_k: torch.Tensor,
                  past_v: torch.Tensor, inputs: PortableInputs | FusedInputs
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v split from one projection; q scaled as transformers scales it (by
        1/sqrt(head size) and, with `scale_attn_by_inverse_layer_idx`, 1/(layer + 1))."""
        attn = layer.attn
        q, k, v = attn.c_attn(h).split(attn.embed_dim, dim=2)
        q, k, v = (split_heads(z, attn.num_heads, attn.head_dim) for z in (q, k, v))
        return attend(q, k, v, past_k, past_v, inputs,
                      (attn.num_heads, attn.num_heads, attn.head_dim), attn.scaling)

    @staticmethod
    def residual(layer: nn.Module, x: torch.Tensor, h: torch.Tensor,
                 o: torch.Tensor) -> torch.Tensor:
        x = x + layer.attn.c_proj(o)
        return x + layer.mlp(layer.ln_2(x))
