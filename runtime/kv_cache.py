"""Preallocated KV-cache buffers (layout "bhsd-fixed", see bundle.py).

One K and one V buffer of shape [1, kv_heads, capacity, head_dim] per layer, allocated once
per generation and never reallocated inside a step, so their addresses stay fixed. They are
the planes of one array in the graph's order (K, V of layer 0, K, V of layer 1, ...), so a
step's new rows go in with one copy. The graph
masks rows >= length, so rollback after a rejected draft is only `length = n`: stale rows
are never read as valid and are overwritten by the next write.
"""

from __future__ import annotations

import numpy as np

CAPACITY_STEP = 256  # capacity is rounded up to this; attention cost is O(capacity)


def capacity_for(tokens: int, max_context: int) -> int:
    """Smallest multiple of CAPACITY_STEP holding `tokens`, capped at `max_context`."""
    if tokens > max_context:
        raise ValueError(f"{tokens} tokens do not fit the model's context of {max_context}")
    return min(max_context, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: np.dtype = np.float32):
        self.planes = np.zeros((2 * num_layers, 1, num_kv_heads, capacity, head_dim), dtype)
        self.keys = list(self.planes[0::2])
        self.values = list(self.planes[1::2])
        self.capacity = capacity
        self.length = 0

    def write(self, rows: np.ndarray) -> None:
        """Store T new rows per plane ([2 * layers, 1, kv_heads, T, head_dim], the graph's
        present outputs in order) at [length, length + T)."""
        end = self.length + rows.shape[3]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} rows needed, capacity {self.capacity}")
        self.planes[:, :, :, self.length:end] = rows
        self.length = end

    def rollback(self, length: int) -> None:
        """Forget rows >= length (a rejected draft); O(1), the rows are masked, not cleared."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} rows")
        self.length = length
