"""Several generations at once on one bundle: each sequence runs the loop of a single
generation (loop.py, with its own drafter, K, sampling, seed, stop strings, cancel event
and statistics) on a thread of its own, and their model calls meet in one call on
several rows.

    sequence 1:  ... target([t, d1, d2]) ...  draft([d2]) ...
    sequence 2:  ... target([u]) .........    draft([u]) ...
                        \\  one call, rows padded to T = 3  /   one call, T = 1

A `BatchSession` holds one SlotCaches per model (kv_cache.py), max_batch slots each, so
that a call on several rows binds one block of memory per cache plane. A sequence takes a
free slot when it starts (`run`) and gives it back when it ends, so sequences join and
leave between steps (continuous batching). A slot keeps the rows of its last sequence
(prompt and answer) after it ends: the next sequence takes the free slot whose rows share
the longest prefix with its prompt and prefills only the rest (on a batched graph, where
that computes what one call does, as prompt chunks do), so that a chat template's system
prompt, or a conversation's earlier turns, are computed once. A sequence's thread blocks
in its model's `forward` until every running sequence waits on a call; the last one to
arrive runs each model's waiting calls (`_Meeting`): the short ones as one call, a prompt's
call (one logit kept, more than two tokens) on its own row, so that it does not pad the
others. While sequences stream (their first token is out), a prompt on a batched graph comes
in chunks of at most PREFILL_CHUNK tokens (a draft's: as many times more as it has fewer
layers), one prompt call a meeting, so that the streams' steps do not wait for all of it.
Prompts read at the same time start their streams together (TOGETHER_TOKENS): with nobody
streaming they run whole, in one meeting, and a first token is held until the companions
that came before it have read theirs, so that no stream's gap holds a companion's prompt.
The threads only take turns: Python runs one at a time, ONNX Runtime's own thread pool runs
the call.

Exact per sequence: a row of a call is computed as in a call of that row alone with the
same T (rows share no reductions; tests/runtime/test_batch.py checks it bit for bit), so
greedy output equals the sequence's plain decoding alone wherever the single-sequence
loop's does across T (fp32; docs/design.md, "Batch invariance of quantized graphs"), and
sampled output follows the target's distribution, each sequence drawing from its own
seeded generator. Graphs on GroupQueryAttention cannot take several rows of several
tokens (runtime/bundle.py): batching needs a bundle exported with --attention batched
(in place, and a row computed alike in every call of two tokens or more, so that int8 and
int4 stay exact too) or portable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Generator as PieceGenerator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from specedge.runtime.backends import Backend
from specedge.runtime.backends.ort_cpu import check_batch_rows
from specedge.runtime.bundle import KV_LAYOUT_IN_PLACE
from specedge.runtime.config import GenerationConfig
from specedge.runtime.drafting import FeatureDrafter, ModelDrafter
from specedge.runtime.drafting.batch_costs import BatchCosts, BatchHistories
from specedge.runtime.generator import GenerationResult, Generator, RowModels, context_limit
from specedge.runtime.kv_cache import MAX_BATCHED_TOKENS, capacity_for
from specedge.runtime.pieces import Piece
from specedge.runtime.prefix_store import PrefixStore, shared_prefix

if TYPE_CHECKING:
    from specedge.runtime.backends.device_slots import DeviceSlotCaches
    from specedge.runtime.kv_cache import SlotCaches

# While others stream, a prompt runs in chunks of this many tokens, one a meeting, so that
# their steps wait for a chunk, not the whole prompt (measured against 12 and 16:
# docs/MEASUREMENTS.md, "Prompt chunks of 8 tokens").
PREFILL_CHUNK = 8
# Prompts of at most this many tokens read at the same time start their streams together,
# each read in one call while nobody streams (docs/MEASUREMENTS.md, "Streams that start
# together"); a longer one is read in chunks, and nobody waits for it.
TOGETHER_TOKENS = 256
# The slots' capacity is cut once this many of its steps (`caches.step`: GROWTH_STEP rows
# on the host, CAPACITY_STEP on a device) are unused: a long generation's rows, kept, would
# slow every later call (kv_cache.py); cut at once, a capacity on the edge would be copied
# back and forth.
SHRINK_SLACK = 2
# Host memory for the rows of sequences that ended (prefix_store.py): ~5,000 tokens of
# SmolLM2-135M and its draft.
PREFIX_STORE_BYTES = 256 * 2**20


class BatchFull(Exception):
    """Every slot of the session holds a running sequence."""


@dataclass
class _Call:
    model: _Model
    slot: int
    tokens: list[int]
    keep: int
    alone: bool = False  # a prompt's chunk: on a row of its own, not padding the others
    chunk: bool = False  # a prompt's chunk before its last: no token follows it
    # A prompt's last call, run, its logits held until `companions` (slots) have read
    # theirs (`_Meeting._hold_first_tokens`).
    read: np.ndarray | None = None
    companions: frozenset[int] = frozenset()
    # A feature draft's input [len(tokens), H]; whether a target with feature output
    # computes it for this call; the call's feature output [len(tokens), H], a copy.
    features: np.ndarray | None = None
    keep_features: bool = False
    features_out: np.ndarray | None = None
    logits: np.ndarray | None = None
    error: BaseException | None = None


@dataclass
class _Model:
    """One model of the session: its backend and the slots of its caches."""

    backend: Backend  # with forward_slots, new_slot_caches and forget_bindings
    caches: SlotCaches | DeviceSlotCaches
    max_context: int
    # Free slots that keep rows: the tokens of the sequence that left them, of which the
    # slot's rows [0, length) are the first `length` (BatchSession.run).
    kept: dict[int, list[int]] = field(default_factory=dict)
    # Tokens of a prompt chunk: PREFILL_CHUNK for the target; for a draft as many more as
    # the target has layers per draft layer, so that its chunks take about as long as the
    # target's (a prompt's cost per token goes with the layers): a 2-layer draft of a
    # 30-layer target takes a chat prompt in one call, not in chunks that each hold the
    # others' steps back for a meeting (the target's calls wait while a draft call does).
    chunk_tokens: int = PREFILL_CHUNK

    @property
    def chunked(self) -> bool:
        """Its prompts may run in chunks (`prefill_chunks`): where that computes what one
        call does (a batched graph)."""
        return self.backend.spec.attention == "batched"


@dataclass
class _Meeting:
    """Where the running sequences' model calls meet."""

    running: int = 0
    waiting: list[_Call] = field(default_factory=list)
    on_call: Callable[[int], None] | None = None
    target: _Model | None = None
    costs: BatchCosts | None = None  # told each batched call's rows, tokens and seconds
    done: threading.Condition = field(default_factory=threading.Condition)
    # The sequences whose first token is not out yet, slot: prompt tokens still to read
    # (at most), from the moment they take a slot (before they join, which waits for a
    # meeting under way) until their prompt's last call has run. `arrivals` guards it, so
    # that a sequence is counted while a meeting runs.
    reading: dict[int, int] = field(default_factory=dict)
    arrivals: threading.Lock = field(default_factory=threading.Lock)
    # Slots of the sequences whose first token is out: those a prompt's reading holds up.
    streaming: set[int] = field(default_factory=set)
    # The thread that last advanced each running sequence, by slot: a call that waits for a
    # companion its own thread advances would wait for ever (`call`).
    threads: dict[int, int] = field(default_factory=dict)

    def join(self, slot: int, tokens: int) -> None:
        with self.arrivals:
            self.reading[slot] = tokens
        with self.done:
            self.running += 1
            self.threads[slot] = threading.get_ident()

    def leave(self, slot: int) -> None:
        with self.done:
            self.running -= 1
            self.threads.pop(slot, None)
            self.streaming.discard(slot)
            with self.arrivals:
                self.reading.pop(slot, None)
            self._run_when_all_wait()

    def read(self, slot: int, tokens: int) -> None:
        """Tell the tokens a sequence's prompt reads (those its slot does not keep)."""
        with self.arrivals:
            if slot in self.reading:
                self.reading[slot] = tokens

    def call(self, call: _Call) -> np.ndarray:
        with self.done:
            me = threading.get_ident()
            self.threads[call.slot] = me
            waiting = {c.slot for c in self.waiting}
            if any(thread == me and slot != call.slot and slot not in waiting
                   for slot, thread in self.threads.items()):
                raise RuntimeError(
                    "two sequences of one BatchSession are advanced on the same thread, so "
                    "each waits for the other's model call: run each BatchSession.run on a "
                    "thread of its own (BatchGenerator does), or one after the other")
            self.waiting.append(call)
            self._run_when_all_wait()
            while call.logits is None and call.error is None:
                self.done.wait()
        if call.error is not None:
            raise call.error
        return call.logits

    def _run_when_all_wait(self) -> None:
        if self._deliver():
            self.done.notify_all()
        calls = [c for c in self.waiting if c.read is None]
        if not calls or len(self.waiting) < self.running:
            return
        # The target's calls wait while any draft call does: the sequences that draft run
        # their draft steps, and every sequence's verification then meets in one target
        # call. Run as they come, the sequences' phases drift apart and split the target's
        # calls (SmolLM2 int4, 4 sequences, K = 2: target calls of 1 and 3 rows).
        if any(c.model is not self.target for c in calls):
            calls = [c for c in calls if c.model is not self.target]
        # While sequences stream, one prompt call (a chunk, as a rule) a model a meeting,
        # the earliest waiting: their steps wait for one chunk, not for every prompt that
        # arrived at once. With none streaming, every prompt runs: nobody waits for them.
        if self.streaming:
            first: dict[int, _Call] = {}
            for c in calls:
                if _prompt(c):
                    first.setdefault(id(c.model), c)
            calls = [c for c in calls if not _prompt(c) or first[id(c.model)] is c]
        running = {id(c) for c in calls}
        self.waiting = [c for c in self.waiting if id(c) not in running]
        for model in {id(c.model): c.model for c in calls}.values():
            group = [c for c in calls if c.model is model]
            try:
                observe = None if self.costs is None else partial(
                    self.costs.observe, model is self.target)
                rows = _run_group(model, group, observe)
                if model is self.target and self.on_call and rows:
                    self.on_call(rows)
                if model is self.target:
                    self._hold_first_tokens(group)
            except BaseException as e:  # the calls it leaves unanswered learn of it
                for c in group:
                    if c.logits is None and c.error is None:
                        c.read, c.error = None, e
                self.waiting = [c for c in self.waiting if c.error is None]
        try:
            self._deliver()
        finally:
            self.done.notify_all()

    def _hold_first_tokens(self, group: list[_Call]) -> None:
        """Count the prompt tokens the target's `group` read, and hold back the first
        tokens of the prompts it ended while companions (sequences that took a slot before)
        still read theirs, if those have at most TOGETHER_TOKENS tokens left: their streams
        then start together, and no gap between two of a stream's tokens holds a
        companion's prompt. Sequences that take a slot later do not hold them."""
        with self.arrivals:
            for c in group:
                if c.slot in self.reading:
                    self.reading[c.slot] = max(self.reading[c.slot] - len(c.tokens), 0)
            ends = [c for c in group if not c.chunk and c.logits is not None
                    and self.reading.pop(c.slot, None) is not None]
            companions = frozenset(s for s, left in self.reading.items()
                                   if left <= TOGETHER_TOKENS)
        for c in ends:  # a copy: the logits are a view that the next call overwrites
            c.read, c.logits, c.companions = c.logits.copy(), None, companions
            self.waiting.append(c)

    def _deliver(self) -> bool:
        """Hand out the held first tokens whose companions have all read their prompts (or
        left); whether any was."""
        with self.arrivals:
            reading = frozenset(self.reading)
        ready = [c for c in self.waiting if c.read is not None and not c.companions & reading]
        for c in ready:
            c.logits, c.read = c.read, None
            self.streaming.add(c.slot)
        handed = {id(c) for c in ready}
        self.waiting = [c for c in self.waiting if id(c) not in handed]
        return bool(ready)


