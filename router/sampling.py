"""An OpenAI request → what each of its choices asks the nodes for (the wire SamplingSpec), the chat prompt as
the request's template options render it, and best_of's pick. Torch-free, like the rest of the router."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from protocol import job_limits as L
from protocol import messages as P
from router.guides import template_tools
from router.openai_schema import ChatCompletionRequest, CompletionRequest


def choice_seed(seed: int, index: int) -> int:
    """Choice i of a seeded request samples with seed + i, wrapped into int64 (the wire's range)."""
    return (seed + index - L.INT64_MIN) % (1 << 64) + L.INT64_MIN


def sampling_spec(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    index: int,
    num_logprobs: int | None,
    guide: P.GuideSpec | None,
) -> P.SamplingSpec:
    """The spec of the request's `index`-th sample of one prompt. best_of > n needs each token's logprob (the
    pick is by cumulative logprob), so it asks for at least the sampled token's."""
    if isinstance(body, CompletionRequest) and body.num_samples > body.n and num_logprobs is None:
        num_logprobs = 0
    return P.SamplingSpec(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(0, body.top_k),
        seed=None if body.seed is None else choice_seed(body.seed, index),
        stop_token_ids=list(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
        logprobs=num_logprobs,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        min_tokens=body.min_tokens,
        logit_bias=body.logit_bias_ids,
        allowed_token_ids=list(body.allowed_token_ids or []),
        guide=guide,
    )


def chat_prompt(tok: Any, body: ChatCompletionRequest) -> list[int]:
    """The conversation's token ids; ValueError for a template that fails on these messages."""
    return list(
        tok.apply_chat_template(
            [m.template_dict() for m in body.messages],
            body.add_generation_prompt,
            chat_template=body.chat_template,
            continue_final_message=body.continue_final_message,
            tools=template_tools(body),
            add_special_tokens=body.add_special_tokens,
            template_kwargs=body.chat_template_kwargs,
        )
    )


class Scored(Protocol):
    index: int
    cumulative_logprob: float


C = TypeVar("C", bound=Scored)


def keep_best(choices: Sequence[C], samples: int, n: int) -> list[C]:
    """best_of: of each prompt's `samples` consecutive choices, the n with the highest cumulative logprob (like
    vLLM), in that order, renumbered 0, 1, ... across prompts."""
    kept: list[C] = []
    for start in range(0, len(choices), samples):
        group = sorted(choices[start : start + samples], key=lambda c: c.cumulative_logprob, reverse=True)
        kept.extend(group[:n])
    for i, c in enumerate(kept):
        c.index = i
    return kept


def truncate(ids: list[int], body: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """truncate_prompt_tokens: the last (truncation_side left) or first k tokens of the prompt."""
    k = body.truncate_prompt_tokens
    if k is None or len(ids) <= k:
        return ids
    return ids[-k:] if body.truncation_side == "left" else ids[:k]


def echo_text(tok: Any, body: CompletionRequest | ChatCompletionRequest, prompt_index: int, ids: list[int]) -> str:
    """What echo=true puts before the generated text: a completion's prompt (as sent, or decoded when it was
    token ids or truncated); in a chat, the last message's content when the assistant wrote it (vLLM's)."""
    if not body.echo:
        return ""
    if isinstance(body, ChatCompletionRequest):
        last = body.messages[-1]
        return last.text() if last.role == "assistant" else ""
    prompt = body.prompts[prompt_index]
    if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
        return prompt
    return str(tok.decode(ids, skip_special_tokens=False))
