"""Rotary position embeddings: the tables for the positions of a call, and their use.

The tables are computed here from the model's rotary embedding's frequencies rather than by
calling it, because two of the scalings transformers ships depend on the call:

* "dynamic" recomputes its frequencies when a call reaches past `max_position_embeddings`
  and keeps them as module state. Up to that length its frequencies are the unscaled ones,
  and a bundle's context is at most `max_position_embeddings` (graph/families.py), so the
  graph uses the unscaled frequencies (`original_inv_freq`), which is exact for every call
  a bundle can make.
* "longrope" uses its long factors for a whole call once the call's last position reaches
  `original_max_position_embeddings`, its short ones before. transformers' greedy decoding
  is one prompt call and then one token per call, so position p is rotated with the long
  factors when p >= that length, and every prompt position is when the prompt reaches it.
  The graph does exactly that (`_long_rows`): per call for a first call (past_length 0),
  per position afterwards, so a speculative call over K + 1 positions rotates each as
  plain decoding does and speculative decoding stays exact.

"default", "linear", "llama3" and "yarn" fix their frequencies (and yarn its attention
factor) at construction; their tables are cos(p * inv_freq) * attention_scaling as well.
"""

from __future__ import annotations

import torch
from torch import nn

from specedge.export.graph.families import model_dims_of

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_type(rotary_emb: nn.Module) -> str:
    """The rotary embedding's scaling, or ValueError for one whose tables are not known to
    match transformers'."""
    kind = getattr(rotary_emb, "rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)}); the graph's rotary tables would not "
                         "match transformers'")
    return kind


def _frequencies(rotary_emb: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(inverse frequencies, longrope's long ones or None, longrope's switch length)."""
    short = getattr(rotary_emb, "original_inv_freq", rotary_emb.inv_freq).float()
    if rope_type(rotary_emb) != "longrope":
        return short, None, 0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    switch = int(rotary_emb.config.rope_parameters["original_max_position_embeddings"])
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary_emb.config, None, seq_len=switch + 1)
    return short, long.float(), switch


def _long_rows(position_ids: torch.Tensor, past_length: torch.Tensor,
               switch: int) -> torch.Tensor:
    """[B, T] bool: the positions longrope rotates with its long factors (module
    docstring): from `switch` on, and all of a row's first call that reaches it."""
    first_call = ((past_length == 0).unsqueeze(-1)
                  & (position_ids.max(dim=-1, keepdim=True).values >= switch))
    return (position_ids >= switch) | first_call


def call_tables(rotary_emb: nn.Module, position_ids: torch.Tensor,
                past_length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, d] for the positions of one call, as transformers computes them
    (position_ids[..., None] * inv_freq, both halves, times attention_scaling)."""
    short, long, switch = _frequencies(rotary_emb)
    inv = short
    if long is not None:
        inv = torch.where(_long_rows(position_ids, past_length, switch).unsqueeze(-1),
                          long, short)
    freqs = position_ids[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = rotary_emb.attention_scaling
    return emb.cos() * scaling, emb.sin() * scaling


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, d: int) -> tuple[torch.Tensor, ...]:
    """(cos, signed sin, permutation) for `rotate`, built once per call from the model's
    rotary embedding [B, T, d]: HF's rotate_half(x) = cat(-x2, x1) = x[..., perm] * sign."""
    half = d // 2
    perm = torch.cat([torch.arange(half, 2 * half), torch.arange(half)])
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin.dtype)
    return cos.unsqueeze(1), (sin * sign).unsqueeze(1), perm


