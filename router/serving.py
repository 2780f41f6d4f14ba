"""OpenAI completions and chat completions on top of the Dispatcher: tokenization, length checks, n choices,
stop strings, logprobs, SSE chunks or one JSON body, usage and latency metrics.

Tokenizing and chat templating run on one worker thread (`pool`), after the prompt's characters and the
request's fan-out were checked: a huge prompt costs that thread, never the event loop (`/health`, streams).
One thread also keeps the fast tokenizer single-user (it is not safe to share across threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from protocol import job_limits as L
from protocol import messages as P
from router.admission import AdmissionQueue, Ticket
from router.detokenizer import IncrementalDetokenizer
from router.dispatcher import Dispatcher, SeqRequest, SeqTrace
from router.guides import ToolCallFormat, request_guide
from router.metrics import RouterMetrics
from router.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest, bad_request
from router.sampling import chat_prompt, echo_text, keep_best, sampling_spec, truncate

_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Choice:
    index: int
    seq: SeqRequest
    detok: IncrementalDetokenizer
    num_logprobs: int | None
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: list[P.TokenLogprob] = field(default_factory=list)
    cache: P.CacheInfo | None = None  # where the prompt came from, as the node that prefilled it reported
    ttft_s: float | None = None
    echo: str = ""  # the prompt's text, returned before the completion (echo=true)
    tools: ToolCallFormat | None = None  # the text is a forced tool call
    cumulative_logprob: float = 0.0  # of the sampled tokens (known when the node sends logprobs)
    best_of: tuple[int, int] | None = None  # (samples per prompt, n returned) when best_of > n

    @property
    def text(self) -> str:
        return self.echo + self.detok.text

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """OpenAI tool_calls when this choice's text is a complete forced call, else None."""
        return self.tools.parse(self.detok.text) if self.tools is not None and self.finish_reason == "stop" else None


@dataclass(frozen=True)
class Chunk:
    """One increment of one choice, as the SSE layer needs it."""

    index: int
    text: str
    logprobs: list[P.TokenLogprob]
    finish_reason: str | None
    tool_calls: list[dict[str, Any]] | None = None  # a forced tool call, whole, in the choice's last chunk


