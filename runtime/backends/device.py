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
    kv_region,
)
from specedge.runtime.backends.device_slots import DeviceSlotCaches
from specedge.runtime.backends.engines import TensorBinding
from specedge.runtime.backends.memory import ALIGNMENT
from specedge.runtime.bundle import ModelSpec, graph_io
from specedge.runtime.kv_cache import (
    CAPACITY_STEP,
    MAX_BATCHED_TOKENS,
    check_call,
    fill_slot_inputs,
)


def binding_plan(spec: ModelSpec, cache: DeviceKVCache, t: int,
                 n: int) -> list[TensorBinding]:
    """Every input and output of the graph for T tokens and N kept logits, at the arena's
    fixed addresses (bundle.py's contract, in graph order)."""
    if not 1 <= n <= min(t, cache.max_keep) or t > cache.max_tokens:
        raise ValueError(f"a call of {t} tokens keeping {n} logits does not fit buffers of "
                         f"{cache.max_tokens} tokens / {cache.max_keep} logits")
    kv = [cache.address(kv_region(j)) for j in range(2 * spec.num_layers)]
    return _plan(spec, cache, kv, 1, t, n)


def slot_binding_plan(spec: ModelSpec, caches: DeviceSlotCaches, lo: int, rows: int,
                      t: int) -> list[TensorBinding]:
    """The same for a call on slots [lo, lo + rows) of `caches`, T tokens a row, every
    row's T logits kept: each cache tensor is bound as the block of those slots."""
    if lo < 0 or rows < 1 or lo + rows > len(caches.slots) or not 1 <= t <= caches.row_tokens:
        raise ValueError(f"a call on slots {lo}..{lo + rows - 1} of {t} tokens a row does not "
                         f"fit {len(caches.slots)} slots of {caches.row_tokens} tokens a row")
    kv = [caches.slot_address(kv_region(j), lo) for j in range(2 * spec.num_layers)]
    return _plan(spec, caches, kv, rows, t, t)


def _plan(spec: ModelSpec, arena, kv: list[int], rows: int, t: int,
          n: int) -> list[TensorBinding]:
    inputs, outputs = graph_io(spec.num_layers)
    kv_dtype = np.dtype(spec.dtype).type
    plan = [TensorBinding(name, arena.input_address(name), shape, np.int64, False)
            for name, shape in zip(INPUT_NAMES, [(rows, t), (rows, t), (rows,), (1,)])]
    full = (rows, spec.num_kv_heads, arena.capacity, spec.head_dim)
    for name, address in zip(inputs[4:], kv):
        plan.append(TensorBinding(name, address, full, kv_dtype, False))
    plan.append(TensorBinding("logits", arena.address("logits"), (rows, n, spec.vocab_size),
                              np.float32, True))
    new_rows = (rows, spec.num_kv_heads, t, spec.head_dim)
    for j, name in enumerate(outputs[1:]):
        plan.append(TensorBinding(name, arena.present_address(j), new_rows, kv_dtype, True))
    return plan


