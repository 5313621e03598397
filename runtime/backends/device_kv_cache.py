"""The KV cache and step buffers of the device backend: one allocation at fixed addresses.

Layout "bhsd-fixed" (bundle.py) per layer: K and V of [1, kv_heads, capacity, head_dim]. A
step's graph writes its T new rows of every layer into a `presents` area packed as
[kv_heads, T, head_dim]; `write` moves them to rows [length, length + T) of each cache
buffer with one strided copy per tensor (cudaMemcpy2D: kv_heads rows of T * head_dim
elements, source pitch T * head_dim, destination pitch capacity * head_dim). The cache is
never copied as a whole. Rollback is `length = n`: the graph masks rows >= past_length.

Everything a step binds lives in the same arena (its int64 inputs, presents, logits),
sized once for `max_tokens` per call, so addresses never change within a generation and
a TensorRT context or CUDA graph bound to them stays valid. Every tensor an engine binds
starts on a multiple of ALIGNMENT: TensorRT 10's `setTensorAddress` requires 256-byte
alignment (NvInferRuntime.h), for host and device pointers alike.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from specedge.runtime.backends.memory import ALIGNMENT
from specedge.runtime.bundle import ModelSpec
from specedge.runtime.kv_cache import CacheRows, check_room


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int


def arena_layout(spec: ModelSpec, capacity: int, max_tokens: int,
                 max_keep: int, slots: int = 1) -> dict[str, Region]:
    """Byte regions of one arena, each aligned to ALIGNMENT.

    keys.{i} / values.{i}: [slots, kv_heads, capacity, head_dim]   the cache (of each slot)
    inputs:   the int64 inputs in aligned slots (`input_slots`): one upload a step
    presents: 2 * layers x [max_tokens x kv_heads x head_dim], each padded to ALIGNMENT:
              the new rows of one call ([rows, kv_heads, T, head_dim], rows x T <= max_tokens)
    logits:   float32 [max_keep, vocab]                     (all the call's rows together)
    probs:    float32 [max_keep, vocab]                     processed rows (device sampling)

    `slots` > 1: the caches of several sequences decoded together (DeviceSlotCaches), one
    call running on several of them; max_tokens and max_keep count over a call's rows.
    """
    if not 1 <= max_keep <= max_tokens or slots < 1 or (slots == 1 and max_tokens > capacity):
        raise ValueError(f"need 1 <= max_keep ({max_keep}) <= max_tokens ({max_tokens}), and "
                         f"max_tokens <= capacity ({capacity}) for one cache")
    item = np.dtype(spec.dtype).itemsize
    head = spec.num_kv_heads * spec.head_dim * item
    sizes: list[tuple[str, int]] = []
    for i in range(spec.num_layers):
        sizes += [(f"keys.{i}", slots * head * capacity),
                  (f"values.{i}", slots * head * capacity)]
    sizes += [("inputs", input_slots(max_tokens, slots)["total"].nbytes),
              ("presents", 2 * spec.num_layers * present_stride(spec, max_tokens)),
              ("logits", max_keep * spec.vocab_size * 4),
              ("probs", max_keep * spec.vocab_size * 4)]
    return _aligned_regions(sizes)


INPUT_NAMES = ("input_ids", "position_ids", "past_length", "logits_to_keep")


def input_slots(max_tokens: int, rows: int = 1) -> dict[str, Region]:
    """Byte regions of the int64 graph inputs inside the arena's `inputs` region, each
    aligned to ALIGNMENT: input_ids and position_ids hold max_tokens values, past_length
    one a row, logits_to_keep one. The host staging buffer (`aligned_host_buffer`) has the
    same layout, so one copy moves them all and every slot is aligned on both sides."""
    tokens = 8 * max_tokens
    return _aligned_regions([("input_ids", tokens), ("position_ids", tokens),
                             ("past_length", 8 * rows), ("logits_to_keep", 8)])


def _aligned_regions(sizes: list[tuple[str, int]]) -> dict[str, Region]:
    layout, offset = {}, 0
    for name, nbytes in sizes:
        layout[name] = Region(offset, nbytes)
        offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
    layout["total"] = Region(0, offset)
    return layout


def aligned_host_buffer(nbytes: int) -> np.ndarray:
    """Zeroed host bytes starting on a multiple of ALIGNMENT (numpy only promises 16 or 64):
    TensorRT reads shape-tensor inputs such as `logits_to_keep` from host memory, at an
    address that must be aligned like any other tensor's."""
    raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes]  # a view: it keeps `raw` alive


