"""Wire messages between the router and the nodes: the ONE module both sides import (no torch, no pickle).

Every message is a msgspec Struct in a tagged union, sent as a single msgpack frame over ZeroMQ
(router: ROUTER socket bound at `--bind-nodes`; each node: a DEALER connected to it).

    node → router   Register, Heartbeat, PrefillDone, TokenBatch, JobFailed (one step's several: StepReplies)
    router → node   Welcome, PrefillJob, DecodeJob, Abort

A request's life on the wire (DESIGN.md §2):
    PrefillJob → P ... PrefillDone(first token, kv_transfer_params) → router
    DecodeJob(prompt ids, first token, kv_transfer_params) → D ... TokenBatch* (last one finished=True) → router
    Abort(request ids) → P and/or D whenever the client goes away or a stop string matched.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

# 2: Heartbeat.steps (the router's progress watch relies on it); 3: typed Welcome, KV params; 4: StepReplies
PROTOCOL_VERSION = 4
# A 128k-token prompt is ~0.7 MB of msgpack; anything far bigger is a bug or an attack.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class NodeRole(enum.Enum):
    PREFILL = "prefill"  # producer: computes the prompt's KV, saves it to the store, returns the first token
    DECODE = "decode"  # consumer: loads the prompt's KV from the store (or prefills locally), decodes
    BOTH = "both"  # colocated: one engine does everything (decode jobs with no first token)


class FinishReason(enum.Enum):
    """Why a sequence ended: the ONE enum, from the engine's scheduler (engine/request.py imports it) through the
    wire to the router's OpenAI `finish_reason` (its values are OpenAI's / vLLM's strings)."""

    STOP = "stop"  # EOS or a stop token / string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the router
    ERROR = "error"


class WelcomeCode(enum.Enum):
    """The router's answer to a Register (or to a heartbeat it cannot place)."""

    ACCEPTED = "accepted"
    UNKNOWN_NODE = "unknown_node"  # a heartbeat from a node the router does not know: register again
    PROTOCOL_MISMATCH = "protocol_mismatch"
    MODEL_MISMATCH = "model_mismatch"  # the node serves another model (name) than the router
    NAMESPACE_MISMATCH = "namespace_mismatch"  # fingerprint / dtype / block size differ from the other nodes


class FailureCode(enum.Enum):
    """Why a node failed a job: the router answers the client 400 for the request's own fault, else 500."""

    SERVER = "server"
    INVALID_REQUEST = "invalid_request"  # the engine refused the request itself (e.g. a schema it cannot compile)


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, omit_defaults=True):
    pass


class GuideKind(enum.Enum):
    """What a structured-output guide is (the engine's `GuidedKind` is this enum)."""

    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format {"type": "json_object"})
    JSON_SCHEMA = "json_schema"  # a JSON value valid under `schema`
    REGEX = "regex"  # text matching the regular expression `schema`


class GuideSpec(msgspec.Struct, omit_defaults=True):
    """Structured output: the sampled tokens must follow this grammar (response_format, tools)."""

    kind: GuideKind
    schema: str | None = None  # JSON schema text or regular expression; None for JSON_OBJECT


