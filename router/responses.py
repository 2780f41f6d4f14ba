"""OpenAI response bodies: a whole completion / chat completion, one streamed choice delta, and logprobs in
OpenAI's two shapes (chat's `content` list, completions' parallel arrays)."""

from __future__ import annotations

from typing import Any

from protocol import messages as P
from router.serving import Choice, Chunk


def logprobs_json(tok: Any, lps: list[P.TokenLogprob], chat: bool) -> dict[str, Any] | None:
    if not lps:
        return None

    def text(t: int) -> str:
        return str(tok.decode([t], skip_special_tokens=False))

    if chat:
        return {
            "content": [
                {
                    "token": text(lp.token_id),
                    "logprob": lp.logprob,
                    "bytes": list(text(lp.token_id).encode()),
                    "top_logprobs": [
                        {"token": text(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in lp.top
                    ],
                }
                for lp in lps
            ]
        }
    return {
        "tokens": [text(lp.token_id) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": [],
    }


def final_choice(tok: Any, c: Choice, chat: bool) -> dict[str, Any]:
    """One choice of a non-streamed answer."""
    lp = logprobs_json(tok, c.logprobs, chat) if c.num_logprobs is not None else None
    if chat:
        calls = c.tool_calls()
        if calls is not None:  # a forced tool call (router/guides.py)
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
            return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": "tool_calls"}
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": lp,
            "finish_reason": c.finish_reason,
        }
    return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}


def delta_choice(tok: Any, ch: Chunk, chat: bool, first: bool) -> dict[str, Any]:
    """One choice of a streamed chunk; `first`: the choice's first chunk (chat announces the role there)."""
    lp = logprobs_json(tok, ch.logprobs, chat)
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ch.text} if first else {"content": ch.text}
        if ch.tool_calls is not None:  # streamed whole, like a parser that has seen the complete call
            delta.update(content=None, tool_calls=[{"index": i, **c} for i, c in enumerate(ch.tool_calls)])
        return {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": ch.finish_reason}
    return {"index": ch.index, "text": ch.text, "logprobs": lp, "finish_reason": ch.finish_reason}