def partial_rotary_tables(cos: torch.Tensor, sin: torch.Tensor, r: int, head_dim: int
                          ) -> tuple[torch.Tensor, ...]:
    """`rotary_tables` for rotary over the first r dims of each head (cos, sin [1, T, r]; as
    transformers' apply_rotary_pos_emb does when its tables are narrower than a head): the
    other dims get cos 1, sin 0 and themselves in the permutation, so that `rotate` leaves
    them as they are (x * 1 + x * 0 is x exactly) and one elementwise pass does it all.
    Sizes are Python ints: a size read from a traced tensor would be a traced value."""
    cos_t, signed_sin, perm = rotary_tables(cos, sin, r)
    if r == head_dim:
        return cos_t, signed_sin, perm
    pad = (0, head_dim - r)
    return (torch.nn.functional.pad(cos_t, pad, value=1.0),
            torch.nn.functional.pad(signed_sin, pad, value=0.0),
            torch.cat([perm, torch.arange(r, head_dim)]))


def rotary_dim(rotary_emb: nn.Module) -> int:
    """How many dims of each head a Hugging Face rotary embedding rotates."""
    return 2 * int(rotary_emb.inv_freq.shape[0])


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Rotary positions, x * cos + rotate_half(x) * sin, as one Gather and three
    elementwise ops."""
    cos, signed_sin, perm = tables
    return x * cos + x[..., perm] * signed_sin


def gqa_rotary_cache(rotary_emb: nn.Module, config) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupQueryAttention's rotary tables (cos, sin) [R, D/2]: the first half of the
    tables (the two halves are equal) for positions 0 .. max_context - 1, R = max_context;
    for longrope the long factors' rows follow the short ones' (R = 2 max_context), and
    `gqa_positions` picks the rows."""
    dims = model_dims_of(config)
    d, positions = dims["head_dim"], torch.arange(dims["max_context"]).float()
    short, long, _ = _frequencies(rotary_emb)
    freqs = torch.cat([positions[:, None] * inv for inv in (short, long) if inv is not None])
    scaling = rotary_emb.attention_scaling
    return ((freqs.cos() * scaling)[:, :d // 2].contiguous(),
            (freqs.sin() * scaling)[:, :d // 2].contiguous())


def gqa_positions(rotary_emb: nn.Module, config, position_ids: torch.Tensor,
                  past_length: torch.Tensor) -> torch.Tensor:
    """The rows of `gqa_rotary_cache` for the positions of a call: the positions, or for
    longrope max_context rows further where the long factors apply."""
    _, long, switch = _frequencies(rotary_emb)
    if long is None:
        return position_ids
    offset = model_dims_of(config)["max_context"]
    return position_ids + _long_rows(position_ids, past_length, switch).long() * offset


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """x [B, N, T, D] rotated as ONNX Runtime's kernels rotate it from `gqa_rotary_cache`'s
    tables (cos, sin) [R, W] and the rows of them for each position [B, T] (`gqa_positions`):
    the first 2 W dims of each head (partial rotary: Phi-3, StableLM), the rest as they are."""
    halves = (torch.cat([cos, cos], -1)[positions], torch.cat([sin, sin], -1)[positions])
    return rotate(x, partial_rotary_tables(*halves, 2 * cos.shape[-1], x.shape[-1]))


class RotaryEmbedding(torch.autograd.Function):
    """ONNX Runtime's rotary kernel, com.microsoft RotaryEmbedding, on x [B, N, T, D] with
    `gqa_rotary_cache`'s tables and `gqa_positions`' rows, N = `heads` (a Python int):
    one node where `rotate` is several, for the graphs whose attention does not rotate
    (graph/attention.py, `batched`). `forward` is `rotate_rows`, what tracing runs."""

    @staticmethod
    def forward(ctx, x, cos, sin, positions, heads):
        return rotate_rows(x, cos, sin, positions)

    @staticmethod
    def symbolic(g, x, cos, sin, positions, heads):
        width = cos.type().varyingSizes()[1]
        out = g.op("com.microsoft::RotaryEmbedding", x, positions, cos, sin,
                   interleaved_i=0, rotary_embedding_dim_i=2 * width, num_heads_i=heads)
        out.setType(x.type())
        return out