def _prompt(call: _Call) -> bool:
    """Whether a call is a prompt or a chunk of one."""
    return call.alone or len(call.tokens) > MAX_BATCHED_TOKENS


def _alone(model: _Model, call: _Call) -> bool:
    """Whether a call runs on its own row: a prompt or a chunk of one, or, on an in-place
    target, a one-token
    step at the context's last position, which `OrtCpuBackend.forward` runs as one row
    (there is no position for a second), as a single generation's step there is run."""
    if _prompt(call):
        return True
    length = model.caches.slots[call.slot].length
    return (len(call.tokens) == 1 and model.backend.one_token_as_two
            and model.caches.spare > 0 and length + 2 > model.max_context)


def _run_group(model: _Model, group: list[_Call],
               observe: Callable[[int, int, float], None] | None = None) -> int:
    """One model's waiting calls: the short ones in one call, prompts one by one; the
    slots' capacity first raised where a call needs more rows, or cut where the sequences
    that needed it have left (the graph attends over all of it). Returns the rows of the
    batched call (0: none); `observe(rows, tokens, seconds)` is told its shape and time.
    A call that cannot run (past the context) gets its error alone, as does a prompt's call
    that fails; the others run. A batched call that fails fails its rows."""
    caches, backend = model.caches, model.backend
    for c in group:
        if caches.slots[c.slot].length + len(c.tokens) > model.max_context:
            c.error = ValueError(f"{caches.slots[c.slot].length + len(c.tokens)} tokens do "
                                 f"not fit the model's context of {model.max_context}")
    group = [c for c in group if c.error is None]
    if not group:
        return 0
    held = max((slot.length for i, slot in enumerate(caches.slots) if i not in model.kept),
               default=0)
    need = max(caches.slots[c.slot].length + len(c.tokens) for c in group)
    fit = capacity_for(max(held, need), model.max_context, caches.step)
    if fit > caches.capacity or fit + SHRINK_SLACK * caches.step <= caches.capacity:
        for i in model.kept:  # a free slot's kept rows do not hold the capacity up
            caches.slots[i].rollback(min(caches.slots[i].length, fit))
        caches.resize(fit)
        backend.forget_bindings()
    short = {c.slot: c for c in group if not _alone(model, c)}
    keeps = backend.spec.keeps_features  # a target with feature output
    for c in group:
        if c.slot not in short:
            if keeps:
                backend.keep_features = c.keep_features
            # A copy: a backend's logits (and features) are views that its next call
            # overwrites.
            try:
                # (only a feature draft takes features: the device backends take none)
                extra = (c.features,) if backend.spec.reads_features else ()
                logits = backend.forward(caches.slots[c.slot], c.tokens, c.keep, *extra)
                features = getattr(backend, "features", None)
                c.features_out = None if features is None else features.copy()
                c.logits = logits.copy()
            except Exception as e:  # this sequence's alone
                c.error = e
    if short:
        start = time.perf_counter()
        tokens = {s: c.tokens for s, c in short.items()}
        if keeps:  # computed for every row of the call if one of them reads them
            backend.keep_features = any(c.keep_features for c in short.values())
        if backend.spec.reads_features:
            rows = backend.forward_slots(caches, min(short), tokens,
                                         {s: c.features for s, c in short.items()})
        else:
            rows = backend.forward_slots(caches, min(short), tokens)
        if observe is not None:
            observe(len(short), max(len(c.tokens) for c in short.values()),
                    time.perf_counter() - start)
        features = getattr(backend, "slot_features", None) if backend.spec.features else None
        for s, c in short.items():
            c.logits = rows[s][len(c.tokens) - c.keep:]
            c.features_out = None if features is None else features[s].copy()
    return len(short)


