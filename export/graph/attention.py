"""Attention over the KV cache, in the two forms a graph can take.

The decoder's own submodules (embeddings, norms, MLPs, rotary embedding, projections) are
reused as they are; only attention is rewritten, in one of two forms, recorded as the
graph's KV layout (runtime/bundle.py):

* "bhsd-fixed", portable (standard ONNX operators: ONNX Runtime on any device, TensorRT):
  reads the cache buffers (rows >= past_length masked, never copied or concatenated) and
  returns only the T new K/V rows, which the runtime writes into its buffers. Below.
* "bhsd-inplace", `fused` (every family, ONNX Runtime CPU): one GroupQueryAttention node
  per layer (an ONNX Runtime contrib operator) writes the new rows into the cache buffers
  in place and attends to the valid rows only; it also does rotary where its tables can
  (the Llama layout), otherwise the graph rotates q and k before it (Gemma) or there is
  no rotary (GPT-2). On SmolLM2 int8, 2 cores: a one-token step in 0.83x the time of the
  portable graph's. Unlike the portable form it computes a row the same way in a
  one-row and a multi-row call once the runtime pads one-token steps to two rows (docs/
  design.md, "Batch invariance of quantized graphs"), which is what int8/int4 need.

* "bhsd-inplace", `batched` (ONNX Runtime CPU, opset 24): per layer two TensorScatter
  nodes write each row's new K/V rows into the cache buffers in place, at that row's
  past_length, and ONNX's own Attention attends over them with the queries grouped by KV
  head, under a mask built once per call (`scatter_inputs`). Unlike GroupQueryAttention's
  CPU kernel, it takes several rows of several tokens each, which batched decoding's
  verification calls are (runtime/batch.py); it computes a row alike in every call,
  whatever its T and the other rows are (`ScatterAttention`). The graph rotates q and k
  before it (with ONNX Runtime's RotaryEmbedding where GroupQueryAttention would rotate
  them). It attends over the whole capacity (the padding masked), so its step costs more
  with the capacity.

Neither repeats K/V heads for grouped-query attention (queries are grouped instead).

Attention over cache + new rows without concatenating them (softmax over the union):
    s_past = q K_past^T * scale + mask(j >= past_length)      [G*T, C]
    s_new  = q k_new^T  * scale + causal mask                 [G*T, T]
    a      = softmax([s_past, s_new])
    out    = a[:, :C] V_past + a[:, C:] v_new
"""

from __future__ import annotations

import torch

from specedge.export.graph.reshape import keep_batch, merge_heads, split_heads
from specedge.export.graph.rotary import rotate, rotate_rows


