"""Runs one scheduled step on the model: packs the batch (vectorised numpy, no per-token Python), applies
copy-on-write copies, drives the worker-side connector around the forward, samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.keys import BlockKey
from engine.attention import set_forward_context
from engine.final_states import FinalStates
from engine.generated_rows import GeneratedRows
from engine.kv_cache import KVCaches
from engine.sampler import Sampler, SamplingRow
from engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from ucm_kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from connector.base import KVConnectorWorker


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv_caches: KVCaches,
        block_size: int,
        device: torch.device | str,
        eos_token_ids: frozenset[int],
        connector: KVConnectorWorker | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids
        self.connector = connector
        self.sampler = Sampler()
        self.final_states = FinalStates()  # whole prompt hits sample without a forward (engine/final_states.py)
        self.between_layers: Callable[[], None] | None = None  # ForwardContext.between_layers (the engine's governor)
        if connector is not None:
            connector.register_kv_caches(kv_caches)

    def prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, GeneratedRows]:
        sched = out.scheduled
        bs = self.block_size
        num_seqs = len(sched)
        num_new = np.fromiter((s.num_scheduled_tokens for s in sched), dtype=np.int64, count=num_seqs)
        computed = np.fromiter((s.num_computed_tokens for s in sched), dtype=np.int64, count=num_seqs)
        token_ids: list[int] = []
        for s in sched:
            token_ids += s.request.all_token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_scheduled_tokens]
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        total = int(qsl[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - computed, num_new)
        seq_lens = computed + num_new
        max_blocks = max(len(s.block_ids) for s in sched)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, s in enumerate(sched):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        dev = self.device
        prompt_lens = np.fromiter((s.request.num_prompt_tokens for s in sched), dtype=np.int64, count=num_seqs)
        prompt_queries = np.clip(prompt_lens - computed, 0, num_new)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(dev),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            context_tokens=int(seq_lens.sum()),
            prompt_queries=torch.from_numpy(prompt_queries.astype(np.int32)).to(dev),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        generated = GeneratedRows.from_mask(positions >= prompt_lens[seq_of_token], dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta, generated

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        conn = self.connector
        hooks = None
        if conn is not None and out.kv_connector_metadata is not None:
            # Before the copies: a write-back connector saves the evicted blocks a copy may land in.
            conn.bind_connector_metadata(out.kv_connector_metadata)
            conn.start_load_kv()
            hooks = conn if conn.needs_layer_hooks() else None
        if out.cow_copies:
            from ucm_kernels import copy_blocks

            src, dst = zip(*out.cow_copies, strict=True)
            copy_blocks(self.kv_caches, torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        hidden = None
        plan = _SamplingPlan.of(out, self.eos_token_ids)
        known = self._known_final_states(out) if out.scheduled and hooks is None else None
        if known is not None:
            hidden = known
            self.final_states.hits += 1
        elif out.scheduled:
            input_ids, positions, meta, generated = self.prepare_inputs(out)
            # Only the sampled rows' final states are read: the model computes just those past the last attention.
            keep = (
                None
                if plan.unique == list(range(len(input_ids)))
                else torch.tensor(plan.unique, dtype=torch.long, device=self.device)
            )
            with set_forward_context(meta, hooks, generated, self.between_layers):
                hidden = self.model.forward(input_ids, positions, self.kv_caches, keep)
            self._remember_final_states(out, plan, hidden)
        if conn is not None and out.kv_connector_metadata is not None:
            conn.wait_for_save()
            sending, recving = conn.get_finished(out.finished_req_ids)
            result.finished_sending = set(sending or ())
            result.finished_recving = set(recving or ())
            result.failed_block_ids = set(conn.get_block_ids_with_load_errors())
            result.loaded_by_tier = conn.take_loaded_by_tier()
            conn.clear_connector_metadata()
        if hidden is not None:
            self._sample(plan, hidden, result)
        return result

    def _prompt_end_key(self, s: ScheduledRequest) -> BlockKey | None:
        """The last block key of a fresh block-aligned prompt this step completes, else None."""
        req = s.request
        num_prompt = req.num_prompt_tokens
        if req.num_output_tokens or num_prompt % self.block_size or not s.completes_prompt:
            return None
        blocks = num_prompt // self.block_size
        return req.block_keys[blocks - 1] if 0 < blocks <= len(req.block_keys) else None

    def _known_final_states(self, out: SchedulerOutput) -> torch.Tensor | None:
        """The step's final states when every row is a whole prompt hit's last token with its state kept (each
        sequence's one row, in order: what the forward would return for the sampled rows); else None."""
        states = []
        for s in out.scheduled:
            # A connector load in this step may yet fail (the scheduler then recomputes): those take the forward.
            key = self._prompt_end_key(s) if s.num_scheduled_tokens == 1 and not s.num_external_tokens else None
            state = self.final_states.get(key) if key is not None else None
            if state is None:
                return None
            states.append(state)
        return torch.stack(states)

    def _remember_final_states(self, out: SchedulerOutput, plan: _SamplingPlan, hidden: torch.Tensor) -> None:
        """Keep the final state of every fresh block-aligned prompt's last token this step computed."""
        end = 0
        for s in out.scheduled:
            end += s.num_scheduled_tokens
            key = self._prompt_end_key(s)
            if key is not None and s.num_samples:
                self.final_states.put(key, hidden[plan.unique.index(end - 1)])

    def _sample(self, plan: _SamplingPlan, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """hidden: the final states of plan.unique's rows, in that order."""
        if not plan.rows:
            return
        logits = self.model.compute_logits(hidden)
        if len(plan.unique) != len(plan.logit_rows):
            where = {r: j for j, r in enumerate(plan.unique)}
            logits = logits[torch.tensor([where[r] for r in plan.logit_rows], device=logits.device)]
        tokens, logprobs = self.sampler(logits.cpu() if logits.is_cuda else logits, plan.rows)
        for rid, tok, lp in zip(plan.owners, tokens, logprobs, strict=True):
            result.sampled.setdefault(rid, []).append(tok)
            if lp is not None:
                result.logprobs.setdefault(rid, []).append(lp)


@dataclass(frozen=True)
class _SamplingPlan:
    """What a step samples: a row index per sample (a sequence's last scheduled token; several samples of one
    sequence share it), the distinct rows in order, and each sample's parameters and request."""

    logit_rows: list[int]
    unique: list[int]
    rows: list[SamplingRow]
    owners: list[str]

    @classmethod
    def of(cls, out: SchedulerOutput, eos_token_ids: frozenset[int]) -> _SamplingPlan:
        logit_rows: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[str] = []
        end = 0
        for s in out.scheduled:
            end += s.num_scheduled_tokens
            req = s.request
            for i in range(s.num_samples):
                logit_rows.append(end - 1)
                owners.append(req.request_id)
                rows.append(
                    SamplingRow(
                        req.sampling_params,
                        req.seed,
                        req.sample_index + i,
                        req.num_output_tokens,
                        req.prompt_token_ids,
                        req.output_token_ids,
                        eos_token_ids,
                    )
                )
        return cls(logit_rows, sorted(set(logit_rows)), rows, owners)
