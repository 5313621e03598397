"""Prompts that the target writes itself (Magpie: Xu et al. 2024, arXiv:2406.08464).

Given its chat template's user-turn header and nothing else, an instruct model continues it
with a user request: the kind of request it was tuned on. Such requests are closer to what
chat users ask than distill's topic x task templates, so a draft trained on the target's
answers to them meets fewer unfamiliar answers in real chats.

Raw continuations are noisy. One is kept only if it ends its turn within the token budget,
has a few words, holds no special token, is new, and is not close to a bench prompt
(specedge/prompts.jsonl), which would make the bench score the draft on what it learned.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from specedge.prompts import load_prompts
from specedge.runtime.atomic_files import atomic_write

REQUEST_TOKENS = 64
MARK = "\x00specedge\x00"
# Words too common in requests to tell two of them apart (see `content_words`).
GENERIC = frozenset("""
about also another best between could does each explain example following from give good
have help into just know like make many more most much need only other should simple some
such tell than that their them there these they this tips using want what when where which
while will with would write your function program code python javascript sentence sentences
passage summarize summary""".split())


def bench_requests() -> list[str]:
    """The bench prompts' first lines: what they ask, without a passage to summarize."""
    return [p["prompt"].split("\n")[0] for p in load_prompts()]


def turn_markers(tokenizer) -> tuple[str, str]:
    """(header, end): the chat template's text before and after a user turn's content."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    header, after = text.split(MARK)
    return header, after.strip() or after


def content_words(text: str) -> set[str]:
    """Lower-case words of four letters or more that say what a request is about."""
    return {w for w in re.findall(r"[a-z]{4,}", text.lower()) if w not in GENERIC}


def close_to(request: str, others: list[set[str]]) -> bool:
    """Whether `request` shares two content words with one of `others` (or all of a
    shorter one's): the same subject, if not the same words."""
    words = content_words(request)
    return any(len(words & o) >= min(2, len(o)) > 0 for o in others)


def pick_requests(continuations: list[str], end: str, special: list[str],
                  avoid: list[str], n: int) -> list[str]:
    """The first `n` continuations that make usable requests, in order (module doc)."""
    avoid_words = [content_words(a) for a in avoid]
    seen, picked = set(), []
    for text in continuations:
        if end not in text:
            continue  # ran out of tokens mid-request
        request = text[:text.index(end)].strip()
        key = " ".join(request.lower().split())
        if (not 3 <= len(key.split()) <= 60 or key in seen
                or any(s in request for s in special) or close_to(request, avoid_words)):
            continue
        seen.add(key)
        picked.append(request)
        if len(picked) == n:
            break
    return picked


def self_prompts(model, tokenizer, n: int, seed: int, batch: int, work: Path,
                 avoid: list[str]) -> list[str]:
    """`n` requests the target writes, sampled at temperature 1 (Magpie's setting) in
    batches cached in `work` (so an interrupted run resumes); at most 4n continuations."""
    header, end = turn_markers(tokenizer)
    enc = tokenizer([header] * batch, return_tensors="pt", add_special_tokens=False)
    special = [s for s in tokenizer.all_special_tokens if s]
    continuations, picked = [], []
    bar = tqdm(total=n, desc="target-written prompts", unit="prompt", file=sys.stderr)
    for i in range(-(-4 * n // batch)):
        path = work / f"requests-{i:04d}.json"
        if not path.is_file():
            torch.manual_seed(seed + 10_000 + i)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=REQUEST_TOKENS, do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0,
                                     pad_token_id=tokenizer.pad_token_id or 0)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:])
            atomic_write(path, json.dumps(texts))
        continuations += json.loads(path.read_text())
        picked = pick_requests(continuations, end, special, avoid, n)
        bar.update(len(picked) - bar.n)
        if len(picked) == n:
            break
    bar.close()
    if len(picked) < n:
        raise ValueError(f"the target wrote only {len(picked)} usable requests in "
                         f"{len(continuations)} tries; ask for fewer --self-prompts")
    return picked
