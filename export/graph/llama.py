"""The Llama family (Llama, Mistral, Qwen2, Qwen3): the decoder skeleton's own layout
(graph/decoder.py), with sliding windows where the config has them; and one layer of it on
its own, as a feature draft runs it (export/drafts/feature.py).

Within the family: Mistral, Qwen2 and Qwen3 may have sliding-window layers
(graph/families.py `layer_windows`); Qwen3 normalizes q and k per head (RMSNorm over the
head size) before rotary, and its head size comes from its config
(graph/projections.py `qkv_projection`)."""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.attention import attention_bias
from specedge.export.graph.decoder import Decoder, FusedInputs, PortableInputs
from specedge.export.graph.families import layer_windows


class LlamaFamilyDecoder(Decoder):
    """Llama, Mistral, Qwen2 and Qwen3: pre-norm blocks, rotary positions, grouped-query
    attention, sliding windows where the config has them (module docstring). The only
    family whose graphs can output features for a feature draft (`features`)."""

    skip_norms = True

    def sliding_windows(self) -> list[int | None]:
        return layer_windows(self.model.config)


def llama_bias(config, past_length: torch.Tensor, past_k: torch.Tensor,
               input_ids: torch.Tensor, dtype: torch.dtype,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_bias` for a Llama-family config's query grouping (`window`: a sliding
    window's)."""
    groups = config.num_attention_heads // config.num_key_value_heads
    return attention_bias(past_length, past_k.shape[2], input_ids.shape[1], groups, dtype,
                          window)


def llama_layer(layer: nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, ...],
                past_k: torch.Tensor, past_v: torch.Tensor,
                bias: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Llama-family decoder layer over the cache, portable attention: (x out, new K
    rows, new V rows)."""
    return LlamaFamilyDecoder.layer_step(layer, x, past_k, past_v, PortableInputs(rotary, bias))


def llama_layer_fused(layer: nn.Module, x: torch.Tensor, past_k: torch.Tensor,
                      past_v: torch.Tensor, inputs: FusedInputs
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`llama_layer` on GroupQueryAttention: (x out, K buffer, V buffer), the buffers
    written in place; `inputs` as graph/decoder.py `FusedInputs` describes them."""
    return LlamaFamilyDecoder.layer_step(layer, x, past_k, past_v, inputs)
