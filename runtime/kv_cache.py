"""Preallocated KV-cache buffers (layouts "bhsd-fixed" and "bhsd-inplace", see bundle.py).

One K and one V buffer of shape [1, kv_heads, capacity, head_dim] per layer, never
reallocated inside a step, so their addresses stay fixed while a step runs. They are the
planes of one array in the graph's order (K, V of layer 0, K, V of layer 1, ...), so a
step's new rows go in with one copy (`write`), or are written by the graph itself
(`advance`). The graph never reads rows >= length, so rollback after a rejected draft is
only `length = n`: stale rows are never read as valid and are overwritten by the next write.

A portable or batched graph attends over the whole capacity, masked rows included
(SmolLM2 int8 on 2 cores: a one-token step takes ~20 ms at capacity 256, ~23 at 512 and
~25 at 768, at one context length; int4 batched, four rows of one token at 50 rows of
context: ~16 ms at capacity 64, ~20 at 256, ~24 at 512). So the host cache does not start
at prompt + max_new_tokens: it starts with room for the prompt and grows by GROWTH_STEP
rows between steps (`grown`, a copy of the rows held: ~46 KB per row for SmolLM2); the
rows computed do not depend on the capacity, bit for bit (tests/runtime/test_batch.py).
Device caches keep one capacity per generation, a multiple of CAPACITY_STEP (their
addresses are captured in CUDA graphs and TensorRT contexts, one capture per capacity).
"""

from __future__ import annotations

import mmap

import numpy as np

CAPACITY_STEP = 256  # a generation's context limit and a device cache's capacity round to this
GROWTH_STEP = 64  # a host cache that grows (attention over its capacity) rounds to this
# The most tokens a row of a call on several sequences' slots takes (runtime/batch.py): a
# call of more is a prompt, run on its own row so that it does not pad the others. A
# device engine's decode profile takes this many (engine_manifest.py).
MAX_BATCHED_TOKENS = 16


