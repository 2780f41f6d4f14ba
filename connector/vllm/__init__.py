"""UCM as a vLLM KV connector: the vLLM-independent core of `connector.vllm_plugin.UCMConnector`.

vLLM builds one connector class twice, `cls(vllm_config, role, kv_cache_config)`: once beside its scheduler and
once in its worker, two processes that share nothing but the metadata vLLM ships each step. Both sides talk to a
running `ucm-serve store` daemon (an embedded store would be two stores).

    plugin_config.py   `kv_connector_extra_config` -> `PluginConfig` (daemon address, what to save)
    model_identity.py  the model part of the key namespace: a content digest of a local model folder
    key_scope.py       `VllmKeyScope`: model, dtype, block size, vLLM version + CPU attention layout, TP rank
    step.py            per-step input (`StepDelta`, from vLLM's SchedulerOutput) and output (`StepPlan`)
    tracker.py         `RequestTracker`: one request's keys, device blocks and save progress across preemptions
    scheduler_core.py  lookups, load plans after allocation, per-step load/save plans
    block_bytes.py     a vLLM per-layer cache as opaque `[num_blocks, page_bytes]` rows, and staging rows
    worker_core.py     layer-wise loads into / saves from those rows, load-error reporting

Nothing here imports vllm; `connector/vllm_plugin.py` is the only module that does.
"""
