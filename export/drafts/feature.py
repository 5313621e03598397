"""A feature draft (EAGLE, Li et al. 2024): one decoder layer that predicts the target's next
feature vector from its current one.

The target's feature f_r is its final norm's output at position r: what its head reads,
p(. | x_<=r) = softmax(W f_r). Predicting the next token from f_r and the token x_{r+1}
that was drawn from it is far easier for one layer than predicting it from tokens alone,
as a small draft model must: f_r already holds what the target's 30 layers computed.

    pair r:   g_r = fc([embed(x_{r+1}); f_r])            (2H -> H)
              f^_{r+1} = layer(g_<=r)                   one target-shaped decoder layer,
                                                        causal over pairs, KV cache per pair
              q(. | x_<=r+1) = softmax(W_head f^_{r+1})  the target's head, head tokens only

Drafting chains the draft's own prediction: pair r + 1 reads f^_{r+1} where the target's
f_{r+1} is not known yet. After verification, pairs computed from predicted features are
recomputed from the target's (drafters.FeatureDrafter), so the draft's cache only holds
pairs built on what the target computed.

With `feature_layers` (EAGLE-3, Li et al. 2025), f_r is not the last layer's output alone
but a learned mix of it and of earlier layers' outputs:

    f_r = fuse([rms(h^(a)_r); rms(h^(b)_r); ...; norm(h^(L)_r)])   ((n+1)H -> H, no bias)

The last layer's features are shaped for predicting x_{r+1}; earlier layers still hold more
of what predicting x_{r+2} needs. `fuse` is the draft's, but it runs in the target's graph
(export/graph/), so the runtime and the bundle contract see an H-wide f_r either way; the
graph computes it for the last `features_to_keep` positions only, none in plain decoding.
rms() is a parameter-free RMS norm: the residual stream's scale grows with depth.

Graph I/O is the bundle's (runtime/bundle.py) plus `hidden_states_in` [B, T, H] (the f_r of
each pair) and `hidden_states` [B, T, H] (the f^_{r+1}); the target graph of such a bundle
takes `features_to_keep` and outputs its f_r of those positions as `hidden_states`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specedge.export.drafts.truncated import check_mlp_width, copy_layer
from specedge.export.graph.attention import soft_cap
from specedge.export.graph.decoder import Decoder
from specedge.export.graph.families import FEATURE_DRAFT_FAMILIES, GPT2_FAMILY
from specedge.export.graph.outputs import last_positions, lm_head
from specedge.export.graph.trace import DECODERS


class FeatureDraft(nn.Module):
    """fc + one decoder layer of the target's shape; embeddings, rotary table and head are
    the target's own, frozen (not stored with the draft)."""

    reads_features = True  # its graph takes the target's features as an input

    def __init__(self, target: nn.Module, head_ids: torch.Tensor,
                 feature_layers: tuple[int, ...] = (), mlp_width: int | None = None):
        super().__init__()
        check_feature_target(target.config)
        stack = decoder_stack(target)
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = 1
        check_mlp_width(config, mlp_width)
        if mlp_width is not None:
            config.intermediate_size = mlp_width
        if getattr(config, "layer_types", None):
            config.layer_types = ["full_attention"]
        # Full attention over its pairs, in training as in its graph: a target's sliding
        # window (Mistral, Phi-3) bounds what its own layers read, not what the draft may.
        if getattr(config, "sliding_window", None):
            config.sliding_window = None
        # Training runs the layer through transformers' attention: sdpa, causal when given
        # no mask, except where the layer soft-caps its scores (Gemma 2), which only the
        # eager path does; `predict` then gives the causal mask itself.
        config._attn_implementation = ("eager" if config.model_type == "gemma2"
                                       and getattr(config, "attn_logit_softcapping", None)
                                       else "sdpa")
        self.config = config
        width = config.hidden_size
        self.fc = nn.Linear(2 * width, width)
        self.layer = type(stack.layers[-1])(config, layer_idx=0)
        copy_layer(self.layer, stack.layers[-1])
        # Start as the identity on the feature: f^_{r+1} = f_r, a poor but sane guess (the
        # target's distribution one position back) from which training moves: fc passes
        # the feature half through, and the layer's two residual branches start at zero.
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, width:].copy_(torch.eye(width))
            self.fc.bias.zero_()
            for branch in residual_outputs(self.layer):
                branch.weight.zero_()
                if getattr(branch, "bias", None) is not None:
                    branch.bias.zero_()
        self.embed_tokens = stack.embed_tokens
        # GPT-2's positions are learned and added to the token embedding (its layers read
        # none): the pairs get them the same way, at the pair's position.
        self.position_embed = stack.position_embed
        self.rotary_emb = stack.rotary_emb
        self.lm_head = target.lm_head
        for frozen in (self.embed_tokens, self.lm_head, self.position_embed):
            if frozen is not None:
                frozen.requires_grad_(False)
        self.register_buffer("specedge_head_ids", head_ids.long(), persistent=False)
        self.feature_layers = check_feature_layers(feature_layers, target.config.num_hidden_layers)
        self.fuse = None
        if self.feature_layers:
            # Starts as the last layer's features alone, the draft without earlier layers.
            self.fuse = nn.Linear((len(self.feature_layers) + 1) * width, width, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -width:].copy_(torch.eye(width))

    attention = "portable"  # see use_attention

    def use_attention(self, form: str) -> None:
        """From now on the graph (`forward`) runs its layer in attention form `form`
        (graph/attention.py): "portable", or in place (KV layout "bhsd-inplace") on
        GroupQueryAttention ("fused") or ONNX's Attention ("batched", several rows of
        several tokens a call), as the target's graph runs its layers; training is
        unchanged."""
        self.attention = form
        self.__dict__.pop("_family", None)

    def family(self) -> Decoder:
        """The target family's export module (graph/decoder.py, its hooks in the family's
        file) over this draft's one layer: the graph runs the layer as the target's graph
        runs each of its own. Made when first asked for, and kept out of the module's
        submodules (its layer is `self.layer`, which the draft folder stores once)."""
        family = self.__dict__.get("_family")
        if family is None:
            family = DECODERS[self.config.model_type](
                _OneLayerModel(self), attention=self.attention)
            self.__dict__["_family"] = family
        return family

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a draft folder stores: fc, the layer, and fuse if it reads earlier layers."""
        return {k: v for k, v in self.state_dict().items()
                if k.startswith(("fc.", "layer.", "fuse."))}

    def pairs(self, input_ids: torch.Tensor, features: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """g_r = fc([embed(x_{r+1}); f_r]), the layer's input; the embedding holds the
        position `positions` where the target adds learned positions to its own (GPT-2)."""
        embedded = self.embed_tokens(input_ids)
        if self.position_embed is not None:
            embedded = embedded + self.position_embed(positions)
        return self.fc(torch.cat([embedded, features], dim=-1))

    def run_layer(self, x: torch.Tensor, positions: torch.Tensor,
                  bias: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Training: the layer through transformers on pairs x [B, L, H] at `positions`
        [B, L], causal, or under the additive mask `bias` [1, 1, L, keys] over `cache`'s
        keys (unroll.py). Its rotary tables come from the target's rotary embedding (Gemma
        3's has one per layer kind: the draft's layer attends to all its pairs, a
        "full_attention" one, as graph/gemma.py reads the draft's config); GPT-2's layer
        reads no positions."""
        if bias is None and self.config._attn_implementation == "eager":
            length = x.shape[1]  # sdpa is causal without a mask; the eager path needs one
            bias = torch.full((length, length), float("-inf")).triu(1)[None, None]
        kwargs = {"attention_mask": bias, "cache": cache}
        if self.rotary_emb is not None:
            kind = ("full_attention",) if self.config.model_type == "gemma3_text" else ()
            kwargs.update(position_ids=positions,
                          position_embeddings=self.rotary_emb(x, positions, *kind))
        return self.layer(x, **kwargs)

    def predict(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Training: f^_{r+1} for pairs (f_r, x_{r+1}); input_ids [B, L], features [B, L, H]
        -> [B, L, H]. Padding goes at the end (attention is causal)."""
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
        return self.run_layer(self.pairs(input_ids, features, positions), positions)

    @property
    def logit_scale(self) -> float:
        """What the target's head multiplies its logits by: 1, or 1 / `logits_scaling`
        (Granite)."""
        return 1.0 / getattr(self.config, "logits_scaling", 1.0)

    def head_output(self, logits: torch.Tensor) -> torch.Tensor:
        """What the target's head does to the product's logits: Granite's scale, Gemma's
        soft-cap (`final_logit_softcapping`, tanh(z / cap) * cap); a token outside the head
        keeps its logit -inf (the cap would make it -cap)."""
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.where(torch.isinf(logits), logits, soft_cap(logits, cap))
        return logits

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the head tokens only, [..., head_tokens], as the target's head
        computes them from features."""
        return self.head_output(features @ self.lm_head.weight[self.specedge_head_ids].T)

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, past_k, past_v,
                features):
        """The graph: one call over T pairs with the bundle's KV-cache contract."""
        family = self.family()
        x = self.pairs(input_ids, features, position_ids)
        inputs = family.layer_inputs(x, input_ids, position_ids, past_length,
                                     (past_k, past_v))[0]
        x, k, v = family.layer_step(self.layer, x, past_k, past_v, inputs)
        logits = self.head_output(lm_head(self, last_positions(x, logits_to_keep)))
        return logits, k, v, x