class OpenAIServing:
    def __init__(
        self,
        dispatcher: Dispatcher,
        admission: AdmissionQueue,
        tokenizer: Any,
        metrics: RouterMetrics,
        model_name: str,
        max_model_len: int | None,
        *,
        pool: ThreadPoolExecutor | None = None,
        max_prompt_chars: int = 1 << 20,
        max_sequences: int = 64,
    ) -> None:
        self.dispatcher = dispatcher
        self.admission = admission
        self.tok = tokenizer
        self.metrics = metrics
        self.model_name = model_name
        self.max_model_len_cap = max_model_len
        self.pool = pool
        self.max_prompt_chars = max_prompt_chars
        self.max_sequences = max_sequences

    # ------------------------------------------------------------------ request → choices

    def max_model_len(self) -> int:
        return self._max_model_len()

    def _max_model_len(self) -> int:
        node_len = self.dispatcher.registry.max_model_len()
        lens = [x for x in (node_len, self.max_model_len_cap) if x]
        return min(lens) if lens else 2048

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found"
            )

    def check_size(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """Refuse, before any tokenizing, a request whose prompts are too long to be worth reading or that asks
        for too many sequences."""
        chat = isinstance(body, ChatCompletionRequest)
        sequences = body.num_prompts * (body.num_samples if isinstance(body, CompletionRequest) else body.n)
        if sequences > self.max_sequences:
            raise bad_request(
                f"this request asks for {sequences} sequences (prompts x n); the limit is {self.max_sequences}", "n"
            )
        if body.prompt_chars > self.max_prompt_chars:
            raise bad_request(
                f"the prompt has {body.prompt_chars} characters; the limit is {self.max_prompt_chars}",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )

    def _tokenize(self, body: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        if isinstance(body, ChatCompletionRequest):
            try:
                return [truncate(chat_prompt(self.tok, body), body)]
            except Exception as e:  # a template error is the client's messages' (or template's) fault
                raise bad_request(
                    f"cannot apply the chat template: {e}", "chat_template" if body.chat_template else "messages"
                ) from e
        prompts = []
        for p in body.prompts:
            ids = self.tok.encode(p, add_special_tokens=body.add_special_tokens) if isinstance(p, str) else p
            if any(t < 0 or t >= self.tok.vocab_size for t in ids):
                raise bad_request("prompt token ids must be in [0, vocab_size)", "prompt")
            prompts.append(truncate(ids, body))
        return prompts

    async def build_choices(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[list[Choice], int]:
        self._check_model(body.model)
        self.check_size(body)
        guide, tools = request_guide(body)  # before tokenizing: a refused tool_choice costs no template
        prompts = await asyncio.get_running_loop().run_in_executor(self.pool, self._tokenize, body)
        if isinstance(body, ChatCompletionRequest):
            limit, num_logprobs, samples = body.limit_tokens, body.num_logprobs, body.n
        else:
            limit, num_logprobs = body.max_tokens or _DEFAULT_COMPLETION_TOKENS, body.logprobs
            samples = body.num_samples
        max_len = self._max_model_len()
        self.dispatcher.check_available()
        base = uuid.uuid4().hex[:16]
        choices: list[Choice] = []
        for pi, ids in enumerate(prompts):
            if not ids:
                raise bad_request("prompt is empty after tokenization", "prompt")
            if len(ids) >= max_len:
                raise bad_request(
                    f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                    f"{len(ids)} tokens.",
                    "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                    "context_length_exceeded",
                )
            max_tokens = limit if limit is not None else max_len - len(ids)
            if len(ids) + max_tokens > max_len:
                raise bad_request(
                    f"This model's maximum context length is {max_len} tokens. However, you requested "
                    f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion).",
                    "max_tokens",
                    "context_length_exceeded",
                )
            echo = echo_text(self.tok, body, pi, ids)
            for i in range(samples):
                params = sampling_spec(body, max_tokens, i, num_logprobs, guide)
                seq = SeqRequest(f"{base}-{pi}-{i}", list(ids), params, body.cache_salt)
                try:  # the nodes check every job with the same bounds: a job they would refuse never leaves
                    if i == 0:
                        job = P.DecodeJob(seq.request_id, seq.prompt_token_ids, params, cache_salt=body.cache_salt)
                        L.check_job(job, self.tok.vocab_size)
                    else:  # same prompt: only the seed differs
                        L.check_spec(params)
                except L.OutOfBounds as e:
                    raise bad_request(e.message, e.param) from e
                detok = IncrementalDetokenizer(
                    self.tok, body.stop_list, body.skip_special_tokens, body.include_stop_str_in_output
                )
                choices.append(Choice(len(choices), seq, detok, num_logprobs, echo=echo, tools=tools))
                if samples > body.n:
                    choices[-1].best_of = (samples, body.n)
        return choices, sum(len(p) for p in prompts) * samples

    # ------------------------------------------------------------------ running choices

    async def _run_choice(self, choice: Choice, t0: float, out: asyncio.Queue[Chunk | BaseException]) -> None:
        trace = SeqTrace()
        first_at: float | None = None
        last_at = t0
        echoed = False
        try:
            gen = self.dispatcher.generate(choice.seq, trace)
            async with contextlib.aclosing(gen):
                async for event in gen:
                    if event.token_ids:
                        now = time.monotonic()
                        if first_at is None:
                            first_at = now
                            choice.ttft_s = now - t0
                            self.metrics.ttft.observe(now - t0)
                        else:  # a batch of k tokens: k gaps of the mean width
                            for _ in event.token_ids:
                                self.metrics.itl.observe((now - last_at) / len(event.token_ids))
                        last_at = now
                    choice.num_tokens += len(event.token_ids)
                    choice.cumulative_logprob += sum(lp.logprob for lp in event.logprobs or [])
                    lps = list(event.logprobs or []) if choice.num_logprobs is not None else []
                    delta = choice.detok.add(event.token_ids, final=event.finished)
                    if delta.stopped:
                        choice.finish_reason = "stop"
                    elif event.finished:
                        reason = event.finish_reason or P.FinishReason.STOP
                        choice.finish_reason = "length" if reason is P.FinishReason.LENGTH else reason.value
                    choice.logprobs.extend(lps)
                    text = delta.text
                    if choice.echo and not echoed:  # echo: the prompt's text leads the choice's first chunk
                        text, echoed = choice.echo + text, True
                    if choice.tools is not None:  # a forced call streams as one tool_calls delta at its end
                        text = ""
                        if choice.finish_reason:
                            calls = choice.tool_calls()
                            if calls is not None:
                                out.put_nowait(Chunk(choice.index, "", lps, "tool_calls", calls))
                                break
                            text = choice.detok.text  # not a complete call (cut by max_tokens): the text as is
                    if text or lps or choice.finish_reason:
                        out.put_nowait(Chunk(choice.index, text, lps, choice.finish_reason))
                    if choice.finish_reason:
                        break
            if choice.finish_reason is None:
                raise ApiError(502, "a node ended the stream without finishing", "server_error")
        except BaseException as e:
            out.put_nowait(e)
            if not isinstance(e, Exception):
                raise
            return
        finally:
            end = time.monotonic()
            self.metrics.generation_tokens.inc(choice.num_tokens)
            for role, info in trace.caches:
                self.metrics.record_cache(role, info)
            choice.cache = prompt_cache(trace.caches)
            if choice.cache is not None:
                self.metrics.vllm.record_prompt(choice.cache)
            self.metrics.vllm.record_finish(choice.finish_reason)
            self.metrics.prefill_retries.inc(max(0, trace.prefill_attempts - 1))
            if trace.stale_route():
                self.metrics.stale_routes.inc()
            if trace.local_prefill:
                self.metrics.local_prefills.inc()
            self.metrics.decode_resumes.inc(trace.decode_resumes)
            if first_at is not None:
                self.metrics.e2e.observe(end - t0)
                if choice.num_tokens > 1:
                    self.metrics.tpot.observe((end - first_at) / (choice.num_tokens - 1))

    async def run(self, choices: list[Choice], prompt_tokens: int, ticket: Ticket) -> AsyncGenerator[Chunk, None]:
        """Chunks of all choices as they come, once admission lets them run; cancels every choice (→ aborts on
        the nodes) if stopped early. The caller owns `ticket` and releases it. With best_of > n (never streamed),
        `choices` is cut in place to each prompt's n best once all have finished."""
        t0 = time.monotonic()  # TTFT counts the time queued here too: the client waited for it
        await self.admission.wait(ticket)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        out: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(c, t0, out)) for c in choices]
        pending = len(choices)
        try:
            while pending:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    pending -= 1
                yield item
            if choices and choices[0].best_of is not None:
                choices[:] = keep_best(choices, *choices[0].best_of)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def requested_tokens(choices: list[Choice]) -> int:
    """The work a request asks for (prompts + max new tokens), as admission counts it."""
    return sum(len(c.seq.prompt_token_ids) + c.seq.params.max_tokens for c in choices)


def prompt_cache(caches: list[tuple[P.NodeRole, P.CacheInfo]]) -> P.CacheInfo | None:
    """The cache report of the node that prefilled the sequence: the prefill node's, or, when the decode node
    prefilled locally, the decode node's (with a prefill node, the decode node's report counts the KV it
    loaded from the prefill node through the store: transfer, not a cache hit)."""
    prefill = [info for role, info in caches if role is P.NodeRole.PREFILL]
    if prefill:
        return prefill[-1]
    return caches[0][1] if caches else None


def cached_tokens(choices: list[Choice]) -> int:
    """Prompt tokens not computed (device prefix cache + KV store), over all choices."""
    return sum(c.cache.cached_tokens for c in choices if c.cache is not None)


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    completion = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(choices)},
    }


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
