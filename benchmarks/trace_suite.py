"""The traces the eviction policies are judged on, split so that tuning on one cannot pass the others.

Every trace is Mooncake-format (`timestamp` ms, `input_length`, `output_length`, `hash_ids`: prefix-chained
block ids), and `--write DIR` writes each as a `.jsonl` file any Mooncake-trace tool reads.

- `conv-tune` / `conv-holdout`: the public Mooncake conversation trace split in two by conversation (a request
  belongs to the half of xxh3(its second block id) mod 2, the block after the shared system prompt: the turns
  of one conversation share it). Policies are tuned on `conv-tune` only.
- `azure-chat`, `azure-rag`, `azure-agent`: the Azure LLM inference traces' real arrivals and prompt lengths
  (Splitwise, ISCA'24: conversation and code services, one hour each) with prefix structure drawn from
  published shapes, because those traces carry no content:
  - chat: multi-turn sessions behind one of a few shared system prompts (Zipf popularity); a turn re-sends the
    whole history, the previous answer and a new message; sessions last ~3 turns (ShareGPT-like; the Mooncake
    trace averages 1.6 requests per conversation) with a lognormal think time of median 60 s (its turns
    come a median 123 s apart).
  - rag: a system prompt, one to three documents from a Zipf-popular pool, then the question; a fifth of the
    requests ask a follow-up about the same documents.
  - agent (the code trace's arrivals and lengths): long shared tool/system prompts (Zipf), sessions of ~8 steps
    that each append a tool result to the history, seconds apart.
  A row's prompt length is honoured: a session continues only into a row long enough for its history, the new
  content fills the rest, and a shared prefix is picked among those that fit.

The seeds below were fixed before any policy was tuned on these traces (commit that added this file); a
changed seed or generator is a new trace, and the old results stop counting as held out.
"""

from __future__ import annotations

import argparse
import csv
import enum
import heapq
import json
import math
import sys
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from benchmarks.traces import MOONCAKE_BLOCK_TOKENS, Chainer, conversation_hash, default_trace_path

# Azure prompts are short (median 1,020 and 1,469 tokens): 512-token blocks would hide their structure.
SYNTHETIC_BLOCK_TOKENS = 128
SEEDS = {"azure-chat": 20261203, "azure-rag": 20261204, "azure-agent": 20261205}


class TraceName(enum.Enum):
    CONV_TUNE = "conv-tune"
    CONV_HOLDOUT = "conv-holdout"
    AZURE_CHAT = "azure-chat"
    AZURE_RAG = "azure-rag"
    AZURE_AGENT = "azure-agent"

    @property
    def held_out(self) -> bool:
        return self is not TraceName.CONV_TUNE


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp_ms,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": self.hash_ids,
            }
        )


