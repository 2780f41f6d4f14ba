"""The router ↔ node wire protocol: every message round-trips, and bad frames are rejected, never executed."""

from __future__ import annotations

import pickle
import subprocess
import sys

import msgspec
import pytest

from protocol import messages as P

SPEC = P.SamplingSpec(max_tokens=8, temperature=0.0, seed=3, stop_token_ids=[2], logprobs=2)
MESSAGES: list[P.Message] = [
    P.Register("p0", P.NodeRole.PREFILL, "smollm2-135m", "fp", "float32", 16, 8192, 64, 728, True, instance="x"),
    P.Heartbeat("p0", running=1, waiting=2, free_blocks=700, cached_keys=[b"k" * 16], stats={"steps": 3.0}),
    P.Heartbeat("p0", running=0, waiting=0, free_blocks=1),
    P.PrefillDone(
        "r1",
        42,
        False,
        None,
        P.KVTransferParams(["ab" * 16], num_cached_tokens=16, block_size=16, store="tcp://127.0.0.1:1"),
        P.TokenLogprob(42, -0.5, [(42, -0.5), (7, -1.5)]),
        P.CacheInfo(20, 16, 16),
    ),
    P.TokenBatch("r1", [1, 2, 3], True, P.FinishReason.LENGTH, None, P.CacheInfo(20, 16, None)),
    P.JobFailed("r1", "boom"),
    P.Welcome("p0", P.WelcomeCode.UNKNOWN_NODE, "unknown node; register again"),
    P.Welcome("p0", P.WelcomeCode.ACCEPTED),
    P.PrefillJob("r1", [1, 2, 3], SPEC, cache_salt="tenant"),
    P.DecodeJob("r1", [1, 2, 3], SPEC, first_token_id=9, kv_transfer_params=P.KVTransferParams(["cd" * 16])),
    P.DecodeJob("r2", [1], SPEC),
    P.Abort(["r1", "r2"]),
    P.StepReplies([msgspec.Raw(P.encode(P.JobFailed("r1", "boom"))), msgspec.Raw(P.encode(P.TokenBatch("r2", [5])))]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_roundtrip(msg: P.Message) -> None:
    assert P.decode(P.encode(msg)) == msg


def test_union_is_tagged() -> None:
    raw = msgspec.msgpack.decode(P.encode(P.Abort(["x"])))
    assert raw["type"] == "abort"


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode({"type": "nope"}),
        msgspec.msgpack.encode({"type": "abort", "request_ids": "not-a-list"}),
        msgspec.msgpack.encode({"type": "prefill_job", "request_id": "r"}),  # missing fields
        pickle.dumps(P.Abort(["x"])),
    ],
)
def test_bad_frames_raise_value_error(frame: bytes) -> None:
    with pytest.raises(ValueError):
        P.decode(frame)


def test_kv_transfer_params_from_a_dict() -> None:
    d = {"block_keys": ["ab" * 16], "num_cached_tokens": 16, "num_saved_tokens": 0, "block_size": 16, "store": "x"}
    assert P.KVTransferParams.from_dict(d) == P.KVTransferParams(["ab" * 16], 16, 0, 16, "x")
    with pytest.raises(ValueError, match="kv_transfer_params"):
        P.KVTransferParams.from_dict({**d, "block_size": "sixteen"})
    with pytest.raises(ValueError, match="kv_transfer_params"):
        P.KVTransferParams.from_dict({**d, "new_field": 1})  # a field the connector adds is a protocol change


def test_welcome_code_decides_accepted() -> None:
    assert P.Welcome("p0", P.WelcomeCode.ACCEPTED).accepted
    assert not P.decode(P.encode(P.Welcome("p0", P.WelcomeCode.MODEL_MISMATCH, "other model"))).accepted


def test_one_finish_reason_from_engine_to_wire() -> None:
    from engine.request import FinishReason, RequestStatus

    assert FinishReason is P.FinishReason
    assert RequestStatus.FINISHED_LENGTH.finish_reason is P.FinishReason.LENGTH


def test_oversized_frame_rejected_before_parsing() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        P.decode(b"\x00" * (P.MAX_MESSAGE_BYTES + 1))


def test_protocol_imports_neither_torch_nor_pickle_users() -> None:
    code = "import sys, protocol.messages; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_steps_replies_travel_in_one_frame_and_come_back_each_checked() -> None:
    replies: list[P.Message] = [P.TokenBatch(f"r{i}", [i, i + 1]) for i in range(7)] + [P.JobFailed("r9", "boom")]
    frames = P.step_replies([P.encode(m) for m in replies])
    assert len(frames) == 1, "one frame for the step"
    step = P.decode(frames[0])
    assert isinstance(step, P.StepReplies) and P.job_replies(step) == replies
    single = P.encode(replies[0])
    assert P.step_replies([single]) == [single], "a lone reply goes as it is"
    assert P.step_replies([]) == []


def test_a_bad_reply_in_a_step_fails_only_itself() -> None:
    good = P.TokenBatch("r1", [3])
    # Well-formed msgpack that is no message (malformed bytes would make the whole frame undecodable, dropped).
    unknown = msgspec.Raw(msgspec.msgpack.encode({"type": "nope"}))
    step = P.StepReplies([unknown, msgspec.Raw(P.encode(good)), msgspec.Raw(P.encode(P.Abort(["x"])))])
    bad, ok, wrong = P.job_replies(P.decode(P.encode(step)))  # type: ignore[arg-type]
    assert isinstance(bad, ValueError) and ok == good
    assert isinstance(wrong, ValueError) and "Abort" in str(wrong), "only job replies may ride in a step"


def test_a_large_step_is_split_below_the_frame_limit() -> None:
    big = [P.encode(P.TokenBatch(f"r{i}", [70_000] * 700_000)) for i in range(6)]  # ~3.5 MB each
    frames = P.step_replies(big)
    assert len(frames) > 1 and all(len(f) <= P.MAX_MESSAGE_BYTES for f in frames)
    got = []
    for frame in frames:
        msg = P.decode(frame)
        got += P.job_replies(msg) if isinstance(msg, P.StepReplies) else [msg]
    assert [m.request_id for m in got] == [f"r{i}" for i in range(6)]  # type: ignore[union-attr]
