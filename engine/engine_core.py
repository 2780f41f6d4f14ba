"""EngineCore: one model, one paged KV cache, one scheduler; `add_request` + `step()` → incremental outputs.

Used directly by the prefill/decode nodes and wrapped by the offline `LLM`. Single-threaded by design: the
caller owns the loop (and any lock around it).

KV connector (optional pair: scheduler side, worker side), called in connector/base.py's order each step:
  Scheduler.schedule: per waiting request, after the device prefix match, get_num_new_matched_tokens (clamped so
    at least one token is computed; async loads are treated as sync: they happen in this step's forward) →
    blocks for computed + external + new tokens → update_state_after_alloc(request, all its block ids, n_external);
    external tokens count as computed. Once per step: build_connector_meta(scheduler_output).
  ModelRunner.execute: bind_connector_metadata → start_load_kv (write-back saves first) → copy-on-write copies →
    forward (the model calls wait_for_layer_load / save_kv_layer per layer) → wait_for_save → get_finished(finished ids) → get_block_ids_with_load_errors →
    clear_connector_metadata.
  Scheduler.update_from_output: a request owning a failed block rolls back to that block's start, drops its
    sample and those blocks' prefix-cache keys, and is recomputed; full blocks are published to the device prefix
    cache only after a successful step. On finish: request_finished(request, block ids) → (delay_free,
    kv_transfer_params); the params go out with the final RequestOutput; delay_free keeps the blocks until
    get_finished reports the request's saves done."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

import ucm_kernels
from common.keys import BlockKey, KeyNamespace, root_key
from common.kv_events.events import KVEvent
from engine.config import EngineConfig
from engine.guided.backend import GuidedBackend
from engine.heap import retain_freed_memory
from engine.kv_cache import allocate_kv_caches, num_blocks_for_budget
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import EngineLoad, RequestOutput
from engine.request import Request
from engine.request_outputs import RequestOutputs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.stats import EngineStats
from engine.step_budget import LiveBudget, StepBudget, auto_budget
from engine.thread_governor import ThreadGovernor
from protocol.messages import KVTransferParams
from ucm_kernels.cpu.amx_gemm import engine_bf16_rows_invariant

if TYPE_CHECKING:
    from connector.base import ConnectorPair
    from engine.loader import LoadedModel

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded_model: LoadedModel | None = None,
        kv_connector: ConnectorPair | None = None,
    ) -> None:
        self.config = config
        if loaded_model is None:
            from engine.loader import load_model

            loaded_model = load_model(config.model, getattr(torch, config.dtype_name), config.device)
        self.loaded = loaded_model
        self.model_config = loaded_model.config
        self.tokenizer = loaded_model.tokenizer
        self.dtype: torch.dtype = loaded_model.dtype
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        bs = config.cache.block_size
        self.step_budget = (
            StepBudget(config.scheduler.max_num_batched_tokens, "given")
            if config.scheduler.max_num_batched_tokens is not None
            else auto_budget(self.model_config, self.dtype_name, config.device)
        )
        logger.info("engine: steps of at most %d tokens (%s)", self.step_budget.tokens, self.step_budget.why)
        # A budget chosen for the host follows its speed while the engine runs (step_budget.py: LiveBudget); without
        # chunked prefill a prompt must fit one step, and max_model_len was set by the first budget.
        self.live_budget = (
            LiveBudget(self.step_budget)
            if config.scheduler.max_num_batched_tokens is None
            and config.device == "cpu"
            and config.scheduler.enable_chunked_prefill
            else None
        )
        num_blocks = num_blocks_for_budget(config.cache.kv_cache_bytes, self.model_config, bs, self.dtype)
        self.max_model_len = self._resolve_max_model_len(num_blocks * bs)
        self.kv_caches = allocate_kv_caches(num_blocks, self.model_config, bs, self.dtype, config.device)
        if config.device == "cpu":  # measure (or read) which CPU attention path is faster now, not on the first step
            mc = self.model_config
            ucm_kernels.calibrate_cpu_attention(self.dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim, bs)
            if self.dtype == torch.bfloat16 and not engine_bf16_rows_invariant():
                logger.warning(
                    "bf16 matmuls on this CPU give a row different bits in calls of different sizes (oneDNN on "
                    "AMX) and the native library has no AMX kernel to stand in: greedy output after a prefix-cache "
                    "hit may differ from the cold run's; fp32 keeps it"
                )
        elif torch.device(config.device).type == "cuda":  # likewise which CUDA prefills run the torch path
            mc = self.model_config
            ucm_kernels.calibrate_gpu_prefill(
                self.dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim, bs, torch.device(config.device)
            )
        self.governor = (
            ThreadGovernor(torch.get_num_threads()) if config.device == "cpu" and config.adaptive_threads else None
        )
        self._idled = False  # idle() ran since the last step: the next one starts a burst (ThreadGovernor.burst)
        if config.device == "cpu" and config.retain_freed_memory:  # the model and KV cache are in place
            retain_freed_memory()
        self.namespace = KeyNamespace(loaded_model.fingerprint, self.dtype_name, bs)
        if kv_connector is None and config.kv_store is not None:
            from connector.base import KVConnectorRole
            from connector.factory import make_connector

            role = KVConnectorRole(config.kv_role or KVConnectorRole.BOTH.value)
            kv_connector = make_connector(config.kv_store, role, config, self.model_config, loaded_model.fingerprint)
        self.kv_connector = kv_connector
        conn_sched, conn_worker = kv_connector if kv_connector is not None else (None, None)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.stats_counters = EngineStats()
        write_back = kv_connector is not None and config.kv_save_policy.writes_back
        self.kv_manager = KVCacheManager(
            num_blocks, bs, config.cache.enable_prefix_caching, write_back, config.enable_kv_cache_events
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=self.step_budget.tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
            policy=config.scheduler.policy,
            max_wait_s=config.scheduler.max_wait_s,
            chunk_after_tokens=config.scheduler.chunk_after_tokens,
            connector=conn_sched,
            stats=self.stats_counters,
        )
        self.runner = ModelRunner(
            loaded_model.model, self.kv_caches, bs, config.device, self.eos_token_ids, conn_worker
        )
        # Grammars compile against the tokenizer; xgrammar loads on the first guided request.
        self.runner.sampler.guided = GuidedBackend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.runner.between_layers = self._between_layers
        self._rng = random.Random(config.seed)
        self._arrival = itertools.count()
        self.request_outputs = RequestOutputs(self.tokenizer, self.scheduler.finish_request)
        self._pending: list[RequestOutput] = []  # outputs of aborts, handed out by the next step()
        logger.info(
            "engine: %d KV blocks x %d tokens (%.1f MiB, %s), max_model_len %d",
            num_blocks,
            bs,
            num_blocks * self.model_config.kv_bytes_per_block(bs, self.dtype) / 2**20,
            self.dtype_name,
            self.max_model_len,
        )

    def _resolve_max_model_len(self, kv_tokens: int) -> int:
        wanted = self.config.scheduler.max_model_len or self.model_config.max_position_embeddings
        if wanted > kv_tokens:
            # One sequence must always fit the whole cache, or preemption could never make room for it.
            log = logger.warning if self.config.scheduler.max_model_len else logger.info
            log("max_model_len %d exceeds the KV cache (%d tokens); using %d", wanted, kv_tokens, kv_tokens)
        limit = min(wanted, kv_tokens)
        if not self.config.scheduler.enable_chunked_prefill:
            # Without chunking a prompt is computed in one step, so it must fit one step's token budget.
            limit = min(limit, self.step_budget.tokens)
        return limit

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        prompt: str | None = None,
    ) -> list[BlockKey]:
        """Queue a request; returns the keys of its prompt's full blocks (computed once, here: a node publishes
        them as its recent-prefix summary). ValueError for a bad request."""
        params = params if params is not None else SamplingParams()
        if request_id in self.request_outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        try:
            ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise ValueError(f"request {request_id!r}: prompt token ids must be ints") from None
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"request {request_id!r}: prompt token ids must be ints in [0, {vocab})")
        guided = self.runner.sampler.guided
        if params.guided_decoding is not None and guided is not None:
            guided.check(params.guided_decoding)  # a schema it cannot compile: ValueError now, not mid-step
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            request_id,
            ids,
            params,
            root_key=root_key(self.namespace, cache_salt),
            block_size=self.namespace.block_size,
            arrival=next(self._arrival),
            seed=seed,
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
        )
        self.scheduler.add_request(req)  # validates the length
        self.request_outputs.add(request_id, ids, params.n, prompt)
        return list(req.block_keys)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for seq in self.scheduler.abort_requests(ids):
            out = self.request_outputs.aborted(seq)
            if out is not None:
                self._pending.append(out)

    def close(self) -> None:
        """Release the connector's resources (a daemon client's sockets); the engine is unusable after."""
        for side in self.kv_connector or ():
            side.close()
        self.kv_connector = None

    def reset_prefix_cache(self) -> bool:
        """Drop every block of the device prefix cache (an AllBlocksCleared event), as vLLM's `reset_prefix_cache`;
        False, and nothing dropped, while a request is unfinished (its blocks are in use)."""
        if self.has_unfinished_requests():
            return False
        self.kv_manager.pool.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.stats_counters)

    def load(self) -> EngineLoad:
        worker = self.kv_connector[1] if self.kv_connector is not None else None
        conn_stats = getattr(worker, "stats", None)
        return EngineLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            num_blocks=self.kv_manager.num_blocks,
            free_blocks=self.kv_manager.pool.num_free_blocks,
            stats=self.stats(),
            connector=dataclasses.replace(conn_stats) if conn_stats is not None else None,
        )

    @property
    def kv_store(self) -> Any:
        """The KV connector's store client (its `stats()` gives per-tier counters), or None."""
        worker = self.kv_connector[1] if self.kv_connector is not None else None
        return getattr(worker, "store", None)

    def running_request_ids(self) -> set[str]:
        """User request ids with a sequence in the running batch (the ones the next step computes)."""
        return {seq.parent_id for seq in self.scheduler.running}

    def unfinished_request_ids(self) -> set[str]:
        return {seq.parent_id for seq in self.scheduler.requests.values()}

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def take_kv_events(self) -> list[KVEvent]:
        """The device prefix cache's KV events since the last call (with `enable_kv_cache_events`; else none): what a
        node publishes after each step, as vLLM's scheduler does."""
        return self.kv_manager.take_events()

    # -- the step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.scheduled and sched.kv_connector_metadata is None:
            return outputs
        self.stats_counters.steps += 1
        for scheduled in sched.scheduled_new_reqs:
            self.request_outputs.stats(scheduled.request).scheduled()
        for rid in sched.preempted_req_ids:
            seq = self.scheduler.requests.get(rid)
            if seq is not None:
                self.request_outputs.stats(seq).num_preemptions += 1
        if self.governor is not None:
            if self._idled:  # the first step of a burst: its sender's work before it is not a neighbour's
                self._idled = False
                self.governor.burst()
            self._govern_threads(self.governor)
        started = self.live_budget.clock() if self.live_budget is not None else 0.0
        result = self.runner.execute(sched)
        if self.live_budget is not None:
            self._follow_host_speed(self.live_budget, sched.total_num_scheduled_tokens, started)
        return outputs + self.request_outputs.of_step(self.scheduler.update_from_output(sched, result))

    def _follow_host_speed(self, live: LiveBudget, tokens: int, started: float) -> None:
        changed = live.observe(tokens, live.clock() - started)
        if changed is not None:
            logger.info("engine: steps of at most %d tokens from now on (%s)", changed.tokens, changed.why)
            self.step_budget = changed
            self.scheduler.max_num_batched_tokens = changed.tokens

    def _between_layers(self) -> None:
        """Before each decoder layer of a step after its first: a prompt step lasts seconds on a 2-core CPU (Llama-1B,
        1024 tokens: ~1.3 s on two threads), so the governor re-decides within it once its window has passed; a
        thread count is read per kernel call, and no kernel's bits depend on it. A burst's first step that started
        on one thread for a neighbour that has just stopped (a benchmark client that sent it) takes the second core
        back after WINDOW_S instead of running its seconds on one."""
        if self.governor is not None:
            self._govern_threads(self.governor)

    def idle(self) -> None:
        """Called by a serving loop while nothing is queued: the thread governor judges the window that just passed,
        so the first step of the next burst runs on what other processes are doing now. Judged only at the next
        step, a window spanning the idle stretch said what they did while this engine waited: vLLM's benchmark
        client took a core preparing its prompts, and a shared-prefix burst after it ran its first steps on one
        thread (Llama-1B, 2-core Xeon: mean TTFT 9.1 s against 7.2-7.7 s without the governor)."""
        if self.governor is not None and not self.has_unfinished_requests():
            self._govern_threads(self.governor)
            self._idled = True

    def _govern_threads(self, governor: ThreadGovernor) -> None:
        before = governor.current
        threads = governor.threads()
        if threads != before:  # only its own changes: a count the caller set stays until the governor decides anew
            # Every kernel reads it per call; libgomp resizes its team at the next parallel region.
            torch.set_num_threads(threads)
        self.stats_counters.threads, self.stats_counters.thread_changes = threads, governor.changes
