"""What a request asks its output to follow. Torch- and xgrammar-free: the router and the node build it."""

from __future__ import annotations

import json
from dataclasses import dataclass

# One enum end to end, like FinishReason: the wire's (protocol/ is torch-free and below the engine).
from protocol.messages import GuideKind as GuidedKind


@dataclass(frozen=True)
class GuidedDecoding:
    kind: GuidedKind
    schema: str | None = None  # the JSON schema (as JSON text) or the regular expression; None for JSON_OBJECT

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuidedKind):
            raise ValueError(f"guided decoding kind must be a GuidedKind, got {self.kind!r}")
        if self.kind is GuidedKind.JSON_OBJECT:
            if self.schema is not None:
                raise ValueError("a json_object guide takes no schema")
            return
        if not isinstance(self.schema, str) or not self.schema:
            raise ValueError(f"a {self.kind.value} guide needs a non-empty schema string")
        if self.kind is GuidedKind.JSON_SCHEMA:
            try:
                parsed = json.loads(self.schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("a JSON schema must be an object or a boolean")

    @staticmethod
    def json_schema(schema: dict | bool) -> GuidedDecoding:
        # Keys keep the client's order: the grammar generates properties in schema order.
        return GuidedDecoding(GuidedKind.JSON_SCHEMA, json.dumps(schema))