class DeviceBackend:
    """A graph on an engine over device memory; same interface as OrtCpuBackend."""

    grows_cache = False  # DeviceKVCache has no `grown`: one capacity per generation
    # A one-token step is one row on every device graph (batch.py asks; ort_cpu.py runs an
    # in-place graph's as two).
    one_token_as_two = False

    def __init__(self, name: str, spec: ModelSpec, engine, memory, sampler=None):
        self.name, self.spec, self.engine, self.memory = name, spec, engine, memory
        self.sampler = sampler  # device_sampling.DeviceSampler / HostSampler, or None
        self.run_seconds = 0.0
        self._arena: DeviceKVCache | DeviceSlotCaches | None = None
        self._plans: dict[tuple, list[TensorBinding]] = {}
        self._staging = np.zeros(0, np.uint8)     # the arena's `inputs` region, on the host
        self._inputs: dict[str, np.ndarray] = {}  # int64 views of its slots, by input name
        self._logits = np.zeros((engine.max_keep, spec.vocab_size), np.float32)
        self._row_logits = np.zeros(0, np.float32)  # a call on several slots: [rows, T, V]

    def new_cache(self, capacity: int) -> DeviceKVCache:
        max_tokens = min(capacity, self.engine.max_tokens)
        return DeviceKVCache(self.memory, self.spec, capacity, max_tokens,
                             min(max_tokens, self.engine.max_keep))

    def new_slot_caches(self, slots: int, spare: int = 0) -> DeviceSlotCaches:
        """The caches of `slots` sequences decoded together (batch.py), CAPACITY_STEP rows
        each to start with (the capacities an engine takes); calls on several of them take
        up to MAX_BATCHED_TOKENS tokens a row. `spare` must be 0: a portable graph writes
        only the rows it is given."""
        if spare:
            raise ValueError("device caches have no spare rows: the device backend runs "
                             "portable graphs, which write only the rows counted")
        if hasattr(self.engine, "check_rows"):  # a TensorRT engine: its --max-batch
            self.engine.check_rows(slots)
        capacity = min(CAPACITY_STEP, self.spec.max_context)
        return DeviceSlotCaches(self.memory, self.spec, capacity, slots,
                                self.engine.max_tokens, self.engine.max_keep,
                                MAX_BATCHED_TOKENS)

    def forget_bindings(self) -> None:
        """Drop what was bound to the last arena's addresses (a resized DeviceSlotCaches)."""
        self._arena, self._plans = None, {}
        self.engine.forget()

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
        self._stage_for(cache.arena)
        step = cache.max_tokens
        # Only the last chunk's logits are kept; it holds at least logits_to_keep tokens.
        last = max(0, t - max(logits_to_keep, (t - 1) % step + 1))
        for start in range(0, last, step):
            self._step(cache, ids[start:min(start + step, last)], 1)
        self._step(cache, ids[last:], logits_to_keep)
        return cache.address("logits")

    def _stage_for(self, arena: DeviceKVCache | DeviceSlotCaches) -> None:
        """Bind to `arena`'s addresses, dropping what was bound to another's."""
        if self._arena is arena:
            return
        self._arena, self._plans = arena, {}
        self.engine.forget()
        # The inputs are staged on the host in the arena's slot layout: one upload a step,
        # and the engine reads shape-tensor inputs (logits_to_keep) from these aligned
        # host slots (TensorRT takes a shape tensor's value from host memory).
        slots = arena.input_regions
        self._staging = aligned_host_buffer(slots["total"].nbytes)
        self._inputs = {name: self._staging[r.offset:r.offset + r.nbytes].view(np.int64)
                        for name, r in slots.items() if name in INPUT_NAMES}

    def forward_slots(self, caches: DeviceSlotCaches, lo: int, rows: dict[int, list[int]]
                      ) -> dict[int, np.ndarray]:
        """One call on slots [lo, hi) of `caches` (hi past the last slot in `rows`), as
        OrtCpuBackend.forward_slots on a portable graph: slot s runs rows[s] at its
        positions [length, length + len); rows are padded to the longest with their last
        token, a slot in the range without a row runs padding at its own length; each row's
        first len(rows[s]) new K/V rows go to its slot (`DeviceSlotCaches.write_rows`), the
        padding's nowhere. Returns each row's logits [len, vocab] (views of one download,
        valid until the next call)."""
        if lo and caches.slot_address("keys.0", lo) % ALIGNMENT:
            # A tensor's address must be 256-byte aligned (TensorRT): where a slot's cache
            # is not a multiple of that (an odd kv_heads x capacity at fp16 and head_dim
            # 64), the call starts at slot 0, the slots below lo running padding.
            lo = 0
        hi = max(rows) + 1
        n, t = hi - lo, max(len(ids) for ids in rows.values())
        for slot, ids in rows.items():
            check_call(caches.slots[slot], len(ids), 1)
        self._stage_for(caches)
        v = self._inputs
        fill_slot_inputs(caches.slots, lo, rows, self.spec.max_context,
                         v["input_ids"][:n * t].reshape(n, t),
                         v["position_ids"][:n * t].reshape(n, t), v["past_length"][:n])
        v["logits_to_keep"][0] = t
        self.memory.upload(caches.address("inputs"), self._staging)
        key = ("rows", lo, n, t)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = slot_binding_plan(self.spec, caches, lo, n, t)
        t0 = time.perf_counter()
        self.engine.execute((id(caches),) + key, plan, self._inputs)
        self.memory.synchronize()
        self.run_seconds += time.perf_counter() - t0
        for slot, tokens in rows.items():
            cache = caches.slots[slot]
            caches.write_rows(slot, cache.length, len(tokens), slot - lo, t)
            cache.length += len(tokens)
        if self._row_logits.size < n * t * self.spec.vocab_size:
            self._row_logits = np.zeros(caches.call_keep * self.spec.vocab_size, np.float32)
        logits = self._row_logits[:n * t * self.spec.vocab_size].reshape(n, t, -1)
        self.memory.download(caches.address("logits"), logits)
        return {slot: logits[slot - lo, :len(tokens)] for slot, tokens in rows.items()}

    def _step(self, cache: DeviceKVCache, ids: np.ndarray, n: int) -> None:
        t, v = ids.size, self._inputs
        v["input_ids"][:t] = ids
        v["position_ids"][:t] = np.arange(cache.length, cache.length + t)
        v["past_length"][0], v["logits_to_keep"][0] = cache.length, n
        self.memory.upload(cache.address("inputs"), self._staging)
        key = (id(cache), t, n)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = binding_plan(self.spec, cache, t, n)
        t0 = time.perf_counter()
        self.engine.execute(key, plan, self._inputs)
        self.memory.synchronize()
        self.run_seconds += time.perf_counter() - t0
        cache.write(t)
