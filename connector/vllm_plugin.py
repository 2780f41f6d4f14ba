"""`UCMConnector`: vLLM's `KVConnectorBase_V1` over the UCM store daemon. The only module of ours importing vllm.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "UCMConnector",
        "kv_connector_module_path": "connector.vllm_plugin", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "tcp://127.0.0.1:5555"}}'

vLLM builds this class twice, `cls(vllm_config, role, kv_cache_config)`: beside the scheduler (lookups, plans)
and in the worker (moves blocks). Both are thin: they translate vLLM's objects for `connector/vllm/`'s
scheduler and worker cores and keep vLLM's contract that no scheduler hook raises (a failure is logged and is
a miss, or — once vLLM counted the tokens as cached — a reported load error, which vLLM recomputes under
`kv_load_failure_policy=recompute`). See docs/vllm.md for what is supported.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole as VllmRole

from connector.base import KVConnectorRole
from connector.metadata import ConnectorStats
from connector.store_spec import StoreSpec
from connector.vllm.key_scope import VllmKeyScope, layout_tag
from connector.vllm.model_identity import model_identity
from connector.vllm.plugin_config import PluginConfig
from connector.vllm.scheduler_core import VllmSchedulerCore
from connector.vllm.step import StepDelta, StepPlan
from connector.vllm.worker_core import VllmWorkerCore
from ucm.store_wire import Layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ucm.api import KVStore
    from ucm.client import StoreClient

log = logging.getLogger("connector.vllm")
CPU_BACKEND = "CPU_ATTN"


def _log_through_vllm() -> None:
    """Our loggers ("connector", "ucm") print with vLLM's handlers and format; vLLM leaves the root unconfigured."""
    vllm_handlers = logging.getLogger("vllm").handlers
    for name in ("connector", "ucm"):
        ours = logging.getLogger(name)
        if not ours.handlers and vllm_handlers:
            for handler in vllm_handlers:
                ours.addHandler(handler)
            ours.setLevel(logging.INFO)
            ours.propagate = False


_log_through_vllm()


class UCMConnectorMetadata(KVConnectorMetadata):
    """One step's plan, shipped by vLLM from the scheduler process to the worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _open_client(
    spec: StoreSpec, layout: Layout | None = None, namespace: str | None = None, *, shared_memory: bool = False
) -> StoreClient:
    from common.auth import ClientAuth
    from ucm.client import StoreClient

    assert spec.address is not None, "PluginConfig only accepts daemon addresses"
    auth = ClientAuth.from_dir(spec.curve_keys, spec.curve_client) if spec.curve_keys else None
    kwargs: dict[str, Any] = {"auth": auth, "layout": layout, "namespace": namespace, "shared_memory": shared_memory}
    if spec.timeout_s is not None:
        kwargs.update(timeout_s=spec.timeout_s, retry_after_s=max(1.0, 4 * spec.timeout_s))
    return StoreClient(spec.address, **kwargs)


def _cache_dtype(vllm_config: VllmConfig) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype and cache_dtype != "auto":
        return str(cache_dtype)
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def cpu_attention_isa(vllm_config: VllmConfig) -> str:
    """The instruction set vLLM-CPU's attention picks for this model; it decides the bytes inside a block."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # private, hence this one wrapper

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    return str(_get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype))


def key_scope(vllm_config: VllmConfig) -> VllmKeyScope:
    mc = vllm_config.model_config
    tag = layout_tag(vllm.__version__, CPU_BACKEND, cpu_attention_isa(vllm_config))
    return VllmKeyScope(
        model_identity(mc.model, mc.revision), _cache_dtype(vllm_config), vllm_config.cache_config.block_size, tag
    )


def refuse_unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Configurations whose blocks our keys cannot name yet: refused at start-up, never silently wrong."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ValueError("UCMConnector supports vLLM's CPU platform only (blocks are moved through host memory)")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise ValueError("UCMConnector does not support tensor/pipeline parallelism yet: keys carry no rank")
    if vllm_config.lora_config is not None:
        raise ValueError("UCMConnector does not support LoRA yet: block keys do not include the adapter")
    if vllm_config.model_config.is_multimodal_model:
        raise ValueError("UCMConnector does not support multimodal models yet: block keys do not include media")
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
        raise ValueError(
            f"UCMConnector needs one KV cache group, this model has "
            f"{len(kv_cache_config.kv_cache_groups)} (hybrid/sliding-window models are not supported)"
        )


class UCMConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self._config = PluginConfig.from_extra(kvt.kv_connector_extra_config)
        refuse_unsupported(vllm_config, kv_cache_config)
        self._kv_role = KVConnectorRole(kvt.kv_role)
        self._stats = ConnectorStats()
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler_core: VllmSchedulerCore | None = None
        self._worker: VllmWorkerCore | None = None
        self._layer_index: dict[str, int] = {}
        if role is VllmRole.SCHEDULER:
            if kvt.kv_load_failure_policy != "recompute":
                log.warning(
                    'kv_load_failure_policy=%s: a failed store load fails its request; set "recompute" '
                    "to recompute instead",
                    kvt.kv_load_failure_policy,
                )
            scope = key_scope(vllm_config)
            log.info(
                "UCMConnector scheduler side: store %s, layout %s, block size %d",
                self._config.store.address,
                scope.layout_tag,
                scope.block_size,
            )
            self._scheduler_core = VllmSchedulerCore(
                _open_client(self._config.store),
                scope,
                self._kv_role,
                self._stats,
                save_decode_blocks=self._config.save_decode_blocks,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ==== scheduler side ========================================================================================

    @property
    def _scheduler(self) -> VllmSchedulerCore:
        assert self._scheduler_core is not None, "scheduler hook on the worker side"
        return self._scheduler_core

    def _track(self, request: Request) -> None:
        self._scheduler.track(
            request.request_id, lambda: request.all_token_ids, request.num_prompt_tokens, request.cache_salt
        )

    def on_new_request(self, request: Request) -> None:
        try:
            self._track(request)
        except Exception:
            log.exception("request %s: cannot track it; it will neither load nor save", request.request_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            self._track(request)
            if request.prompt_embeds is not None or request.mm_features:
                return 0, False  # keys name token ids only
            return self._scheduler.num_new_matched_tokens(request.request_id, num_computed_tokens), False
        except Exception:
            log.exception("request %s: store lookup failed; treating it as a miss", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        block_ids: list[int] = []
        try:
            block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens else []
            self._scheduler.after_alloc(request.request_id, block_ids, num_external_tokens)
        except Exception:
            log.exception(
                "request %s: cannot plan its load; its %d external tokens will be recomputed",
                request.request_id,
                num_external_tokens,
            )
            try:
                if num_external_tokens:
                    self._scheduler.poison(request.request_id, block_ids, num_external_tokens)
            except Exception:
                log.exception("request %s: cannot even report its load as failed", request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        try:
            plan = self._scheduler.build_plan(StepDelta.of(scheduler_output))
        except Exception:
            log.exception("planning this step's loads and saves failed; reporting its loads as failed")
            try:
                plan = self._scheduler.poison_pending()
            except Exception:
                log.exception("cannot report the step's loads as failed")
                plan = StepPlan()
        return UCMConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        try:
            if connector_output.invalid_block_ids:
                self._scheduler.on_load_errors(set(connector_output.invalid_block_ids))
        except Exception:
            log.exception("cannot account this step's load errors")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        try:
            self._scheduler.finished(request.request_id)
        except Exception:
            log.exception("request %s: finishing failed", request.request_id)
        return False, None  # saves complete within their step: blocks can be freed now

    # ==== worker side ===========================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._check_layers(names)
        self._layer_index = {name: i for i, name in enumerate(names)}
        num_blocks = self._kv_cache_config.num_blocks
        scope_tag = layout_tag(vllm.__version__, CPU_BACKEND, cpu_attention_isa(self._vllm_config))
        worker = VllmWorkerCore(
            cast("KVStore", _NoStore()), self._kv_role, self._stats, task_timeout_s=self._config.task_timeout_s
        )
        page = worker.register([kv_caches[n] for n in names], num_blocks)
        layout = Layout(len(names), page, self._block_size)
        namespace = f"vllm:{scope_tag}:{len(names)}x{page}x{self._block_size}"
        worker.use_store(_open_client(self._config.store, layout, namespace, shared_memory=self._config.shared_memory))
        self._worker = worker
        log.info(
            "UCMConnector worker side: %d layers, %d blocks of %d bytes per layer, store %s",
            len(names),
            num_blocks,
            page,
            self._config.store.address,
        )

    def _check_layers(self, names: list[str]) -> None:
        """The attention layers must use the backend and ISA the scheduler side named in the keys."""
        expect = cpu_attention_isa(self._vllm_config)
        context = self._vllm_config.compilation_config.static_forward_context
        for name in names:
            layer = context.get(name)
            backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: CPU_BACKEND)()
            isa = getattr(layer, "isa", expect)
            if backend != CPU_BACKEND or isa != expect:
                raise ValueError(
                    f"layer {name}: attention {backend}/{isa}, but UCMConnector keys blocks as {CPU_BACKEND}/{expect}"
                )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, UCMConnectorMetadata), "metadata from another connector"
            self._worker.bind(connector_metadata.plan)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None:
            return
        try:
            self._worker.start_load()
        except Exception:
            log.exception("starting this step's loads failed; reporting them for recomputation")
            self._worker.fail_all_loads("start failed")

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if self._worker is not None and index is not None:
            self._worker.wait_layer(index)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        index = self._layer_index.get(layer_name)
        if self._worker is not None and index is not None:
            self._worker.save_layer(index)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        log.info("UCMConnector %s side: %s", self.role.name.lower(), self._stats)
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler_core is not None:
            self._scheduler_core.store.close()
            self._scheduler_core = None


class _NoStore:
    """Placeholder until the worker knows its page size (the daemon namespace declares it)."""

    def staging_buffer(self, nbytes: int) -> memoryview:
        return memoryview(bytearray(nbytes))

    def close(self) -> None:
        pass
