"""The target's features on a corpus (corpus.py), recomputed by teacher forcing: what a
draft trains on besides the answers' tokens.

For every row, one forward pass of the target over its prompt and answer gives, at every
position but the last, its final norm's output f_r (what its head reads) and the outputs of
the decoder `layers` a feature draft also reads (export/drafts/feature.py). The target's
next-token distribution needs no storing: it is softmax(W f_r), which training computes over
the draft's head tokens (losses.py). Rows run longest first in batches of about
`batch_tokens` padded tokens.

A corpus of a few million tokens makes gigabytes of features (SmolLM2-135M: 576 values a
position a layer, fp16), so they go to disk, one array a shard (`np.lib.format`, read back
memory-mapped), in the specedge cache (`$SPECEDGE_CACHE/teacher/TARGET`, outside any draft
folder and work tree): a shard's file is made once and found again by its rows' digest, so a
grown corpus computes only its new shards and runs on a part of the corpus (`--corpus-tokens`)
or for another draft reuse the files. On CPUs with native bfloat16 (AVX-512 BF16, AMX) the
pass runs in bfloat16 by default, about twice as fast as float32 on a 2-core AMD EPYC (257
against 132 tokens a second with the corpus' growth sharing the cores); the features are
stored in fp16 either way.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specedge.export.distill.corpus import Row
from specedge.export.drafts.feature import target_layer_outputs
from specedge.export.sources import cache_dir
from specedge.runtime.atomic_files import replacing

TEACHER_DTYPES = ("auto", "fp32", "bf16")


def teacher_dtype(name: str) -> torch.dtype:
    """"auto": bfloat16 where oneDNN runs it natively, else float32."""
    if name not in TEACHER_DTYPES:
        raise ValueError(f"--teacher-dtype must be one of {', '.join(TEACHER_DTYPES)}, "
                         f"got {name!r}")
    if name == "auto":
        name = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    return torch.bfloat16 if name == "bf16" else torch.float32


def shard_features(target, rows: Sequence[Row], layers: tuple[int, ...], path: Path,
                   batch_tokens: int, dtype: torch.dtype) -> np.ndarray:
    """[sum over rows of (len(ids) - 1), (len(layers) + 1) * H] fp16, memory-mapped: each
    row's features at positions 0 .. len(ids) - 2, rows one after another; for each
    position the outputs of `layers` (in order), then the final norm's. Made once into
    `path`."""
    hidden = target.config.hidden_size
    width = (len(layers) + 1) * hidden
    total = sum(len(r.ids) - 1 for r in rows)
    if path.is_file():
        cached = np.load(path, mmap_mode="r")
        if cached.shape == (total, width):
            return cached
    offsets = np.concatenate([[0], np.cumsum([len(r.ids) - 1 for r in rows])])
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].ids))
    batches, current = [], []
    for i in order:
        if current and len(rows[current[0]].ids) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    # A copy in `dtype`: the target itself stays float32 (the draft shares its embeddings
    # and head).
    model = target if dtype == torch.float32 else copy.deepcopy(target).to(dtype)
    with replacing(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                        shape=(total, width))
        for batch in tqdm(batches, desc=f"target features {path.stem}", unit="batch",
                          file=sys.stderr, leave=False):
            lengths = [len(rows[i].ids) - 1 for i in batch]
            ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, (i, n) in enumerate(zip(batch, lengths)):
                ids[b, :n] = torch.from_numpy(rows[i].ids[:n].astype(np.int64))
                mask[b, :n] = 1
            got = target_layer_outputs(model, ids, mask, layers, final=True)
            both = torch.cat([got[i] for i in layers] + [got["final"]], dim=-1)
            both = both.to(torch.float16).numpy()
            for b, (i, n) in enumerate(zip(batch, lengths)):
                out[offsets[i]:offsets[i] + n] = both[b, :n]
        out.flush()
        del out
    return np.load(path, mmap_mode="r")


class CorpusExamples(Sequence):
    """The corpus' rows as distillation examples (the dicts losses.py reads), built when
    asked for, their features read from the memory-mapped shard files:
    `ids` int32 [n], `start` (the position that predicts the answer's first token),
    `features` fp16 [n - 1, H] (the final norm's output) and, with `layers`,
    `layer_features` fp16 [n - 1, len(layers) * H]; `answer` tokens follow `start`."""

    def __init__(self, rows: list[Row], shard_rows: list[int], features: list[np.ndarray],
                 hidden: int):
        self.rows, self.hidden = rows, hidden
        self.where: list[tuple[int, int]] = []  # (shard, first feature row) of each row
        for shard, (count, array) in enumerate(zip(shard_rows, features)):
            offset = 0
            for row in rows[len(self.where):len(self.where) + count]:
                self.where.append((shard, offset))
                offset += len(row.ids) - 1
            if offset != len(array):
                raise ValueError(f"teacher features of shard {shard} hold {len(array)} "
                                 f"positions, its rows {offset}: delete the cache and rerun")
        self.features = features

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.rows[i]
        shard, first = self.where[i]
        block = self.features[shard][first:first + len(row.ids) - 1]
        ex = {"ids": torch.from_numpy(row.ids), "start": row.prompt_len - 1,
              "answer": len(row.ids) - row.prompt_len,
              "features": torch.from_numpy(np.ascontiguousarray(block[:, -self.hidden:]))}
        if block.shape[1] > self.hidden:
            ex["layer_features"] = torch.from_numpy(np.ascontiguousarray(
                block[:, :-self.hidden]))
        return ex


def teacher_cache(target: str) -> Path:
    """The folder of a target's teacher features: `$SPECEDGE_CACHE/teacher/NAME-HASH`, NAME
    the target's alias or folder name, HASH of how it was given."""
    name = Path(str(target)).name or "target"
    digest = hashlib.sha256(str(target).encode()).hexdigest()[:8]
    return cache_dir() / "teacher" / f"{name}-{digest}"


def rows_digest(rows: Sequence[Row]) -> str:
    """Names a shard's rows by their tokens: its features' file is found again whichever
    run, draft folder or corpus size asks for it."""
    h = hashlib.sha256()
    for r in rows:
        h.update(np.int64(r.prompt_len).tobytes())
        h.update(r.ids.astype(np.int32).tobytes())
    return h.hexdigest()[:16]


def corpus_examples(target, shards: list[list[Row]], layers: tuple[int, ...], cache: Path,
                    batch_tokens: int = 8192, dtype: torch.dtype = torch.float32
                    ) -> CorpusExamples:
    """The corpus' shards as examples, computing the features of shards not in `cache` (a
    folder for this target: the files are named by their rows, layers and precision)."""
    tag = "_".join(map(str, layers)) or "final"
    kind = str(dtype).removeprefix("torch.")
    features = [shard_features(target, rows, tuple(layers),
                               cache / f"features-{rows_digest(rows)}-{tag}-{kind}.npy",
                               batch_tokens, dtype)
                for rows in tqdm(shards, desc="teacher forcing", unit="shard",
                                 file=sys.stderr)]
    return CorpusExamples([r for rows in shards for r in rows], [len(r) for r in shards],
                          features, target.config.hidden_size)


def answer_head_ids(rows: list[Row], count: int, vocab_size: int) -> torch.Tensor:
    """The draft's head: the `count` tokens the corpus' answers use most (at a greedy
    answer's position the token is the target's first choice), ascending."""
    freq = np.bincount(np.concatenate([r.answer for r in rows]), minlength=vocab_size)
    count = min(count, vocab_size)
    top = np.argsort(-freq, kind="stable")[:count]
    return torch.from_numpy(np.sort(top)).long()
