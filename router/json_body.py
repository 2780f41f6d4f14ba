"""A request body → one JSON object, refusing with a 400 what stdlib `json` accepts but nothing after it can handle.

- integer literals longer than 20 digits (beyond 64 bits) become a `HugeInt` marker instead of an int, so the
  schema's strict int check names the parameter (and Python never converts a 5000-digit string);
- NaN / Infinity literals are refused (JSON has no such numbers; a sampling parameter cannot be one);
- nesting deeper than MAX_DEPTH is refused (and the C parser's RecursionError beyond ~1000 levels is a 400);
- strings with lone surrogates (`"\\ud800"`) are refused: they cannot be encoded as UTF-8, so the tokenizer or
  the error response itself would fail on them.

CPU-bound on large bodies: the router calls it on a worker thread, never on the event loop.
"""

from __future__ import annotations

import json
from typing import Any

from router.openai_schema import bad_request

MAX_DEPTH = 32
MAX_INT_DIGITS = 20  # 2**64 has 20 digits: anything longer cannot fit any parameter


class HugeInt:
    """An integer literal too long for any parameter; the schema rejects it as 'not an integer'."""

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def __repr__(self) -> str:
        return f"{self.literal[:12]}… ({len(self.literal)} digits)"


def _parse_int(literal: str) -> int | HugeInt:
    return HugeInt(literal) if len(literal.lstrip("-")) > MAX_INT_DIGITS else int(literal)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _is_utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_tree(obj: dict[str, Any]) -> None:
    """Depth and string checks; the offending top-level key is the error's param."""
    stack: list[tuple[Any, int, str | None]] = [(obj, 1, None)]
    while stack:
        item, depth, param = stack.pop()
        if isinstance(item, str):
            if not _is_utf8(item):
                raise bad_request("strings must be valid Unicode (no lone surrogates)", param)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise bad_request(f"JSON nested deeper than {MAX_DEPTH} levels", param)
        if isinstance(item, dict):
            for key, value in item.items():
                if not _is_utf8(key):
                    raise bad_request("strings must be valid Unicode (no lone surrogates)", param)
                stack.append((value, depth + 1, key if param is None else param))
        else:  # numbers need no check: skip them here (a prompt of token ids is a long list of them)
            stack.extend((value, depth + 1, param) for value in item if isinstance(value, (str, dict, list)))


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict, or ApiError(400)."""
    try:
        obj = json.loads(raw, parse_int=_parse_int, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise bad_request(f"invalid JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    _check_tree(obj)
    return obj
