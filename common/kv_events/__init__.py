"""KV cache events in vLLM's wire format (vllm/distributed/kv_events.py, vLLM 0.32): what a node's device prefix
cache stored and removed, published over ZeroMQ so that a consumer written for vLLM (llm-d, Dynamo, the router's
prefix index) reads ours unchanged.

    events.py      the structs (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`) and the media
    config.py      `KVEventsConfig`: vLLM's `--kv-events-config` JSON, typed; endpoint rules (bind or connect, offsets)
    codec.py       encode a batch as vLLM does; decode either of vLLM's encodings (maps with a `type` key, arrays)
    publisher.py   `ZmqEventPublisher`: PUB (topic, sequence, payload) + the replay ROUTER over a ring of batches
    subscriber.py  `EventStream`: one publisher's batches in sequence order, gaps repaired through its replay socket

Only `publisher.py` and `subscriber.py` import zmq; the engine imports `events.py` alone.
"""