def capacity_for(tokens: int, max_context: int, step: int = CAPACITY_STEP) -> int:
    """Smallest multiple of `step` holding `tokens`, capped at `max_context`."""
    if tokens > max_context:
        raise ValueError(f"{tokens} tokens do not fit the model's context of {max_context}")
    return min(max_context, -(-tokens // step) * step)


def zeroed(shape: tuple[int, ...], dtype: np.dtype = np.float32) -> np.ndarray:
    """A zeroed array on memory of its own mapping, freed with the array. numpy asks the
    kernel to back an array of 4 MB or more with transparent huge pages, and the first
    write to one may wait while the kernel compacts memory for it: caches allocated
    between two steps took 35-70 ms instead of 4 (SmolLM2, four slots of 256 rows). A
    private anonymous mapping comes zeroed, page by page as it is written (numpy's own
    allocation where the platform has none, or for less than a page)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    private = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if count * dtype.itemsize < mmap.PAGESIZE or None in private:
        return np.zeros(shape, dtype)
    memory = mmap.mmap(-1, count * dtype.itemsize, flags=private[0] | private[1])
    return np.frombuffer(memory, dtype, count).reshape(shape)


def check_room(length: int, t: int, capacity: int) -> None:
    """Raise ValueError unless T more rows after `length` fit a cache of `capacity` rows."""
    if length + t > capacity:
        raise ValueError(f"KV cache full: {length + t} rows needed, capacity {capacity}")


def check_call(cache: CacheRows, t: int, logits_to_keep: int) -> None:
    """What every backend's `forward` checks before a call of T tokens: it keeps between 1
    and T logits, and the cache has room for the T new rows."""
    if t == 0 or not 1 <= logits_to_keep <= t:
        raise ValueError(f"need 1 <= logits_to_keep ({logits_to_keep}) <= tokens ({t})")
    check_room(cache.length, t, cache.capacity)


class CacheRows:
    """The rows of a KV cache that count: [0, length) of `capacity`. Every cache (this
    module's host cache, the device backend's arena) counts its rows this way."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0

    def rollback(self, length: int) -> None:
        """Forget rows >= length (a rejected draft); O(1), the rows are masked, not cleared."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} rows")
        self.length = length

    def reclaim(self, length: int) -> None:
        """Count rows [0, length) again after a rollback, for a caller that knows nothing
        was written there since: a batch slot's rows kept for the next sequence whose prompt
        starts with the same tokens (batch.py)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cannot count {length} rows in a cache of {self.capacity}")
        self.length = length


class KVCache(CacheRows):
    """`capacity` rows a generation may hold, plus `spare` rows past them that a graph may
    write but the cache never counts (ort_cpu.py: a one-token step run as two rows)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: np.dtype = np.float32, spare: int = 0,
                 planes: np.ndarray | None = None):
        super().__init__(capacity)
        # `planes`: memory of another cache's, one slot of a SlotCaches (this cache a view).
        self.planes = planes if planes is not None else zeroed(
            (2 * num_layers, 1, num_kv_heads, capacity + spare, head_dim), dtype)
        self.keys = list(self.planes[0::2])
        self.values = list(self.planes[1::2])
        self.spare = spare

    def write(self, rows: np.ndarray) -> None:
        """Store T new rows per plane ([2 * layers, 1, kv_heads, T, head_dim], the graph's
        present outputs in order) at [length, length + T)."""
        t = rows.shape[3]
        check_room(self.length, t, self.capacity)
        self.planes[:, :, :, self.length:self.length + t] = rows
        self.length += t

    def advance(self, t: int) -> None:
        """Count T rows that the graph wrote in place at [length, length + T) (KV layout
        "bhsd-inplace")."""
        check_room(self.length, t, self.capacity)
        self.length += t

    def grown(self, capacity: int) -> KVCache:
        """A cache of `capacity` rows holding this one's rows (new buffers, new addresses)."""
        layers2, _, heads, _, dim = self.planes.shape
        if capacity < self.length:
            raise ValueError(f"cannot shrink a cache holding {self.length} rows to {capacity}")
        new = KVCache(layers2 // 2, heads, dim, capacity, self.planes.dtype, self.spare)
        new.planes[:, :, :, :self.length] = self.planes[:, :, :, :self.length]
        new.length = self.length
        return new


class SlotCaches:
    """The caches of several sequences decoded together, as slots of one array: planes
    [2 * layers, slots, kv_heads, capacity + spare, head_dim], so that a call on slots
    [lo, hi) binds one contiguous block per plane ([hi - lo, kv_heads, ...]), and each slot
    is a KVCache of its own (`slots[i]`, a view) with its own length, for the loop of the
    sequence that holds it. All slots share one capacity, which `resize` changes between
    calls (a portable or batched graph attends over all of it: the module docstring)."""

    step = GROWTH_STEP  # capacities are multiples of this (capacity_for), or the context

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 slots: int, spare: int = 0):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.spare = spare
        self.planes = zeroed((2 * num_layers, slots, num_kv_heads, capacity + spare,
                              head_dim))
        self.slots = [KVCache(*self.shape, capacity, spare=spare,
                              planes=self.planes[:, i:i + 1]) for i in range(slots)]
        self.capacity = capacity

    def resize(self, capacity: int) -> None:
        """Give every slot `capacity` rows, more or fewer, keeping each slot's rows: new
        buffers (new addresses: bindings to the old ones must go), the same slot objects."""
        if capacity == self.capacity:
            return
        held = max(slot.length for slot in self.slots)
        if held > capacity:
            raise ValueError(f"a slot holds {held} rows, more than a capacity of {capacity}")
        layers2, slots, heads, _, dim = self.planes.shape
        planes = zeroed((layers2, slots, heads, capacity + self.spare, dim))
        for i, slot in enumerate(self.slots):
            planes[:, i, :, :slot.length] = self.planes[:, i, :, :slot.length]
            slot.planes = planes[:, i:i + 1]
            slot.keys, slot.values = list(slot.planes[0::2]), list(slot.planes[1::2])
            slot.capacity = capacity
        self.planes, self.capacity = planes, capacity

    def block(self, lo: int, hi: int) -> np.ndarray:
        """The planes of slots [lo, hi): [2 * layers, hi - lo, kv_heads, C + spare, D]."""
        return self.planes[:, lo:hi]


def fill_slot_inputs(slots: list[CacheRows], lo: int, rows: dict[int, list[int]],
                     max_context: int, ids: np.ndarray, positions: np.ndarray,
                     past_length: np.ndarray) -> None:
    """The int64 inputs of a call on slots [lo, lo + n) (n = len(ids), T = ids.shape[1]),
    written into `ids` and `positions` [n, T] and `past_length` [n]: slot s runs rows[s]
    padded to T with its last token, a slot without a row one padding token, each at its
    own positions [length, length + T)."""
    last = max_context - 1
    for i in range(len(ids)):
        cache = slots[lo + i]
        tokens = rows.get(lo + i) or [0]
        ids[i, :len(tokens)] = tokens
        ids[i, len(tokens):] = tokens[-1]
        # Padding past the context's end reuses its last position: what the padding
        # computes is dropped, and a row's own positions are all inside the context.
        positions[i] = np.minimum(np.arange(cache.length, cache.length + ids.shape[1]), last)
        past_length[i] = cache.length
