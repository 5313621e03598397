"""The speculative decoding loop and the public `Generator` API.

One step (DESIGN "The speculative step"):
    drafts, q = drafter.propose(context, k)            # 1. K draft tokens and q_1..q_K
    p = target([last token] + drafts)                  # 2. one call -> p_1..p_{K+1}
    n, token = verify(drafts, q, p)                    # 3-6. accept a prefix, emit one more
                                                       #   (token_choice.py: host or device)
    rollback both caches to the n accepted rows         # KV rule: rollback = set length
Plain decoding is the same step with k = 0, so the baseline shares every line of the loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backends import load_backend
from .bundle import load_bundle
from .draft_length import StepHistory, auto_k
from .drafters import FeatureDrafter, LookupThenModelDrafter, ModelDrafter, PromptLookupDrafter
from .kv_cache import KVCache, capacity_for
from .params import (
    DEFAULT_DRAFTER,
    Sampling,
    check_draft_tokens,
    check_drafter,
    check_positive_int,
    check_seed,
    check_stop,
    check_threshold,
    check_token_ids,
)
from .stats import StepClock, summarize
from .text import TextCodec
from .token_choice import choice_for


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: dict
    stop_reason: str  # "eos", "stop_string" or "max_new_tokens"


class Generator:
    def __init__(self, bundle, target, draft, codec: TextCodec):
        self.bundle = bundle
        self.target = target
        self.draft = draft
        self.codec = codec
        self.last_result: GenerationResult | None = None
        self._cache: KVCache | None = None
        self._model_drafter = None
        if draft is not None:
            feature_draft = bundle.draft.reads_features
            self._model_drafter = (FeatureDrafter if feature_draft else ModelDrafter)(draft)
        self._choice = choice_for(target)
        # What recent steps cost and accepted, for `auto`, kept across generations, per
        # (source of the draft, greedy): drafts, and the choice of tokens from K + 1 rows,
        # differ (drafters.py, `source`).
        self._history: dict[tuple[str, bool], StepHistory] = {}
        self._verify_costs: dict[bool, dict[int, float]] = {}  # v(T) per greedy, shared

    @classmethod
    def from_bundle(cls, path: str | Path, backend: str = "ort-cpu",
                    threads: int | None = None) -> Generator:
        """Load and validate a bundle folder and open its graphs on `backend`."""
        bundle = load_bundle(path)
        target = load_backend(backend, bundle, "target", threads)
        draft = load_backend(backend, bundle, "draft", threads) if bundle.draft else None
        return cls(bundle, target, draft, TextCodec(bundle))

    def max_context(self, drafter=None) -> int:
        """Largest prompt + new tokens: the target's context, and the draft's if it runs."""
        limits = [self.bundle.target.max_context]
        if isinstance(drafter, (ModelDrafter, LookupThenModelDrafter)):
            limits.append(self.bundle.draft.max_context)
        return min(limits)

    # ---- public API -----------------------------------------------------------------------

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Generate a completion; see `stream` for the arguments."""
        for _ in self.stream(prompt, **kwargs):
            pass
        return self.last_result

    def stream(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
               messages: Sequence[dict[str, str]] | None = None, raw: bool = False,
               max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = 0, draft_tokens: int | str | None = None,
               use_draft: bool = True, drafter: str = DEFAULT_DRAFTER, draft_threshold: float = 0.0,
               stop: str | Sequence[str] | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; `self.last_result` holds the result.

        Exactly one of `prompt` (chat-templated unless `raw` or the bundle has no template),
        `prompt_ids` or `messages`. `temperature=0` is greedy; `draft_tokens` is K, or
        "auto" to pick K as generation runs (K then follows measured times, so a seed fixes
        the distribution but not the exact sampled text); by default auto when greedy and
        a fixed K when sampling (params.SAMPLED_DEFAULT_K, params.check_draft_tokens);
        `draft_threshold` stops drafting after a token whose draft probability is below it;
        `use_draft=False` is plain target-only decoding in the same loop. With a stop
        string, `token_ids` ends with the token that completes the text.
        """
        ids = self._prompt_ids(prompt, prompt_ids, messages, raw)
        max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        sampling = Sampling(temperature, top_k, top_p)
        k_max, auto = check_draft_tokens(draft_tokens, sampling.greedy)
        threshold = check_threshold(draft_threshold)
        proposer = self._drafter(check_drafter(drafter)) if use_draft else None
        context_limit = self.max_context(proposer)
        if len(ids) + max_new_tokens > context_limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds the bundle's context of {context_limit} tokens; "
                             "shorten the prompt or lower max_new_tokens")
        stops = check_stop(stop)
        rng = np.random.default_rng(check_seed(seed))
        if proposer is None:
            k_max, auto = 0, False

        clock = StepClock()
        tokens: list[int] = []
        reason = "max_new_tokens"
        text = ""
        chunks = self._decode(ids, max_new_tokens, sampling, k_max, auto, threshold, proposer,
                              rng, clock)
        eos = set(self.bundle.eos_token_ids)

        def accepted() -> Iterator[list[int]]:
            nonlocal reason
            for chunk in chunks:
                for i, tok in enumerate(chunk):
                    if tok in eos:
                        tokens.extend(chunk[:i + 1])
                        reason = "eos"
                        yield chunk[:i]
                        return
                tokens.extend(chunk)
                yield chunk

        # Text that could be the start of a stop string is held back until it is not.
        longest = max(map(len, stops), default=0)
        emitted = 0
        for piece in self.codec.stream(accepted()):
            search_from = max(0, len(text) - longest)
            text += piece
            cut = min((i for s in stops if (i := text.find(s, search_from)) >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
                reason = "stop_string"
            ready = len(text) if cut >= 0 else len(text) - max(0, longest - 1)
            if ready > emitted:
                yield text[emitted:ready]
                emitted = ready
            if cut >= 0:
                break
        if emitted < len(text):
            yield text[emitted:]
        chunks.close()
        if reason == "stop_string":
            # The last chunk may run past the stop string: keep the tokens the text needs.
            while tokens and len(self.codec.decode(tokens[:-1])) >= len(text):
                tokens.pop()
        clock.finish()
        stats = summarize(clock, len(tokens), "auto" if auto else k_max,
                          proposer.name if proposer else "none", self.target.name, reason)
        stats["sampling_on"] = self._choice.where
        self.last_result = GenerationResult(text, tokens, stats, reason)

    # ---- the loop -------------------------------------------------------------------------

    def _decode(self, prompt: list[int], max_new: int, sampling: Sampling, k_max: int,
                auto: bool, threshold: float, drafter, rng: np.random.Generator,
                clock: StepClock) -> Iterator[list[int]]:
        limit = capacity_for(len(prompt) + max_new, self.max_context(drafter))
        # A portable graph attends over the whole capacity: its host cache starts with room
        # for the prompt and grows between steps (kv_cache.py); other caches are sized once.
        capacity = capacity_for(len(prompt), limit) if self.target.grows_cache else limit
        if self._cache is None or self._cache.capacity != capacity:
            self._cache = self.target.new_cache(capacity)
        cache = self._cache
        cache.rollback(0)

        choice = self._choice
        with clock.time("prefill"):
            rows = choice.run(self.target, cache, prompt, 1)
            if drafter:
                drafter.start(prompt, limit)
                if drafter.needs_features:
                    drafter.observe(self.target.features, 0)
        with clock.time("sampling"):
            token = choice.pick(rows, sampling, rng)
        clock.model_start = self._model_seconds()
        context, new = [*prompt, token], [token]
        yield new
        generated = 1
        while generated < max_new:
            source = drafter.source(context) if drafter else "none"
            history = self._history.get((source, sampling.greedy))
            if history is None:
                history = self._history[source, sampling.greedy] = StepHistory(
                    self._verify_costs.setdefault(sampling.greedy, {}))
            # Never draft past max_new_tokens: the last slot is the target's own token.
            k = min(auto_k(history, k_max) if auto else k_max, max_new - generated - 1)
            drafts, q, draft_calls = [], None, 0
            if drafter and k > 0:
                calls = drafter.calls
                with clock.time("draft"):
                    drafts, q = drafter.propose(context, k, sampling, rng, threshold)
                draft_calls = drafter.calls - calls
                clock.draft_calls += draft_calls
            if cache.length + len(drafts) + 1 > cache.capacity:
                cache = self._cache = cache.grown(
                    capacity_for(cache.length + len(drafts) + 1, limit))
            with clock.time("target"):
                rows = choice.run(self.target, cache, [context[-1], *drafts], len(drafts) + 1)
                if drafter and drafter.needs_features:
                    drafter.observe(self.target.features, len(context) - 1)
            with clock.time("sampling"):
                n, token = choice.verify(rows, drafts, q, sampling, rng)
            clock.record_step(len(drafts), n)
            # A draft that took in more than the last step's tokens was catching up: not
            # what a draft step costs (drafters.py), so it does not feed d.
            steady = draft_calls and drafter.caught_up <= len(new)
            history.observe(len(drafts), n, clock.last["target"] + clock.last["sampling"],
                            clock.last["draft"], draft_calls if steady else 0)
            # Rows for context[-1] and the n accepted drafts stay; the rest is stale.
            cache.rollback(len(context) + n)
            if drafter:
                drafter.rollback(len(context) + n)
            new = [*drafts[:n], token]
            context += new
            generated += len(new)
            clock.model_end = self._model_seconds()
            yield new

    # ---- helpers --------------------------------------------------------------------------

    def _model_seconds(self) -> float:
        return self.target.run_seconds + (self.draft.run_seconds if self.draft else 0.0)

    def _drafter(self, name: str):
        if name == "prompt-lookup":
            return PromptLookupDrafter()
        if self._model_drafter is None:
            raise ValueError("this bundle has no draft model: use drafter='prompt-lookup' "
                             "(--drafter prompt-lookup), use_draft=False (--no-draft), or "
                             "re-export with --draft / --draft-layers")
        if name == "lookup+model":
            return LookupThenModelDrafter(self._model_drafter)
        return self._model_drafter

    def _prompt_ids(self, prompt, prompt_ids, messages, raw) -> list[int]:
        given = [x is not None for x in (prompt, prompt_ids, messages)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of prompt, prompt_ids or messages")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt.strip():
                raise ValueError("prompt is empty: give some text to continue")
            if raw or not self.codec.has_chat_template:
                ids = self.codec.encode(prompt)
            else:
                ids = self.codec.encode_chat([{"role": "user", "content": prompt}])
        elif messages is not None:
            if not messages:
                raise ValueError("messages is empty: give at least one message")
            ids = self.codec.encode_chat(messages)
        else:
            ids = prompt_ids
        ids = check_token_ids(ids, self.bundle.target.vocab_size)
        if not ids:
            raise ValueError("the prompt encodes to no tokens: give some text to continue")
        return ids
