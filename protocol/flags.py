"""One declaration per command-line flag that more than one command takes (name, type, default, help): `up` / `serve`
(launch/launcher.py), the node roles (node/config.py) and the router (router/cli.py) add these, so a flag cannot mean
one thing to one command and another to the next. vLLM's names and meanings where vLLM has the flag.

Torch-free and import-free beyond the defaults (the router reads it too). A command's own flags stay with it.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from typing import Any

from protocol import defaults

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Flag:
    name: str
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # argparse's: type, default, choices, action

    def add(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument(self.name, help=self.help, **self.kwargs)


def one_of(kind: type[enum.Enum], default: enum.Enum | None) -> dict[str, Any]:
    """argparse's kwargs for a flag that takes one of a str enum's values, parsed into the enum (--help lists them)."""
    values = [member.value for member in kind]
    return {"type": kind, "default": default, "choices": list(kind), "metavar": "{" + ",".join(values) + "}"}


def curve_keys(reads: str) -> Flag:
    """--curve-keys DIR, the one key folder `ucm-serve keys` writes; `reads`: what this command takes from it."""
    return Flag(
        "--curve-keys", f"folder from `ucm-serve keys DIR --nodes ...`: {reads}", {"metavar": "DIR", "default": None}
    )


def insecure(unauthenticated: str) -> Flag:
    """--insecure, the explicit opt-out of CURVE; `unauthenticated`: which sockets go without it, and the risk."""
    return Flag("--insecure", f"no authentication {unauthenticated}", {"action": "store_true"})


MODEL = Flag("--model", "alias, Hugging Face folder or .gguf file", {"default": defaults.MODEL})
HOST = Flag("--host", "HTTP address of the router (0.0.0.0: every interface)", {"default": defaults.HTTP_HOST})
PORT = Flag("--port", "HTTP port of the router", {"type": int, "default": defaults.HTTP_PORT})
SERVED_MODEL_NAME = Flag("--served-model-name", "the model name clients send (default: the model)", {"default": None})
API_KEY = Flag("--api-key", "require 'Authorization: Bearer KEY' on /v1/*", {"default": None})
MAX_MODEL_LEN = Flag(
    "--max-model-len",
    "prompt + completion tokens per request (default: the model's, bounded by each node's KV cache)",
    {"type": int, "default": None},
)
MAX_NUM_SEQS = Flag(
    "--max-num-seqs",
    "sequences each engine runs at once (vLLM's flag; more wait in its queue)",
    {"type": int, "default": defaults.MAX_NUM_SEQS},
)
MAX_NUM_BATCHED_TOKENS = Flag(
    "--max-num-batched-tokens",
    "tokens one engine step computes at most, prompt chunks and decodes together (vLLM's flag): smaller steps give "
    "first tokens sooner, larger ones more throughput. Default: each engine picks it for the host at start-up and "
    "logs why: vLLM's CPU default 2048 where such a step's matmuls are predicted under 1 s from a measured matmul, "
    "else 1024 (engine/step_budget.py)",
    {"type": int, "default": defaults.MAX_NUM_BATCHED_TOKENS},
)
KV_CACHE_MEMORY = Flag(
    "--kv-cache-memory",
    "each engine's paged KV cache (the device tier), e.g. 512MiB, 4GiB",
    {"default": defaults.NODE_KV_CACHE_MEMORY},
)
ENABLE_PREFIX_CACHING = Flag(
    "--enable-prefix-caching",
    "reuse the KV of prompt prefixes held in each engine's device cache",
    {"action": argparse.BooleanOptionalAction, "default": True},
)
DTYPE = Flag(
    "--dtype",
    "auto = bf16 on CPUs with native bf16 where a measured matmul agrees (and on CUDA), else fp32",
    {"default": "auto", "choices": list(DTYPES)},
)
DEVICE = Flag("--device", "cpu or cuda (default: cuda if available)", {"default": None})
KV_EVENTS_CONFIG = Flag(
    "--kv-events-config",
    "vLLM's KV cache events config, a JSON object: e.g. "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
    '"replay_endpoint": "tcp://*:5558"}\'; fields: enable_kv_cache_events, publisher, endpoint, replay_endpoint, '
    "buffer_steps, hwm, max_queue_size, topic (vLLM's defaults). Each node publishes its device cache's "
    "BlockStored/BlockRemoved/AllBlocksCleared there in vLLM's wire format (CURVE unless --insecure); the router "
    "indexes them. `up` offsets both ports by each further node's index, as vLLM offsets them per data-parallel rank",
    {"default": None, "metavar": "JSON"},
)
