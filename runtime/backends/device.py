"""The device backend: the `forward(cache, token_ids, logits_to_keep)` of backends/__init__.py on an
engine (engines.py) and device memory (memory.py).

One call of T tokens, in order (docs/design.md#kv-cache-contract-and-rollback):
    1. one upload: input_ids, position_ids, past_length = cache.length, logits_to_keep
    2. engine.execute: the graph reads cache rows [0, past_length), writes logits and the
       T new K/V rows into the arena's `presents` (plan: binding_plan)
    3. cache.write(T): strided copies of those rows to [length, length + T)
    4. download the kept logits (host sampling; the only device -> host copy of a step), or,
       with `sampler` set (token_selection.DeviceSelector), leave them where they are
Prompts longer than the engine's `max_tokens` are prefilled in chunks, which the graph
supports as is: a chunk is a call with past_length > 0.
"""

from __future__ import annotations

import time

import numpy as np

from specedge.runtime.backends.device_kv_cache import (
    INPUT_NAMES,
    DeviceKVCache,
    aligned_host_buffer,
    input_slots,
    kv_region,
)
from specedge.runtime.backends.engines import TensorBinding
from specedge.runtime.bundle import ModelSpec, graph_io
from specedge.runtime.kv_cache import check_call


def binding_plan(spec: ModelSpec, cache: DeviceKVCache, t: int,
                 n: int) -> list[TensorBinding]:
    """Every input and output of the graph for T tokens and N kept logits, at the arena's
    fixed addresses (bundle.py's contract, in graph order)."""
    if not 1 <= n <= min(t, cache.max_keep) or t > cache.max_tokens:
        raise ValueError(f"a call of {t} tokens keeping {n} logits does not fit buffers of "
                         f"{cache.max_tokens} tokens / {cache.max_keep} logits")
    inputs, outputs = graph_io(spec.num_layers)
    kv_dtype = np.dtype(spec.dtype).type
    plan = [TensorBinding(name, cache.input_address(name), shape, np.int64, False)
            for name, shape in zip(INPUT_NAMES, [(1, t), (1, t), (1,), (1,)])]
    full = (1, spec.num_kv_heads, cache.capacity, spec.head_dim)
    for j, name in enumerate(inputs[4:]):
        plan.append(TensorBinding(name, cache.address(kv_region(j)), full, kv_dtype, False))
    plan.append(TensorBinding("logits", cache.address("logits"), (1, n, spec.vocab_size),
                              np.float32, True))
    new_rows = (1, spec.num_kv_heads, t, spec.head_dim)
    for j, name in enumerate(outputs[1:]):
        plan.append(TensorBinding(name, cache.present_address(j), new_rows, kv_dtype, True))
    return plan


class DeviceBackend:
    """A graph on an engine over device memory; same interface as OrtCpuBackend."""

    grows_cache = False  # DeviceKVCache has no `grown`: one capacity per generation

    def __init__(self, name: str, spec: ModelSpec, engine, memory, sampler=None):
        self.name, self.spec, self.engine, self.memory = name, spec, engine, memory
        self.sampler = sampler  # device_sampling.DeviceSampler / HostSampler, or None
        self.run_seconds = 0.0
        self._cache: DeviceKVCache | None = None
        self._plans: dict[tuple[int, int], list[TensorBinding]] = {}
        self._staging = np.zeros(0, np.uint8)     # the arena's `inputs` region, on the host
        self._inputs: dict[str, np.ndarray] = {}  # int64 views of its slots, by input name
        self._logits = np.zeros((engine.max_keep, spec.vocab_size), np.float32)

    def new_cache(self, capacity: int) -> DeviceKVCache:
        max_tokens = min(capacity, self.engine.max_tokens)
        return DeviceKVCache(self.memory, self.spec, capacity, max_tokens,
                             min(max_tokens, self.engine.max_keep))

    def forward(self, cache: DeviceKVCache, token_ids: list[int] | np.ndarray,
                logits_to_keep: int = 1) -> np.ndarray:
        """Run T tokens; returns logits [logits_to_keep, vocab] (a view, valid until the next
        call) and appends their K/V rows to `cache`."""
        self.forward_rows(cache, token_ids, logits_to_keep)
        out = self._logits[:logits_to_keep]
        self.memory.download(cache.address("logits"), out)
        return out

    def forward_rows(self, cache: DeviceKVCache, token_ids: list[int] | np.ndarray,
                     logits_to_keep: int = 1) -> int:
        """`forward` without the download: the logits stay at cache.address("logits")."""
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        t = ids.size
        check_call(cache, t, logits_to_keep)
        if logits_to_keep > cache.max_keep:
            raise ValueError(f"{logits_to_keep} logits per call exceed this engine's "
                             f"{cache.max_keep}: draft fewer tokens (or rebuild the engines "
                             "with a larger --max-draft-tokens)")
        if self._cache is not cache:
            self._cache, self._plans = cache, {}
            self.engine.forget()
            # The inputs are staged on the host in the arena's slot layout: one upload a step,
            # and the engine reads shape-tensor inputs (logits_to_keep) from these aligned
            # host slots (TensorRT takes a shape tensor's value from host memory).
            slots = input_slots(cache.max_tokens)
            self._staging = aligned_host_buffer(slots["total"].nbytes)
            self._inputs = {name: self._staging[r.offset:r.offset + r.nbytes].view(np.int64)
                            for name, r in slots.items() if name in INPUT_NAMES}
        step = cache.max_tokens
        # Only the last chunk's logits are kept; it holds at least logits_to_keep tokens.
        last = max(0, t - max(logits_to_keep, (t - 1) % step + 1))
        for start in range(0, last, step):
            self._step(cache, ids[start:min(start + step, last)], 1)
        self._step(cache, ids[last:], logits_to_keep)
        return cache.address("logits")

    def _step(self, cache: DeviceKVCache, ids: np.ndarray, n: int) -> None:
        t, v = ids.size, self._inputs
        v["input_ids"][:t] = ids
        v["position_ids"][:t] = np.arange(cache.length, cache.length + t)
        v["past_length"][0], v["logits_to_keep"][0] = cache.length, n
        self.memory.upload(cache.address("inputs"), self._staging)
        key = (t, n)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = binding_plan(self.spec, cache, t, n)
        t0 = time.perf_counter()
        self.engine.execute((id(cache), t, n), plan, self._inputs)
        self.memory.synchronize()
        self.run_seconds += time.perf_counter() - t0
        cache.write(t)
