"""The KV cache and step buffers of the device backend: one allocation at fixed addresses.

Layout "bhsd-fixed" (bundle.py) per layer: K and V of [1, kv_heads, capacity, head_dim]. A
step's graph writes its T new rows of every layer into a `presents` area packed as
[kv_heads, T, head_dim]; `write` moves them to rows [length, length + T) of each cache
buffer with one strided copy per tensor (cudaMemcpy2D: kv_heads rows of T * head_dim
elements, source pitch T * head_dim, destination pitch capacity * head_dim). The cache is
never copied as a whole. Rollback is `length = n`: the graph masks rows >= past_length.

Everything a step binds lives in the same arena (its int64 inputs, presents, logits),
sized once for `max_tokens` per call, so addresses never change within a generation and
a TensorRT context or CUDA graph bound to them stays valid.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from specedge.runtime.backends.memory import ALIGNMENT
from specedge.runtime.bundle import ModelSpec


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int


def arena_layout(spec: ModelSpec, capacity: int, max_tokens: int,
                 max_keep: int) -> dict[str, Region]:
    """Byte regions of one arena, each aligned to ALIGNMENT.

    keys.{i} / values.{i}: [kv_heads, capacity, head_dim]   the cache
    inputs:   int64 [2 * max_tokens + 2]   input_ids, position_ids (max_tokens apart),
                                           past_length, logits_to_keep: one upload a step
    presents: [2 * layers, kv_heads, max_tokens, head_dim]  new rows of one call
    logits:   float32 [max_keep, vocab]
    probs:    float32 [max_keep, vocab]                     processed rows (device sampling)
    """
    if not 1 <= max_keep <= max_tokens <= capacity:
        raise ValueError(f"need 1 <= max_keep ({max_keep}) <= max_tokens ({max_tokens}) <= "
                         f"capacity ({capacity})")
    item = np.dtype(spec.dtype).itemsize
    head = spec.num_kv_heads * spec.head_dim * item
    sizes: list[tuple[str, int]] = []
    for i in range(spec.num_layers):
        sizes += [(f"keys.{i}", head * capacity), (f"values.{i}", head * capacity)]
    sizes += [("inputs", (2 * max_tokens + 2) * 8),
              ("presents", 2 * spec.num_layers * present_stride(spec, max_tokens)),
              ("logits", max_keep * spec.vocab_size * 4),
              ("probs", max_keep * spec.vocab_size * 4)]
    layout, offset = {}, 0
    for name, nbytes in sizes:
        layout[name] = Region(offset, nbytes)
        offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
    layout["total"] = Region(0, offset)
    return layout


def kv_region(j: int) -> str:
    """Arena region of cache tensor j in graph order: K of layer j // 2 (even j), else V."""
    return f"{'keys' if j % 2 == 0 else 'values'}.{j // 2}"


def present_stride(spec: ModelSpec, max_tokens: int) -> int:
    """Bytes between presents j and j + 1: each is packed [kv_heads, T <= max_tokens, dim]."""
    return spec.num_kv_heads * max_tokens * spec.head_dim * np.dtype(spec.dtype).itemsize


def row_copies(spec: ModelSpec, layout: dict[str, Region], capacity: int, max_tokens: int,
               length: int, t: int) -> list[tuple[int, int, int, int, int, int]]:
    """(dst, dst_pitch, src, src_pitch, width, height) offsets for `copy_2d` that store T
    new rows per tensor at rows [length, length + T). Present j (K of layer j // 2 for even
    j, V for odd) is packed [kv_heads, T, head_dim] at presents + j * its max size."""
    if length + t > capacity:
        raise ValueError(f"KV cache full: {length + t} rows needed, capacity {capacity}")
    row = spec.head_dim * np.dtype(spec.dtype).itemsize
    stride = present_stride(spec, max_tokens)
    copies = []
    for j in range(2 * spec.num_layers):
        copies.append((layout[kv_region(j)].offset + length * row, capacity * row,
                       layout["presents"].offset + j * stride, t * row,
                       t * row, spec.num_kv_heads))
    return copies


class DeviceKVCache:
    """Cache + step buffers in one device allocation; `length` rows are valid."""

    def __init__(self, memory, spec: ModelSpec, capacity: int, max_tokens: int,
                 max_keep: int):
        self.memory, self.spec = memory, spec
        self.capacity, self.max_tokens, self.max_keep = capacity, max_tokens, max_keep
        self.layout = arena_layout(spec, capacity, max_tokens, max_keep)
        self.base = memory.alloc(self.layout["total"].nbytes)
        self._free = weakref.finalize(self, memory.free, self.base)
        self.length = 0

    def address(self, name: str) -> int:
        return self.base + self.layout[name].offset

    def present_address(self, j: int) -> int:
        return self.address("presents") + j * present_stride(self.spec, self.max_tokens)

    def write(self, t: int) -> None:
        """Move the T new rows of the last call from `presents` into the cache."""
        for dst, dst_pitch, src, src_pitch, width, height in row_copies(
                self.spec, self.layout, self.capacity, self.max_tokens, self.length, t):
            self.memory.copy_2d(self.base + dst, dst_pitch, self.base + src, src_pitch,
                                width, height)
        self.length += t

    def rollback(self, length: int) -> None:
        """Forget rows >= length (a rejected draft); O(1), the rows are masked, not cleared."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} rows")
        self.length = length

    def close(self) -> None:
        self._free()
