"""The export module of a decoder-only model: the embeddings, the layers over the KV cache,
the final norm and the head, with a hook at each place where the families differ.

A family is a subclass that overrides only what differs (one file each in this package).
The defaults are the Llama layout: pre-norm layers, q|k|v from one projection, rotary
positions, grouped-query attention, a gated MLP, no sliding windows. Attention takes one of
one of the forms of graph/attention.py: portable, fused on GroupQueryAttention, or batched
on ONNX's Attention (the `attention` form).

The hooks on a layer (`attention_input`, `qkv`, `attention`, `residual`) are static: they
read all they need from the layer and its config, so that one layer also runs on its own
(a feature draft's, export/drafts/feature.py). The hooks on the model (`layers`,
`sliding_windows`, `prepare`, `embed`, `rotary`, `norm`, `logits`) are methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specedge.export.graph.attention import (
    GroupQueryAttention,
    ScatterAttention,
    attention_bias,
    cached_attention,
    gqa_lengths,
    pack_qkv,
    portable_attention,
    scatter_inputs,
)
from specedge.export.graph.families import kernel_rotates, model_dims_of
from specedge.export.graph.outputs import last_positions, lm_head, target_features
from specedge.export.graph.projections import gated_mlp, qkv_projection
from specedge.export.graph.reshape import merge_heads, split_heads
from specedge.export.graph.rotary import (
    RotaryEmbedding,
    call_tables,
    gqa_positions,
    gqa_rotary_cache,
    partial_rotary_tables,
    rope_type,
    rotary_dim,
    rotate,
)
from specedge.export.graph.skip_norm import skip_rms_norm


@dataclass(frozen=True)
class PortableInputs:
    """What a layer's portable attention reads besides its own q, k and v, built once per
    call: the rotary tables (graph/rotary.py `rotary_tables`; None without rotary) and the
    masks (graph/attention.py `attention_bias`)."""

    rotary: tuple[torch.Tensor, ...] | None
    bias: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FusedInputs:
    """What a layer's in-place attention reads besides its own q|k|v, built once per call:
    (seqlens_k, total) (graph/attention.py `gqa_lengths`; with `batched`, ScatterAttention's
    (past_length, mask) from `scatter_inputs`), the rotary tables (cos, sin) and
    the rows of them for this call (graph/rotary.py `gqa_rotary_cache`, `gqa_positions`)
    when the kernel rotates, and the layer's sliding window (None: full attention).
    `rotary`: when the graph rotates q and k itself (graph/families.py
    `kernel_rotates` false), the layer's rotary tables as portable attention reads them
    (None without rotary)."""

    lengths: tuple[torch.Tensor, torch.Tensor]
    rotary_cache: tuple[torch.Tensor, torch.Tensor] | None
    rows: torch.Tensor | None
    window: int | None = None
    rotary: tuple[torch.Tensor, ...] | None = None
    batched: bool = False


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
           past_v: torch.Tensor, inputs: PortableInputs | FusedInputs,
           shape: tuple[int, int, int], scale: float, cap: float | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of q [1, H, T, D] (rotated, unscaled), k and v [1, Hkv, T, D] (k rotated)
    over the cache, in the layer's form: -> (output [1, T, H D], K, V) as
    `Decoder.attention` returns them. For families that compute q, k and v their own way
    (Gemma, GPT-2); `cap`: soft-capped scores (Gemma 2)."""
    if isinstance(inputs, FusedInputs) and inputs.batched:
        out, k_buffer, v_buffer = ScatterAttention.apply(
            q, k, v, past_k, past_v, *inputs.lengths, shape[0], shape[1], float(scale),
            float(cap or 0.0), int(inputs.window or 0))
        return merge_heads(out, shape[0] * shape[2]), k_buffer, v_buffer
    if isinstance(inputs, FusedInputs):
        return GroupQueryAttention.apply(
            pack_qkv(q, k, v, shape), past_k, past_v, *inputs.lengths, None, None, None,
            shape[0], shape[1], float(scale), int(inputs.window or 0), float(cap or 0.0))
    return cached_attention(q * scale, k, v, past_k, past_v, inputs.bias, shape, cap), k, v


