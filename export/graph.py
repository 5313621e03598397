"""Torch modules that export a Hugging Face decoder with the bundle's KV-cache contract.

The decoder's own submodules (embeddings, norms, MLPs, rotary embedding, projections) are
reused as they are; only attention is rewritten, in one of two forms, recorded as the
graph's KV layout (runtime/bundle.py):

* "bhsd-fixed", portable (standard ONNX operators: ONNX Runtime on any device, TensorRT):
  reads the cache buffers (rows >= past_length masked, never copied or concatenated) and
  returns only the T new K/V rows, which the runtime writes into its buffers. Below.
* "bhsd-inplace", `fused` (Llama family, ONNX Runtime CPU): one GroupQueryAttention node
  per layer (an ONNX Runtime contrib operator) does rotary, writes the new rows into the
  cache buffers in place and attends to the valid rows only. On SmolLM2 int8, 2 cores:
  a one-token step in 0.83x the time of the portable graph's.

Neither repeats K/V heads for grouped-query attention (queries are grouped instead).

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
ATTENTIONS = ("auto", "fused", "portable")  # `specedge export --attention`
OPSET = 21
# Bumped when the same checkpoint would export to a different graph, so that bundles made
# by an older exporter are not taken as up to date (export/bundle.py). 2: one mask, fused
# projections and constant shapes (2845 -> 1060 nodes for SmolLM2 after ORT's fusions);
# int4 on Q4_1's grid (export/quantize.py). 3: GroupQueryAttention (`fused`), the
# default for int8 and int4. 4: int8's embedding table at 8 bits (export/quantize.py).
GRAPH_REVISION = 4


def attention_bias(past_length: torch.Tensor, capacity: int | torch.Tensor,
                   t: int | torch.Tensor, groups: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive masks, built once per call and shared by every layer: [C] for the cache
    (rows >= past_length are empty) and [G*T, T] causal for the new rows (queries grouped)."""
    neg = torch.finfo(dtype).min
    past_valid = torch.arange(capacity) < past_length
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (torch.where(past_valid, 0.0, neg).to(dtype),
            torch.where(causal, 0.0, neg).to(dtype).repeat(groups, 1))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     past_k: torch.Tensor, past_v: torch.Tensor,
                     bias: tuple[torch.Tensor, torch.Tensor],
                     shape: tuple[int, int, int]) -> torch.Tensor:
    """q [1, H, T, D], already scaled; k, v [1, Hkv, T, D]; past_k, past_v [1, Hkv, C, D];
    bias from `attention_bias`; shape (H, Hkv, D) -> [1, T, H*D].

    Sizes come in as Python ints, not read from the tensors, and the cache size is read
    from the shared bias: a traced tensor's size would become a Shape/Gather/Concat chain
    recomputed in every layer, a few microseconds of ONNX Runtime overhead per node.
    """
    heads, kv_heads, d = shape
    capacity = bias[0].shape[0]
    # Query head h reads KV head h // groups (HF repeat_kv order), so grouping the queries
    # is a free reshape, while repeating K/V would copy the cache.
    qg = q.reshape(1, kv_heads, -1, d)
    s_past = torch.matmul(qg, past_k.transpose(-1, -2)) + bias[0]
    s_new = torch.matmul(qg, k.transpose(-1, -2)) + bias[1]
    a = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
    out = torch.matmul(a[..., :capacity], past_v) + torch.matmul(a[..., capacity:], v)
    return out.reshape(1, heads, -1, d).transpose(1, 2).reshape(1, -1, heads * d)


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


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, d: int) -> tuple[torch.Tensor, ...]:
    """(cos, signed sin, permutation) for `rotate`, built once per call from the model's
    rotary embedding [1, T, d]: HF's rotate_half(x) = cat(-x2, x1) = x[..., perm] * sign."""
    half = d // 2
    perm = torch.cat([torch.arange(half, 2 * half), torch.arange(half)])
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin.dtype)
    return cos.unsqueeze(1), (sin * sign).unsqueeze(1), perm


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Rotary positions, x * cos + rotate_half(x) * sin, as one Gather and three
    elementwise ops."""
    cos, signed_sin, perm = tables
    return x * cos + x[..., perm] * signed_sin


def _fused(linears: list[nn.Module], scales: list[float]) -> tuple[torch.Tensor, ...]:
    """One projection for several that read the same input: weights (and biases) stacked
    along the output axis, so the graph runs one MatMul where the model runs several."""
    weight = torch.cat([m.weight * s for m, s in zip(linears, scales)])
    if all(m.bias is None for m in linears):
        return weight, None
    return weight, torch.cat([m.bias * s if m.bias is not None else
                              torch.zeros(m.weight.shape[0]) for m, s in zip(linears, scales)])


class _GroupQueryAttention(torch.autograd.Function):
    """ONNX Runtime's fused attention, com.microsoft GroupQueryAttention, for one layer.

    Inputs: q|k|v from one projection [1, T, (H + 2 Hkv) D], unscaled and unrotated; the
    cache buffers [1, Hkv, C, D]; seqlens_k [1] = past_length + T - 1 and total [] =
    past_length + T (int32); the rotary tables [max_context, D/2]; position_ids [1, T].
    Outputs: attention [1, T, H D] and the two cache buffers with the T new rotated rows
    written at [past_length, past_length + T). The runtime binds each of them to its past
    buffer, so that the kernel writes the rows in place (it compares the addresses) and
    attends to the valid rows only: no mask over the capacity, no copy of new rows.

    `forward` is the same math in torch (`cached_attention`, then the rows written into
    copies of the buffers): what tracing runs. `symbolic` is the node the graph gets.
    """

    @staticmethod
    def forward(ctx, qkv, past_k, past_v, seqlens_k, total, cos, sin, positions, heads,
                kv_heads, scale):
        t = qkv.shape[1]
        d = qkv.shape[2] // (heads + 2 * kv_heads)
        x = qkv.reshape(1, t, heads + 2 * kv_heads, d).transpose(1, 2)
        halves = torch.cat([cos, cos], -1)[positions], torch.cat([sin, sin], -1)[positions]
        qk = rotate(x[:, :heads + kv_heads], rotary_tables(*halves, d))
        k, v = qk[:, heads:], x[:, heads + kv_heads:]
        past_length = int(total) - t
        bias = attention_bias(torch.tensor([past_length]), past_k.shape[2], t,
                              heads // kv_heads, qkv.dtype)
        out = cached_attention(qk[:, :heads] * scale, k, v, past_k, past_v, bias,
                               (heads, kv_heads, d))
        present_k, present_v = past_k.clone(), past_v.clone()
        present_k[:, :, past_length:past_length + t] = k
        present_v[:, :, past_length:past_length + t] = v
        return out, present_k, present_v

    @staticmethod
    def symbolic(g, qkv, past_k, past_v, seqlens_k, total, cos, sin, positions, heads,
                 kv_heads, scale):
        absent = g.op("prim::Constant")  # the omitted optional inputs key and value
        absent.setType(torch._C.OptionalType.ofTensor())
        out, present_k, present_v = g.op(
            "com.microsoft::GroupQueryAttention", qkv, absent, absent, past_k, past_v,
            seqlens_k, total, cos, sin, positions, outputs=3, num_heads_i=heads,
            kv_num_heads_i=kv_heads, scale_f=scale, do_rotary_i=1)
        # The exporter cannot infer a contrib operator's output shapes; without them every
        # shape after the first layer (logits, features) would be unknown in the graph.
        width = qkv.type().varyingSizes()[2] // (heads + 2 * kv_heads) * heads
        out.setType(qkv.type().with_sizes([1, None, width]))
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def llama_bias(config, past_length: torch.Tensor, past_k: torch.Tensor,
               input_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_bias` for a Llama-family config's query grouping."""
    groups = config.num_attention_heads // config.num_key_value_heads
    return attention_bias(past_length, past_k.shape[2], input_ids.shape[1], groups, dtype)


