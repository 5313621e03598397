"""The OpenAI API's request and response shapes, as far as specedge serves them.

Requests are pydantic models in strict mode: a string where a number belongs is a 400, not
a silent conversion. Fields OpenAI defines and specedge cannot honour exactly (n > 1,
logprobs, tools, response_format, penalties, logit_bias) are refused with a message that
says so; fields nobody defined are ignored and logged (`unknown_fields`). The sampling
settings then go through the runtime's own `GenerationConfig`, so a bad value gets the
same check and message as in the Python API.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specedge.runtime.config import GenerationConfig, short_repr
from specedge.runtime.generator import GenerationResult
from specedge.runtime.pieces import Piece


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SpeculativeOptions(_Strict):
    """The request's speculative settings (an extension): None keeps the server's. `marks`
    asks for each token's kind and each step's counts with the text (`piece_marks`)."""

    enabled: bool = True
    drafter: str | None = None
    draft_tokens: int | Literal["auto"] | None = None
    draft_threshold: float | None = None
    marks: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


# Fields OpenAI defines whose effect specedge does not reproduce: a request that uses them
# is refused rather than answered as if it had not asked. A value equal to the default
# (what the client sends when it means "off") is accepted.
UNSUPPORTED = {
    "n": 1, "logprobs": False, "top_logprobs": None, "tools": None, "tool_choice": None,
    "functions": None, "function_call": None, "response_format": None, "logit_bias": None,
    "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False,
    "suffix": None, "parallel_tool_calls": None, "audio": None, "modalities": None,
    "prediction": None,
}
# Fields OpenAI defines that do not change the output: accepted without a warning.
HARMLESS = {"user", "metadata", "store", "service_tier", "reasoning_effort"}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's defaults: sampling at temperature 1. temperature 0 is greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None

    def check_supported(self) -> None:
        """400 for a field OpenAI defines that specedge does not reproduce."""
        for name, off in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name, off)
            if value not in (off, None) and value != [] and value != {"type": "text"}:
                raise bad_request(f"'{name}' is not supported by specedge's server (it "
                                  f"generates one exact completion per request); remove "
                                  f"it", param=name, code="unsupported_parameter")

    def unknown_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - set(UNSUPPORTED) - HARMLESS)

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def generation_config(self, max_new_tokens: int, draft_tokens: int | str | None,
                          drafter: str, draft_threshold: float = 0.0) -> GenerationConfig:
        """The runtime's settings for this request (its checks and messages); the server's
        speculative defaults where the request gives none."""
        spec = self.speculative or SpeculativeOptions()
        try:
            return GenerationConfig(
                max_new_tokens=max_new_tokens, temperature=self.temperature,
                top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=self.stop,
                use_draft=spec.enabled, drafter=spec.drafter or drafter,
                draft_tokens=spec.draft_tokens if spec.draft_tokens is not None
                else draft_tokens,
                draft_threshold=spec.draft_threshold if spec.draft_threshold is not None
                else draft_threshold)
        except ValueError as e:
            raise bad_request(str(e)) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def include_marks(self) -> bool:
        return bool(self.speculative and self.speculative.marks)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[int]


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> Any:
    """A request model from parsed JSON; a ValidationError becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"] if not _union_tag(x))
        raise bad_request(f"{where or 'body'}: {first['msg']} "
                          f"(got {short_repr(first.get('input'))})",
                          param=where or None) from None


def _union_tag(part: object) -> bool:
    """Whether a part of a pydantic error location names a member of a union (`str`,
    `list[str]`, `literal['auto']`) rather than a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool")
                                      or part.startswith(("list[", "literal[", "dict[")))


# ---- responses ------------------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, result: GenerationResult) -> dict:
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def speculative_stats(stats: dict) -> dict:
    """The request's speculative statistics (an extension field of every response)."""
    return {key: stats[key] for key in (
        "drafter", "draft_tokens_k", "target_calls", "drafted_tokens", "accepted_tokens",
        "acceptance_rate", "tokens_per_target_call", "acceptance_per_position")}


class Framing:
    """Response bodies for one request: a chat or text completion, whole or in chunks,
    all with the same id and creation time."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, result: GenerationResult, prompt_tokens: int,
              marks: Piece | None = None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason":
                                  FINISH_REASONS.get(result.stop_reason, "stop"),
                                  "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        spec = speculative_stats(result.stats)
        return {**self._head(self.object), "choices": [choice],
                "usage": usage(prompt_tokens, result),
                "speculative": spec | piece_marks(marks) if marks else spec}

    def chunk(self, piece: Piece | None = None, *, role: bool = False,
              finish: GenerationResult | None = None, usage_field: bool = False,
              marks: bool = False) -> dict:
        """One streamed chunk: the role (first), a piece's text (with its marks when
        `marks`), or the finish reason."""
        reason = FINISH_REASONS.get(finish.stop_reason, "stop") if finish else None
        text = piece.text if piece else None
        if self.chat:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason,
                      "logprobs": None}
            out = {**self._head("text_completion"), "choices": [choice]}
        if finish is not None:
            out["speculative"] = speculative_stats(finish.stats)
        elif marks and piece is not None:
            out["speculative"] = piece_marks(piece)
        if usage_field:
            out["usage"] = None  # OpenAI: null on every chunk but the last, when asked for
        return out

    def usage_chunk(self, result: GenerationResult, prompt_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, result)}


def piece_marks(piece: Piece) -> dict:
    """A piece's marks (an extension field of a streamed chunk, or of a whole answer, when
    the request asks for `speculative.marks`): `marks`, [characters, kind] for each token
    of the text in order, the kind one of runtime/pieces.py's TOKEN_KINDS; `steps`, the
    speculative steps (target calls) the piece completes, the prompt's first."""
    return {"marks": [[n, kind] for n, kind in piece.marks],
            "steps": [{"drafted": s.drafted, "accepted": s.accepted, "source": s.source}
                      for s in piece.steps]}
