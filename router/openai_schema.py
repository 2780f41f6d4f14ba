"""OpenAI request models (validated, strict types) and the error body shape.

Honour or refuse, never ignore: every field a model declares is applied (on the node through the SamplingSpec,
or here: stop strings, detokenization, chat templating, echo, best_of, tool calls); a vLLM or OpenAI parameter
we do not implement is a 400 naming it (`UNSUPPORTED`, unless sent with its no-op value), and so is any other
unknown field. Known ones are checked strictly ("5" is not an int) so a client bug surfaces as a 400 naming the
field instead of a silently coerced value. Numeric bounds come from protocol/job_limits.py, the module nodes
check their jobs with, so the two sides cannot drift. Structured output and tools live in router/guides.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from protocol import job_limits as L
from router.guide_schema import STRICT, NamedToolChoice, ResponseFormat, StructuredOutputs, Tool, ToolCall


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


_STRICT = STRICT  # strict types, unknown fields refused, no NaN/Infinity (router/guide_schema.py)

# vLLM / OpenAI parameters this server does not implement → the value that asks for nothing (sent by clients
# that fill in every default: accepted and dropped). Any other value is a 400 naming the parameter.
UNSUPPORTED: dict[str, Any] = {
    "suffix": None,
    "prompt_logprobs": None,
    "bad_words": [],
    "use_beam_search": False,
    "length_penalty": 1.0,
    "early_stopping": False,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "guided_decoding_backend": None,
    "priority": 0,
    "request_id": None,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "logprob_token_ids": None,
    "prompt_embeds": None,
    "documents": None,
    "mm_processor_kwargs": None,
    "media_io_kwargs": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "watermarking": False,
    "reasoning_effort": None,
    "thinking_token_budget": None,
    "include_reasoning": True,
    "functions": None,
    "function_call": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "web_search_options": None,
    "service_tier": None,
    "store": False,
    "metadata": None,
}


def _refuse_unsupported(data: Any, model: type[BaseModel]) -> Any:
    """Drop the unsupported parameters sent with their no-op value; a 400 naming any other unsupported or unknown
    one. Raises ApiError itself (not ValueError, which pydantic would report without the parameter's name)."""
    if not isinstance(data, dict):
        return data
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    for key in list(data):
        if key in known:
            continue
        if key in UNSUPPORTED:
            if data[key] is None or data[key] == UNSUPPORTED[key]:
                del data[key]
                continue
            raise bad_request(f"`{key}` is not supported by this server", key, "unsupported_parameter")
        raise bad_request(f"unknown parameter `{key:.64}`", str(key)[:64], "unknown_parameter")
    return data


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries the usage so far (guidellm sends it by default)
    continuous_usage_stats: bool = False


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
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=L.MAX_REPETITION_PENALTY)
    presence_penalty: float = Field(default=0.0, ge=-L.MAX_PENALTY, le=L.MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-L.MAX_PENALTY, le=L.MAX_PENALTY)
    min_tokens: int = Field(default=0, ge=0, le=L.MAX_TOKENS)
    # OpenAI's shape: token ids as JSON object keys (strings), biases in [-100, 100]
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-L.MAX_LOGIT_BIAS, le=L.MAX_LOGIT_BIAS)]],
            Field(max_length=L.MAX_LOGIT_BIAS_TOKENS),
        ]
        | None
    ) = None
    skip_special_tokens: bool = True
    # Like vLLM with a fast tokenizer (the only kind served here): decoding never puts spaces between special
    # tokens, so only True (the default) is what the output is.
    spaces_between_special_tokens: Literal[True] = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: Annotated[list[_TokenId], Field(min_length=1, max_length=L.MAX_ALLOWED_TOKEN_IDS)] | None = None
    # vLLM's: keep only this many prompt tokens, dropping from the left (or the right) end
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=L.MAX_PROMPT_TOKENS)
    truncation_side: Literal["left", "right"] = "left"

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        return _refuse_unsupported(data, cls)

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: _Stop) -> _Stop:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit() or int(key) > L.MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (decimal strings), got {key[:32]!r}")
        return v

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's continuous_usage_stats, which it honours only with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=64)]
        | Annotated[list[_TokenId], Field(min_length=1, max_length=L.MAX_PROMPT_TOKENS)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=L.MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=L.MAX_N)
    add_special_tokens: bool = True

    # Field validators (not a model validator) so the 400 names the parameter.
    @field_validator("prompt")
    @classmethod
    def _prompt_nonempty(cls, v: Any) -> Any:
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs needs prompt logprobs, which are not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v < info.data.get("n", 1):
            raise ValueError(f"best_of must be >= n ({info.data.get('n', 1)})")
        if v is not None and v > info.data.get("n", 1) and info.data.get("stream"):
            raise ValueError("best_of > n cannot be streamed: the best are known only at the end")
        return v

    @property
    def num_samples(self) -> int:
        """Sequences generated per prompt (best_of of them, the n best returned)."""
        return max(self.n, self.best_of or 1)

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
            return [list(self.prompt)]
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
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call
    # What the OpenAI SDK writes back when a client returns its response message as is: only empty values
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention: arguments as a dict when they parse)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        return out


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=L.MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=L.MAX_LOGPROBS)
    chat_template: str | None = Field(default=None, min_length=1, max_length=L.MAX_GUIDE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens it wants
    echo: bool = False  # vLLM's: the answer starts with the last message's content when that is the assistant's
    tools: Annotated[list[Tool], Field(max_length=64)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # with "required": False allows exactly one call

    @field_validator("continue_final_message")
    @classmethod
    def _continue_xor_generation_prompt(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message needs add_generation_prompt=false")
        return v

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
