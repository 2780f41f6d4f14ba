"""Request models for structured output and tools (part of router/openai_schema.py's requests): OpenAI's
`response_format`, vLLM's `structured_outputs`, `tools` / `tool_choice` and the tool calls a conversation carries.
router/guides.py turns them into the grammar the nodes sample under."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol import job_limits as L

# Strict types, unknown fields refused, and no NaN/Infinity: json accepts them, no sampling parameter can.
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the grammar always enforces the schema


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_type(self) -> ResponseFormat:
        # A model validator: a field validator would not run when json_schema is left out.
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of the constraints (a `grammar` or `structural_tag` is refused)."""

    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1, max_length=L.MAX_GUIDE_CHARS)
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=256)] | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if sum(x is not None for x in (self.json_, self.regex, self.choice, self.json_object)) != 1:
            raise ValueError("exactly one of json, regex, choice, json_object is required")
        return self


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDef(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar always enforces the parameters' schema


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction
