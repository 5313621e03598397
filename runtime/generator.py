"""`Generator`, the public API: load a bundle, turn a prompt into token ids, run the loop
(loop.py) and turn its tokens into text, honouring eos and stop strings."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Generator as PieceGenerator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specedge.runtime import cpu_load
from specedge.runtime.backends import CPU_THREAD_BACKENDS, load_backend
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import Bundle, load_bundle
from specedge.runtime.config import DEFAULT_SPINNING, GenerationConfig, check_spinning
from specedge.runtime.drafting import (
    Drafter,
    FeatureDrafter,
    ModelDrafter,
    auto_k_file,
    make_drafter,
)
from specedge.runtime.drafting.auto_k import Histories
from specedge.runtime.kv_cache import GROWTH_STEP, capacity_for
from specedge.runtime.loop import GenerationState, Step, decode
from specedge.runtime.one_row import one_row_is_exact
from specedge.runtime.pieces import Piece, PieceMaker
from specedge.runtime.prefix_store import PrefixStore, shared_prefix
from specedge.runtime.stats import StepClock, summarize
from specedge.runtime.text import TextCodec


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: dict
    stop_reason: str  # "eos", "stop_string", "max_new_tokens" or "cancelled"


def context_limit(bundle, config: GenerationConfig) -> int:
    """Largest prompt + max_new_tokens for a generation with `config` on `bundle`: the
    target's context, and the draft's if that generation runs the draft model (a drafter
    other than prompt lookup); ValueError when it needs a draft model the bundle lacks.
    A function of the bundle alone, so a server's front end checks requests without
    opening the models."""
    limits = [bundle.target.max_context]
    if config.use_draft and config.drafter != "prompt-lookup":
        if bundle.draft is None:
            make_drafter(config.drafter, None)  # raises the message that says what to do
        limits.append(bundle.draft.max_context)
    return min(limits)


@dataclass
class RowModels:
    """What one sequence of several decoded together runs on (runtime/batch.py): the
    target and the draft drafter on backends whose calls meet those of the other
    sequences, its cache slot, and auto K's measurements of the batch."""

    target: object
    model_drafter: Drafter | None
    cache: object
    histories: Histories


@dataclass
class _AutoSpinning:
    """Spinning "auto": the meter of the others' CPU use, and how to open the models with a
    given spinning (`Generator._follow_load`)."""

    meter: cpu_load.LoadMeter
    open_models: Callable[[bool], tuple]
    wanted: bool | None = None  # what the latest reading calls for
    # Generations not yet judged: their seconds, and the others' core-seconds meanwhile.
    seconds: float = 0.0
    others: float = 0.0


@dataclass
class _Outcome:
    """Every token a generation produced (the end-of-sequence token included) and why it
    ended, as `_until_eos_or_cancel` finds them."""

    tokens: list[int] = field(default_factory=list)
    reason: str = "max_new_tokens"


def _until_eos_or_cancel(steps: Iterator[Step], eos: set[int],
                         cancel: threading.Event | None, outcome: _Outcome) -> Iterator[Step]:
    """The loop's steps, the last one's tokens cut before the first end-of-sequence token,
    or ended after the step during which `cancel` was set."""
    for step in steps:
        for i, token in enumerate(step.new):
            if token in eos:
                outcome.tokens.extend(step.new[:i + 1])
                outcome.reason = "eos"
                yield replace(step, new=step.new[:i])
                return
        outcome.tokens.extend(step.new)
        yield step
        if cancel is not None and cancel.is_set():
            outcome.reason = "cancelled"
            return


