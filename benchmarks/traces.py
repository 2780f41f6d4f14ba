"""Workloads for the hit-rate benchmark: each is a list of requests, a request being its prompt's block ids.

Block ids are prefix-chained like real block keys: the same id always has the same parent id (the block
before it), so two requests share block i only if they share blocks 0..i. The replay turns each id into a
real `ucm.keys.chain_key` key. Sources:

- `mooncake`: the Mooncake FAST'25 conversation trace (see ../shared/data/traces/PROVENANCE.md), whose
  `hash_ids` are remapped prefix-chained hashes of 512-token blocks. The last id of a request covers the
  trailing *partial* block (len(hash_ids) == ceil(input_length / 512)); the store keys full blocks only,
  so we keep floor(input_length / 512) ids per request. `sample=k` keeps about 1/k of the conversations,
  SHARDS-style: a request is kept iff xxh3(its second block id) falls in bucket 0 of k. Every block past
  the first (the global system prompt) is only ever shared within the requests that share block 1, so each
  kept conversation keeps all its reuse; capacities are then fractions of the sample's working set.
- `chat`: multi-turn conversations behind a shared system prompt; sessions interleave, each turn re-sends
  the whole history plus the previous answer and a new user message.
- `sysprompt`: single-turn requests that start with one of a few shared system prompts (Zipf popularity).
- `rag`: a system prompt, then one or two retrieved documents from a Zipf-popular pool, then a question.

The generators are seeded and deterministic (numpy `default_rng`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

Request = list[int]
MOONCAKE_BLOCK_TOKENS = 512


class Workload(enum.Enum):
    MOONCAKE = "mooncake"
    CHAT = "chat"
    SYSPROMPT = "sysprompt"
    RAG = "rag"


def default_trace_path() -> Path:
    """`<repo>/../shared/data/traces/conversation_trace.jsonl`, the repo being this file's grandparent."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"


def conversation_hash(ids: list[int]) -> int | None:
    """A stable hash of the block after the shared system prompt, which the turns of one conversation share (None:
    the request is no longer than the system prompt). Samples and splits of the trace bucket requests by it."""
    return xxhash.xxh3_64_intdigest(ids[1].to_bytes(8, "little")) if len(ids) > 1 else None


@dataclass(frozen=True)
class MooncakeRow:
    """One request of a Mooncake-format trace: its arrival, lengths and full blocks' hash ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    blocks: list[int]  # the full blocks (the trailing partial block is not keyed)


def read_mooncake(path: Path, max_requests: int | None = None, sample: int = 1) -> list[MooncakeRow]:
    """The trace's rows; `max_requests` reads the first N lines, `sample` keeps ~1/k conversations (whole, by
    `conversation_hash`)."""
    if not path.is_file():
        raise ValueError(f"trace not found: {path} (pass --trace)")
    if sample < 1:
        raise ValueError(f"sample must be >= 1, got {sample}")
    rows: list[MooncakeRow] = []
    short = 0
    with path.open() as f:
        for i, line in enumerate(f):
            if max_requests is not None and i >= max_requests:
                break
            row = json.loads(line)
            ids = [int(h) for h in row["hash_ids"][: int(row["input_length"]) // MOONCAKE_BLOCK_TOKENS]]
            conversation = conversation_hash(ids)
            if conversation is not None:
                keep = conversation % sample == 0
            else:  # nothing to share beyond the system prompt: keep the same fraction of them
                keep, short = short % sample == 0, short + 1
            if keep:
                rows.append(
                    MooncakeRow(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), ids)
                )
    return rows


def load_mooncake(path: Path, max_requests: int | None = None, sample: int = 1) -> list[Request]:
    """Full-block hash ids per request (`read_mooncake`'s rows without their times and lengths)."""
    return [row.blocks for row in read_mooncake(path, max_requests, sample)]


class Chainer:
    """Interns (parent id, content) pairs into fresh int ids, so equal prefixes get equal ids (as chained hashes do)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}

    def chain(self, contents: list[Hashable], parent: int = -1) -> Request:
        """Ids of `contents` in order, the first chained below `parent` (-1: the root)."""
        out: Request = []
        for content in contents:
            parent = self._ids.setdefault((parent, content), len(self._ids))
            out.append(parent)
        return out


def _zipf_choice(rng: np.random.Generator, n: int, alpha: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** alpha
    return int(rng.choice(n, p=weights / weights.sum()))


def chat(num_requests: int, seed: int = 0, system_blocks: int = 4, active_sessions: int = 64) -> list[Request]:
    rng = np.random.default_rng(seed)
    chainer = Chainer()
    system = [("sys", j) for j in range(system_blocks)]
    sessions: dict[int, list[Hashable]] = {}  # session id -> its content after the system prompt
    next_session = 0
    out: list[Request] = []
    while len(out) < num_requests:
        # Keep a pool of live sessions; recent sessions are picked more often (users are mid-conversation).
        while len(sessions) < active_sessions:
            sessions[next_session] = []
            next_session += 1
        live = sorted(sessions)
        sid = live[len(live) - 1 - _zipf_choice(rng, len(live), 0.6)]
        history = sessions[sid]
        turn = len(history)
        history += [("user", sid, turn, j) for j in range(int(rng.integers(1, 4)))]
        out.append(chainer.chain(system + history))
        history += [("answer", sid, turn, j) for j in range(int(rng.integers(1, 3)))]
        if rng.random() < 0.15 or len(history) > 60:  # the user leaves
            del sessions[sid]
    return out


def sysprompt(num_requests: int, seed: int = 0, num_prompts: int = 24, alpha: float = 1.0) -> list[Request]:
    rng = np.random.default_rng(seed)
    chainer = Chainer()
    lengths = rng.integers(2, 12, size=num_prompts)
    out: list[Request] = []
    for i in range(num_requests):
        p = _zipf_choice(rng, num_prompts, alpha)
        prompt: list[Hashable] = [("sys", p, j) for j in range(int(lengths[p]))]
        user: list[Hashable] = [("q", i, j) for j in range(int(rng.integers(1, 6)))]
        out.append(chainer.chain(prompt + user))
    return out


def rag(
    num_requests: int, seed: int = 0, num_docs: int = 2000, doc_blocks: int = 6, alpha: float = 0.9
) -> list[Request]:
    rng = np.random.default_rng(seed)
    chainer = Chainer()
    system: list[Hashable] = [("sys", j) for j in range(3)]
    out: list[Request] = []
    for i in range(num_requests):
        docs = [_zipf_choice(rng, num_docs, alpha) for _ in range(int(rng.integers(1, 3)))]
        body: list[Hashable] = [("doc", d, j) for d in docs for j in range(doc_blocks)]
        question: list[Hashable] = [("q", i, j) for j in range(int(rng.integers(1, 3)))]
        out.append(chainer.chain(system + body + question))
    return out


def make_workload(
    workload: Workload, *, trace: Path | None = None, num_requests: int | None = None, seed: int = 0, sample: int = 1
) -> list[Request]:
    if workload is Workload.MOONCAKE:
        return load_mooncake(trace or default_trace_path(), num_requests, sample)
    n = num_requests if num_requests is not None else 8000
    generator = {Workload.CHAT: chat, Workload.SYSPROMPT: sysprompt, Workload.RAG: rag}[workload]
    return generator(n, seed=seed)


def working_set(requests: list[Request]) -> int:
    """Distinct blocks: what an infinite cache ends up holding."""
    return len({block for request in requests for block in request})
