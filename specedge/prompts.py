"""The bench prompt set (prompts.jsonl): chat questions, passage summaries and code edits.

`specedge bench` times decoding on it; `specedge distill` keeps its training requests away
from it, so that the bench never scores a draft on what it was trained on."""

from __future__ import annotations

import json
from importlib import resources


def load_prompts(limit: int | None = None) -> list[dict]:
    """The prompts as dicts (`prompt`, `category`, ...), the first `limit` of them if given."""
    text = resources.files("specedge").joinpath("prompts.jsonl").read_text()
    prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts
