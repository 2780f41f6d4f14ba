"""`ResumableStream`: what the router remembers of a streamed `/v1/completions` answer from a vLLM decode instance, so
that when the instance dies mid-stream another one continues it where it stopped.

The router asks vLLM for the token ids (`return_token_ids`: the prompt's ids in the first chunk, each chunk's new
ids), strips them from the chunks unless the client asked for them, and on a broken stream sends the next decode
instance the prompt's ids followed by the ids generated so far, with `max_tokens` (and `min_tokens`) reduced by
their number, as a ucm-serve decode node resumes (docs/architecture.md, Faults). The new instance loads the prompt's
blocks from the store and recomputes the generated tail; greedy output continues as if nothing happened. The final
`usage` is rewritten to count the prompt and completion of the whole answer.

Only single-prompt, single-choice streams without `echo`, `best_of` or `logprobs` are resumable: the others'
chunks cannot be stitched from token ids alone. Chat streams are not (vLLM's chat endpoint takes no token ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_ID_FIELDS = ("token_ids", "prompt_token_ids")
_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default


def resumable(body: dict[str, Any]) -> bool:
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
    )
    return (
        single
        and body.get("n", 1) == 1
        and not body.get("echo")
        and not body.get("best_of")
        and body.get("logprobs") is None
        and not body.get("use_beam_search")
    )


@dataclass
class ResumableStream:
    body: dict[str, Any]  # the client's request
    prompt_ids: list[int] | None = None  # from the first chunk
    generated: list[int] = field(default_factory=list)
    offset: int = 0  # generated tokens that are part of the current upstream request's prompt
    finished: bool = False  # a choice reported its finish_reason

    @property
    def strip_ids(self) -> bool:
        return not self.body.get("return_token_ids")

    def upstream_body(self) -> dict[str, Any]:
        return {**self.body, "return_token_ids": True}

    def absorb(self, line: str) -> bytes | None:
        """One SSE line from upstream -> the bytes to send the client (None: nothing, e.g. a blank line)."""
        if not line.startswith("data: "):
            return None
        payload = line[len("data: ") :]
        if payload.strip() == "[DONE]":
            return b"data: [DONE]\n\n"
        chunk = json.loads(payload)
        for choice in chunk.get("choices") or []:
            if self.prompt_ids is None and choice.get("prompt_token_ids"):
                self.prompt_ids = list(choice["prompt_token_ids"])
            self.generated.extend(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.strip_ids:  # as vLLM answers a request without return_token_ids: the fields, null
                for name in _ID_FIELDS:
                    if name in choice:
                        choice[name] = None
        usage = chunk.get("usage")
        if usage and self.offset:
            usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.offset
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.offset
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def resume_body(self) -> dict[str, Any] | None:
        """The request that continues the answer elsewhere; None if it cannot (no prompt ids yet) or need not."""
        if self.prompt_ids is None or self.finished:
            return None
        max_tokens = self.body.get("max_tokens") or _DEFAULT_MAX_TOKENS
        left = max_tokens - len(self.generated)
        if left <= 0:
            return None
        self.offset = len(self.generated)
        resumed = {**self.upstream_body(), "prompt": self.prompt_ids + self.generated, "max_tokens": left}
        if self.body.get("min_tokens"):
            resumed["min_tokens"] = max(0, self.body["min_tokens"] - len(self.generated))
        return resumed
