"""Torch modules that export a Hugging Face decoder with the bundle's KV-cache contract.

The decoder's own submodules (embeddings, norms, MLPs, rotary embedding, projections) are
reused as they are; only attention is rewritten, so that the graph

* reads the cache in place (rows >= past_length are masked, never copied or concatenated),
* returns only the T new K/V rows (the runtime writes them into its fixed buffers),
* never repeats K/V heads for grouped-query attention (queries are grouped instead).

Attention over cache + new rows without concatenating them (softmax over the union):
    s_past = q K_past^T * scale + mask(j >= past_length)      [G*T, C]
    s_new  = q k_new^T  * scale + causal mask                 [G*T, T]
    a      = softmax([s_past, s_new])
    out    = a[:, :C] V_past + a[:, C:] v_new
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import torch
from torch import nn

from specedge.runtime.bundle import FEATURES_IN, FEATURES_OUT, graph_io

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
GPT2_FAMILY = ("gpt2",)
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + GPT2_FAMILY
OPSET = 21


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     past_k: torch.Tensor, past_v: torch.Tensor, past_length: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [1, H, T, D]; k, v [1, Hkv, T, D]; past_k, past_v [1, Hkv, C, D] -> [1, T, H*D]."""
    _, heads, t, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    # Query head h reads KV head h // groups (HF repeat_kv order), so grouping the queries
    # is a free reshape, while repeating K/V would copy the cache.
    qg = q.reshape(1, kv_heads, groups * t, d)
    capacity = past_k.shape[2]
    neg = torch.finfo(q.dtype).min
    past_valid = torch.arange(capacity, device=q.device) < past_length
    past_bias = torch.where(past_valid, 0.0, neg).to(q.dtype)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    new_bias = torch.where(causal, 0.0, neg).to(q.dtype).repeat(groups, 1)
    s_past = torch.matmul(qg, past_k.transpose(-1, -2)) * scale + past_bias
    s_new = torch.matmul(qg, k.transpose(-1, -2)) * scale + new_bias
    a = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
    out = torch.matmul(a[..., :capacity], past_v) + torch.matmul(a[..., capacity:], v)
    return out.reshape(1, heads, t, d).transpose(1, 2).reshape(1, t, heads * d)


def _last_positions(hidden: torch.Tensor, logits_to_keep: torch.Tensor) -> torch.Tensor:
    t = hidden.shape[1]
    start = t - logits_to_keep[0]
    return hidden[:, start:]


def _lm_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    flat = hidden.reshape(-1, hidden.shape[-1])  # 2-D, so that `share_tied_head` applies
    head_ids = getattr(model, "specedge_head_ids", None)
    if head_ids is None:
        return model.lm_head(flat).unsqueeze(0)
    # A distilled draft scores only its head tokens; the others get logit -inf, q = 0.
    small = torch.nn.functional.linear(flat, model.lm_head.weight[head_ids])
    full = torch.full((flat.shape[0], model.config.vocab_size), float("-inf"))
    return full.scatter(1, head_ids.expand(flat.shape[0], -1), small).unsqueeze(0)


def llama_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor, past_length: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Llama-family decoder layer over the cache: (x out, new K rows, new V rows)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    h = layer.input_layernorm(x)
    t = h.shape[1]
    q = attn.q_proj(h).view(1, t, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(h).view(1, t, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(h).view(1, t, -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = cached_attention(q, k, v, past_k, past_v, past_length, attn.scaling)
    x = x + attn.o_proj(o)
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v


class LlamaFamilyDecoder(nn.Module):
    """Llama, Mistral and Qwen2: pre-norm blocks, rotary positions, grouped-query attention.

    `features`: also output the final norm's output at every input position (the vectors
    the head reads), which a feature draft takes as input (export/feature_draft.py).
    """

    def __init__(self, model: nn.Module, features: bool = False):
        super().__init__()
        self.model = model
        self.features = features

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base = self.model.model
        x = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(x, position_ids)
        presents = []
        for i, layer in enumerate(base.layers):
            x, k, v = llama_layer(layer, x, cos, sin, past[2 * i], past[2 * i + 1], past_length)
            presents += [k, v]
        if not self.features:
            x = base.norm(_last_positions(x, logits_to_keep))
            return (_lm_head(self.model, x), *presents)
        features = base.norm(x)
        return (_lm_head(self.model, _last_positions(features, logits_to_keep)), *presents,
                features)


class GPT2Decoder(nn.Module):
    """GPT-2: learned positions, fused QKV (Conv1D), LayerNorm, one KV head per query head."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base = self.model.transformer
        x = base.wte(input_ids) + base.wpe(position_ids)
        presents = []
        for i, block in enumerate(base.h):
            attn = block.attn
            t = x.shape[1]
            q, k, v = attn.c_attn(block.ln_1(x)).split(attn.embed_dim, dim=2)
            q, k, v = (z.view(1, t, attn.num_heads, attn.head_dim).transpose(1, 2)
                       for z in (q, k, v))
            scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
            if attn.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            o = cached_attention(q, k, v, past[2 * i], past[2 * i + 1], past_length, scale)
            x = x + attn.c_proj(o)
            x = x + block.mlp(block.ln_2(x))
            presents += [k, v]
        x = base.ln_f(_last_positions(x, logits_to_keep))
        return (_lm_head(self.model, x), *presents)


def model_dims(model: nn.Module) -> dict[str, int]:
    """Layer count, KV heads, head dim, vocab size and largest usable context of a model."""
    cfg = model.config
    if cfg.model_type in GPT2_FAMILY:
        return {"num_layers": cfg.n_layer, "num_kv_heads": cfg.n_head,
                "head_dim": cfg.n_embd // cfg.n_head, "vocab_size": cfg.vocab_size,
                "max_context": cfg.n_positions}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    max_context = cfg.max_position_embeddings
    # Sliding-window attention only differs from full attention beyond the window; the graph
    # does full attention, so the context is capped at the window to stay exact.
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        max_context = min(max_context, cfg.sliding_window)
    return {"num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim, "vocab_size": cfg.vocab_size, "max_context": max_context}


def wrap(model: nn.Module, features: bool = False) -> nn.Module:
    """The export module for a Hugging Face causal LM, or ValueError if unsupported.

    `features`: the graph also outputs the target's features for a feature draft."""
    model_type = model.config.model_type
    if features and model_type not in LLAMA_FAMILY:
        raise ValueError(f"feature drafts need a Llama, Mistral or Qwen2 target, not "
                         f"{model_type!r}")
    if model_type in LLAMA_FAMILY:
        return LlamaFamilyDecoder(model, features)
    if model_type in GPT2_FAMILY:
        return GPT2Decoder(model)
    raise ValueError(f"architecture {model_type!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def share_tied_head(path: str) -> bool:
    """Make the LM head read the embedding table instead of its own transposed copy.

    The exporter folds `x @ W^T` into MatMul(x, W^T) with W^T stored as a second initializer;
    for tied embeddings that is a duplicate of the largest tensor (113 MB for SmolLM2).
    Gemm(x, W, transB=1) computes the same product from W itself.
    """
    m = onnx.load(path)
    inits = {i.name: i for i in m.graph.initializer}
    gathers = [n.input[0] for n in m.graph.node if n.op_type == "Gather" and n.input[0] in inits]
    changed = False
    for node in m.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        head = onnx.numpy_helper.to_array(inits[node.input[1]])
        for name in gathers:
            table = inits[name]
            if list(table.dims) == list(head.shape[::-1]) and np.array_equal(
                    onnx.numpy_helper.to_array(table), head.T):
                m.graph.initializer.remove(inits.pop(node.input[1]))
                node.op_type = "Gemm"
                node.input[1] = name
                node.attribute.append(onnx.helper.make_attribute("transB", 1))
                changed = True
                break
    if changed:
        onnx.save(m, path)
    return changed


def export_onnx(model: nn.Module, path: str, share_head: bool = True,
                features: bool = False) -> None:
    """Trace `model` into an ONNX graph at `path` with the bundle's KV-cache I/O.

    `share_head`: for tied embeddings, let the LM head read the embedding table (no second
    copy). Quantized exports keep the copy, so that the head gets quantized as a MatMul.
    `features`: a target that also outputs its features (for a feature draft). A feature
    draft (export/feature_draft.py) is its own export module and always has feature I/O.
    """
    from .feature_draft import FeatureDraft

    dims = model_dims(model)
    n, kv, d = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    dtype = next(model.parameters()).dtype
    t, capacity = 3, 8  # example sizes; both axes are dynamic in the graph
    reads = isinstance(model, FeatureDraft)
    args = (torch.zeros(1, t, dtype=torch.long), torch.arange(2, 2 + t).unsqueeze(0),
            torch.tensor([2]), torch.tensor([t]),
            *[torch.zeros(1, kv, capacity, d, dtype=dtype) for _ in range(2 * n)])
    if reads:
        args += (torch.zeros(1, t, model.config.hidden_size, dtype=dtype),)
    inputs, outputs = graph_io(n, reads, features or reads)
    dynamic = {"input_ids": {1: "T"}, "position_ids": {1: "T"}, "logits": {1: "N"}}
    for name in inputs[4:]:
        dynamic[name] = {1: "T"} if name == FEATURES_IN else {2: "C"}
    for name in outputs[1:]:
        dynamic[name] = {1: "T"} if name == FEATURES_OUT else {2: "T"}
    module = model if reads else wrap(model, features)
    with torch.no_grad():
        torch.onnx.export(module.eval(), args, path, input_names=inputs,
                          output_names=outputs, dynamic_axes=dynamic, opset_version=OPSET,
                          dynamo=False)
    if share_head and model.config.tie_word_embeddings:
        share_tied_head(path)