class RowBackend:
    """One sequence's view of a model shared by the session: `forward` on its slot, run
    when the sequences' calls meet (`_Meeting`)."""

    grows_cache = False  # the meeting grows every slot at once (`_run_group`)

    def __init__(self, model: _Model, slot: int, meeting: _Meeting, reuse: int = 0):
        """`reuse`: rows of the slot that hold the first tokens of this sequence's prompt
        (BatchSession.run), counted again at its prompt's call."""
        self.model, self.slot, self.meeting = model, slot, meeting
        self.name, self.spec = model.backend.name, model.backend.spec
        self.reuse = reuse
        self.called = False  # whether this sequence ran the model: the slot's rows are its
        # A target with feature output: whether this sequence's calls compute them (its
        # drafter reads them), and the last call's [T, H], as a backend's `features`.
        self.keep_features = False
        self.features: np.ndarray | None = None

    @property
    def run_seconds(self) -> float:
        return self.model.backend.run_seconds

    def new_cache(self, capacity: int):
        return self.model.caches.slots[self.slot]

    def forward(self, cache, token_ids, logits_to_keep: int = 1,
                features: np.ndarray | None = None) -> np.ndarray:
        if cache is not self.model.caches.slots[self.slot]:
            raise ValueError("a batched sequence runs on its own cache slot only")
        tokens, meeting = list(token_ids), self.meeting
        skipped = 0
        if not self.called:
            if self.reuse and cache.length == 0:
                # The prompt's call, its first rows kept in the slot: only the rest runs.
                cache.reclaim(self.reuse)
                tokens, skipped = tokens[self.reuse:], self.reuse
                features = None if features is None else features[self.reuse:]
            if self.model is meeting.target:
                meeting.read(self.slot, len(tokens))
        self.called = True
        # A prompt (one logit kept) runs in chunks while others stream, or, long, while
        # others read theirs (which then start without it); alone, or with others that
        # read theirs, in one call. A step is never chunked: it asks nothing of the meeting.
        chunked = False
        if self.model.chunked and logits_to_keep == 1 and len(tokens) > self.model.chunk_tokens:
            with meeting.done:  # `streaming` changes when a held first token is handed out
                chunked = bool(meeting.streaming - {self.slot} or (
                    meeting.running > 1 and len(tokens) > TOGETHER_TOKENS))
        chunks = prefill_chunks(len(tokens), logits_to_keep, chunked, self.model.chunk_tokens)
        calls, at = [], 0
        for i, chunk in enumerate(chunks):
            # A prompt's call (one logit kept, after a slot's kept rows often a few tokens)
            # runs on a row of its own: in the others' call, it would pad them all to its T.
            last = i == len(chunks) - 1
            alone = len(chunks) > 1 or (logits_to_keep == 1 and chunk > 2)
            calls.append(_Call(self.model, self.slot, tokens[at:at + chunk],
                               logits_to_keep if last else 1, alone, chunk=not last,
                               features=None if features is None else features[at:at + chunk],
                               keep_features=self.keep_features))
            logits = self.meeting.call(calls[-1])
            at += chunk
        # The features of every position the call covers, as the loop reads a backend's
        # (from the cache's length before the call): the rows it reclaimed were computed by
        # an earlier sequence, their features not kept (zeros), and the feature drafter,
        # whose own kept rows reach as far (BatchSession.run), never reads them.
        out = [c.features_out for c in calls]
        if any(f is None for f in out):
            self.features = None
        elif len(out) == 1 and not skipped:  # a step: its call's own copy, no second one
            self.features = out[0]
        else:
            self.features = np.concatenate(
                [np.zeros((skipped, out[0].shape[1]), np.float32), *out])
        return logits