class _OneLayerModel(nn.Module):
    """What a family's export module reads of a causal LM (graph/decoder.py: its config, and
    its model's layers, rotary embedding and embeddings; GPT-2's under `transformer`), over
    a feature draft's one layer."""

    def __init__(self, draft: FeatureDraft):
        super().__init__()
        self.config = draft.config
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([draft.layer])
        self.model.rotary_emb = draft.rotary_emb
        self.model.embed_tokens = draft.embed_tokens
        self.transformer = nn.Module()
        self.transformer.h = self.model.layers


@dataclass
class DecoderStack:
    """The parts of a causal LM that a feature draft takes, whatever the family names them."""

    layers: nn.ModuleList
    norm: nn.Module  # the final norm, whose output the head reads: the features
    embed_tokens: nn.Module
    rotary_emb: nn.Module | None  # None: no rotary (GPT-2)
    position_embed: nn.Module | None  # learned positions added to the embedding (GPT-2)
    forward: Callable  # the stack's own forward (input_ids, attention_mask)


def decoder_stack(target: nn.Module) -> DecoderStack:
    """The target's decoder stack: `target.model` (Llama layout and the others), or GPT-2's
    `target.transformer`."""
    if target.config.model_type in GPT2_FAMILY:
        t = target.transformer
        return DecoderStack(t.h, t.ln_f, t.wte, None, t.wpe, t)
    m = target.model
    return DecoderStack(m.layers, m.norm, m.embed_tokens, m.rotary_emb, None, m)


