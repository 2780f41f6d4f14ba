"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from common.save_policy import KVSavePolicy
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, canonical_dtype
from engine.engine_core import EngineCore
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from protocol import defaults

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str = defaults.MODEL,
        dtype: Any = "auto",
        device: str = "cpu",
        kv_cache_memory: int | str = "1GiB",
        block_size: int = 16,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_store: str | None = None,
        kv_role: str | None = None,
        seed: int = 0,
        loaded_model: Any = None,
        kv_save_policy: KVSavePolicy | str = KVSavePolicy.COMPUTED,
    ) -> None:
        self.config = EngineConfig(
            model=model,
            dtype=canonical_dtype(dtype),
            device=device,
            seed=seed,
            cache=CacheConfig(block_size, kv_cache_memory, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill),
            kv_store=kv_store,
            kv_role=kv_role,
            kv_save_policy=KVSavePolicy(kv_save_policy),
        )
        if loaded_model is not None and self.config.dtype != "auto":
            want = self.config.dtype_name
            have = str(loaded_model.dtype).removeprefix("torch.")
            if want != have:
                raise ValueError(f"loaded_model is {have} but dtype={want!r} was asked for")
        self.engine = EngineCore(self.config, loaded_model=loaded_model)
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompt_list)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"{len(priority)} priorities for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                text, token_ids = self._tokenize(prompt)
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, token_ids, params, priority=priority[i] if priority else 0, prompt=text)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's chat options: a jinja `chat_template` instead of the model's, the assistant turn opened or the
        last message continued, `tools` and extra variables for the template."""
        conversations = cast(
            "list[list[dict[str, Any]]]", [messages] if messages and isinstance(messages[0], dict) else messages
        )
        tok = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    c,
                    add_generation_prompt,
                    chat_template=chat_template,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    template_kwargs=chat_template_kwargs,
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        return None, list(prompt)

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        wanted = set(ids)
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.request_id not in wanted:
                        continue
                    _merge(results, delta)
                    if delta.finished and bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]


def _merge(results: dict[str, RequestOutput], delta: RequestOutput) -> None:
    acc = results.get(delta.request_id)
    if acc is None:
        acc = results[delta.request_id] = RequestOutput(
            delta.request_id, delta.prompt, delta.prompt_token_ids, [], False, delta.num_cached_tokens
        )
    by_index = {c.index: c for c in acc.outputs}
    for c in delta.outputs:
        cur = by_index.get(c.index)
        if cur is None:
            cur = by_index[c.index] = CompletionOutput(c.index, "", [], [] if c.logprobs is not None else None)
            acc.outputs.append(cur)
        cur.text += c.text
        cur.token_ids += c.token_ids
        if c.logprobs is not None:
            cur.logprobs = (cur.logprobs or []) + c.logprobs
        if c.finish_reason is not None:
            cur.finish_reason, cur.stop_reason = c.finish_reason, c.stop_reason
    acc.outputs.sort(key=lambda c: c.index)
    acc.finished = delta.finished
    acc.num_cached_tokens = max(acc.num_cached_tokens, delta.num_cached_tokens)
    acc.num_external_tokens = max(acc.num_external_tokens, delta.num_external_tokens)
    if delta.external_tokens_by_tier:
        acc.external_tokens_by_tier = dict(delta.external_tokens_by_tier)
    if delta.kv_transfer_params is not None:
        acc.kv_transfer_params = delta.kv_transfer_params
    if delta.metrics is not None:
        acc.metrics = delta.metrics


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(p, int) for p in items):
        return [items]  # one prompt given as token ids
    return items
