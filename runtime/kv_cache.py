"""Preallocated KV-cache buffers (layouts "bhsd-fixed" and "bhsd-inplace", see bundle.py).

One K and one V buffer of shape [1, kv_heads, capacity, head_dim] per layer, never
reallocated inside a step, so their addresses stay fixed while a step runs. They are the
planes of one array in the graph's order (K, V of layer 0, K, V of layer 1, ...), so a
step's new rows go in with one copy (`write`), or are written by the graph itself
(`advance`). The graph never reads rows >= length, so rollback after a rejected draft is
only `length = n`: stale rows are never read as valid and are overwritten by the next write.

A portable graph attends over the whole capacity, masked rows included (SmolLM2 int8 on
2 cores: a one-token step takes ~20 ms at capacity 256, ~23 at 512 and ~25 at 768, at one
context length). So the host cache does not start at prompt + max_new_tokens: it starts
with room for the prompt and grows by CAPACITY_STEP rows between steps (`grown`, a copy of
the rows held: ~46 KB per row for SmolLM2). Device caches keep one capacity per generation
(their addresses are captured in CUDA graphs and TensorRT contexts).
"""

from __future__ import annotations

import numpy as np

CAPACITY_STEP = 256  # capacity is rounded up to this; a portable graph's attention is O(capacity)


def capacity_for(tokens: int, max_context: int) -> int:
    """Smallest multiple of CAPACITY_STEP holding `tokens`, capped at `max_context`."""
    if tokens > max_context:
        raise ValueError(f"{tokens} tokens do not fit the model's context of {max_context}")
    return min(max_context, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)


class KVCache:
    """`capacity` rows a generation may hold, plus `spare` rows past them that a graph may
    write but the cache never counts (ort_cpu.py: a one-token step run as two rows)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: np.dtype = np.float32, spare: int = 0):
        self.planes = np.zeros((2 * num_layers, 1, num_kv_heads, capacity + spare, head_dim),
                               dtype)
        self.keys = list(self.planes[0::2])
        self.values = list(self.planes[1::2])
        self.capacity = capacity
        self.spare = spare
        self.length = 0

    def write(self, rows: np.ndarray) -> None:
        """Store T new rows per plane ([2 * layers, 1, kv_heads, T, head_dim], the graph's
        present outputs in order) at [length, length + T)."""
        end = self.length + rows.shape[3]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} rows needed, capacity {self.capacity}")
        self.planes[:, :, :, self.length:end] = rows
        self.length = end

    def advance(self, t: int) -> None:
        """Count T rows that the graph wrote in place at [length, length + T) (KV layout
        "bhsd-inplace")."""
        if self.length + t > self.capacity:
            raise ValueError(f"KV cache full: {self.length + t} rows needed, capacity "
                             f"{self.capacity}")
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

    def rollback(self, length: int) -> None:
        """Forget rows >= length (a rejected draft); O(1), the rows are masked, not cleared."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} rows")
        self.length = length
