"""What a step hands back per user request (vLLM's RequestOutput): each sequence's new tokens, detokenized
incrementally (a stop string ends the sequence there), its logprobs as vLLM's `Logprob`s, and the request finished
once every one of its n samples is (samples fork from one sequence and may finish at different steps)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request import Request, RequestStatus
from engine.request_stats import RequestStateStats
from engine.scheduler_output import TokenLogprobs
from engine.tokenizer import Tokenizer
from protocol.messages import KVTransferParams


@dataclasses.dataclass
class UserRequest:
    """A user request: its n samples may finish at different steps."""

    prompt_token_ids: list[int]
    n: int
    prompt: str | None = None
    done: set[int] = dataclasses.field(default_factory=set)
    kv_transfer_params: KVTransferParams | None = None
    stats: RequestStateStats = dataclasses.field(default_factory=RequestStateStats)


class RequestOutputs:
    """The live user requests, and the outputs their sequences' tokens make. `finish` ends a sequence whose text
    reached a stop string (the scheduler's `finish_request`)."""

    def __init__(self, tokenizer: Tokenizer, finish: Callable[[Request, RequestStatus], None]) -> None:
        self.tokenizer = tokenizer
        self._finish = finish
        self._requests: dict[str, UserRequest] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, prompt_token_ids: list[int], n: int, prompt: str | None) -> None:
        assert request_id not in self._requests, f"request id {request_id!r} is already live"
        self._requests[request_id] = UserRequest(prompt_token_ids, n, prompt)

    def stats(self, seq: Request) -> RequestStateStats:
        """The timeline of the user request `seq` samples for."""
        return self._requests[seq.parent_id].stats

    def aborted(self, seq: Request) -> RequestOutput | None:
        """The output that ends an aborted sequence's samples (before its fork, all n of them); None where its
        request has already finished."""
        parent = self._requests.get(seq.parent_id)
        if parent is None:
            return None
        indexes = [seq.sample_index] if seq.forked else list(range(parent.n))
        parent.done.update(indexes)
        self._detoks.pop(seq.request_id, None)
        return self._request_output(seq, parent, [CompletionOutput(i, "", [], None, "abort") for i in indexes])

    def of_step(self, updates: list[tuple[Request, list[int], list[TokenLogprobs]]]) -> list[RequestOutput]:
        """One output per user request among the step's (sequence, new tokens, their logprobs) updates."""
        by_parent: dict[str, tuple[Request, list[CompletionOutput]]] = {}
        for seq, tokens, logprobs in updates:
            self._requests[seq.parent_id].stats.tokens(len(tokens))
            comp = self._completion_delta(seq, tokens, logprobs)
            by_parent.setdefault(seq.parent_id, (seq, []))[1].append(comp)
        return [self._request_output(seq, self._requests[seq.parent_id], comps) for seq, comps in by_parent.values()]

    def _completion_delta(self, seq: Request, tokens: list[int], logprobs: list[TokenLogprobs]) -> CompletionOutput:
        sp = seq.sampling_params
        text = ""
        if sp.detokenize:
            detok = self._detoks.get(seq.request_id)
            if detok is None:
                detok = self._detoks[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, sp)
            # Like vLLM, a stop/EOS token is returned in token_ids but not rendered into the text.
            stopped_by_token = seq.status is RequestStatus.FINISHED_STOPPED and not isinstance(seq.stop_reason, str)
            text_tokens = tokens[:-1] if stopped_by_token else tokens
            check_stop = seq.num_output_tokens >= sp.min_tokens
            text, hit = detok.update(text_tokens, finished=seq.is_finished, check_stop=check_stop)
            if hit:
                seq.stop_reason = detok.stop_string
                if seq.is_finished:
                    seq.status = RequestStatus.FINISHED_STOPPED  # the stop string wins over a length finish
                else:
                    self._finish(seq, RequestStatus.FINISHED_STOPPED)
        reason = seq.finish_reason
        if reason is not None:
            self._detoks.pop(seq.request_id, None)
            self._requests[seq.parent_id].done.add(seq.sample_index)
        return CompletionOutput(
            index=seq.sample_index,
            text=text,
            token_ids=list(tokens),
            logprobs=[self._to_logprobs(lp) for lp in logprobs] if sp.logprobs is not None else None,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=seq.stop_reason,
        )

    def _to_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        return {
            tid: Logprob(val, rank, self.tokenizer.decode([tid], skip_special_tokens=False))
            for tid, val, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True)
        }

    def _request_output(self, seq: Request, parent: UserRequest, comps: list[CompletionOutput]) -> RequestOutput:
        if seq.is_finished and seq.sample_index == 0 and seq.finished_kv_transfer_params is not None:
            parent.kv_transfer_params = seq.finished_kv_transfer_params
        finished = len(parent.done) >= parent.n
        if finished:
            self._requests.pop(seq.parent_id, None)
        return RequestOutput(
            request_id=seq.parent_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=comps,
            finished=finished,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_external_tokens=seq.num_external_tokens,
            external_tokens_by_tier={t.value: n for t, n in seq.external_tokens_by_tier.items()},
            kv_transfer_params=parent.kv_transfer_params if finished else None,
            metrics=parent.stats,
        )
