"""The nouns every side shares: a torch-free leaf the router, the nodes, the engine, the connector, the store and
the launcher may all import, and which imports nothing of ours (docs/architecture.md).

    keys.py         content-addressed block keys (`KeyNamespace`, `root_key`, `chain_key`, `block_keys`)
    auth.py         CURVE key files for every server and node, applied to ZeroMQ sockets
    log_limit.py    `LogLimiter`: rate-limited warnings for receive loops that face untrusted peers
    size.py         human byte sizes ("4GiB" ⇄ bytes) for every flag and config that takes one
    save_policy.py  `KVSavePolicy`: when a node's connector saves a block to the store
    file_digest.py  a file's content hash, memoised on disk (model fingerprints, the vLLM plugin's model identity)
"""
