"""OpenAI request models (validated, strict types) and the error body shape.

Unknown fields are ignored like OpenAI does; known ones are checked strictly ("5" is not an int) so a
client bug surfaces as a 400 naming the field instead of a silently coerced value. Numeric bounds come from
protocol/job_limits.py, the module nodes check their jobs with, so the two sides cannot drift.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from protocol import job_limits as L


class ApiError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# Strict types, unknown fields ignored, and no NaN/Infinity: json accepts them, no sampling parameter can.
_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


_Stop = str | Annotated[list[str], Field(max_length=L.MAX_STOP_STRINGS)] | None
_TokenId = Annotated[int, Field(ge=0, le=L.MAX_TOKEN_ID)]


class _Common(BaseModel):
    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=L.MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=L.MIN_TEMPERATURE, le=L.MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=L.MAX_TOP_K)
    n: int = Field(default=1, ge=1, le=L.MAX_N)
    stop: _Stop = None
    stop_token_ids: Annotated[list[_TokenId], Field(max_length=L.MAX_STOP_TOKEN_IDS)] = []
    seed: int | None = Field(default=None, ge=L.INT64_MIN, le=L.INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=L.MAX_CACHE_SALT_CHARS)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: _Stop) -> _Stop:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=64)]
        | Annotated[list[_TokenId], Field(min_length=1, max_length=L.MAX_PROMPT_TOKENS)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=L.MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=L.MAX_N)

    # Field validators (not a model validator) so the 400 names the parameter.
    @field_validator("prompt")
    @classmethod
    def _prompt_nonempty(cls, v: Any) -> Any:
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported")
        return v

    @property
    def num_prompts(self) -> int:
        return 1 if isinstance(self.prompt, str) or isinstance(self.prompt[0], int) else len(self.prompt)

    @property
    def prompt_chars(self) -> int:
        return sum(len(p) for p in self.prompts if isinstance(p, str))

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=L.MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=L.MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return v

    @property
    def num_prompts(self) -> int:
        return 1  # the chat template makes one prompt of all the messages

    @property
    def prompt_chars(self) -> int:
        return sum(len(m.text()) + len(m.name or "") for m in self.messages)

    @property
    def limit_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
