"""`ResumableStream`: what the router remembers of a streamed `/v1/completions` answer from a vLLM decode instance, so
that when the instance dies mid-stream another one continues it where it stopped.

The router asks vLLM for the token ids (`return_token_ids`: the prompt's ids in the first chunk, each chunk's new
ids), strips them from the chunks unless the client asked for them, and on a broken stream sends the next decode
instance the prompt's ids followed by the ids generated so far, with `max_tokens` (and `min_tokens`) reduced by
their number, as a ucm-serve decode node resumes (docs/architecture.md, Faults). The new instance loads the prompt's
blocks from the store and recomputes the generated tail; greedy output continues as if nothing happened. The final
`usage` is rewritten to count the prompt and completion of the whole answer.

Chat streams resume on `/v1/completions` (vLLM's chat endpoint takes no token ids): the chat's prompt ids (its
template applied by the first instance) + the generated ids, the chat's sampling parameters, and each completion
chunk turned back into a chat chunk (`delta.content`) under the chat's id. Only single-prompt, single-choice
streams without `echo`, `best_of`, `logprobs`, tools or structured output are resumable: the others' chunks cannot
be stitched from token ids alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_ID_FIELDS = ("token_ids", "prompt_token_ids")
_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default
# A chat's request fields that mean the same to /v1/completions: what a resumed chat carries over.
_CHAT_SAMPLING = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "stream_options",
    "cache_salt",
)
_CHAT_UNRESUMABLE = ("tools", "tool_choice", "functions", "response_format", "structured_outputs", "top_logprobs")


def resumable(body: dict[str, Any], chat: bool = False) -> bool:
    if chat:
        single = isinstance(body.get("messages"), list) and not any(body.get(k) for k in _CHAT_UNRESUMABLE)
        return single and body.get("n", 1) == 1 and not body.get("logprobs") and not body.get("use_beam_search")
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
    chat: bool = False  # a /v1/chat/completions stream (resumed on /v1/completions, chunks turned back into chat's)
    prompt_ids: list[int] | None = None  # from the first chunk
    generated: list[int] = field(default_factory=list)
    offset: int = 0  # generated tokens that are part of the current upstream request's prompt
    finished: bool = False  # a choice reported its finish_reason
    resumed: bool = False  # upstream is now a /v1/completions continuation
    head: dict[str, Any] = field(default_factory=dict)  # the chat stream's id, created, model (for turned chunks)

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
        if self.chat and not self.resumed:
            self.head = self.head or {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
            if self.prompt_ids is None and chunk.get("prompt_token_ids"):
                self.prompt_ids = list(chunk["prompt_token_ids"])
            if self.strip_ids and "prompt_token_ids" in chunk:
                chunk["prompt_token_ids"] = None
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
        if self.chat and self.resumed:
            chunk = self._as_chat(chunk)
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def _as_chat(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A /v1/completions chunk of the continuation as the chat stream's next chunk."""
        out: dict[str, Any] = {**self.head, "object": "chat.completion.chunk"}
        out["choices"] = [
            {
                "index": c.get("index", 0),
                "delta": {"content": c.get("text", "")},
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
                "token_ids": c.get("token_ids"),
            }
            for c in chunk.get("choices") or []
        ]
        if "usage" in chunk:
            out["usage"] = chunk["usage"]
        return out

    def needs_model_len(self) -> bool:
        """A chat without a token limit runs to the context's end: its continuation needs the model's length."""
        return self.chat and not (self.body.get("max_completion_tokens") or self.body.get("max_tokens"))

    def resume_body(self, max_model_len: int | None = None) -> dict[str, Any] | None:
        """The /v1/completions request that continues the answer elsewhere; None if it cannot (no prompt ids yet,
        or a chat without a token limit and no `max_model_len`) or need not."""
        if self.prompt_ids is None or self.finished:
            return None
        prompt = self.prompt_ids + self.generated
        if self.chat:
            limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
            if limit:
                left = limit - len(self.generated)
            elif max_model_len is not None:
                left = max_model_len - len(prompt)
            else:
                return None
            base = {k: self.body[k] for k in _CHAT_SAMPLING if k in self.body}
            resumed = {**base, "stream": True, "return_token_ids": True, "prompt": prompt, "max_tokens": left}
        else:
            left = (self.body.get("max_tokens") or _DEFAULT_MAX_TOKENS) - len(self.generated)
            resumed = {**self.upstream_body(), "prompt": prompt, "max_tokens": left}
        if left <= 0:
            return None
        self.offset = len(self.generated)
        self.resumed = True
        if self.body.get("min_tokens"):
            resumed["min_tokens"] = max(0, self.body["min_tokens"] - len(self.generated))
        return resumed
