"""Where tokens are chosen from a model's output: on the host, from downloaded logits
(`HostSelector`, every backend), or on the device next to the logits (`DeviceSelector`, a
device backend with a sampler: only token ids and the accept count come back).

The loop and the model drafter use the same operations either way:

    rows = selector.call_model(backend, cache, ids, keep)       # one model call
    token = selector.pick(rows, sampling, rng)                  # argmax, or one draw from p
    x, q_x = selector.draw(rows, sampling, rng, q, need_q_x)    # a draft token; q collects q_i
    n, token = selector.verify(rows, drafts, selector.q(q), sampling, rng)   # steps 3-6

(steps of docs/design.md#the-speculative-step).

Both follow the same math (runtime/sampling.py, runtime/speculative.py); the device path
draws K + 1 uniforms per verification where the host draws n + 2 (device_sampling.py), so
the two agree in distribution, and token for token when greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specedge.runtime.config import Sampling
from specedge.runtime.probs import sample
from specedge.runtime.speculative import verify_greedy, verify_sampled

# q(x) of a greedy draft token, for the draft threshold: the softmax at T = 1.
_UNIT_TEMPERATURE = Sampling(1.0)


class HostSelector:
    """Logits come back to the host as numpy rows; numpy chooses."""

    where = "host"

    def call_model(self, backend, cache, ids, keep: int) -> np.ndarray:
        return backend.forward(cache, ids, keep)

    def pick(self, rows: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
        return sampling.pick(rows[-1], rng)

    def draw(self, rows: np.ndarray, sampling: Sampling, rng: np.random.Generator,
             q: list, need_q_x: bool) -> tuple[int, float]:
        logits = rows[-1]
        if sampling.greedy:
            x = sampling.pick(logits, rng)
            # q(x) at the argmax is 1 / sum_j exp(l_j - l_x); only needed for a threshold.
            return x, (1.0 / np.exp(logits - logits[x]).sum() if need_q_x else 1.0)
        q.append(sampling.probs(logits))
        x = sample(q[-1], rng)
        return x, float(q[-1].at(x))

    def q(self, q: list) -> list | None:
        return q or None

    def verify(self, rows: np.ndarray, drafts: list[int], q: list | None,
               sampling: Sampling, rng: np.random.Generator) -> tuple[int, int]:
        if sampling.greedy:
            return verify_greedy(drafts, rows)
        # Each p_i is processed when verification reaches it (docs/design.md#the-speculative-step
        # step 3 stops at the
        # first rejection, so the rows after it are never needed).
        return verify_sampled(drafts, q, _RowsOnDemand(rows, sampling.probs), rng)


class _RowsOnDemand(Sequence):
    """`process(logits[i])`, computed the first time row i is read."""

    def __init__(self, logits: np.ndarray, process):
        self._logits, self._process, self._rows = logits, process, {}

    def __len__(self) -> int:
        return len(self._logits)

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._rows:
            self._rows[i] = self._process(self._logits[i])
        return self._rows[i]


@dataclass(frozen=True)
class DeviceRows:
    """`keep` logit rows at `address` in a device backend's arena."""

    backend: object
    cache: object
    address: int
    keep: int

    @property
    def last(self) -> int:
        return self.address + (self.keep - 1) * self.backend.spec.vocab_size * 4


class DeviceSelector:
    """The backend's sampler chooses where the logits are; processed rows go to the arena's
    `probs` region (the draft's q_1..q_K, or the target's p_1..p_{K+1})."""

    where = "device"

    def call_model(self, backend, cache, ids, keep: int) -> DeviceRows:
        return DeviceRows(backend, cache, backend.forward_rows(cache, ids, keep), keep)

    def pick(self, rows: DeviceRows, sampling: Sampling, rng: np.random.Generator) -> int:
        sampler, vocab = rows.backend.sampler, rows.backend.spec.vocab_size
        if sampling.greedy:
            return sampler.verify_greedy(rows.last, [], vocab)[1]
        probs = rows.cache.address("probs")
        sampler.process(rows.last, 1, vocab, sampling, probs)
        return sampler.sample(probs, 1, vocab, [rng.random()])[0]

    def draw(self, rows: DeviceRows, sampling: Sampling, rng: np.random.Generator,
             q: list, need_q_x: bool) -> tuple[int, float]:
        sampler, vocab = rows.backend.sampler, rows.backend.spec.vocab_size
        if len(q) + 1 >= rows.cache.max_keep:  # the target verifies K + 1 <= max_keep rows
            raise ValueError(f"{len(q) + 1} draft tokens do not fit this backend's "
                             f"{rows.cache.max_keep - 1}: draft fewer tokens (or rebuild the "
                             "engines with a larger --max-draft-tokens)")
        slot = rows.cache.address("probs") + len(q) * vocab * 4
        if sampling.greedy:
            x = sampler.verify_greedy(rows.last, [], vocab)[1]
            if need_q_x:
                sampler.process(rows.last, 1, vocab, _UNIT_TEMPERATURE, slot)
        else:
            sampler.process(rows.last, 1, vocab, sampling, slot)
            x = sampler.sample(slot, 1, vocab, [rng.random()])[0]
            q.append(slot)
        if not need_q_x:
            return x, 1.0
        q_x = np.zeros(1, np.float32)
        rows.backend.memory.download(slot + 4 * x, q_x)
        return x, float(q_x[0])

    def q(self, q: list) -> int | None:
        return q[0] if q else None  # the rows are consecutive in the draft's probs region

    def verify(self, rows: DeviceRows, drafts: list[int], q: int | None, sampling: Sampling,
               rng: np.random.Generator) -> tuple[int, int]:
        sampler, vocab = rows.backend.sampler, rows.backend.spec.vocab_size
        if sampling.greedy:
            return sampler.verify_greedy(rows.address, drafts, vocab)
        probs = rows.cache.address("probs")
        sampler.process(rows.address, len(drafts) + 1, vocab, sampling, probs)
        return sampler.verify_sampled(probs, q, drafts, vocab, rng)


def selector_for(backend) -> HostSelector | DeviceSelector:
    """Tokens chosen on the device when the backend has a sampler, else on the host."""
    return DeviceSelector() if getattr(backend, "sampler", None) is not None else HostSelector()