def residual_outputs(layer: nn.Module) -> list[nn.Module]:
    """The projections that end a layer's two residual branches (attention, MLP)."""
    if hasattr(layer, "attn"):  # GPT-2
        return [layer.attn.c_proj, layer.mlp.c_proj]
    return [layer.self_attn.o_proj, layer.mlp.down_proj]


def check_feature_target(config) -> None:
    """ValueError unless a feature draft can be made for this target's family."""
    if config.model_type not in FEATURE_DRAFT_FAMILIES:
        raise ValueError(f"feature drafts take a target of the families "
                         f"{', '.join(FEATURE_DRAFT_FAMILIES)}, not {config.model_type!r}: "
                         "distill a model draft (--kind model) for it")


class _Enough(Exception):
    """Ends the target's forward pass once every wanted output is recorded."""


def target_layer_outputs(target: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None,
                         layers: tuple[int, ...], final: bool = False) -> dict:
    """The target's outputs of decoder `layers` on `ids` [B, L] (and its final norm's, key
    "final", if `final`); without `final` the pass stops after the last of `layers`."""
    base, outputs = decoder_stack(target), {}
    wanted = [(i, base.layers[i]) for i in layers] + ([("final", base.norm)] if final else [])

    def keep(key):
        def hook(module, args, out):
            outputs[key] = out[0] if isinstance(out, tuple) else out
            if len(outputs) == len(wanted):
                raise _Enough
        return hook

    hooks = [module.register_forward_hook(keep(key)) for key, module in wanted]
    try:
        with torch.no_grad():
            base.forward(input_ids=ids, attention_mask=mask)
    except _Enough:
        pass
    finally:
        for h in hooks:
            h.remove()
    return outputs


def check_feature_layers(layers, num_layers: int) -> tuple[int, ...]:
    """Distinct target layer indices in [0, num_layers - 1), ascending (the last layer's
    output is always read, through the final norm)."""
    layers = tuple(sorted(set(int(i) for i in layers)))
    if any(not 0 <= i < num_layers - 1 for i in layers):
        raise ValueError(f"--feature-layers must be target layers 0..{num_layers - 2} (the "
                         f"last one is always read), got {list(layers)}")
    return layers
