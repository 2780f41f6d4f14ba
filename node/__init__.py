"""The serving-node runtime shared by prefill_node and decode_node: one engine behind a ZeroMQ DEALER.

config.py    NodeConfig + the node CLI flags (one parser for both node kinds)
openmp_env.py how a node's idle OpenMP threads wait, set before torch loads (launch/cli.py)
key_cache.py recent block keys on this node (the heartbeat's prefix-cache summary)
job.py       the role seam: RoleWorker (prefill_node/worker.py, decode_node/worker.py), LiveJob, counters
runner.py    protocol jobs → EngineCore requests, engine outputs → protocol messages (role-agnostic)
heartbeat.py a thread that keeps heartbeats flowing even while a long step runs
server.py    the loop: poll the socket without blocking, step the engine, stream outputs back

Wire messages come from protocol.messages, the one torch-free module both sides import (DESIGN.md §1).
"""
