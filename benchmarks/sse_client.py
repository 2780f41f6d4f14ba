"""One streaming completion, read the way a client reads it: every SSE event kept, in-band errors kept apart.

The fault tests and benchmarks/faults.py judge a request by what the client saw: the HTTP status, the text,
`usage`, and whether any `{"error": ...}` event came in a 200 stream (the failure mode issue 11 measured).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    chunks: int = 0  # events that carried text
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # in-band error events (or the error body)
    done: bool = False  # saw `data: [DONE]`
    exception: str | None = None  # transport failure (connection reset, timeout)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.errors and self.exception is None


def stream_completion(
    url: str,
    body: dict[str, Any],
    result: StreamResult,
    timeout_s: float = 600.0,
    headers: dict[str, str] | None = None,
    stop_after_chunks: int | None = None,
) -> StreamResult:
    """POST /v1/completions with stream=True into `result` (filled as events arrive, so other threads can watch
    `result.chunks`); `stop_after_chunks`: hang up after that many text events (a client disconnect)."""
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout_s, headers=headers
        ) as r:
            result.status = r.status_code
            if r.status_code != 200:
                r.read()
                result.errors.append(r.json().get("error", {}) if r.content else {})
                return result
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    result.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.errors.append(event["error"])
                    continue
                if event.get("usage"):
                    result.usage = event["usage"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        result.text += choice["text"]
                        result.chunks += 1
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                if stop_after_chunks is not None and result.chunks >= stop_after_chunks:
                    break
    except (httpx.HTTPError, ValueError) as e:
        result.exception = f"{type(e).__name__}: {e}"
    return result


class StreamThread(threading.Thread):
    """`stream_completion` on its own thread; `result` fills while it runs."""

    def __init__(self, url: str, body: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.kwargs = url, body, kwargs
        self.result = StreamResult()

    def run(self) -> None:
        stream_completion(self.url, self.body, self.result, **self.kwargs)
