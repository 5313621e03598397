"""Preallocated KV-cache buffers (layout "bhsd-fixed", see bundle.py).

One K and one V buffer of shape [1, kv_heads, capacity, head_dim] per layer, allocated once
per generation and never reallocated inside a step, so their addresses stay fixed. The graph
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
        shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0

    def write(self, new_keys: list[np.ndarray], new_values: list[np.ndarray]) -> None:
        """Store T new rows per layer ([1, kv_heads, T, head_dim]) at [length, length + T)."""
        t = new_keys[0].shape[2]
        end = self.length + t
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} rows needed, capacity {self.capacity}")
        for buf, new in zip(self.keys, new_keys):
            buf[:, :, self.length:end] = new
        for buf, new in zip(self.values, new_values):
            buf[:, :, self.length:end] = new
        self.length = end

    def rollback(self, length: int) -> None:
        """Forget rows >= length (a rejected draft); O(1), the rows are masked, not cleared."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} rows")
        self.length = length
