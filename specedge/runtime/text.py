"""Text <-> token ids with the bundle's `tokenizers` file and chat template (no transformers).

Chat templates are rendered the way transformers renders them: a sandboxed Jinja2
environment with trim_blocks / lstrip_blocks, `raise_exception`, and the special tokens as
variables; the rendered text is then tokenized without adding special tokens again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from specedge.runtime.bundle import Bundle
from specedge.runtime.errors import BundleError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class TextCodec:
    def __init__(self, bundle: Bundle):
        try:
            self.tokenizer = Tokenizer.from_file(str(bundle.tokenizer_path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise BundleError(f"cannot read {bundle.tokenizer_path}: {e}; "
                              "re-export the bundle") from e
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

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Plain text with the tokenizer's own special tokens (as `tokenizer(text)` does)."""
        return self.tokenizer.encode(text).ids

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Messages through the chat template, with the assistant turn opened."""
        if self._template is None:
            raise ValueError("this bundle has no chat template: pass prompt= (or --raw)")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        try:
            text = self._template.render(messages=list(messages), add_generation_prompt=True,
                                         **self._special)
        except TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def stream(self, chunks: Iterator[list[int]]) -> Iterator[str]:
        """Text pieces for token-id chunks; holds back bytes of an unfinished UTF-8 char."""
        state = DecodeStream(skip_special_tokens=True)
        for chunk in chunks:
            for token in chunk:
                piece = state.step(self.tokenizer, token)
                if piece:
                    yield piece
