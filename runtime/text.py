"""Text <-> token ids with the bundle's `tokenizers` file and chat template (no transformers).

Chat templates are rendered the way transformers renders them: a sandboxed Jinja2
environment with trim_blocks / lstrip_blocks, `raise_exception`, and the special tokens as
variables; the rendered text is then tokenized without adding special tokens again.

Message content is text, never control tokens: special-token text inside a message (say
`<|im_end|>` typed by a client) is tokenized as ordinary characters, so a message cannot
close its turn or open a forged system turn. Only the template's own markers become
special-token ids. Honest messages tokenize exactly as the rendered text does.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding, Tokenizer
from tokenizers.decoders import DecodeStream

from specedge.runtime.bundle import Bundle
from specedge.runtime.config import check_text, check_token_ids
from specedge.runtime.errors import BundleError

# Roles are identifiers ("system", "user", "assistant", "tool", ...): no whitespace, which a
# template would print around its markers, and no markup.
_ROLE = re.compile(r"[A-Za-z0-9_-]+")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


EMPTY_CHAT = "the message is empty: write something to ask"


class TextCodec:
    def __init__(self, bundle: Bundle):
        try:
            self.tokenizer = Tokenizer.from_file(str(bundle.tokenizer_path))
            # A second instance for message content, encoding special tokens as text. Kept
            # apart so the shared tokenizer's flag never changes while other threads encode.
            self._text_tokenizer = Tokenizer.from_file(str(bundle.tokenizer_path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise BundleError(f"cannot read {bundle.tokenizer_path}: {e}; "
                              "re-export the bundle") from e
        self._text_tokenizer.encode_special_tokens = True
        added = self.tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._special_texts = tuple(t.content for t in added.values() if t.special and t.content)
        self._template = None
        if bundle.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            try:
                self._template = env.from_string(bundle.chat_template)
            except TemplateError as e:
                raise BundleError(f"the bundle's chat template does not parse ({e}); "
                                  "re-export the bundle, or use raw prompts") from e
        self._special = {"bos_token": bundle.bos_token or "", "eos_token": bundle.eos_token or ""}
        self.vocab_size = bundle.target.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Plain text with the tokenizer's own special tokens (as `tokenizer(text)` does)."""
        return self.tokenizer.encode(check_text(text, "the prompt")).ids

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Messages through the chat template, with the assistant turn opened.

        Each message is a dict with a string "role" (letters, digits, "_" or "-") and a
        string "content"; other keys reach the template unchanged but may not hold
        special-token text. The template's markers become special-token ids; special-token
        text inside a message's content is tokenized as ordinary text.
        """
        if self._template is None:
            raise ValueError("this bundle has no chat template: pass prompt= (or --raw)")
        messages = list(messages)
        for i, m in enumerate(messages):
            self._check_message(m, i)
        text = self._render(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        if not any(i in self._special_ids for i in encoding.ids):
            return encoding.ids
        spans = self._content_spans(messages, text)
        if spans is None:
            if any(self._has_special_text(m["content"]) for m in messages):
                raise ValueError(
                    "a message's content holds special-token text (such as "
                    f"{self._special_in([m['content'] for m in messages])!r}) and this chat "
                    "template changes content in a way that cannot be traced, so it cannot be "
                    "kept as plain text: remove the special-token text from the messages")
            return encoding.ids
        return self._encode_pieces(text, encoding, spans)

    def chat_text(self, messages: Sequence[dict[str, Any]]) -> str:
        """The chat template's text for `messages`, the assistant turn opened (what
        `encode_chat` tokenizes). ValueError if the bundle has no template."""
        if self._template is None:
            raise ValueError("this bundle has no chat template: pass prompt= (or --raw)")
        return self._render(list(messages))

    def _check_message(self, m: Any, index: int) -> None:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or not _ROLE.fullmatch(role):
            raise ValueError(f"a message role must be a word of letters, digits, '_' or '-' "
                             f"(such as 'system', 'user', 'assistant'), got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"a message's content must be a string, got "
                             f"{type(content).__name__}: join text parts into one string")
        check_text(content, f"message {index}'s content")
        for key, value in m.items():
            if isinstance(value, str):
                check_text(value, f"message {index}'s {key!r}")
            if key not in ("role", "content") and self._has_special_text(value):
                raise ValueError(f"message field {key!r} holds special-token text "
                                 f"({self._special_in([value])!r}): remove it; only 'content' "
                                 "may hold such text, and it is read as plain text")

    def _render(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         **self._special)
        except TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from e

    def _has_special_text(self, value: Any) -> bool:
        return self._special_in([value]) is not None

    def _special_in(self, values: list[Any]) -> str | None:
        """The first special token's text found in these values (nested lists/dicts too)."""
        stack = list(values)
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                for s in self._special_texts:
                    if s in v:
                        return s
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
        return None

    def _content_spans(self, messages: list[dict[str, Any]],
                       text: str) -> list[tuple[int, int]] | None:
        """Character spans of the messages' content in the rendered `text`, or None when the
        template transforms content beyond trimming whitespace.

        The template is rendered again with a unique marker in place of each content; the
        text between markers is the template's own, and each marker stands for the content
        as written or stripped of surrounding whitespace (Jinja's `trim`), whichever makes
        the pieces add up to `text` exactly.
        """
        nonce = secrets.token_hex(8)
        while nonce in text:
            nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{nonce}{i}\ue001"} for i, m in enumerate(messages)]
        try:
            skeleton = self._template.render(messages=marked, add_generation_prompt=True,
                                              **self._special)
        except TemplateError:
            return None
        parts = re.split(f"\ue000{nonce}(\\d+)\ue001", skeleton)
        fixed, slots = parts[0::2], [int(i) for i in parts[1::2]]
        if any(i >= len(messages) for i in slots):
            return None
        choices = []
        for i in slots:
            c = messages[i]["content"]
            choices.append(list(dict.fromkeys((c, c.strip(), c.lstrip(), c.rstrip()))))
        # Depth-first over the choices; a (slot, position) pair already tried led nowhere.
        failed: set[tuple[int, int]] = set()
        stack: list[tuple[int, int, list[tuple[int, int]]]] = [(0, 0, [])]
        while stack:
            k, pos, found = stack.pop()
            if not text.startswith(fixed[k], pos):
                continue
            pos += len(fixed[k])
            if k == len(slots):
                if pos == len(text):
                    return found
                continue
            if (k, pos) in failed:
                continue
            failed.add((k, pos))
            for c in reversed(choices[k]):
                if text.startswith(c, pos):
                    stack.append((k + 1, pos + len(c), [*found, (pos, pos + len(c))]))
        return None

    def _encode_pieces(self, text: str, encoding: Encoding,
                       spans: list[tuple[int, int]]) -> list[int]:
        """Keeps the template's special tokens and tokenizes the text between them, content
        included, with special tokens read as text."""
        def in_content(a: int, b: int) -> bool:
            return any(text[max(a, s):min(b, e)].strip() for s, e in spans)

        specials = [(a, b, i) for i, (a, b) in zip(encoding.ids, encoding.offsets)
                    if i in self._special_ids]
        markers = [(a, b, i) for a, b, i in specials if not in_content(a, b)]
        if len(markers) == len(specials):  # no special token inside content: as rendered
            return encoding.ids
        ids: list[int] = []
        pos = 0
        for a, b, i in markers:
            if a > pos:
                ids += self._text_tokenizer.encode(text[pos:a], add_special_tokens=False).ids
            ids.append(i)
            pos = max(pos, b)
        if pos < len(text):
            ids += self._text_tokenizer.encode(text[pos:], add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decoder(self) -> Callable[[int], str]:
        """A function from each next token of a generation to the text it adds: "" for a
        token that ends inside a UTF-8 character, which the token completing it adds
        whole."""
        state = DecodeStream(skip_special_tokens=True)
        return lambda token: state.step(self.tokenizer, token) or ""

    def encode_prompt(self, prompt: str | None = None,
                      prompt_ids: Sequence[int] | None = None,
                      messages: Sequence[dict[str, str]] | None = None,
                      raw: bool = False) -> list[int]:
        """The token ids a generation starts from: exactly one of `prompt` (chat-templated
        unless `raw` or the bundle has no template), `prompt_ids` or `messages`, checked
        against the vocabulary; ValueError says what is wrong."""
        given = [x is not None for x in (prompt, prompt_ids, messages)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of prompt, prompt_ids or messages")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            chat = not raw and self.has_chat_template
            # One rule for every way in (a prompt, messages; the API, the CLI): no text at
            # all is refused, in the words of its mode.
            if not check_text(prompt, "the prompt").strip():
                raise ValueError(EMPTY_CHAT if chat else
                                 "prompt is empty: give some text to continue")
            if chat:
                ids = self.encode_chat([{"role": "user", "content": prompt}])
            else:
                ids = self.encode(prompt)
        elif messages is not None:
            if not messages:
                raise ValueError("messages is empty: give at least one message")
            ids = self.encode_chat(messages)
            if not any(isinstance(m.get("content"), str) and m["content"].strip()
                       for m in messages):
                raise ValueError(EMPTY_CHAT)
        else:
            ids = prompt_ids
        ids = check_token_ids(ids, self.vocab_size)
        if not ids:
            raise ValueError("the prompt encodes to no tokens: give some text to continue")
        return ids