def _qkv(layer: nn.Module, x: torch.Tensor, q_scale: float) -> torch.Tensor:
    """q|k|v [1, T, (H + 2 Hkv) D] from one projection (the exporter folds the stacked
    weights into one constant), q scaled by `q_scale`."""
    attn = layer.self_attn
    return torch.nn.functional.linear(
        layer.input_layernorm(x),
        *_fused([attn.q_proj, attn.k_proj, attn.v_proj], [q_scale, 1.0, 1.0]))


def _mlp_block(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x + MLP(norm(x)), gate and up from one projection."""
    mlp = layer.mlp
    gate, up = torch.nn.functional.linear(
        layer.post_attention_layernorm(x), *_fused([mlp.gate_proj, mlp.up_proj], [1.0, 1.0])
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
    qkv = _qkv(layer, x, attn.scaling).reshape(1, -1, heads + 2 * kv_heads, d).transpose(1, 2)
    qk = rotate(qkv[:, :heads + kv_heads], rotary)
    k, v = qk[:, heads:], qkv[:, heads + kv_heads:]
    o = cached_attention(qk[:, :heads], k, v, past_k, past_v, bias, (heads, kv_heads, d))
    return _mlp_block(layer, x + attn.o_proj(o)), k, v


def gqa_rotary_cache(rotary_emb: nn.Module, config) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupQueryAttention's rotary tables (cos, sin) [max_context, D/2] from a Hugging
    Face rotary embedding: the first half of its tables (the two halves are equal)."""
    dims = model_dims_of(config)
    d, positions = dims["head_dim"], torch.arange(dims["max_context"]).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0, :, :d // 2].contiguous(), sin[0, :, :d // 2].contiguous()


def gqa_lengths(past_length: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupQueryAttention's (seqlens_k, total): past_length + T - 1 and past_length + T,
    int32, built once per call and shared by every layer."""
    total = past_length + input_ids.shape[1]
    return (total - 1).to(torch.int32), total.to(torch.int32).reshape(())


def llama_layer_fused(layer: nn.Module, x: torch.Tensor, past_k: torch.Tensor,
                      past_v: torch.Tensor, lengths: tuple[torch.Tensor, torch.Tensor],
                      rotary_cache: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`llama_layer` on GroupQueryAttention: (x out, K buffer, V buffer), the buffers
    written in place. lengths: (seqlens_k, total); rotary_cache: (cos, sin) tables."""
    attn = layer.self_attn
    # Read from the config: a size read from a weight is a traced value while tracing, and
    # the tracer cannot make a node attribute of it.
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    o, present_k, present_v = _GroupQueryAttention.apply(
        _qkv(layer, x, 1.0), past_k, past_v, *lengths, *rotary_cache, positions, heads,
        kv_heads, float(attn.scaling))
    return _mlp_block(layer, x + attn.o_proj(o)), present_k, present_v


def target_features(fuse: nn.Module | None, layer_outputs: list[torch.Tensor],
                    final: torch.Tensor) -> torch.Tensor:
    """The f_r a feature draft reads: the final norm's output, or with the draft's `fuse`,
    fuse([rms(h^(a)); ...; final]) over the outputs of its `feature_layers`
    (export/feature_draft.py)."""
    if fuse is None:
        return final
    return fuse(torch.cat([*map(_rms, layer_outputs), final], dim=-1))


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMS norm: earlier layers' outputs differ in scale from the final one."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaFamilyDecoder(nn.Module):
    """Llama, Mistral and Qwen2: pre-norm blocks, rotary positions, grouped-query attention.

    `features`: also output, at every input position, the f_r a feature draft reads
    (export/feature_draft.py): True for the final norm's output (the vectors the head
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
        if fused:
            self.rotary_cache = gqa_rotary_cache(model.model.rotary_emb, model.config)

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base = self.model.model
        x = base.embed_tokens(input_ids)
        presents, layer_outputs = [], []
        if self.fused:
            lengths = gqa_lengths(past_length, input_ids)
        else:
            rotary = rotary_tables(*base.rotary_emb(x, position_ids),
                                   base.layers[0].self_attn.head_dim)
            bias = llama_bias(self.model.config, past_length, past[0], input_ids, x.dtype)
        for i, layer in enumerate(base.layers):
            if self.fused:
                x, k, v = llama_layer_fused(layer, x, past[2 * i], past[2 * i + 1], lengths,
                                            self.rotary_cache, position_ids)
            else:
                x, k, v = llama_layer(layer, x, rotary, past[2 * i], past[2 * i + 1], bias)
            presents += [k, v]
            if i in self.feature_layers:
                layer_outputs.append(x)
        if not self.features:
            x = base.norm(_last_positions(x, logits_to_keep))
            return (_lm_head(self.model, x), *presents)
        final = base.norm(x)
        return (_lm_head(self.model, _last_positions(final, logits_to_keep)), *presents,
                target_features(self.fuse, layer_outputs, final))


class GPT2Decoder(nn.Module):
    """GPT-2: learned positions, fused QKV (Conv1D), LayerNorm, one KV head per query head."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, past_length, logits_to_keep, *past):
        base = self.model.transformer
        x = base.wte(input_ids) + base.wpe(position_ids)
        bias = attention_bias(past_length, past[0].shape[2], input_ids.shape[1], 1, x.dtype)
        presents = []
        for i, block in enumerate(base.h):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(x)).split(attn.embed_dim, dim=2)
            q, k, v = (z.reshape(1, -1, attn.num_heads, attn.head_dim).transpose(1, 2)
                       for z in (q, k, v))
            scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
            if attn.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            o = cached_attention(q * scale, k, v, past[2 * i], past[2 * i + 1], bias,
                                 (attn.num_heads, attn.num_heads, attn.head_dim))
            x = x + attn.c_proj(o)
            x = x + block.mlp(block.ln_2(x))
            presents += [k, v]
        x = base.ln_f(_last_positions(x, logits_to_keep))
        return (_lm_head(self.model, x), *presents)


def model_dims(model: nn.Module) -> dict[str, int]:
    """Layer count, KV heads, head dim, vocab size and largest usable context of a model."""
    return model_dims_of(model.config)


def model_dims_of(cfg) -> dict[str, int]:
    """`model_dims` from a Hugging Face config."""
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


def fused_attention(attention: str, precision: str, config) -> bool:
    """Whether a graph gets GroupQueryAttention (KV layout "bhsd-inplace"), for a Hugging
    Face `config`. `auto` picks it where ONNX Runtime CPU is the only runtime for the graph
    anyway (int8 and int4: TensorRT cannot parse MatMulNBits) and the model can have it:
    Llama family, head size a multiple of 16 (the CPU kernel's requirement)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTIONS)}, "
                         f"got {attention!r}")
    can = config.model_type in LLAMA_FAMILY and model_dims_of(config)["head_dim"] % 16 == 0
    if attention == "fused" and not can:
        raise ValueError(f"--attention fused needs a Llama, Mistral or Qwen2 model with a "
                         f"head size that is a multiple of 16, not {config.model_type!r} "
                         f"with {model_dims_of(config)['head_dim']}: export it with "
                         "--attention portable")
    return attention == "fused" or (attention == "auto" and can
                                    and precision in ("int8", "int4"))


def wrap(model: nn.Module, features: bool | nn.Module = False,
         fused: bool = False) -> nn.Module:
    """The export module for a Hugging Face causal LM, or ValueError if unsupported.

    `features`: the graph also outputs the target's features for a feature draft (True,
    or the feature draft: LlamaFamilyDecoder).
    `fused`: attention on ONNX Runtime's GroupQueryAttention (Llama family only)."""
    model_type = model.config.model_type
    if features and model_type not in LLAMA_FAMILY:
        raise ValueError(f"feature drafts need a Llama, Mistral or Qwen2 target, not "
                         f"{model_type!r}")
    if fused:
        fused_attention("fused", "", model.config)  # raises for models it cannot have
    if model_type in LLAMA_FAMILY:
        return LlamaFamilyDecoder(model, features, fused)
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
                features: bool | nn.Module = False, fused: bool = False) -> None:
    """Trace `model` into an ONNX graph at `path` with the bundle's KV-cache I/O.

    `share_head`: for tied embeddings, let the LM head read the embedding table (no second
    copy). Quantized exports keep the copy, so that the head gets quantized as a MatMul.
    `features`: a target that also outputs its features (True, or the feature draft that
    reads them: LlamaFamilyDecoder). A feature draft (export/feature_draft.py) is its own
    export module and always has feature I/O.
    `fused`: attention on GroupQueryAttention, KV layout "bhsd-inplace" (a feature draft is
    switched to it with its `fuse_attention`).
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
    inputs, outputs = graph_io(n, reads, bool(features) or reads)
    dynamic = {"input_ids": {1: "T"}, "position_ids": {1: "T"}, "logits": {1: "N"}}
    for name in inputs[4:]:
        dynamic[name] = {1: "T"} if name == FEATURES_IN else {2: "C"}
    for name in outputs[1:]:
        dynamic[name] = {1: "T"} if name == FEATURES_OUT else {2: "C" if fused else "T"}
    if reads and fused:
        model.fuse_attention()
    module = model if reads else wrap(model, features, fused)
    with torch.no_grad():
        torch.onnx.export(module.eval(), args, path, input_names=inputs,
                          output_names=outputs, dynamic_axes=dynamic, opset_version=OPSET,
                          dynamo=False)
    if share_head and model.config.tie_word_embeddings:
        share_tied_head(path)