def attention_bias(past_length: torch.Tensor, capacity: int | torch.Tensor,
                   t: int | torch.Tensor, groups: int, dtype: torch.dtype,
                   window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive masks, built once per call and shared by every layer: [B, 1, 1, C] for the
    cache (rows >= the row's past_length [B] are empty) and [G*T, T] causal for the new
    rows (queries grouped).

    `window`: sliding-window attention, each query attends to the last `window` positions,
    itself included (transformers' `kv_idx > q_idx - window`). The cache mask then depends
    on the query and is [B, 1, G*T, C]. The cache keeps every row, so a rollback stays a
    change of length."""
    neg = torch.finfo(dtype).min
    rows = torch.arange(capacity)
    lengths = past_length.reshape(-1, 1, 1, 1)  # [B, 1, 1, 1]
    past_valid = rows < lengths
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    if window is None:
        return (torch.where(past_valid, 0.0, neg).to(dtype),
                torch.where(causal, 0.0, neg).to(dtype).repeat(groups, 1))
    query = torch.arange(t).unsqueeze(1)  # [T, 1], at position past_length + query
    past_valid = past_valid & (rows > lengths + query - window)  # [B, 1, T, C]
    causal = causal & (torch.arange(t) > query - window)
    return (torch.where(past_valid, 0.0, neg).to(dtype).repeat(1, 1, groups, 1),
            torch.where(causal, 0.0, neg).to(dtype).repeat(groups, 1))


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap, Gemma's soft-capping; x as it is without a cap."""
    return x if not cap else torch.tanh(x / cap) * cap


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     past_k: torch.Tensor, past_v: torch.Tensor,
                     bias: tuple[torch.Tensor, torch.Tensor],
                     shape: tuple[int, int, int], cap: float | None = None) -> torch.Tensor:
    """q [B, H, T, D], already scaled; k, v [B, Hkv, T, D]; past_k, past_v [B, Hkv, C, D];
    bias from `attention_bias`; shape (H, Hkv, D) -> [B, T, H*D]. `cap`: the scores are
    soft-capped before the mask is added (Gemma 2's eager_attention_forward), or not (None).

    Sizes come in as Python ints, not read from the tensors, and the cache size is read
    from the shared bias: a traced tensor's size would become a Shape/Gather/Concat chain
    recomputed in every layer, a few microseconds of ONNX Runtime overhead per node.
    """
    heads, kv_heads, d = shape
    capacity = bias[0].shape[-1]
    # Query head h reads KV head h // groups (HF repeat_kv order), so grouping the queries
    # is a free reshape, while repeating K/V would copy the cache.
    qg = keep_batch(q, (kv_heads, -1, d))
    s_past = soft_cap(torch.matmul(qg, past_k.transpose(-1, -2)), cap) + bias[0]
    s_new = soft_cap(torch.matmul(qg, k.transpose(-1, -2)), cap) + bias[1]
    a = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
    out = torch.matmul(a[..., :capacity], past_v) + torch.matmul(a[..., capacity:], v)
    return merge_heads(keep_batch(out, (heads, -1, d)), heads * d)


def portable_attention(qkv: torch.Tensor, rotary: tuple[torch.Tensor, ...],
                       past_k: torch.Tensor, past_v: torch.Tensor,
                       bias: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int, int],
                       q_scale: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's attention over the cache from q|k|v [B, T, (H + 2 Hkv) D] of one
    projection, unrotated: q and k rotated with `rotary` (graph/rotary.py `rotary_tables`),
    then `cached_attention`. -> (output [B, T, H D], new K rows, new V rows [B, Hkv, T, D]).

    q is either scaled already (the scale folded into its projection, which commutes with
    the rotation) or scaled here by `q_scale` after the rotation."""
    heads, kv_heads, d = shape
    x = split_heads(qkv, heads + 2 * kv_heads, d)
    qk = rotate(x[:, :heads + kv_heads], rotary)
    k, v = qk[:, heads:], x[:, heads + kv_heads:]
    q = qk[:, :heads] if q_scale == 1.0 else qk[:, :heads] * q_scale
    return cached_attention(q, k, v, past_k, past_v, bias, shape), k, v


def written_rows(past_k: torch.Tensor, past_v: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, past_length: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the cache buffers [B, Hkv, C, D] with each row's T new rows k, v
    [B, Hkv, T, D] at [past_length, past_length + T): what an in-place attention node
    leaves in them, for tracing."""
    t = k.shape[2]
    present_k, present_v = past_k.clone(), past_v.clone()
    for row, start in enumerate(past_length.tolist()):
        present_k[row, :, start:start + t] = k[row]
        present_v[row, :, start:start + t] = v[row]
    return present_k, present_v


class GroupQueryAttention(torch.autograd.Function):
    """ONNX Runtime's fused attention, com.microsoft GroupQueryAttention, for one layer.

    Inputs: q|k|v from one projection [B, T, (H + 2 Hkv) D], unscaled; the cache buffers
    [B, Hkv, C, D]; seqlens_k [B] = past_length + T - 1 per row and total [] = the largest
    past_length + T (int32); the rotary tables [R, D/2] and the rows of them to use [B, T]
    (the positions,
    graph/rotary.py `gqa_positions`), or three Nones when q and k come rotated already (the
    kernel rotates only multiples of 16 dims, and not Gemma's per-layer-kind tables) or the
    model has no rotary (GPT-2); `window`: the sliding window, or 0; `cap`: Gemma 2's
    soft-capping of the scores, or 0.
    Outputs: attention [B, T, H D] and the two cache buffers with each row's T new rows
    written at [past_length, past_length + T) of that row. The runtime binds each of them
    to its past buffer, so that the kernel writes the rows in place (it compares the
    addresses) and attends to the valid rows only: no mask over the capacity, no copy of
    new rows. The CPU kernel takes B > 1 with T = 1 only once a past is given
    (runtime/bundle.py).

    `forward` is the same math in torch (`cached_attention`, then the rows written into
    copies of the buffers): what tracing runs. `symbolic` is the node the graph gets.
    """

    @staticmethod
    def forward(ctx, qkv, past_k, past_v, seqlens_k, total, cos, sin, positions, heads,
                kv_heads, scale, window=0, cap=0.0):
        t = qkv.shape[1]
        d = qkv.shape[2] // (heads + 2 * kv_heads)
        past_length = seqlens_k.long() + 1 - t  # [B]
        bias = attention_bias(past_length, past_k.shape[2], t, heads // kv_heads, qkv.dtype,
                              window or None)
        x = split_heads(qkv, heads + 2 * kv_heads, d)
        q, k, v = x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]
        if cos is not None:
            q, k = rotate_rows(q, cos, sin, positions), rotate_rows(k, cos, sin, positions)
        out = cached_attention(q * scale, k, v, past_k, past_v, bias, (heads, kv_heads, d),
                               cap or None)
        return out, *written_rows(past_k, past_v, k, v, past_length)

    @staticmethod
    def symbolic(g, qkv, past_k, past_v, seqlens_k, total, cos, sin, positions, heads,
                 kv_heads, scale, window=0, cap=0.0):
        absent = g.op("prim::Constant")  # the omitted optional inputs key and value
        absent.setType(torch._C.OptionalType.ofTensor())
        rotary = [] if cos is None else [cos, sin, positions]
        out, present_k, present_v = g.op(
            "com.microsoft::GroupQueryAttention", qkv, absent, absent, past_k, past_v,
            seqlens_k, total, *rotary, outputs=3, num_heads_i=heads,
            kv_num_heads_i=kv_heads, scale_f=scale, do_rotary_i=int(cos is not None),
            softcap_f=float(cap),
            # The CPU kernel attends to the last local_window_size positions, the query's
            # included: transformers' window (checked by tests/export/test_families_llama.py).
            local_window_size_i=window if window else -1)
        # The exporter cannot infer a contrib operator's output shapes; without them every
        # shape after the first layer (logits, features) would be unknown in the graph.
        # The head size from the cache input, whose last axis is static (q|k|v's may not be
        # known after a reshape).
        width = past_k.type().varyingSizes()[3] * heads
        out.setType(qkv.type().with_sizes([None, None, width]))
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             shape: tuple[int, int, int]) -> torch.Tensor:
    """q [B, H, T, D], k and v [B, Hkv, T, D] -> q|k|v [B, T, (H + 2 Hkv) D], the layout
    GroupQueryAttention reads; shape (H, Hkv, D) as Python ints (`cached_attention`)."""
    heads, kv_heads, d = shape
    return torch.cat([merge_heads(z, n * d)
                      for z, n in ((q, heads), (k, kv_heads), (v, kv_heads))], dim=-1)


