"""The device caches of several sequences decoded together (runtime/batch.py on the device
backend): one arena of `slots` caches and the step buffers of a call on several of them.

Per layer, K and V are [slots, kv_heads, capacity, head_dim]: slot s is the cache
[1, kv_heads, capacity, head_dim] at offset s x kv_heads x capacity x head_dim, so a call
on slots [lo, hi) binds one block per cache tensor ([hi - lo, kv_heads, capacity,
head_dim], a portable graph's `past_key_values` for hi - lo rows). The call's new rows come
back packed [rows, kv_heads, T, head_dim] in `presents`; each row's first len(tokens) go to
its slot at its own length with one strided copy per tensor (`row_copies`), the padding's
are dropped. Each slot is a cache of its own for the loop of the sequence that holds it
(`DeviceSlot`: its own length, rollback and, for a call on it alone, the device backend's
`forward`). All slots share one capacity, a multiple of CAPACITY_STEP (the capacities a
TensorRT engine's profiles accept), which `resize` changes between calls: a new arena,
each slot's rows copied over, new addresses (bindings to the old ones must go).
"""

from __future__ import annotations

import weakref

import numpy as np

from specedge.runtime.backends.device_kv_cache import (
    Region,
    arena_layout,
    input_slots,
    present_stride,
    row_copies,
)
from specedge.runtime.bundle import ModelSpec
from specedge.runtime.kv_cache import CAPACITY_STEP, CacheRows


class DeviceSlotCaches:
    """`slots` device caches in one arena. A call on one slot alone (`forward` on a
    DeviceSlot: a prompt) takes up to `max_tokens` tokens and keeps up to `max_keep` logits,
    as a DeviceKVCache's; a call on several takes up to `row_tokens` tokens a row and keeps
    every row's logits. The step buffers are sized for the larger of the two."""

    step = CAPACITY_STEP  # capacities are multiples of this (kv_cache.capacity_for)
    spare = 0  # a portable graph writes no row past the ones counted

    def __init__(self, memory, spec: ModelSpec, capacity: int, slots: int, max_tokens: int,
                 max_keep: int, row_tokens: int):
        self.memory, self.spec = memory, spec
        self.max_tokens, self.max_keep, self.row_tokens = max_tokens, max_keep, row_tokens
        # Over all the rows of one call: its input_ids, new K/V rows and kept logits.
        self.call_tokens = max(max_tokens, slots * row_tokens)
        self.call_keep = max(max_keep, slots * row_tokens)
        self.capacity = 0
        self._allocate(capacity, slots)
        self.slots = [DeviceSlot(self, i) for i in range(slots)]

    def _allocate(self, capacity: int, slots: int) -> None:
        self.layout = arena_layout(self.spec, capacity, self.call_tokens, self.call_keep,
                                   slots)
        self.base = self.memory.alloc(self.layout["total"].nbytes)
        self._free = weakref.finalize(self, self.memory.free, self.base)
        self.capacity = capacity

    @property
    def arena(self) -> DeviceSlotCaches:
        return self

    @property
    def input_regions(self) -> dict[str, Region]:
        """The `inputs` region's slots (`input_slots`), which the host staging mirrors."""
        return input_slots(self.call_tokens, len(self.slots))

    def address(self, name: str) -> int:
        return self.base + self.layout[name].offset

    def input_address(self, name: str) -> int:
        """Device address of one int64 graph input in the `inputs` region."""
        return self.address("inputs") + self.input_regions[name].offset

    def present_address(self, j: int) -> int:
        return self.address("presents") + j * present_stride(self.spec, self.call_tokens)

    def slot_address(self, name: str, slot: int) -> int:
        """Address of `slot`'s cache tensor `name` (a keys.{i} or values.{i} region)."""
        s = self.spec
        plane = s.num_kv_heads * self.capacity * s.head_dim * np.dtype(s.dtype).itemsize
        return self.address(name) + slot * plane

    def write_rows(self, slot: int, length: int, t: int, call_row: int = 0,
                   call_tokens: int | None = None) -> None:
        """Copy the first T new rows of row `call_row` of the last call (T = call_tokens
        tokens a row) into `slot` at rows [length, length + T)."""
        for dst, dst_pitch, src, src_pitch, width, height in row_copies(
                self.spec, self.layout, self.capacity, self.call_tokens, length, t, slot,
                call_row, call_tokens):
            self.memory.copy_2d(self.base + dst, dst_pitch, self.base + src, src_pitch,
                                width, height)

    def resize(self, capacity: int) -> None:
        """Give every slot `capacity` rows (a multiple of `step`, or the context), keeping
        each slot's rows: a new arena, the same slot objects."""
        if capacity == self.capacity:
            return
        held = max(slot.length for slot in self.slots)
        if held > capacity:
            raise ValueError(f"a slot holds {held} rows, more than a capacity of {capacity}")
        old_base, old_layout, old_capacity, old_free = (self.base, self.layout, self.capacity,
                                                        self._free)
        self._allocate(capacity, len(self.slots))
        s = self.spec
        row = s.head_dim * np.dtype(s.dtype).itemsize
        for name in (n for n in self.layout if n.startswith(("keys.", "values."))):
            for i, slot in enumerate(self.slots):
                if slot.length:
                    # kv_heads runs of `length` rows: capacity rows apart, old and new.
                    self.memory.copy_2d(
                        self.slot_address(name, i), capacity * row,
                        old_base + old_layout[name].offset
                        + i * s.num_kv_heads * old_capacity * row,
                        old_capacity * row, slot.length * row, s.num_kv_heads)
        self.memory.synchronize()  # the copies read the old arena: done before it goes
        old_free()
        for slot in self.slots:
            slot.capacity = capacity

    def close(self) -> None:
        self._free()


class DeviceSlot(CacheRows):
    """Slot `index` of a DeviceSlotCaches: the cache of one sequence of the batch. The
    device backend's `forward` runs on it as on a DeviceKVCache (its cache tensors are the
    slot's, its step buffers the arena's)."""

    def __init__(self, caches: DeviceSlotCaches, index: int):
        super().__init__(caches.capacity)
        self.caches, self.index = caches, index

    @property
    def arena(self) -> DeviceSlotCaches:
        return self.caches

    @property
    def input_regions(self) -> dict[str, Region]:
        return self.caches.input_regions

    @property
    def max_tokens(self) -> int:
        return self.caches.max_tokens

    @property
    def max_keep(self) -> int:
        return self.caches.max_keep

    def address(self, name: str) -> int:
        if name.startswith(("keys.", "values.")):
            return self.caches.slot_address(name, self.index)
        return self.caches.address(name)

    def input_address(self, name: str) -> int:
        return self.caches.input_address(name)

    def present_address(self, j: int) -> int:
        return self.caches.present_address(j)

    def write(self, t: int) -> None:
        """Move the T new rows of the last call (this slot's, alone) into the slot."""
        self.caches.write_rows(self.index, self.length, t)
        self.length += t