def prefill_chunks(n: int, logits_to_keep: int, chunked: bool,
                   size: int = PREFILL_CHUNK) -> list[int]:
    """The sizes of the calls that run n tokens of which the last keeps its logits (a
    prompt): `size` each, the last one from 2 to `size` tokens (a batched graph computes a
    row alike in every call of two tokens or more, and a one-token call would take another
    path: with size 8, n = 17 runs as 8, 7 and 2), so that no meeting waits for more than
    one chunk; or [n] when not `chunked`, short, or keeping more logits (a verification)."""
    if not chunked or n <= size or logits_to_keep > 1:
        return [n]
    sizes = [size] * (n // size)
    rest = n % size
    if rest == 1:
        sizes[-1] -= 1
        rest = 2
    return sizes + [rest] * (rest > 0)


class BatchSession:
    """Up to `max_batch` generations at once on a Generator's models (module docstring):
    `run` is one of them, on the caller's thread. The session uses the generator's models
    while it exists: single generations on the same Generator must not run meanwhile."""

    def __init__(self, generator: Generator, max_batch: int = 4,
                 on_call: Callable[[int], None] | None = None,
                 store_bytes: int = PREFIX_STORE_BYTES):
        """`on_call(rows)`: told the rows of each batched call of the target; `store_bytes`:
        the host memory for rows of earlier sequences (prefix_store.py; 0: none)."""
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.models: list[_Model] = []
        for backend in (generator.target, generator.draft):
            if backend is None:
                continue
            if not hasattr(backend, "forward_slots"):
                raise ValueError(f"backend {backend.name!r} runs one sequence a call: "
                                 "batched decoding needs ort-cpu or a device backend")
            check_batch_rows(backend.spec)
            s = backend.spec
            # An in-place graph writes every row of a call, a short row's padding and the
            # rows of a slot in the call's range that has no call too, past the slot's
            # counted rows: spare rows past the capacity take them, even at a full context.
            spare = MAX_BATCHED_TOKENS if s.kv_layout == KV_LAYOUT_IN_PLACE else 0
            layers = generator.target.spec.num_layers / s.num_layers
            self.models.append(_Model(backend, backend.new_slot_caches(max_batch, spare),
                                      s.max_context,
                                      chunk_tokens=PREFILL_CHUNK * max(1, round(layers))))
        self.generator, self.max_batch = generator, max_batch
        self.feature_draft = generator.draft is not None and generator.draft.spec.reads_features
        # Auto K in the session prices a K with the batch's call costs at its current size
        # (drafting/batch_costs.py), apart from single generations' measurements.
        self.costs = BatchCosts()
        self.histories = BatchHistories(self.costs, lambda: max(self.running, 1))
        self.meeting = _Meeting(on_call=on_call, target=self.models[0], costs=self.costs)
        self._free = list(range(max_batch))
        self._lock = threading.Lock()
        self.store = PrefixStore(store_bytes)
        # Sequences that start together fill their slots one at a time (the store, and a
        # resize of the caches, are shared).
        self._filling = threading.Lock()

    @property
    def running(self) -> int:
        return self.max_batch - len(self._free)

    def run(self, prompt_ids: list[int], config: GenerationConfig,
            cancel: threading.Event | None = None
            ) -> PieceGenerator[Piece, None, GenerationResult]:
        """One generation's pieces, as `Generator.stream_pieces` yields them, with the others
        running; returns its GenerationResult (StopIteration.value). BatchFull when every
        slot is taken."""
        prompt = list(prompt_ids)
        target = self.models[0]
        if config.draft_tokens is None and config.use_draft and not config.sampling.greedy:
            # Sampled, K left to the default: auto, priced for the whole batch
            # (drafting/batch_costs.py), not the fixed K = 1 of a sampled generation alone,
            # whose two-token rows would pad every row of every call; a seed fixes a batch's
            # sampled text no more than auto's (docs/design.md, "Batched decoding").
            config = GenerationConfig.of(config, draft_tokens="auto")
        with self._lock:
            if not self._free:
                raise BatchFull(f"all {self.max_batch} sequences of the batch are running")
            # The slot that keeps the longest start of this prompt; else the one that keeps
            # the fewest rows, the lowest of those, so that calls span fewer idle slots.
            slot = max(self._free, key=lambda s: (shared_prefix(prompt, target.kept.get(s, [])),
                                                  -target.caches.slots[s].length, -s))
            self._free.remove(slot)
        self.meeting.join(slot, len(prompt))
        rows: list[RowBackend] = []
        drafter: ModelDrafter | None = None
        held: list[int] = []  # the tokens the slot's rows are the start of
        tokens = None  # the sequence's tokens once it ends: what its slot's rows hold
        try:
            with self._filling:
                held = self._fill(slot, prompt)
            # At least the prompt's last token runs: its logits choose the first token.
            reuse = min(shared_prefix(prompt, held), len(prompt) - 1)
            kept = [min(reuse, m.caches.slots[slot].length) if m.chunked else 0
                    for m in self.models]
            if self.feature_draft:
                # A feature draft's row r pairs the target's feature at r with token r + 1:
                # it keeps the rows of pairs inside the shared prefix, and a sequence that
                # drafts with it has the target recompute from where they end, for the
                # features of those positions.
                kept[1] = max(0, min(kept[1], reuse - 1))
                if config.use_draft and config.drafter != "prompt-lookup":
                    kept[0] = min(kept[0], kept[1])
            # The target reclaims its kept rows at its prompt's call, the sequence's first;
            # the draft keeps them counted from its start on, for its first call may come
            # many steps later (ModelDrafter.start).
            rows = [RowBackend(m, slot, self.meeting, kept[0] if m is target else 0)
                    for m in self.models]
            if len(rows) > 1:
                drafter = (FeatureDrafter if self.feature_draft else ModelDrafter)(
                    rows[1], kept[1])
            row = RowModels(rows[0], drafter, rows[0].new_cache(0), self.histories)
            result = yield from self.generator._run(prompt, config, cancel, row)
            tokens = prompt + result.token_ids
            return result
        finally:
            # No call runs while this sequence, still counted as running, does not wait on
            # one. A free slot's rows past its length take the padding of later calls.
            for i, model in enumerate(self.models):
                cache = model.caches.slots[slot]
                if tokens is None or not model.chunked:
                    cache.rollback(0)
                    continue
                if i >= len(rows) or not rows[i].called:  # still the rows of `held`
                    # (a feature draft's row r reads token r + 1: one row fewer)
                    shared = shared_prefix(held, tokens) - (i == 1 and self.feature_draft)
                    cache.rollback(min(cache.length, max(shared, 0)))
                elif isinstance(drafter, FeatureDrafter) and i == 1:
                    # Only rows built on the target's features (a step cut short may
                    # leave rows of predicted ones).
                    cache.rollback(min(cache.length, drafter.exact_rows))
                cache.rollback(min(cache.length, len(tokens)))
                model.kept[slot] = tokens
            self.meeting.leave(slot)
            if tokens is not None:
                self._store(slot)
            with self._lock:
                self._free.append(slot)
                self._free.sort()

    def _store(self, slot: int) -> None:
        """Copy the rows `slot` keeps into the store (prefix_store.py), the sequence that
        computed them having left and the slot not yet free: the others' calls go on
        meanwhile (up to 16 ms for a few hundred rows of SmolLM2 and its draft, which every
        running sequence would wait for if the copy were made once a new prompt has joined
        and taken the slot). No call writes those rows (a call's padding on a free slot
        goes past them) and a resize keeps them: the planes are read before the length,
        and a cut lowers the length before it replaces the planes, so the rows read are
        rows of the tokens."""
        chunked = [m.chunked for m in self.models]
        if not any(chunked) or not self.store.budget:
            return
        views = []
        for model, on in zip(self.models, chunked):
            planes = model.caches.planes
            views.append(planes[:, slot, :, :model.caches.slots[slot].length] if on else None)
        tokens = self.models[0].kept.get(slot, [])[:max(v.shape[2] for v in views
                                                        if v is not None)]
        nbytes = sum(v.nbytes for v in views if v is not None)
        with self._filling:
            if not self.store.wants(tokens, nbytes):
                return
        rows = [None if v is None else v.copy() for v in views]
        with self._filling:
            self.store.add(tokens, rows, copy=False)

    def _fill(self, slot: int, prompt: list[int]) -> list[int]:
        """Make `slot`'s rows hold as much of the start of `prompt` as they or the store
        have (the store's rows copied in), after storing the rows the prompt will overwrite
        (already stored when their sequence left, as a rule: `_store`); returns the tokens
        that each model's rows [0, length) of the slot are the start of. Runs while no call
        does (the sequence has joined and waits on none)."""
        kept = self.models[0].kept.pop(slot, [])  # every model's rows start the same list
        for model in self.models[1:]:
            model.kept.pop(slot, None)
        chunked = [m.chunked for m in self.models]
        slots = [m.caches.slots[slot] for m in self.models]
        if not any(chunked):
            return kept
        length = max(c.length for c, on in zip(slots, chunked) if on)
        n, entry = self.store.exchange(kept[:length], [
            m.caches.planes[:, slot, :, :c.length] if on else None
            for m, c, on in zip(self.models, slots, chunked)], prompt)
        if entry is None:
            return kept
        for model, cache, stored in zip(self.models, slots, entry.rows):
            if stored is None or not model.chunked:
                cache.rollback(min(cache.length, shared_prefix(kept, entry.tokens)))
                continue
            k = min(stored.shape[2], n)
            if k > model.caches.capacity:
                model.caches.resize(capacity_for(k, model.max_context, model.caches.step))
                model.backend.forget_bindings()
            model.caches.planes[:, slot, :, :k] = stored[:, :, :k]
            cache.reclaim(k)
        return list(entry.tokens)


@dataclass(frozen=True)
class BatchRequest:
    """One sequence of a batch: a prompt as `Generator.generate` takes it (exactly one of
    prompt, prompt_ids, messages) and its settings."""

    prompt: str | None = None
    prompt_ids: Sequence[int] | None = None
    messages: Sequence[dict[str, str]] | None = None
    raw: bool = False
    config: GenerationConfig = field(default_factory=GenerationConfig)


class BatchGenerator:
    """Generations of several prompts at once (a BatchSession over the call):
    `generate(requests)` returns each request's GenerationResult, in order, as
    `Generator.generate` returns it alone: the same tokens when greedy (where the module
    docstring says), the same distribution when sampled. It holds the Generator while it
    runs, so single generations wait for it, and it for them."""

    def __init__(self, generator: Generator, max_batch: int = 4):
        self.session = BatchSession(generator, max_batch)
        self.generator = generator

    def generate(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        gen, session = self.generator, self.session
        if len(requests) > session.max_batch:
            raise ValueError(f"{len(requests)} requests exceed max_batch={session.max_batch}")
        prompts = [gen.encode_prompt(r.prompt, r.prompt_ids, r.messages, r.raw)
                   for r in requests]
        for ids, r in zip(prompts, requests):
            limit = context_limit(gen.bundle, r.config)
            if len(ids) + r.config.max_new_tokens > limit:
                raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                                 f"({r.config.max_new_tokens}) exceeds the bundle's context "
                                 f"of {limit} tokens")
        results: list[GenerationResult | BaseException | None] = [None] * len(requests)

        def run(i: int) -> None:
            pieces = session.run(prompts[i], requests[i].config)
            try:
                while True:
                    next(pieces)
            except StopIteration as done:
                results[i] = done.value
            except BaseException as e:  # raised on the caller's thread below
                results[i] = e

        with gen._lock:
            threads = [threading.Thread(target=run, args=(i,), name=f"specedge-batch-{i}")
                       for i in range(len(requests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results