def gqa_lengths(past_length: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupQueryAttention's (seqlens_k, total): past_length + T - 1 per row [B] and the
    largest past_length + T [], int32, built once per call and shared by every layer."""
    total = past_length + input_ids.shape[1]
    return (total - 1).to(torch.int32), total.max().to(torch.int32)


class ScatterAttention(torch.autograd.Function):
    """One layer's attention on standard ONNX operators of opset 24, the cache written in
    place: the `batched` form (module docstring).

    Inputs: q [B, H, T, D] and k [B, Hkv, T, D] rotated, v [B, Hkv, T, D], unscaled; the
    cache buffers [B, Hkv, C, D]; past_length [B] (int64) and the call's mask [B, 1, G R, C]
    (`scatter_inputs`, which holds the sliding window if any); `heads` and `kv_heads` (H, Hkv)
    as Python ints; `scale`; `cap`: Gemma 2's soft-capping of the scores, or 0; `window`:
    the layer's sliding window, or 0 (the torch path's; the graph's is in the mask).
    Outputs: attention [B, H, T, D] and the two buffers with each row's T new rows at
    [past_length, past_length + T). The runtime binds each output to its input buffer, so
    that TensorScatter writes in place (it compares the addresses, as GroupQueryAttention
    does) instead of copying the buffer.

    The queries go to the kernel grouped by the KV head they read, [B, Hkv, G R, D] (a free
    reshape: query head h reads KV head h // G), so that it runs Hkv heads over the cache
    and never repeats K and V for the G query heads of each: on SmolLM2 (G = 4), four rows
    of one token over 256 cached rows, 74 against 128 microseconds an Attention node on
    2 threads. What the kernel then sees as one head's sequence is G R query rows, each
    with its own mask row.

    `forward` is the same math in torch (`cached_attention` on copies of the buffers): what
    tracing runs. `symbolic` is the nodes the graph gets; the graph's opset is raised to 24
    after tracing (graph/trace.py).
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, past_length, mask, heads, kv_heads, scale,
                cap=0.0, window=0):
        t, d = q.shape[2], q.shape[3]
        bias = attention_bias(past_length, past_k.shape[2], t, heads // kv_heads, q.dtype,
                              window or None)
        out = cached_attention(q * scale, k, v, past_k, past_v, bias, (heads, kv_heads, d),
                               cap or None)
        return split_heads(out, heads, d), *written_rows(past_k, past_v, k, v, past_length)

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, past_length, mask, heads, kv_heads, scale,
                 cap=0.0, window=0):
        present_k = g.op("TensorScatter", past_k, k, past_length, axis_i=2)
        present_v = g.op("TensorScatter", past_v, v, past_length, axis_i=2)
        extra = {"softcap_f": float(cap)} if cap else {}
        d = past_k.type().varyingSizes()[3]  # the head size, static in the cache's type
        one, axis = (g.op("Constant", value_t=torch.tensor([v])) for v in (1, 2))
        if heads == kv_heads:
            # Ungrouped, a one-token row would be one query, and the kernel's one-query
            # path sums its products otherwise than a row of a multi-query call: the query
            # row of a copy of the first token in front (`scatter_inputs`), dropped after.
            first = g.op("Slice", q, g.op("Constant", value_t=torch.tensor([0])), one, axis)
            q = g.op("Concat", first, q, axis_i=2)
        grouped = g.op("Reshape", q, g.op("Constant", value_t=torch.tensor([0, kv_heads, -1, d])))
        out = g.op("Attention", grouped, present_k, present_v, mask, scale_f=scale, **extra)
        out = g.op("Reshape", out, g.op("Constant", value_t=torch.tensor([0, heads, -1, d])))
        if heads == kv_heads:
            out = g.op("Slice", out, one,
                       g.op("Constant", value_t=torch.tensor([torch.iinfo(torch.int64).max])),
                       axis)
        out.setType(q.type())
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def scatter_inputs(past_length: torch.Tensor, input_ids: torch.Tensor,
                   capacity: int | torch.Tensor, groups: int, window: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """ScatterAttention's (past_length [B], mask [B, 1, G R, C]), built once per call and
    shared by every layer with the same `window`: the mask is true where a query row sees a
    cache row. Its rows are the kernel's grouped query rows: G groups of R = T rows, query i
    of a row at position past_length + i seeing the cache rows [0, past_length + i]; with
    G = 1, R = T + 1, the first a copy of the first query seeing [0, past_length), whose
    output the graph drops (ScatterAttention.symbolic). `window`: a sliding window, each
    query seeing only the last `window` rows up to its own (transformers' `kv_idx > q_idx -
    window`, as `attention_bias`); the cache keeps every row, so a rollback stays a change of
    length."""
    t = input_ids.shape[1]
    first = 1 if groups == 1 else 0
    query = torch.arange(t + first).repeat(groups)  # [G R]: each query's offset, per group
    ends = past_length.reshape(-1, 1, 1) + query.reshape(1, -1, 1) + (1 - first)  # [B, G R, 1]
    rows = torch.arange(capacity).reshape(1, 1, -1)
    mask = rows < ends  # [B, G R, C]
    if window:
        mask = mask & (rows >= ends - window)
    return past_length, mask.unsqueeze(1)