class SamplingSpec(msgspec.Struct, omit_defaults=True):
    """The subset of engine.SamplingParams that crosses the wire (stop strings, detokenization and chat
    templating stay in the router). node/sampling.py is the one conversion to SamplingParams."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token (0 = sampled token only)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # counted from the request's first output token, wherever it was sampled
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] = []  # empty: any token
    guide: GuideSpec | None = None
    # Output tokens produced before this job (a decode job: the prefill's first token, plus the tokens a resumed
    # job carries): they end the job's prompt + first token, and count towards min_tokens, penalties and guides.
    num_generated: int = 0


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What a prefill node's connector hands the decode node with PrefillDone, sent back with the DecodeJob: which
    blocks the producer saved and where. The same struct from the wire to the connector and back: the connector's
    `request_finished` returns it, the engine's `Request` carries it, the connector reads its fields.
    Unknown fields are refused: a field the connector adds is a protocol change, made here."""

    block_keys: list[str] = []  # hex keys of the prompt's full blocks, as the producer computed them
    num_cached_tokens: int = 0  # prompt tokens the producer did not compute (device prefix cache + store)
    num_saved_tokens: int = 0
    block_size: int = 0
    store: str = ""  # the store address the blocks went to

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> KVTransferParams:
        """The one conversion for a peer that speaks these fields as a dict, as vLLM hands a connector its
        `kv_transfer_params` (our own path carries the struct throughout). ValueError naming the field for a field
        of the wrong type, or one this struct does not have."""
        try:
            return msgspec.convert(params, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"bad kv_transfer_params: {e}") from e


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class CacheInfo(msgspec.Struct, omit_defaults=True):
    """Where a request's prompt tokens came from on one node."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # not computed: the node's device prefix cache plus the store
    store_hit_tokens: int | None = None  # the part loaded through the connector, when the node knows it
    # Of store_hit_tokens, the part read from the store's DRAM tier and from its disk tier (loaded and verified
    # blocks only); both 0 when the node does not know. The router clamps them to store_hit_tokens.
    store_dram_tokens: int = 0
    store_disk_tokens: int = 0


# ---------------------------------------------------------------- node → router


class KVEventsEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Where a node publishes its device prefix cache's KV events (vLLM's wire format, common/kv_events/): the
    bound PUB address and replay ROUTER address as a subscriber reaches them, and the topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class Register(_Msg, tag="register"):
    node_id: str
    role: NodeRole
    model: str  # the name clients use ("smollm2-135m")
    model_fingerprint: str  # with dtype + block_size: the KeyNamespace, so the router can compute block keys
    dtype: str
    block_size: int
    max_model_len: int
    capacity: int  # max concurrent requests (max_num_seqs)
    num_blocks: int
    has_store: bool
    instance: str = ""  # random per process: a restarted node with the same id is a new incarnation
    protocol_version: int = PROTOCOL_VERSION
    # Set when the node publishes KV events on a socket it binds (--kv-events-config): the router's prefix index
    # subscribes there. None: no events, or a PUB that connects out to a consumer the router is not.
    kv_events: KVEventsEndpoint | None = None


class Heartbeat(_Msg, tag="heartbeat"):
    node_id: str
    running: int
    waiting: int
    free_blocks: int
    # Engine steps that did work, monotone per process: the router gives up on a node only when this stops
    # moving while it holds the router's requests (a busy node's queue is slow, not stuck).
    steps: int = 0
    # Keys (16 bytes each) of the blocks most recently computed or hit on this node, newest last, capped:
    # a summary of its device prefix cache for prefix-aware pairing. None = unchanged since the last one.
    cached_keys: list[bytes] | None = None
    stats: dict[str, float] = {}  # engine / connector counters, exported by the router as gauges


class PrefillDone(_Msg, tag="prefill_done"):
    request_id: str
    first_token_id: int
    finished: bool  # the first token already ended the request (EOS, stop token)
    finish_reason: FinishReason | None = None
    kv_transfer_params: KVTransferParams | None = None
    logprob: TokenLogprob | None = None
    cache: CacheInfo = msgspec.field(default_factory=CacheInfo)


class TokenBatch(_Msg, tag="tokens"):
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    cache: CacheInfo | None = None  # sent with the first batch of a decode job


class JobFailed(_Msg, tag="job_failed"):
    request_id: str
    message: str
    code: FailureCode = FailureCode.SERVER


JobReply = PrefillDone | TokenBatch | JobFailed
JOB_REPLIES = (PrefillDone, TokenBatch, JobFailed)


class StepReplies(_Msg, tag="step_replies"):
    """One engine step's job replies in one frame, each an encoded PrefillDone, TokenBatch or JobFailed: a step of
    8 decodes was 8 sends, 8 CURVE boxes and 8 wake-ups of the router, each taking a core from the engine's threads.
    Each reply is decoded and checked on its own (`job_replies`), so one bad reply fails only itself."""

    replies: list[msgspec.Raw]


# ---------------------------------------------------------------- router → node


class Welcome(_Msg, tag="welcome"):
    """Answer to Register; also sent to a node whose heartbeat the router does not know (it re-registers)."""

    node_id: str
    code: WelcomeCode
    reason: str = ""  # for the log, with any code but ACCEPTED

    @property
    def accepted(self) -> bool:
        return self.code is WelcomeCode.ACCEPTED


class PrefillJob(_Msg, tag="prefill_job"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingSpec
    cache_salt: str | None = None


class DecodeJob(_Msg, tag="decode_job"):
    """With `first_token_id` the prompt's KV comes from the store; without it the node prefills locally."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingSpec
    first_token_id: int | None = None
    kv_transfer_params: KVTransferParams | None = None
    cache_salt: str | None = None


class Abort(_Msg, tag="abort"):
    request_ids: list[str]


class ResetPrefixCache(_Msg, tag="reset_prefix_cache"):
    """Drop the device prefix cache (vLLM's `POST /reset_prefix_cache`), once no request holds blocks; the node then
    publishes AllBlocksCleared."""


Message = (
    Register
    | Heartbeat
    | PrefillDone
    | TokenBatch
    | JobFailed
    | StepReplies
    | Welcome
    | PrefillJob
    | DecodeJob
    | Abort
    | ResetPrefixCache
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


class _JobHeader(msgspec.Struct):
    type: str
    request_id: str


def job_request_id(buf: bytes | memoryview) -> str | None:
    """The request id of a frame that failed `decode` but is a job, so the node can answer JobFailed; else None."""
    if len(buf) > MAX_MESSAGE_BYTES:
        return None
    try:
        head = msgspec.msgpack.decode(buf, type=_JobHeader)
    except Exception:  # anything else wrong with it (RecursionError included): no answer
        return None
    return head.request_id if head.type in ("prefill_job", "decode_job") else None


def step_replies(frames: list[bytes]) -> list[bytes]:
    """Encoded job replies of one step as frames to send: one StepReplies per up to MAX_MESSAGE_BYTES // 2 of them
    (a single reply goes as it is)."""
    if len(frames) <= 1:
        return frames
    out: list[bytes] = []
    group: list[msgspec.Raw] = []
    size = 0
    for frame in frames:
        if group and size + len(frame) > MAX_MESSAGE_BYTES // 2:
            out.append(encode(StepReplies(group)))
            group, size = [], 0
        group.append(msgspec.Raw(frame))
        size += len(frame)
    out.append(encode(StepReplies(group)) if len(group) > 1 else bytes(group[0]))
    return out


def job_replies(msg: StepReplies) -> list[JobReply | ValueError]:
    """The replies a StepReplies carries, each decoded on its own: a ValueError in place of one that is malformed
    or not a job reply."""
    out: list[JobReply | ValueError] = []
    for raw in msg.replies:
        try:
            reply = decode(raw)
        except ValueError as e:
            out.append(e)
            continue
        out.append(
            reply if isinstance(reply, JOB_REPLIES) else ValueError(f"a {type(reply).__name__} in a step's replies")
        )
    return out


def decode(buf: bytes | memoryview) -> Message:
    """Decode one frame; ValueError for anything oversized, malformed or not one of our messages."""
    if len(buf) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(buf)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        message: Message = _decoder.decode(buf)
        return message
    except msgspec.DecodeError as e:  # a ValueError subclass; re-raised with context
        raise ValueError(f"bad wire message: {e}") from e
