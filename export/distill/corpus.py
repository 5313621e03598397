"""The distillation corpus on disk: requests and the target's answers as token ids.

A draft learns from the target's own answers (docs/distill.md). Making them is the slow part
(hours on a laptop CPU), and what the draft trains on besides, the target's features and
top-k log-probabilities, is large but recomputed from the answers in one teacher-forced pass.
So the corpus keeps only what cannot be recomputed cheaply, small enough for version control:

    DIR/corpus.json       what made it: target, tokenizer hash, settings
    DIR/shard-NNNN.npz    one shard of answers (`np.savez_compressed`):
        tokens        uint16 (uint32 for vocabularies over 65536): each row's prompt ids
                      (chat-templated) and answer ids, rows one after another
        prompt_len    int32 [n]  prompt ids of each row
        answer_len    int32 [n]  answer ids of each row (the last one is EOS if `ended`)
        ended         bool [n]   whether the answer ended by itself (EOS), not at the cap
        temperature   float32 [n] 0: greedy; otherwise sampled at that temperature
        kind          uint8 [n]  index into KINDS: where the request came from
        request       str [n]    the user's request as text (for de-duplication and reading)
        meta          str        JSON: seconds, answer tokens a second, date, the bundle

Shards are written whole (atomically), so an interrupted run loses at most the shard it was
making, and the next run appends after the last one (`grow.py`).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specedge.runtime.atomic_files import atomic_write, replacing

CORPUS_FORMAT = 1
CORPUS_META = "corpus.json"
# Where a request came from: prompts.py's topic x task templates, everyday questions,
# summaries of a passage (an earlier answer of the corpus), code requests, requests the
# target wrote itself (self_prompts.py, Magpie), code requests it finished from their first
# words, and requests to change a block of code from an earlier answer (grow.py). New kinds
# go at the end: a shard stores each row's index into this tuple.
KINDS = ("template", "question", "summary", "code", "self", "code-self", "code-edit")


@dataclass(frozen=True)
class CorpusSettings:
    """What the answers depend on (besides the bundle that makes them): recorded in
    corpus.json, and a run with other settings is refused rather than mixed in."""

    new_tokens: int = 256  # an answer's cap
    shard_prompts: int = 256  # requests a shard answers
    sampled_fraction: float = 0.25  # answers sampled (at `temperature`), the rest greedy
    temperature: float = 0.7
    self_fraction: float = 0.5  # requests the target writes itself, the rest from prompts.py
    seed: int = 0


@dataclass
class Row:
    """One answer of the corpus."""

    ids: np.ndarray  # int32 [prompt + answer]
    prompt_len: int
    ended: bool
    temperature: float
    kind: str
    request: str

    @property
    def answer(self) -> np.ndarray:
        return self.ids[self.prompt_len:]


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:04d}.npz"


def shard_paths(folder: Path) -> list[Path]:
    """The corpus' shards in order; ValueError if one is missing in the numbering."""
    paths = sorted(folder.glob("shard-*.npz"))
    for i, p in enumerate(paths):
        if p != shard_path(folder, i):
            raise ValueError(f"{folder} has no {shard_path(folder, i).name} before {p.name}: "
                             "restore it (git checkout) or remove the shards after it")
    return paths


def write_meta(folder: Path, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / CORPUS_META, json.dumps(meta, indent=1) + "\n")


def read_meta(folder: Path) -> dict | None:
    path = folder / CORPUS_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} ({e}): restore it from version control") from e
    if meta.get("format") != CORPUS_FORMAT:
        raise ValueError(f"{path} has format {meta.get('format')!r}; this specedge reads "
                         f"format {CORPUS_FORMAT}")
    return meta


def new_meta(target: str, tokenizer_sha256: str, settings: CorpusSettings) -> dict:
    return {"format": CORPUS_FORMAT, "target": target, "tokenizer_sha256": tokenizer_sha256,
            "settings": asdict(settings)}


def write_shard(path: Path, rows: list[Row], meta: dict, vocab_size: int) -> None:
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    buf = io.BytesIO()
    np.savez_compressed(
        buf, tokens=np.concatenate([r.ids for r in rows]).astype(dtype),
        prompt_len=np.array([r.prompt_len for r in rows], np.int32),
        answer_len=np.array([len(r.ids) - r.prompt_len for r in rows], np.int32),
        ended=np.array([r.ended for r in rows], bool),
        temperature=np.array([r.temperature for r in rows], np.float32),
        kind=np.array([KINDS.index(r.kind) for r in rows], np.uint8),
        request=np.array([r.request for r in rows], dtype=str),
        meta=np.array(json.dumps(meta)))
    with replacing(path) as tmp:
        Path(tmp).write_bytes(buf.getvalue())


def read_shard(path: Path) -> list[Row]:
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, plen, alen = z["tokens"].astype(np.int32), z["prompt_len"], z["answer_len"]
            ended, temp, kind, request = z["ended"], z["temperature"], z["kind"], z["request"]
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}): restore it from version control or "
                         "remove it (the next `specedge corpus` run makes it again)") from e
    ends = np.cumsum(plen + alen)
    return [Row(tokens[end - p - a:end], int(p), bool(e), float(t), KINDS[k], str(r))
            for end, p, a, e, t, k, r in zip(ends, plen, alen, ended, temp, kind, request)]


def read_shards(folder: str | Path, max_tokens: int | None = None) -> list[list[Row]]:
    """The rows of each shard, in order; with `max_tokens`, the first shards whose answers
    hold at most that many tokens (at least one shard): the same rows each time, for
    measuring how agreement grows with data."""
    folder = Path(folder)
    if read_meta(folder) is None:
        raise ValueError(f"{folder} is not a corpus (no {CORPUS_META}): make one with "
                         "`specedge corpus --bundle BUNDLE --out DIR`")
    shards: list[list[Row]] = []
    tokens = 0
    for path in shard_paths(folder):
        shard = read_shard(path)
        tokens += answer_tokens(shard)
        if shards and max_tokens is not None and tokens > max_tokens:
            break
        shards.append(shard)
    return shards


def read_corpus(folder: str | Path, max_tokens: int | None = None) -> list[Row]:
    """Every row of `read_shards`, shard after shard."""
    return [row for shard in read_shards(folder, max_tokens) for row in shard]


def answer_tokens(rows: list[Row]) -> int:
    return sum(len(r.ids) - r.prompt_len for r in rows)


def summary(rows: list[Row]) -> dict:
    """Counts for reports and docs/distill.md: rows and answer tokens, by kind and by
    greedy / sampled, and how many answers ended by themselves."""
    by_kind, tokens_by_kind = Counter(), Counter()
    greedy = 0
    for r in rows:
        by_kind[r.kind] += 1
        tokens_by_kind[r.kind] += len(r.ids) - r.prompt_len
        greedy += r.temperature == 0
    return {"rows": len(rows), "answer_tokens": answer_tokens(rows),
            "prompt_tokens": sum(r.prompt_len for r in rows),
            "greedy_rows": greedy, "sampled_rows": len(rows) - greedy,
            "ended_rows": sum(r.ended for r in rows),
            "rows_by_kind": dict(by_kind), "answer_tokens_by_kind": dict(tokens_by_kind)}
