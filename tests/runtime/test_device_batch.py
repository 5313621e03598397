"""Several sequences decoded together on the device backend (runtime/backends/device_slots.py,
`DeviceBackend.forward_slots`), run on host memory with ONNX Runtime CPU as the engine
("host-emulated"): each row's new K/V rows land in its own slot at its own length, a
resize keeps every slot's rows, and each sequence's greedy output equals its plain decoding
alone on the ort-cpu backend."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime import Generator
from specedge.runtime.backends.device import DeviceBackend, slot_binding_plan
from specedge.runtime.backends.device_kv_cache import kv_region
from specedge.runtime.backends.device_slots import DeviceSlotCaches
from specedge.runtime.backends.memory import ALIGNMENT, HostMemory
from specedge.runtime.batch import BatchGenerator, BatchRequest
from specedge.runtime.bundle import ModelSpec
from specedge.runtime.config import GenerationConfig
from specedge.runtime.kv_cache import CAPACITY_STEP

SPEC = ModelSpec(path=None, num_layers=3, num_kv_heads=2, head_dim=4, vocab_size=50,
                 max_context=512, dtype="float32", file_size=1)
HEADS, DIM = SPEC.num_kv_heads, SPEC.head_dim


def _slot(memory: HostMemory, caches: DeviceSlotCaches, j: int, slot: int) -> np.ndarray:
    """Cache tensor j of `slot`: [kv_heads, capacity, head_dim]."""
    out = np.zeros((HEADS, caches.capacity, DIM), np.float32)
    memory.download(caches.slot_address(kv_region(j), slot), out)
    return out


def test_each_row_of_a_call_lands_in_its_own_slot_and_a_resize_keeps_them():
    """A call on slots 0..2 of T = 3 tokens a row, where slot 0 runs 3 tokens, slot 1 none
    (padding) and slot 2 one: the first len(tokens) new rows of each row go to its slot at
    its own length, nothing to slot 1; growing and cutting the capacity keeps every row."""
    memory = HostMemory()
    caches = DeviceSlotCaches(memory, SPEC, 256, slots=3, max_tokens=64, max_keep=9,
                              row_tokens=4)
    expected = np.zeros((2 * SPEC.num_layers, 3, HEADS, 1024, DIM), np.float32)
    rng = np.random.default_rng(0)
    for slot, length in ((0, 5), (2, 7)):  # rows from earlier calls
        old = rng.standard_normal((2 * SPEC.num_layers, HEADS, length, DIM)).astype(np.float32)
        for j in range(2 * SPEC.num_layers):
            for h in range(HEADS):
                memory.upload(caches.slot_address(kv_region(j), slot)
                              + (h * caches.capacity) * DIM * 4, old[j, h])
        expected[:, slot, :, :length] = old
        caches.slots[slot].reclaim(length)
    t = 3
    new = rng.standard_normal((2 * SPEC.num_layers, 3, HEADS, t, DIM)).astype(np.float32)
    for j in range(2 * SPEC.num_layers):
        memory.upload(caches.present_address(j), new[j])
    for slot, count in ((0, 3), (2, 1)):
        length = caches.slots[slot].length
        caches.write_rows(slot, length, count, call_row=slot, call_tokens=t)
        caches.slots[slot].length += count
        expected[:, slot, :, length:length + count] = new[:, slot, :, :count]
    lengths = [slot.length for slot in caches.slots]
    assert lengths == [8, 0, 8]
    for capacity in (256, 512, 256):
        caches.resize(capacity)
        assert caches.capacity == capacity and all(s.capacity == capacity
                                                   for s in caches.slots)
        for j in range(2 * SPEC.num_layers):
            for slot in range(3):
                got = _slot(memory, caches, j, slot)[:, :lengths[slot]]
                assert np.array_equal(got, expected[j, slot, :, :lengths[slot]])
    caches.slots[0].rollback(2)
    assert caches.slots[0].length == 2
    caches.slots[2].reclaim(200)
    with pytest.raises(ValueError, match="more than a capacity"):
        caches.resize(128)


def test_a_call_on_several_slots_binds_each_cache_as_their_block():
    memory = HostMemory()
    caches = DeviceSlotCaches(memory, SPEC, 256, slots=4, max_tokens=32, max_keep=5,
                              row_tokens=16)
    plan = {b.name: b for b in slot_binding_plan(SPEC, caches, 1, 3, 5)}
    assert plan["input_ids"].shape == plan["position_ids"].shape == (3, 5)
    assert plan["past_length"].shape == (3,) and plan["logits_to_keep"].shape == (1,)
    assert plan["logits"].shape == (3, 5, SPEC.vocab_size)
    key = plan["past_key_values.1.value"]
    assert key.shape == (3, HEADS, 256, DIM)
    assert key.address == caches.slot_address("values.1", 1)
    assert plan["present.2.key"].shape == (3, HEADS, 5, DIM)
    assert all(b.address % ALIGNMENT == 0 for b in plan.values())
    # Every row's tokens and logits fit the step buffers, the slots' count is kept to.
    assert caches.call_tokens == caches.call_keep == 4 * 16
    with pytest.raises(ValueError, match="does not fit 4 slots of 16 tokens a row"):
        slot_binding_plan(SPEC, caches, 2, 3, 1)
    with pytest.raises(ValueError, match="does not fit"):
        slot_binding_plan(SPEC, caches, 0, 1, 17)


PROMPTS = ["hello world", "the cat sat on the mat and the cat sat on the", "a, b, c!", "why?",
           "one two three one two"]
CONFIGS = [dict(max_new_tokens=12, draft_tokens=2), dict(max_new_tokens=20, draft_tokens=3),
           dict(max_new_tokens=300, draft_tokens=1), dict(max_new_tokens=7, use_draft=False),
           dict(max_new_tokens=16, draft_tokens=4)]


def test_batched_greedy_on_the_device_backend_equals_plain_decoding_alone(
        tiny_portable_bundle, monkeypatch):
    """Five sequences on five slots of the host-emulated device backend, with different K
    and lengths (one past the first capacity of CAPACITY_STEP rows, so the slots grow), fp32
    portable: each one's tokens equal its plain decoding alone on ort-cpu; calls carried
    several rows, and drafts were both accepted and rejected."""
    calls = []
    original = DeviceBackend.forward_slots

    def spy(self, caches, lo, rows):
        calls.append((self.name, len(rows), caches.capacity))
        return original(self, caches, lo, rows)

    monkeypatch.setattr(DeviceBackend, "forward_slots", spy)
    ref = Generator.from_bundle(tiny_portable_bundle)
    alone = [ref.generate(p, raw=True, max_new_tokens=c["max_new_tokens"], use_draft=False)
             for p, c in zip(PROMPTS, CONFIGS)]
    gen = Generator.from_bundle(tiny_portable_bundle, backend="host-emulated")
    batch = BatchGenerator(gen, max_batch=5).generate(
        [BatchRequest(prompt=p, raw=True, config=GenerationConfig(**c))
         for p, c in zip(PROMPTS, CONFIGS)])
    for a, b in zip(alone, batch):
        assert b.token_ids == a.token_ids
    assert {name for name, _, _ in calls} == {"host-emulated"}
    assert max(rows for _, rows, _ in calls) >= 3
    assert {capacity for _, _, capacity in calls} == {CAPACITY_STEP, 2 * CAPACITY_STEP}
    drafted = sum(b.stats["drafted_tokens"] for b in batch)
    accepted = sum(b.stats["accepted_tokens"] for b in batch)
    assert 0 < accepted < drafted


def test_device_slot_caches_have_no_spare_rows(tiny_portable_bundle):
    gen = Generator.from_bundle(tiny_portable_bundle, backend="host-emulated")
    with pytest.raises(ValueError, match="no spare rows"):
        gen.target.new_slot_caches(2, spare=16)
