"""Our KV event publisher read by vLLM's own consumer code: a subprocess in the vLLM venv subscribes (CURVE, as a
consumer given a key pair from our key folder), decodes every frame with vllm.distributed.kv_events.KVEventBatch
and asks the replay socket for what it missed, exactly as a consumer written for vLLM does. Skipped without the
vLLM venv (~/.cache/ucm-peers/vllm-venv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.auth import ClientAuth, PublisherAuth, generate_keys
from common.keys import KeyNamespace, root_key
from common.kv_events.config import KVEventsConfig
from common.kv_events.publisher import ZmqEventPublisher
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

VLLM_PYTHON = Path.home() / ".cache/ucm-peers/vllm-venv/bin/python"
BS = 4

CONSUMER = r"""
import json, sys, zmq, zmq.auth, msgspec
from vllm import __version__
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared

endpoint, replay_endpoint, my_secret, server_public, count = sys.argv[1:6]
count = int(count)
ctx = zmq.Context()

def curve(sock):
    public, secret = zmq.auth.load_certificate(my_secret)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = zmq.auth.load_certificate(server_public)[0]

sub = ctx.socket(zmq.SUB)
curve(sub)
sub.setsockopt(zmq.SUBSCRIBE, b"kv")
sub.connect(endpoint)
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

def describe(seq, batch):
    out = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append(["stored", [h.hex() for h in e.block_hashes],
                        e.parent_block_hash.hex() if e.parent_block_hash is not None else None,
                        e.token_ids, e.block_size, e.medium, e.lora_id])
        elif isinstance(e, BlockRemoved):
            out.append(["removed", [h.hex() for h in e.block_hashes], e.medium])
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append(["cleared"])
    return {"seq": seq, "ts": batch.ts, "rank": batch.data_parallel_rank, "events": out}

print("ready", flush=True)
live = []
while len(live) < count:
    assert sub.poll(20000), "no batch within 20 s"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv"
    live.append(describe(int.from_bytes(seq, "big"), decoder.decode(payload)))

replay = ctx.socket(zmq.REQ)
curve(replay)
replay.connect(replay_endpoint)
replay.send((1).to_bytes(8, "big"))
assert replay.poll(20000), "no replay answer"
topic, seq, payload = replay.recv_multipart()
first_replayed = describe(int.from_bytes(seq, "big"), decoder.decode(payload))
print(json.dumps({"vllm": __version__, "live": live, "replayed": first_replayed}), flush=True)
"""


def _events_of_a_real_block_pool() -> tuple[list[list], list[bytes]]:
    """Batches as the engine makes them: a prompt of 3 full blocks + 1 token cached, then evicted, then a reset."""
    m = KVCacheManager(num_blocks=4, block_size=BS, record_events=True)
    root = root_key(KeyNamespace("test-model", "float32", BS))
    first = Request("a", list(range(13)), SamplingParams(), root_key=root, block_size=BS, arrival=0, seed=0)
    m.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    m.cache_full_blocks(first)
    stored = m.take_events()
    m.free(first)
    other = Request("b", [99] * 12, SamplingParams(), root_key=root, block_size=BS, arrival=1, seed=0)
    m.allocate_slots(other, other.num_tokens)  # takes the free block, then the two least recently freed
    removed = m.take_events()
    m.pool.reset_prefix_cache()
    return [stored, removed, m.take_events()], first.block_keys


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv at ~/.cache/ucm-peers/vllm-venv")
def test_vllms_decoder_reads_our_frames_and_replay(tmp_path) -> None:
    keys = generate_keys(tmp_path / "keys", ("decode-0", "indexer"))
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv",
    )
    pub = ZmqEventPublisher(config, PublisherAuth.from_client(ClientAuth.for_router(keys.dir, "decode-0")))
    batches, prompt_keys = _events_of_a_real_block_pool()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    consumer = subprocess.Popen(
        [
            str(VLLM_PYTHON),
            "-c",
            CONSUMER,
            pub.endpoint,
            str(pub.replay_endpoint),
            str(keys.dir / "indexer.key_secret"),
            str(keys.authorized / "decode-0.key"),
            str(len(batches)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert consumer.stdout is not None
        line = consumer.stdout.readline()  # vLLM imports for a while (torch), then connects
        assert line.strip() == "ready", consumer.stderr.read() if consumer.stderr else line
        time.sleep(1.0)  # the slow joiner: its subscription reaches the publisher
        for i, events in enumerate(batches):
            pub.publish(events, ts=100.0 + i)
        out, err = consumer.communicate(timeout=120)
    finally:
        if consumer.poll() is None:
            consumer.kill()
        pub.close()
    assert consumer.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    print(f"decoded by vLLM {got['vllm']}", file=sys.stderr)
    hexes = [k.hex() for k in prompt_keys]
    assert got["live"] == [
        {"seq": 0, "ts": 100.0, "rank": 0, "events": [["stored", hexes, None, list(range(12)), BS, "GPU", None]]},
        # the free block (never cached), then the two least recently freed: the prompt's tail first
        {"seq": 1, "ts": 101.0, "rank": 0, "events": [["removed", [hexes[2], hexes[1]], "GPU"]]},
        {"seq": 2, "ts": 102.0, "rank": 0, "events": [["cleared"]]},
    ]
    assert got["replayed"] == got["live"][1]
