"""The Llama family (Llama, Mistral, Qwen2, Qwen3): the decoder skeleton's own layout
(graph/decoder.py), with sliding windows where the config has them.

Within the family: Mistral, Qwen2 and Qwen3 may have sliding-window layers
(graph/families.py `layer_windows`); Qwen3 normalizes q and k per head (RMSNorm over the
head size) before rotary, and its head size comes from its config
(graph/projections.py `qkv_projection`)."""

from __future__ import annotations

from specedge.export.graph.decoder import Decoder
from specedge.export.graph.families import layer_windows


class LlamaFamilyDecoder(Decoder):
    """Llama, Mistral, Qwen2 and Qwen3: pre-norm blocks, rotary positions, grouped-query
    attention, sliding windows where the config has them (module docstring)."""

    skip_norms = True

    def sliding_windows(self) -> list[int | None]:
        return layer_windows(self.model.config)
