"""Structured output at the router: `response_format` and `tools` / `tool_choice` → the grammar the node samples
under (a wire GuideSpec, compiled there with xgrammar), and the generated text → OpenAI `tool_calls`.

Tool calls are forced, never guessed: "required" makes the model write a JSON array of {"name", "parameters"}
objects, one of the tools each (vLLM's form); a named function makes it write that function's arguments.
"auto" would need a model-specific parser to tell a call from prose, so it is refused; "none" generates text
(the tools still reach the chat template)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from protocol import job_limits as L
from protocol import messages as P
from router.guide_schema import NamedToolChoice, ResponseFormat, StructuredOutputs
from router.openai_schema import ChatCompletionRequest, CompletionRequest, bad_request


@dataclass(frozen=True)
class ToolCallFormat:
    """How a choice's text becomes tool calls: `function` named (the text is its arguments) or, with None, a
    JSON array of {"name", "parameters"} objects."""

    function: str | None

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI tool_calls, or None when the text is not a complete call (e.g. cut by max_tokens)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.function is not None:
            calls = [(self.function, value)]
        elif isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value):
            calls = [(c["name"], c.get("parameters", {})) for c in value]
        else:
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(a)},
            }
            for n, a in calls
        ]


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


def _schema_problem(schema: Any, root: Any) -> str | None:
    """The first mistake the node's grammar compiler would refuse (unknown type, bad pattern, dangling local
    $ref), found here so it is a 400 and not a failed job. Not a full meta-schema check: the node has the last
    word, and what it refuses comes back as a failed request naming the reason."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        for t in types if isinstance(types, list) else [types] if types is not None else []:
            if t not in _JSON_TYPES:
                return f"unknown type {str(t)[:32]!r}"
        if isinstance(node.get("pattern"), str):
            try:
                re.compile(node["pattern"])
            except re.error as e:
                return f"bad pattern {node['pattern'][:32]!r}: {e}"
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = root
            for part in filter(None, ref[1:].split("/")):
                target = target.get(part) if isinstance(target, dict) else None
            if target is None:
                return f"$ref {ref[:64]!r} points nowhere"
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())  # name → schema: the names are not keywords
            elif key not in ("const", "enum", "default", "examples"):
                stack.append(value)
    return None


def _schema_guide(schema: Any, param: str) -> P.GuideSpec:
    problem = _schema_problem(schema, schema)
    if problem is not None:
        raise bad_request(f"the JSON schema cannot be enforced: {problem}", param)
    text = json.dumps(schema)
    if len(text) > L.MAX_GUIDE_CHARS:
        raise bad_request(f"the schema has {len(text)} characters; the limit is {L.MAX_GUIDE_CHARS}", param)
    return P.GuideSpec(P.GuideKind.JSON_SCHEMA, text)


def _response_guide(fmt: ResponseFormat | None) -> P.GuideSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return P.GuideSpec(P.GuideKind.JSON_OBJECT)
    assert fmt.json_schema is not None, "the schema validator requires json_schema with type json_schema"
    return _schema_guide(fmt.json_schema.schema_ or {"type": "object"}, "response_format")


_REGEX_SPECIAL = frozenset("\\.^$*+?()[]{}|")


def _literal_regex(text: str) -> str:
    """`text` as a regular expression matching itself (only metacharacters escaped: xgrammar warns on others)."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def _structured_guide(so: StructuredOutputs) -> P.GuideSpec:
    param = "structured_outputs"
    if so.json_object:
        return P.GuideSpec(P.GuideKind.JSON_OBJECT)
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise bad_request(f"structured_outputs.json is not valid JSON: {e}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise bad_request("structured_outputs.json must be a JSON schema (an object)", param)
        return _schema_guide(schema, param)
    if so.choice is not None:
        return P.GuideSpec(P.GuideKind.REGEX, "(" + "|".join(_literal_regex(c) for c in so.choice) + ")")
    if so.regex is not None:
        try:
            re.compile(so.regex)
        except re.error as e:
            raise bad_request(f"structured_outputs.regex is not a regular expression: {e}", param) from None
        return P.GuideSpec(P.GuideKind.REGEX, so.regex)
    raise bad_request("structured_outputs.json_object must be true when it is the constraint", param)


def _tool_guide(body: ChatCompletionRequest) -> tuple[P.GuideSpec | None, ToolCallFormat | None]:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, None
    if choice == "none":
        return None, None
    if choice in (None, "auto"):
        raise bad_request(
            'tool_choice "auto" is not supported (a call cannot be told from text reliably): use "required", a '
            'named function, or "none"',
            "tool_choice",
            "unsupported_parameter",
        )
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("response_format cannot be combined with forced tool calls", "response_format")
    if body.structured_outputs is not None:
        raise bad_request("structured_outputs cannot be combined with forced tool calls", "structured_outputs")
    params = {t.function.name: t.function.parameters or {"type": "object"} for t in body.tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in params:
            raise bad_request(f"tool_choice names {name[:64]!r}, which is not among the tools", "tool_choice")
        return _schema_guide(params[name], "tools"), ToolCallFormat(name)
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n, p in params.items()
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not body.parallel_tool_calls:
        array["maxItems"] = 1
    return _schema_guide(array, "tools"), ToolCallFormat(None)


def request_guide(body: CompletionRequest | ChatCompletionRequest) -> tuple[P.GuideSpec | None, ToolCallFormat | None]:
    """The grammar a request's choices sample under, and how their text becomes tool calls (None: it does not)."""
    if isinstance(body, ChatCompletionRequest):
        guide, tools = _tool_guide(body)
        if guide is not None:
            return guide, tools
    response = _response_guide(body.response_format)
    if body.structured_outputs is None:
        return response, None
    if response is not None:
        raise bad_request("use response_format or structured_outputs, not both", "structured_outputs")
    return _structured_guide(body.structured_outputs), None


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (HF's convention: OpenAI's JSON shape)."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