def kv_region(j: int) -> str:
    """Arena region of cache tensor j in graph order: K of layer j // 2 (even j), else V."""
    return f"{'keys' if j % 2 == 0 else 'values'}.{j // 2}"


def present_stride(spec: ModelSpec, max_tokens: int) -> int:
    """Bytes between presents j and j + 1: each is packed [kv_heads, T <= max_tokens, dim],
    and starts on a multiple of ALIGNMENT (an engine binds each)."""
    nbytes = spec.num_kv_heads * max_tokens * spec.head_dim * np.dtype(spec.dtype).itemsize
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def row_copies(spec: ModelSpec, layout: dict[str, Region], capacity: int, max_tokens: int,
               length: int, t: int, slot: int = 0, call_row: int = 0,
               call_tokens: int | None = None) -> list[tuple[int, int, int, int, int, int]]:
    """(dst, dst_pitch, src, src_pitch, width, height) offsets for `copy_2d` that store T
    new rows per tensor at rows [length, length + T) of cache `slot`. Present j (K of layer
    j // 2 for even j, V for odd) is packed [rows, kv_heads, call_tokens, head_dim] at
    presents + j * its max size; the T rows are the first of row `call_row` (a shorter row
    of a padded call keeps the first of call_tokens)."""
    check_room(length, t, capacity)
    call_tokens = t if call_tokens is None else call_tokens
    heads, row = spec.num_kv_heads, spec.head_dim * np.dtype(spec.dtype).itemsize
    stride = present_stride(spec, max_tokens)
    copies = []
    for j in range(2 * spec.num_layers):
        copies.append((layout[kv_region(j)].offset + (slot * heads * capacity + length) * row,
                       capacity * row,
                       layout["presents"].offset + j * stride
                       + call_row * heads * call_tokens * row,
                       call_tokens * row, t * row, heads))
    return copies


class DeviceKVCache(CacheRows):
    """Cache + step buffers in one device allocation; `length` rows are valid."""

    def __init__(self, memory, spec: ModelSpec, capacity: int, max_tokens: int,
                 max_keep: int):
        super().__init__(capacity)
        self.memory, self.spec = memory, spec
        self.max_tokens, self.max_keep = max_tokens, max_keep
        self.layout = arena_layout(spec, capacity, max_tokens, max_keep)
        self.base = memory.alloc(self.layout["total"].nbytes)
        self._free = weakref.finalize(self, memory.free, self.base)

    @property
    def arena(self) -> DeviceKVCache:
        """The allocation whose step buffers a call on this cache uses: its own."""
        return self

    def address(self, name: str) -> int:
        return self.base + self.layout[name].offset

    @property
    def input_regions(self) -> dict[str, Region]:
        """The `inputs` region's slots (`input_slots`), which the host staging mirrors."""
        return input_slots(self.max_tokens)

    def input_address(self, name: str) -> int:
        """Device address of one int64 graph input (INPUT_NAMES) in the `inputs` region."""
        return self.address("inputs") + self.input_regions[name].offset

    def present_address(self, j: int) -> int:
        return self.address("presents") + j * present_stride(self.spec, self.max_tokens)

    def write(self, t: int) -> None:
        """Move the T new rows of the last call from `presents` into the cache."""
        for dst, dst_pitch, src, src_pitch, width, height in row_copies(
                self.spec, self.layout, self.capacity, self.max_tokens, self.length, t):
            self.memory.copy_2d(self.base + dst, dst_pitch, self.base + src, src_pitch,
                                width, height)
        self.length += t

    def close(self) -> None:
        self._free()