@dataclass(frozen=True)
class Trace:
    name: TraceName
    block_tokens: int
    requests: list[TraceRequest]

    def full_blocks(self) -> list[list[int]]:
        """Each request's full blocks (the trailing partial block is not keyed), as the store replay wants them."""
        return [r.hash_ids[: r.input_length // self.block_tokens] for r in self.requests]


def traces_dir() -> Path:
    return default_trace_path().parent


# --- the conversation trace, split ---------------------------------------------------------------------------


def conversation_half(name: TraceName, path: Path | None = None) -> Trace:
    assert name in (TraceName.CONV_TUNE, TraceName.CONV_HOLDOUT), f"{name} is not a half of the conversation trace"
    path = path or default_trace_path()
    if not path.is_file():
        raise ValueError(f"trace not found: {path}")
    want = 0 if name is TraceName.CONV_TUNE else 1
    out: list[TraceRequest] = []
    short = 0
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            ids = [int(h) for h in row["hash_ids"]]
            conversation = conversation_hash(ids)
            if conversation is not None:
                half = conversation % 2
            else:  # only the system prompt: alternate, so both halves get their share
                half, short = short % 2, short + 1
            if half == want:
                out.append(
                    TraceRequest(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), ids)
                )
    return Trace(name, MOONCAKE_BLOCK_TOKENS, out)


# --- Azure arrivals and lengths with generated prefixes --------------------------------------------------------


@dataclass(frozen=True)
class AzureRow:
    timestamp_ms: int
    context_tokens: int
    generated_tokens: int


def azure_rows(kind: str) -> list[AzureRow]:
    path = traces_dir() / f"AzureLLMInferenceTrace_{kind}.csv"
    if not path.is_file():
        raise ValueError(f"trace not found: {path}")
    rows: list[AzureRow] = []
    t0: datetime | None = None
    with path.open() as f:
        for rec in csv.DictReader(f):
            # Seven fractional digits: more than datetime parses; milliseconds are what the format keeps.
            stamp = datetime.strptime(rec["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            t0 = t0 or stamp
            ms = round((stamp - t0).total_seconds() * 1000)
            rows.append(AzureRow(ms, int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
    return rows


@dataclass(order=True)
class _Session:
    due_ms: float  # when its user (or agent) sends the next turn
    sid: int = field(compare=False)
    blocks: list[Hashable] = field(compare=False)  # content so far, as block contents (tokens // block)
    tokens: int = field(compare=False)  # history length, the last answer included
    turns_left: int = field(compare=False)


@dataclass(frozen=True)
class SessionShape:
    """How a generated workload's sessions look."""

    prefixes: int  # shared prefixes (system or tool prompts, or documents)
    prefix_blocks: tuple[int, int]  # their length range, in blocks
    zipf: float  # their popularity
    mean_turns: float  # requests per session (geometric)
    think_median_s: float  # lognormal gap between a session's turns
    think_sigma: float
    expire_s: float  # a session not continued this long after it was due has ended
    docs_per_request: tuple[int, int] = (1, 1)  # prefixes stacked per request (rag: documents)
    system_blocks: int = 0  # one prompt before the prefixes every request shares


SHAPES = {
    TraceName.AZURE_CHAT: SessionShape(24, (1, 12), 1.0, 3.0, 60.0, 1.0, 900.0),
    TraceName.AZURE_RAG: SessionShape(4000, (4, 16), 0.9, 1.25, 30.0, 0.8, 300.0, (1, 3), 2),
    TraceName.AZURE_AGENT: SessionShape(12, (8, 24), 1.2, 8.0, 5.0, 0.8, 120.0),
}
AZURE_SOURCE = {TraceName.AZURE_CHAT: "conv", TraceName.AZURE_RAG: "conv", TraceName.AZURE_AGENT: "code"}


def generated(name: TraceName) -> Trace:
    shape, rows = SHAPES[name], azure_rows(AZURE_SOURCE[name])
    rng = np.random.default_rng(SEEDS[name.value])
    bt = SYNTHETIC_BLOCK_TOKENS
    lengths = rng.integers(shape.prefix_blocks[0], shape.prefix_blocks[1] + 1, size=shape.prefixes)
    weights = 1.0 / np.arange(1, shape.prefixes + 1) ** shape.zipf
    chainer = Chainer()
    system: list[Hashable] = [("system", j) for j in range(shape.system_blocks)]
    waiting: list[_Session] = []  # heap by due time
    ready: list[_Session] = []  # due, in due order
    next_sid = 0
    out: list[TraceRequest] = []
    for i, row in enumerate(rows):
        now = row.timestamp_ms
        session = _due_session(waiting, ready, now, row.context_tokens, shape)
        if session is not None:
            new_tokens = row.context_tokens - session.tokens
            history = session.blocks[: session.tokens // bt]
            content = history + _unique(("turn", session.sid, i), session.tokens, new_tokens, bt)
        else:
            sid, next_sid = next_sid, next_sid + 1
            budget = int(row.context_tokens * 0.9) // bt - len(system)
            prefix = list(system)
            for _ in range(int(rng.integers(shape.docs_per_request[0], shape.docs_per_request[1] + 1))):
                fits = np.flatnonzero(lengths <= budget - (len(prefix) - len(system)))
                if not len(fits):
                    break
                p = int(rng.choice(fits, p=weights[fits] / weights[fits].sum()))
                prefix += [("prefix", p, j) for j in range(int(lengths[p]))]
            if len(prefix) * bt > row.context_tokens:  # the system prompt alone does not fit
                prefix = []
            session = _Session(0.0, sid, prefix, len(prefix) * bt, int(rng.geometric(1.0 / shape.mean_turns)))
            content = prefix + _unique(("turn", sid, i), session.tokens, row.context_tokens - session.tokens, bt)
        ids = chainer.chain(content[: row.context_tokens // bt])
        # The trailing partial block's id is unique to this request, as in Mooncake's files.
        if row.context_tokens % bt:
            ids += chainer.chain([("tail", i)], parent=ids[-1] if ids else -1)
        out.append(TraceRequest(now, row.context_tokens, row.generated_tokens, ids))
        session.turns_left -= 1
        if session.turns_left > 0:
            # The next turn re-sends this prompt and its answer: both become history.
            answer = _unique(("answer", session.sid, i), row.context_tokens, row.generated_tokens, bt)
            session.blocks = content[: row.context_tokens // bt] + answer
            session.tokens = row.context_tokens + row.generated_tokens
            session.due_ms = now + 1000 * shape.think_median_s * math.exp(shape.think_sigma * rng.standard_normal())
            heapq.heappush(waiting, session)
    return Trace(name, bt, out)


def _due_session(
    waiting: list[_Session], ready: list[_Session], now: int, context_tokens: int, shape: SessionShape
) -> _Session | None:
    """The session due longest ago whose history fits this row. `waiting` is a heap of sessions not yet due;
    `ready` holds the due ones in due order, and loses those not continued within `expire_s` of their due time."""
    while waiting and waiting[0].due_ms <= now:
        ready.append(heapq.heappop(waiting))
    expired = 0
    while expired < len(ready) and now - ready[expired].due_ms > 1000 * shape.expire_s:
        expired += 1
    del ready[:expired]
    for k, s in enumerate(ready):
        if s.tokens < context_tokens:
            return ready.pop(k)
    return None


def _unique(tag: tuple[Hashable, ...], start_tokens: int, tokens: int, bt: int) -> list[Hashable]:
    """Content blocks for `tokens` new tokens after `start_tokens`: a block straddling the boundary is new content
    too (it mixes the old tail with new tokens), so block indices continue from the history's full blocks."""
    first, last = start_tokens // bt, (start_tokens + max(tokens, 0)) // bt + 1
    return [(*tag, j) for j in range(first, last)]


def load(name: TraceName) -> Trace:
    if name in (TraceName.CONV_TUNE, TraceName.CONV_HOLDOUT):
        return conversation_half(name)
    return generated(name)


def iter_all(names: list[TraceName] | None = None) -> Iterator[Trace]:
    for name in names or list(TraceName):
        yield load(name)


def describe(trace: Trace) -> str:
    blocks = trace.full_blocks()
    accesses = sum(map(len, blocks))
    distinct = len({b for r in blocks for b in r})
    return (
        f"{trace.name.value:<13} {'held out' if trace.name.held_out else 'tuning':<9} {len(trace.requests):>6} requests "
        f"{trace.block_tokens:>4}-token blocks {accesses:>7} block accesses, {distinct:>7} distinct "
        f"(infinite-cache hit rate {100 * (accesses - distinct) / max(accesses, 1):.1f}%)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, default=None, help="write each trace as DIR/<name>.jsonl")
    args = ap.parse_args(argv)
    for trace in iter_all():
        print(describe(trace))
        if args.write:
            args.write.mkdir(parents=True, exist_ok=True)
            path = args.write / f"{trace.name.value}.jsonl"
            path.write_text("".join(r.to_json() + "\n" for r in trace.requests))
            print(f"  wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