class Generator:
    """A bundle opened on a backend: `generate` and `stream` run exact speculative decoding
    with its draft (or prompt lookup, or none).

    One generation runs at a time: the KV caches and auto K's measurements are the
    generator's own. Calls from several threads are serialized: a second `generate`, or the
    first step of a second `stream`, waits until the running generation ends (a stream ends
    when it is exhausted or closed). A second generation started on the thread whose stream
    is still open would wait for itself, so it raises RuntimeError instead.
    """

    def __init__(self, bundle, target, draft, codec: TextCodec, threads: int | None = None):
        self.bundle = bundle
        self.codec = codec
        self.last_result: GenerationResult | None = None
        self._use_models(target, draft)
        # Whether the CPU threads spin now, and with spinning "auto", the load they follow
        # and how to reopen the models the other way (`_follow_load`).
        self.spinning: bool | None = None
        self._auto_spinning: _AutoSpinning | None = None
        # What recent steps cost and accepted, for `auto`, kept across generations, starting
        # from what earlier runs stored in the bundle (drafting/auto_k_file.py).
        self._histories = Histories()
        self.machine = auto_k_file.machine_of(target, threads)
        record = auto_k_file.read(bundle.root)
        self.stored_costs = record is not None and auto_k_file.seed(self._histories, record,
                                                               self.machine)
        self._lock = threading.Lock()  # held by the running generation
        self._owner: int | None = None  # the thread that holds it
        # On a batched graph, the target's rows of earlier prompts that the next generation
        # would overwrite (prefix_store.py): 0 bytes, none, until the owner gives it a budget
        # (`specedge serve --prompt-cache-mb`), so that conversations taking turns each
        # compute only what is new to them.
        self.prompt_store = PrefixStore(0)

    def _use_models(self, target, draft) -> None:
        """Run on these backends from the next generation on (caches and drafts anew)."""
        self.target = target
        self.draft = draft
        self._cache = None  # the target's KV cache, reused by the next generation
        self._cache_tokens: list[int] = []  # the tokens its rows [0, length) start
        self._model_drafter = None
        if draft is not None:
            feature_draft = self.bundle.draft.reads_features
            self._model_drafter = (FeatureDrafter if feature_draft else ModelDrafter)(draft)

    @classmethod
    def from_bundle(cls, path: str | Path | Bundle, backend: str = "ort-cpu",
                    threads: int | None = None,
                    spinning: bool | str = DEFAULT_SPINNING) -> Generator:
        """Load and validate a bundle folder (or take one `load_bundle` read already) and
        open its graphs on `backend`, each with `threads` ONNX Runtime CPU threads (None:
        one per core) that spin while they wait for work when `spinning` (ONNX Runtime's
        `session.intra_op.allow_spinning`; docs/design.md#threads). "auto" (the default)
        spins while other processes leave this process's CPUs idle (runtime/cpu_load.py):
        measured for 0.2 s before the graphs open (while the tokenizer loads), then over
        each generation and each pause between two; when that changes, the graphs are
        opened again the other way before the next generation (about 0.5 s for a
        135M-parameter model on 2 cores)."""
        check_spinning(spinning)
        bundle = path if isinstance(path, Bundle) else load_bundle(path)
        meter = None
        if spinning == "auto" and backend in CPU_THREAD_BACKENDS:
            meter = cpu_load.LoadMeter()
        # The tokenizer loads (0.2-0.4 s) while the meter takes its first reading.
        codec = TextCodec(bundle)
        if spinning == "auto":
            spinning = meter is not None and cpu_load.first_choice(meter)

        def open_models(spin: bool):
            target = load_backend(backend, bundle, "target", threads, spin)
            if (isinstance(target, OrtCpuBackend) and target.one_token_as_two
                    and target.spec.attention == "batched"):
                # The two-row step only where this machine needs it (one_row.py).
                target.one_token_as_two = not one_row_is_exact(target, threads)
            draft = (load_backend(backend, bundle, "draft", threads, spin) if bundle.draft
                     else None)
            return target, draft

        gen = cls(bundle, *open_models(spinning), codec, threads)
        gen.spinning = spinning
        if meter is not None and meter.available:
            gen._auto_spinning = _AutoSpinning(meter, open_models)
        return gen

    def _follow_load(self, reopen: bool) -> None:
        """With spinning "auto": before a generation (`reopen`), reopen the graphs when the
        latest reading calls for the other setting, and start the meter's window; after
        one, read the others' use of the CPUs during it, and once generations of at least
        MIN_WINDOW_SECONDS are read, decide. The pauses between generations are not read:
        another process busy only while this one waits (a client, a job between requests)
        does not slow its generations, and judging by the pauses reopened the graphs twice
        (0.7 s each for SmolLM2-135M) at every change of turn. The old sessions go first,
        so that memory never holds both."""
        auto = self._auto_spinning
        if auto is None:
            return
        if not reopen:
            seconds, others = auto.meter.elapsed(), auto.meter.others()
            if others is None:
                auto.wanted = cpu_load.spin_now(None, bool(self.spinning))
                return
            auto.seconds += seconds
            auto.others += others * seconds
            if auto.seconds >= cpu_load.MIN_WINDOW_SECONDS:
                auto.wanted = cpu_load.spin_now(auto.others / auto.seconds, bool(self.spinning))
                auto.seconds = auto.others = 0.0
            return
        if auto.wanted is not None and auto.wanted != self.spinning:
            self._use_models(None, None)
            self._use_models(*auto.open_models(auto.wanted))
            self.spinning = auto.wanted
        auto.meter.others()  # the window starts now: not the pause, nor the reopening

    def context_limit(self, config: GenerationConfig) -> int:
        """Largest prompt + max_new_tokens for a generation with `config` (`context_limit`)."""
        return context_limit(self.bundle, config)

    # ---- public API -----------------------------------------------------------------------

    def generate(self, prompt: str | None = None, *,
                 prompt_ids: Sequence[int] | None = None,
                 messages: Sequence[dict[str, str]] | None = None, raw: bool = False,
                 config: GenerationConfig | None = None,
                 cancel: threading.Event | None = None, **settings) -> GenerationResult:
        """Generate a completion; the arguments are `stream`'s. Returns this call's own
        result, also when other threads generate at the same time."""
        ids = self.encode_prompt(prompt, prompt_ids, messages, raw)
        pieces = self._generation(ids, GenerationConfig.of(config, **settings), cancel)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | None = None, *,
               prompt_ids: Sequence[int] | None = None,
               messages: Sequence[dict[str, str]] | None = None, raw: bool = False,
               config: GenerationConfig | None = None,
               cancel: threading.Event | None = None, **settings) -> Iterator[str]:
        """Yield text pieces as tokens are accepted, one a speculative step (the tokens a
        step accepts arrive together); `self.last_result` then holds the result (the last
        generation's to finish, on any thread).

        Exactly one of `prompt` (chat-templated unless `raw` or the bundle has no template),
        `prompt_ids` or `messages`. The settings are a `GenerationConfig` (`config`), its
        fields as keyword arguments (max_new_tokens, temperature, top_k, top_p, seed,
        draft_tokens, use_draft, drafter, draft_threshold, stop), or both: the keywords
        replace the config's values. With a stop string, `token_ids` ends with the token
        that completes the text. `cancel`, a `threading.Event`, ends the generation after
        the step that is running when it is set (stop reason "cancelled"). Nothing is
        checked or run before the first piece is asked for.
        """
        for piece in self.stream_pieces(prompt, prompt_ids=prompt_ids, messages=messages,
                                        raw=raw, config=config, cancel=cancel, **settings):
            if piece.text:
                yield piece.text

    def stream_pieces(self, prompt: str | None = None, *,
                      prompt_ids: Sequence[int] | None = None,
                      messages: Sequence[dict[str, str]] | None = None, raw: bool = False,
                      config: GenerationConfig | None = None,
                      cancel: threading.Event | None = None, **settings
                      ) -> PieceGenerator[Piece, None, GenerationResult]:
        """`stream`, one `Piece` a speculative step: its text, the kind of each of its
        tokens (an accepted draft, or the target's own) and the steps it completes
        (runtime/pieces.py); returns the GenerationResult (StopIteration.value)."""
        ids = self.encode_prompt(prompt, prompt_ids, messages, raw)
        return (yield from self._generation(ids, GenerationConfig.of(config, **settings),
                                            cancel))

    def _generation(self, ids: list[int], config: GenerationConfig,
                    cancel: threading.Event | None
                    ) -> PieceGenerator[Piece, None, GenerationResult]:
        """One generation's pieces, once the generator is free; returns the result
        (StopIteration.value)."""
        if self._owner == threading.get_ident():
            raise RuntimeError("a generation is already running on this thread (a stream "
                               "not yet exhausted): finish or close() it before starting "
                               "another")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                self._follow_load(reopen=True)
                result = yield from self._run(ids, config, cancel)
                self._follow_load(reopen=False)
            finally:
                self._owner = None
            self.last_result = result
        return result

    def _run(self, ids: list[int], config: GenerationConfig,
             cancel: threading.Event | None, row: RowModels | None = None
             ) -> PieceGenerator[Piece, None, GenerationResult]:
        """One generation; the caller holds the lock. `row`: one sequence of several
        decoded together (runtime/batch.py), on the models and cache slot it gives, or
        None: on the generator's own."""
        limit = context_limit(self.bundle, config)
        if len(ids) + config.max_new_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                             f"({config.max_new_tokens}) exceeds the bundle's context of "
                             f"{limit} tokens; shorten the prompt or lower "
                             "max_new_tokens")
        if row is None:
            proposer = self._drafter(config)
            state = self._new_state(ids, config, proposer, limit)
            chunks = decode(state, ids, self._histories, self._model_seconds)
        else:
            proposer = (make_drafter(config.drafter, row.model_drafter) if config.use_draft
                        else None)
            row.cache.rollback(0)
            if row.target.spec.keeps_features:  # as `_new_state` sets them
                row.target.keep_features = bool(proposer and proposer.needs_features)
            state = GenerationState(row.target, row.cache, proposer, config,
                                    np.random.default_rng(config.seed), StepClock(),
                                    capacity_for(len(ids) + config.max_new_tokens, limit))
            chunks = decode(state, ids, row.histories, self._model_seconds)
        outcome = _Outcome()
        steps = _until_eos_or_cancel(chunks, set(self.bundle.eos_token_ids), cancel, outcome)
        maker, text_of = PieceMaker(config.stops), self.codec.decoder()
        for step in steps:
            piece = maker.add(step, [text_of(token) for token in step.new])
            if not piece.empty:
                yield piece
            if maker.stopped:
                outcome.reason = "stop_string"
                break
        if not (piece := maker.finish()).empty:
            yield piece
        chunks.close()
        if row is None:
            self._cache = state.cache  # it may have grown
            self._cache_tokens = ids + outcome.tokens  # before a stop string's cut
        text, tokens, reason = maker.holdback.text, outcome.tokens, outcome.reason
        if reason == "stop_string":
            # The last chunk may run past the stop string: keep the tokens the text needs.
            while tokens and len(self.codec.decode(tokens[:-1])) >= len(text):
                tokens.pop()
        clock = state.clock
        clock.finish()
        stats = summarize(clock, len(tokens), "auto" if config.auto else config.k_max,
                          proposer.name if proposer else "none", self.target.name, reason)
        stats["sampling_on"] = state.selector.where
        stats["threads_spinning"] = self.spinning
        return GenerationResult(text, tokens, stats, reason)

    def _new_state(self, prompt: list[int], config: GenerationConfig,
                   drafter: Drafter | None, context: int) -> GenerationState:
        """The state of one generation (`context`: its context_limit), with the target's
        cache ready for the prompt."""
        limit = capacity_for(len(prompt) + config.max_new_tokens, context)
        # A portable or batched graph attends over the whole capacity: its host cache starts
        # with room for the prompt and grows between steps (kv_cache.py); other caches are
        # sized once.
        capacity = (capacity_for(len(prompt), limit, GROWTH_STEP) if self.target.grows_cache
                    else limit)
        # On a batched graph, which computes a row alike in every call, the rows of the
        # last generation that start this prompt stay and its prefill runs the rest (a chat's
        # system prompt and earlier turns); at least the last token runs, for its logits.
        # Rows the prompt would overwrite go to the prompt store first, and the store's
        # rows that start the prompt, past those the cache holds, are copied in.
        reuse, stored = 0, 0
        if self.target.spec.attention == "batched":
            held = 0 if self._cache is None else min(self._cache.length,
                                                     len(self._cache_tokens))
            rows = None if self._cache is None else self._cache.planes[:, 0, :, :held]
            stored, entry = self.prompt_store.exchange(self._cache_tokens[:held], [rows],
                                                       prompt)
            reuse = min(shared_prefix(prompt, self._cache_tokens), len(prompt) - 1, held)
            if entry is not None:
                stored = min(stored, len(prompt) - 1, entry.rows[0].shape[2])
        self._cache_tokens = []  # until this generation ends, its rows are its own
        if self._cache is not None and reuse and self._cache.capacity != capacity:
            self._cache.rollback(reuse)
            self._cache = self._cache.grown(capacity)  # a copy of the rows kept
        elif self._cache is None or self._cache.capacity != capacity:
            self._cache = self.target.new_cache(capacity)
        self._cache.rollback(reuse)
        if stored > reuse:
            self._cache.planes[:, 0, :, :stored] = entry.rows[0][:, :, :stored]
            self._cache.reclaim(stored)
        if self.target.spec.keeps_features:
            # The features cost a feature draft's fuse product: computed only for one.
            self.target.keep_features = bool(drafter and drafter.needs_features)
        return GenerationState(self.target, self._cache, drafter, config,
                               np.random.default_rng(config.seed), StepClock(), limit)

    def save_measurements(self, written_by: str) -> Path:
        """Store what auto K measured so far (each draft's acceptance per position, and
        this machine's draft and verification costs) in the bundle's auto_k.json, where the
        next Generator on this bundle starts from it. Returns the file's path."""
        with self._lock:
            return auto_k_file.write(self.bundle.root, self._histories, self.machine, written_by)

    # ---- helpers --------------------------------------------------------------------------

    def _drafter(self, config: GenerationConfig) -> Drafter | None:
        return make_drafter(config.drafter, self._model_drafter) if config.use_draft else None

    def _model_seconds(self) -> float:
        return self.target.run_seconds + (self.draft.run_seconds if self.draft else 0.0)

    def encode_prompt(self, prompt: str | None = None,
                      prompt_ids: Sequence[int] | None = None,
                      messages: Sequence[dict[str, str]] | None = None,
                      raw: bool = False) -> list[int]:
        """The token ids a generation starts from (exactly one of the three, as `stream`
        takes them), with the same checks and messages (TextCodec.encode_prompt)."""
        return self.codec.encode_prompt(prompt, prompt_ids, messages, raw)