def attention_shape(attn: nn.Module) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of an attention module, as Python ints from its
    config: a size read from a weight is a traced value while tracing, and the tracer cannot
    make a node attribute of it."""
    return attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim


class Decoder(nn.Module):
    """A causal LM as a graph with the bundle's KV-cache I/O (module docstring).

    `features`: also output, at every input position, the f_r a feature draft reads
    (export/drafts/feature.py): True for the final norm's output (the vectors the head
    reads), or the feature draft itself, whose `fuse` may mix earlier layers' outputs (its
    `feature_layers`) in: graph/outputs.py `target_features`.
    `attention`: the attention's form (graph/attention.py): "portable", or in place (KV
    layout "bhsd-inplace") on GroupQueryAttention ("fused") or on ONNX's Attention
    ("batched").
    """

    def __init__(self, model: nn.Module, features: bool | nn.Module = False,
                 attention: str = "portable"):
        super().__init__()
        self.model = model
        self.features = bool(features)
        self.feature_layers = getattr(features, "feature_layers", ())
        self.fuse = getattr(features, "fuse", None)
        self.fused = attention in ("fused", "batched")  # the cache written in place
        self.batched = attention == "batched"
        # Fused attention: GroupQueryAttention rotates q and k with its own tables, or the
        # graph rotates them before the kernel (FusedInputs.rotary; graph/families.py).
        # ONNX's Attention has no rotary: ONNX Runtime's RotaryEmbedding rotates them with
        # the same tables where GroupQueryAttention would, else the graph does.
        self.kernel_rotary = kernel_rotates(model.config)
        # Query heads per KV head.
        self.groups = (model.config.num_attention_heads
                       // model_dims_of(model.config)["num_kv_heads"])
        self.windows = self.sliding_windows()
        self.prepare()

    # Pre-norm layers whose residual adds can go into the norms after them on ONNX Runtime
    # (graph/skip_norm.py): the Llama layout's own residual; families that change it say no.
    skip_norms = False

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        """The graph's inputs in order (runtime/bundle.py); a target with features ends
        them with features_to_keep."""
        if self.features:
            *past, features_to_keep = past
        x = self.embed(input_ids, position_ids)
        inputs = self.layer_inputs(x, input_ids, position_ids, past_length, past)
        presents, layer_outputs = [], []
        pending = None  # with skip norms: a block's output not yet added to x
        for i, layer in enumerate(self.layers):
            if self.fused and self.skip_norms:
                x, pending, k, v = self.skip_norm_layer(layer, x, pending, past[2 * i],
                                                        past[2 * i + 1], inputs[i])
                if i in self.feature_layers:
                    layer_outputs.append(x + pending)
            else:
                x, k, v = self.layer_step(layer, x, past[2 * i], past[2 * i + 1], inputs[i])
                if i in self.feature_layers:
                    layer_outputs.append(x)
            presents += [k, v]
        if pending is not None:
            x = x + pending
        if not self.features:
            return (self.logits(self.norm(last_positions(x, logits_to_keep))), *presents)
        # The features of the last features_to_keep positions only: none in plain decoding,
        # which then skips the feature draft's fuse product.
        kept = [last_positions(h, features_to_keep) for h in layer_outputs]
        return (self.logits(self.norm(last_positions(x, logits_to_keep))), *presents,
                target_features(self.fuse, kept,
                                self.norm(last_positions(x, features_to_keep))))

    def layer_inputs(self, x: torch.Tensor, input_ids: torch.Tensor,
                     position_ids: torch.Tensor, past_length: torch.Tensor,
                     past: tuple[torch.Tensor, ...]) -> list[PortableInputs | FusedInputs]:
        """What each layer's attention reads besides its own q, k and v, built once per call
        and shared by the layers."""
        if self.fused and self.batched:
            # A mask per distinct window, in layer order (batched attention's masks hold it).
            lengths = {w: self.fused_lengths(input_ids, past_length, past, w)
                       for w in dict.fromkeys(self.windows)}
        elif self.fused:
            # GroupQueryAttention takes the window as an attribute: one set for all layers.
            lengths = dict.fromkeys(self.windows,
                                    self.fused_lengths(input_ids, past_length, past))
        if self.fused and self.kernel_rotary:
            rows = gqa_positions(self.model.model.rotary_emb, self.model.config, position_ids,
                                 past_length)
            return [FusedInputs(lengths[w], self.rotary_cache, rows, w, None, self.batched)
                    for w in self.windows]
        rotary = self.rotary(x, position_ids, past_length)
        if self.fused:
            return [FusedInputs(lengths[w], None, None, w, tables, self.batched)
                    for tables, w in zip(rotary, self.windows)]
        # One mask per distinct window, shared by the layers that have it (in layer order,
        # so that the graph is the same on every export).
        biases = {w: attention_bias(past_length, past[0].shape[2], input_ids.shape[1],
                                    self.groups, x.dtype, w) for w in dict.fromkeys(self.windows)}
        return [PortableInputs(tables, biases[w]) for tables, w in zip(rotary, self.windows)]

    def fused_lengths(self, input_ids: torch.Tensor, past_length: torch.Tensor,
                      past: tuple[torch.Tensor, ...], window: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What in-place attention reads of the call's lengths, once for the layers with
        sliding window `window` (batched: in its mask; GroupQueryAttention's lengths do not
        depend on it)."""
        if self.batched:
            return scatter_inputs(past_length, input_ids, past[0].shape[2], self.groups,
                                  window)
        return gqa_lengths(past_length, input_ids)

    @classmethod
    def layer_step(cls, layer: nn.Module, x: torch.Tensor, past_k: torch.Tensor,
                   past_v: torch.Tensor, inputs: PortableInputs | FusedInputs
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer over the cache: (x out, K, V), K and V the new rows (portable)
        or the cache buffers with the new rows written in place (fused)."""
        h = cls.attention_input(layer, x)
        o, k, v = cls.attention(layer, h, past_k, past_v, inputs)
        return cls.residual(layer, x, h, o), k, v

    @classmethod
    def skip_norm_layer(cls, layer: nn.Module, x: torch.Tensor, pending: torch.Tensor | None,
                        past_k: torch.Tensor, past_v: torch.Tensor, inputs: FusedInputs
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`layer_step` with each residual add inside the norm that reads the sum
        (graph/skip_norm.py): the residual stream is x + pending, pending the previous
        layer's MLP output (None before the first layer). Returns (x, pending, K, V)."""
        if pending is None:
            h = cls.attention_input(layer, x)
        else:
            h, x = skip_rms_norm(pending, x, layer.input_layernorm)
        o, k, v = cls.attention(layer, h, past_k, past_v, inputs)
        h, x = skip_rms_norm(layer.self_attn.o_proj(o), x, layer.post_attention_layernorm)
        return x, gated_mlp(layer.mlp, h), k, v

    # Hooks on the model.

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def sliding_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention): none by default."""
        return [None] * len(self.layers)

    def prepare(self) -> None:
        """Raise for a model whose graph would not compute what transformers computes, and
        keep what every call reuses: the rotary and head sizes, and for fused attention
        GroupQueryAttention's rotary tables."""
        rotary_emb = self.model.model.rotary_emb
        rope_type(rotary_emb)  # raises for a scaling the graph cannot match
        self.rotary_dim = rotary_dim(rotary_emb)
        self.head_dim = self.layers[0].self_attn.head_dim
        if self.fused and self.kernel_rotary:
            self.rotary_cache = gqa_rotary_cache(rotary_emb, self.model.config)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor,
               past_length: torch.Tensor) -> list[tuple[torch.Tensor, ...] | None]:
        """Each layer's rotary tables for the positions of a call (portable attention):
        one set for all, over the first `rotary_dim` dims of each head."""
        tables = partial_rotary_tables(
            *call_tables(self.model.model.rotary_emb, position_ids, past_length),
            self.rotary_dim, self.head_dim)
        return [tables] * len(self.layers)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm."""
        return self.model.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over the final norm's output at the kept positions."""
        return lm_head(self.model, hidden)

    # Hooks on a layer.

    @staticmethod
    def attention_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What the attention reads: the normalized layer input."""
        return layer.input_layernorm(x)

    @staticmethod
    def qkv(layer: nn.Module, h: torch.Tensor, q_scale: float) -> torch.Tensor:
        """q|k|v [1, T, (H + 2 Hkv) D] of the attention input from one projection, q scaled
        by `q_scale`, unrotated."""
        return qkv_projection(layer.self_attn, h, q_scale)

    @classmethod
    def attention(cls, layer: nn.Module, h: torch.Tensor, past_k: torch.Tensor,
                  past_v: torch.Tensor, inputs: PortableInputs | FusedInputs
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output [1, T, H D], K, V) of the layer's attention. Portable: the attention
        scale is folded into q's projection (it commutes with the rotation); fused:
        GroupQueryAttention rotates (or the graph does before it) and scales."""
        attn = layer.self_attn
        shape = heads, kv_heads, d = attention_shape(attn)
        if isinstance(inputs, FusedInputs) and (inputs.rotary_cache is None or inputs.batched):
            x = split_heads(cls.qkv(layer, h, 1.0), heads + 2 * kv_heads, d)
            qk = (rotate(x[:, :heads + kv_heads], inputs.rotary) if inputs.rotary_cache is None
                  else RotaryEmbedding.apply(x[:, :heads + kv_heads], *inputs.rotary_cache,
                                             inputs.rows, heads + kv_heads))
            return attend(qk[:, :heads], qk[:, heads:], x[:, heads + kv_heads:], past_k, past_v,
                          inputs, shape, attn.scaling)
        if isinstance(inputs, FusedInputs):
            return GroupQueryAttention.apply(
                cls.qkv(layer, h, 1.0), past_k, past_v, *inputs.lengths, *inputs.rotary_cache,
                inputs.rows, shape[0], shape[1], float(attn.scaling), int(inputs.window or 0))
        return portable_attention(cls.qkv(layer, h, attn.scaling), inputs.rotary, past_k,
                                  past_v, inputs.bias, shape)

    @staticmethod
    def residual(layer: nn.Module, x: torch.Tensor, h: torch.Tensor,
                 o: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input x, the attention's input h and its output o:
        the attention added to the residual stream, then the gated MLP of the normalized
        sum."""
        x = x + layer.self_attn.o_proj(o)
        return x + gated_mlp(layer.mlp, layer.post_attention_layernorm(x))
