"""The bench prompt set (prompts.jsonl): chat questions, passage summaries and code edits,
and users' own prompt files for `specedge bench --prompts`.

`specedge bench` times decoding on it; `specedge distill` keeps its training requests away
from it, so that the bench never scores a draft on what it was trained on."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

DEFAULT_CATEGORY = "custom"


def load_prompts(limit: int | None = None) -> list[dict]:
    """The prompts as dicts (`prompt`, `category`, ...), the first `limit` of them if given."""
    text = resources.files("specedge").joinpath("prompts.jsonl").read_text()
    prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


def read_prompt_file(path: str | Path) -> list[dict]:
    """A user's prompt file (JSON Lines) as prompt dicts.

    Each non-blank line is a JSON object with either `prompt` (a string, chat-templated by the
    generator as one user message) or `messages` (a list of `{"role", "content"}` objects,
    sent as `messages=`), and an optional `category` (default "custom") that the bench report
    groups by. Other keys are ignored. Each returned dict holds `category`, `line` (its line
    number in the file) and `prompt` or `messages`.

    Raises ValueError naming the file and line of the first bad line and what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"prompt file {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {path}: {e}") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                prompts.append({**_prompt_entry(line), "line": n})
            except ValueError as e:
                raise ValueError(f"{path} line {n}: {e}") from None
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts: write one JSON object per "
                         'line, such as {"category": "chat", "prompt": "Why is the sky blue?"}')
    return prompts


def _prompt_entry(line: str) -> dict:
    """One line's prompt dict (without `line`); ValueError says what is wrong with it."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(entry, dict):
        raise ValueError(f"expected a JSON object with 'prompt' or 'messages', got "
                         f"{_json_type(entry)}")
    category = entry.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"'category' must be a non-empty string, got {category!r}")
    has_prompt, has_messages = "prompt" in entry, "messages" in entry
    if has_prompt and has_messages:
        raise ValueError("has both 'prompt' and 'messages': give one of them")
    if has_prompt:
        prompt = entry["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"'prompt' must be a string, got {_json_type(prompt)}")
        if not prompt.strip():
            raise ValueError("'prompt' is empty: give some text")
        return {"category": category, "prompt": prompt}
    if has_messages:
        return {"category": category, "messages": _messages(entry["messages"])}
    raise ValueError("has neither 'prompt' nor 'messages': give one of them")


def _messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        got = "an empty array" if messages == [] else _json_type(messages)
        raise ValueError("'messages' must be a non-empty array of {\"role\": ..., "
                         f"\"content\": ...}} objects, got {got}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got "
                             f"{_json_type(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = _json_type(m[key]) if key in m else "nothing"
                raise ValueError(f"messages[{i}] needs a string {key!r}, got {got}")
        if not m["role"].strip():
            raise ValueError(f"messages[{i}] has an empty 'role'")
    if not any(m["content"].strip() for m in messages):
        raise ValueError("every message's 'content' is empty: give some text")
    return [dict(m) for m in messages]  # other keys reach the chat template unchanged


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type, as a user wrote it."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def prompt_input(prompt: dict) -> dict:
    """The `Generator.generate` / `encode_prompt` keyword for a prompt dict: `messages=` for
    a conversation, `prompt=` for a string."""
    if "messages" in prompt:
        return {"messages": prompt["messages"]}
    return {"prompt": prompt["prompt"]}
