"""`specedge corpus`: grow a distillation corpus (corpus.py) with the target's answers, a
shard at a time, resuming after the last shard.

The answers come from the project's own runtime: a bundle of the target exported with
`--attention batched`, decoding many requests at once (runtime/batch.py's BatchSession,
continuous batching: a finished answer's slot takes the next request at once) without a
draft. On 2 cores (AMD EPYC, AVX-512 VNNI) the int4 SmolLM2 bundle answers 276 tokens a
second at 32 rows, against 121 for torch's batched `generate` at fp32, whose finished rows
keep running (docs/MEASUREMENTS.md, "Making a corpus"). The greedy answers are then the
bundle's own, which is what a draft meets when it runs beside that bundle.

Each shard answers `shard_prompts` requests (CorpusSettings), a fixed mix:
* `self_fraction` written by the target itself (Magpie, self_prompts.py): given only the chat
  template's text before a user's words, the target continues with a request (temperature 1,
  at most REQUEST_TOKENS tokens), kept if it ends its turn and passes `pick_requests`;
* an eighth: summaries of passages cut from the corpus' earlier greedy answers;
* an eighth: code requests the target finishes itself from the first words of one
  (prompts.CODE_OPENINGS: "Write a Rust function that", ...), kept as self-written ones are;
* an eighth: requests to change or explain a block of code cut from an earlier greedy
  answer (prompts.CODE_EDITS), the code fenced after the request;
* the rest from prompts.py's template, question and code requests, in `pool_requests`
  order (the next ones not yet in the corpus); once those run out, self-written ones, and
  where too few self-written ones pass, more of those.
The code parts make a quarter of each shard: a fixed pool of code tasks runs out after a
few hundred requests, and a draft meets code in a third of the held-out prompts.
Every request is new to the corpus and not close to a held-out prompt (the bench's and
docs/examples/prompts.jsonl), so that measuring a draft on those stays measuring it on
prompts it never saw. A `sampled_fraction` of the answers is sampled at `temperature`, the
rest greedy. Seeds derive from the corpus seed and the shard's number, so a shard's choices
do not depend on when the run was interrupted.
"""

from __future__ import annotations

import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specedge import __version__
from specedge.export.distill.corpus import (
    CorpusSettings,
    Row,
    answer_tokens,
    new_meta,
    read_corpus,
    read_meta,
    shard_path,
    shard_paths,
    summary,
    write_meta,
    write_shard,
)
from specedge.export.distill.draft_folder import tokenizer_digest
from specedge.export.distill.prompts import (
    CODE_OPENINGS,
    code_blocks,
    code_edit_request,
    passage_of,
    pool_requests,
    summary_request,
)
from specedge.export.distill.self_prompts import MARK, REQUEST_TOKENS, close_to, content_words
from specedge.prompts import load_prompts, read_prompt_file
from specedge.runtime import GenerationConfig, Generator
from specedge.runtime.batch import BatchSession

# The repository's second held-out prompt set, read when specedge runs from a clone.
EXAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "docs" / "examples" / "prompts.jsonl"
# Self-written requests sampled per request a shard needs in one round (more rounds follow
# when too few pass): about half of SmolLM2-135M-Instruct's pass.
SELF_TRIES = 2
# Kinds of request that ask for code: their answers are not passages to summarise.
CODE_KINDS = ("code", "code-self", "code-edit")


def held_out_requests() -> list[str]:
    """The requests a draft is measured on: the bench prompts' and the examples' first
    lines (what they ask, without a passage to summarise)."""
    prompts = load_prompts()
    if EXAMPLE_PROMPTS.is_file():
        prompts += read_prompt_file(EXAMPLE_PROMPTS)
    return [p["prompt"].split("\n")[0] for p in prompts if "prompt" in p]


def normalized(request: str) -> str:
    return " ".join(request.lower().split())


def answer_jobs(session: BatchSession, jobs: list[tuple[list[int], GenerationConfig]],
                on_done: Callable[[int], None] = lambda n: None) -> list:
    """Each job's GenerationResult, in order: `session.max_batch` threads take the next job
    as soon as theirs ends, so the batch stays full until the jobs run out. `on_done(n)`
    is told each answer's token count. Interrupted (Ctrl-C), the running answers stop
    within a step and no new one starts."""
    todo: queue.Queue = queue.Queue()
    for i in range(len(jobs)):
        todo.put(i)
    results: list = [None] * len(jobs)
    lock, cancel = threading.Lock(), threading.Event()

    def work() -> None:
        while not cancel.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            ids, config = jobs[i]
            try:
                pieces = session.run(ids, config, cancel)
                while True:
                    next(pieces)
            except StopIteration as done:
                results[i] = done.value
                with lock:
                    on_done(len(done.value.token_ids))
            except BaseException as e:  # raised on the caller's thread below
                results[i] = e
                cancel.set()  # the others stop too: the shard will not be written
                return

    threads = [threading.Thread(target=work, name=f"specedge-corpus-{k}", daemon=True)
               for k in range(min(session.max_batch, len(jobs)))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        cancel.set()
        for t in threads:
            t.join(timeout=10)
        raise
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def self_request(ids: list[int], eos: set[int], special_ids: set[int],
                 decode: Callable[[list[int]], str]) -> str | None:
    """The request a self-written continuation makes, or None if it is unusable: it did not
    end its turn (EOS) within its tokens, holds another special token, or has under 3 or
    over 60 words (as self_prompts.py `pick_requests` keeps them)."""
    if not ids or ids[-1] not in eos or special_ids.intersection(ids[:-1]):
        return None
    request = decode(ids[:-1]).strip()
    return request if 3 <= len(request.split()) <= 60 else None


class CorpusGrower:
    """One corpus folder and the generator that answers into it."""

    def __init__(self, out: Path, gen: Generator, settings: CorpusSettings, max_batch: int,
                 target: str):
        self.out, self.gen, self.settings = out, gen, settings
        self.session = BatchSession(gen, max_batch)
        codec = gen.codec
        self.eos = set(gen.bundle.eos_token_ids)
        meta = read_meta(out)
        digest = tokenizer_digest(codec.tokenizer)
        if meta is None:
            if any(out.glob("shard-*.npz")):
                raise ValueError(f"{out} holds shards but no corpus.json: restore it, or use "
                                 "another --out")
            write_meta(out, new_meta(target, digest, settings))
        else:
            if meta["tokenizer_sha256"] != digest:
                raise ValueError(f"the corpus in {out} was made by a target with another "
                                 f"tokenizer ({meta['target']!r}): use another --out")
            if meta["settings"] != asdict(settings):
                raise ValueError(f"the corpus in {out} was made with other settings "
                                 f"({meta['settings']}): grow it with those, or use another "
                                 "--out")
        self.rows = read_corpus(out)
        self.shards = len(shard_paths(out))
        self.seen = {normalized(r.request) for r in self.rows}
        self.held_out = [content_words(r) for r in held_out_requests()]
        self.tries = 0  # self-written requests sampled for the shard being made
        self.pool = pool_requests(settings.seed)
        where = {request: i for i, (_, request) in enumerate(self.pool)}
        self.pool_next = 1 + max((where.get(r.request, -1) for r in self.rows), default=-1)
        self.header = codec.chat_text([{"role": "user", "content": MARK}]).split(MARK)[0]
        self.special_ids = {i for i, t in codec.tokenizer.get_added_tokens_decoder().items()
                            if t.special}

    def usable(self, request: str) -> bool:
        return (normalized(request) not in self.seen
                and not close_to(request, self.held_out))

    def take(self, kind: str, request: str, out: list[tuple[str, str]]) -> bool:
        if not self.usable(request):
            return False
        self.seen.add(normalized(request))
        out.append((kind, request))
        return True

    def self_written(self, n: int, seed: int, openings: tuple[str, ...] = ("",),
                     kind: str = "self") -> list[tuple[str, str]]:
        """Up to `n` new requests the target writes (module docstring): try i starts from
        the chat template's user-turn header and `openings[i % len(openings)]`, the
        request's first words, which the target finishes."""
        tries = n * SELF_TRIES
        self.tries += tries
        codec = self.gen.codec
        starts = [openings[i % len(openings)] for i in range(tries)]
        start_ids = {o: codec.encode(self.header + o) for o in set(starts)}
        configs = [GenerationConfig(max_new_tokens=REQUEST_TOKENS, temperature=1.0,
                                    seed=seed + i, use_draft=False) for i in range(tries)]
        bar = tqdm(total=tries * REQUEST_TOKENS, desc=f"{kind}-written requests", unit="tok",
                   file=sys.stderr, leave=False)
        results = answer_jobs(self.session, [(start_ids[o], c) for o, c in zip(starts, configs)],
                              lambda k: bar.update(k))
        bar.close()
        picked: list[tuple[str, str]] = []
        for opening, result in zip(starts, results):
            request = self_request(result.token_ids, self.eos, self.special_ids,
                                   lambda ids, o=opening: o + codec.decode(ids))
            if request is not None and self.take(kind, request, picked) and len(picked) == n:
                break
        return picked

    def summaries(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """Up to `n` requests to summarise passages cut from earlier greedy answers."""
        candidates = [r for r in self.rows if r.temperature == 0
                      and r.kind not in ("summary", *CODE_KINDS)]
        picked: list[tuple[str, str]] = []
        for r in rng.sample(candidates, min(len(candidates), 8 * n)):
            passage = passage_of(self.gen.codec.decode(r.answer))
            if passage is not None:
                self.take("summary", summary_request(passage, rng), picked)
            if len(picked) == n:
                break
        return picked

    def code_edits(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """Up to `n` requests to change or explain a block of code cut from an earlier
        greedy answer (prompts.CODE_EDITS)."""
        candidates = [r for r in self.rows if r.temperature == 0 and r.kind != "code-edit"]
        picked: list[tuple[str, str]] = []
        for r in rng.sample(candidates, len(candidates)):
            blocks = code_blocks(self.gen.codec.decode(r.answer))
            if blocks:
                self.take("code-edit", code_edit_request(*rng.choice(blocks), rng), picked)
            if len(picked) == n:
                break
        return picked

    def from_pool(self, n: int) -> list[tuple[str, str]]:
        picked: list[tuple[str, str]] = []
        while len(picked) < n and self.pool_next < len(self.pool):
            self.take(*self.pool[self.pool_next], picked)
            self.pool_next += 1
        return picked

    def requests(self, index: int) -> list[tuple[str, str]]:
        """The shard's requests (module docstring)."""
        s = self.settings
        rng = random.Random(s.seed * 1_000_003 + index)
        n = s.shard_prompts
        seed = (s.seed * 1_000_003 + index) * 10_000
        picked = self.summaries(n // 8, rng)
        picked += self.code_edits(n // 8, rng)
        for attempt in range(3):  # as for self-written ones below
            wanted = n // 4 - sum(kind in CODE_KINDS for kind, _ in picked)
            if wanted <= 0:
                break
            picked += self.self_written(wanted, seed + 3_000 + attempt * 500, CODE_OPENINGS,
                                        "code-self")
        picked += self.from_pool(n - len(picked) - round(s.self_fraction * n))
        for attempt in range(3):  # a few rounds, in case few self-written ones pass
            if len(picked) >= n:
                break
            picked += self.self_written(n - len(picked), seed + attempt * 1000)
        picked += self.from_pool(n - len(picked))  # too few self-written ones passed
        rng.shuffle(picked)
        return picked[:n]

    def grow_shard(self) -> dict:
        """Answer one shard's requests and write it; returns the shard's meta."""
        s, index, t0 = self.settings, self.shards, time.time()
        self.tries = 0
        requests = self.requests(index)
        rng = random.Random(s.seed * 1_000_003 + index + 500_000)
        temps = [s.temperature if rng.random() < s.sampled_fraction else 0.0
                 for _ in requests]
        seed = (s.seed * 1_000_003 + index) * 10_000 + 5_000
        prompts = [self.gen.codec.encode_chat([{"role": "user", "content": r}])
                   for _, r in requests]
        jobs = [(ids, GenerationConfig(max_new_tokens=s.new_tokens, temperature=t,
                                       seed=seed + i, use_draft=False))
                for i, (ids, t) in enumerate(zip(prompts, temps))]
        bar = tqdm(total=len(jobs), desc=f"shard {index}", unit="answer", file=sys.stderr,
                   leave=False)
        results = answer_jobs(self.session, jobs, lambda k: bar.update())
        bar.close()
        rows = [Row(ids=_ids(p, res.token_ids), prompt_len=len(p),
                    ended=bool(res.token_ids) and res.token_ids[-1] in self.eos,
                    temperature=t, kind=kind, request=request)
                for (kind, request), p, t, res in zip(requests, prompts, temps, results)]
        seconds = time.time() - t0
        tokens = answer_tokens(rows)
        meta = {"seconds": round(seconds, 1), "answer_tokens": tokens,
                "answer_tokens_per_second": round(tokens / seconds, 1),
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "specedge": __version__, "bundle": bundle_summary(self.gen),
                "max_batch": self.session.max_batch, "self_written_sampled": self.tries}
        write_shard(shard_path(self.out, index), rows, meta, self.gen.codec.vocab_size)
        self.rows += rows
        self.shards += 1
        return meta


def _ids(prompt: list[int], answer: list[int]) -> np.ndarray:
    return np.array(prompt + list(answer), dtype=np.int32)


def bundle_summary(gen: Generator) -> dict:
    """What a shard's answers depend on besides the settings: the bundle's model and
    precision."""
    m = gen.bundle.manifest
    src = m.get("source", {})
    return {"model": src.get("model"), "precision": m.get("precision"),
            "attention": src.get("attention"), "int4_grid": src.get("int4_grid")}


def grow_corpus(out: str | Path, bundle: str | Path, settings: CorpusSettings,
                answer_tokens_goal: int, minutes: float | None = None, max_batch: int = 32,
                threads: int | None = None) -> dict:
    """Add shards to the corpus in `out` until its answers hold `answer_tokens_goal` tokens
    or `minutes` are up (a shard is not started when the last one's time would pass the
    limit); returns the corpus' summary."""
    if settings.shard_prompts < 8 or settings.new_tokens < 1 or max_batch < 1:
        raise ValueError("--shard-prompts must be >= 8, --new-tokens and --max-batch >= 1")
    out = Path(out)
    gen = Generator.from_bundle(bundle, threads=threads, spinning=False)
    target = gen.bundle.manifest.get("source", {}).get("model") or str(bundle)
    grower = CorpusGrower(out, gen, settings, max_batch, target)
    t0, last = time.time(), 0.0
    bar = tqdm(total=answer_tokens_goal, initial=min(answer_tokens(grower.rows),
                                                     answer_tokens_goal),
               desc="corpus answer tokens", unit="tok", file=sys.stderr)
    while answer_tokens(grower.rows) < answer_tokens_goal:
        if minutes is not None and time.time() - t0 + last > 60 * minutes:
            break
        meta = grower.grow_shard()
        last = meta["seconds"]
        bar.update(min(meta["answer_tokens"], answer_tokens_goal - bar.n))
        bar.set_postfix(shards=grower.shards, tok_s=meta["answer_tokens_per_second"])
    bar.close()
    return {"corpus": str(out), "shards": grower.shards, **summary(grower.rows),
            "seconds": round(time.time() - t0)}
