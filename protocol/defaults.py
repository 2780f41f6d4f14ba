"""One source for the deployment's defaults: the router, the nodes, `ucm-serve up` / `serve`, `ClusterSpec` and the
store daemon all take these, so a default can no longer differ between two ways of starting the same thing.

Torch-free and import-free (the router and the store daemon read it too)."""

from __future__ import annotations

MODEL = "smollm2-135m"  # the alias of the model shipped with the project (engine/model_source.py ALIASES)
HTTP_HOST = "127.0.0.1"  # the router's HTTP address: local only unless asked (`--host 0.0.0.0`)
HTTP_PORT = 8000  # vLLM's default, so clients written for it find us
NODES_ADDR = "tcp://127.0.0.1:5557"  # where a router started by hand listens for nodes (`up` picks free ports)
NODE_KV_CACHE_MEMORY = "2GiB"  # each node's paged KV cache (the device tier)
# Sequences an engine runs at once (vLLM's --max-num-seqs); more wait in its queue.
MAX_NUM_SEQS = 64
# Tokens an engine step computes at most, decodes and prompt chunks together (vLLM's --max-num-batched-tokens).
# None: each engine picks it for its host by measurement at start-up (engine/step_budget.py says how and why).
MAX_NUM_BATCHED_TOKENS: int | None = None
STORE_DRAM = "4GiB"  # the store daemon's DRAM tier
STORE_DISK = "20GiB"  # the store daemon's disk tier (LMDB map size; the file grows as blocks arrive)
