"""HTTP requests a client should never send, each of which must get a 4xx (never a 5xx, never a dead router):
broken JSON, wrong types, out-of-range numbers, oversized or deeply nested bodies, unknown models, bad tokens."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

MODEL = "smollm2-135m"


@dataclass(frozen=True)
class BadInput:
    name: str
    path: str
    body: bytes | dict  # bytes go out verbatim as application/json
    content_type: str = "application/json"


def _chat(**kw: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def _completion(**kw: object) -> dict:
    return {"model": MODEL, "prompt": "hi", **kw}


BAD_INPUTS: list[BadInput] = [
    BadInput("invalid json", "/v1/completions", b"{not json"),
    BadInput("empty body", "/v1/completions", b""),
    BadInput("body not an object", "/v1/completions", b"[1, 2]"),
    BadInput("invalid utf-8", "/v1/completions", b'{"model": "\xff\xfe"}'),
    BadInput("lone surrogate", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "\\ud800"}'),
    BadInput("NaN temperature", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "temperature": NaN}'),
    BadInput(
        "5000-digit max_tokens",
        "/v1/completions",
        b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    ),
    BadInput("nesting 10000 deep", "/v1/completions", b"[" * 10000 + b"]" * 10000),
    BadInput("max_tokens a string", "/v1/completions", _completion(max_tokens="five")),
    BadInput("negative max_tokens", "/v1/completions", _completion(max_tokens=-1)),
    BadInput("temperature 9", "/v1/chat/completions", _chat(temperature=9)),
    BadInput("top_p 0", "/v1/completions", _completion(top_p=0)),
    BadInput("n 0", "/v1/completions", _completion(n=0)),
    BadInput("missing messages", "/v1/chat/completions", {"model": MODEL}),
    BadInput("message without role", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}),
    BadInput("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}),
    BadInput("prompt beyond the context", "/v1/completions", _completion(prompt="hello " * 9000)),
    BadInput("token id out of vocabulary", "/v1/completions", _completion(prompt=[1, 2, 10**9])),
    BadInput("negative token id", "/v1/completions", _completion(prompt=[-5])),
    BadInput("empty prompt", "/v1/completions", _completion(prompt="")),
    BadInput("stop a number", "/v1/completions", _completion(stop=7)),
    BadInput("logprobs 1000", "/v1/completions", _completion(logprobs=1000)),
    BadInput("wrong content type", "/v1/completions", b"model=x&prompt=y", "application/x-www-form-urlencoded"),
]


def send(url: str, bad: BadInput, headers: dict[str, str] | None = None) -> int:
    """The HTTP status the router answered `bad` with (0: no answer)."""
    try:
        if isinstance(bad.body, bytes):
            r = httpx.post(
                url + bad.path,
                content=bad.body,
                timeout=60,
                headers={**(headers or {}), "Content-Type": bad.content_type},
            )
        else:
            r = httpx.post(url + bad.path, json=bad.body, timeout=60, headers=headers)
    except httpx.HTTPError:
        return 0
    return r.status_code
