"""Which prefill node and which decode node serve a request: `Pairing`, one of `PairingPolicy`'s rules.

COST (the default) prices each candidate in seconds, with the weights each node measured (router/step_cost.py):
    prefill: (queued prompt tokens + tokens left to compute after its device and store hits) x seconds per token
             + blocks loaded from the store x seconds per loaded block
    decode:  blocks its device cache lacks x seconds per loaded block (the KV it must bring)
             + max_tokens x (seconds per step + seconds per token x its batch with this sequence)
             (+ the prefill's price when the decode node computes the prompt itself: no prefill node)
and never places work on a node at its admission bound (running + waiting >= capacity) while another has room. A
node without measurements yet is priced at the median of those with; with none measured every node shares one unit,
so the ranking still follows tokens (a loaded block then costs `LOAD_PRIOR` of its block's compute, a guess stated
as one, until a node measures its loads). Prices within `PRICE_TIE` of the cheapest count as equal: the less loaded
node, then a turn that moves per request, takes the prompt.

The others are kept for comparison (benchmarks/cluster_sim.py runs them side by side): PREFIX_SLACK, the policy
before (the longest cached prefix while its node is within `PREFIX_LOAD_SLACK` of the least loaded); LEAST_LOADED;
ROUND_ROBIN; DYNAMO (NVIDIA Dynamo's KV router at temperature 0: least overlap_weight x prefill blocks + decode
blocks); SGLANG (SGLang's cache-aware router: shortest queue while the load is imbalanced, else the best prefix
match when it covers over half the prompt, else the node caching least).

What a node holds comes from the KV event index where the node publishes events (`hits`, router/kv_index.py), else
from the recent keys in its heartbeats. `pick_prefill` / `pick_decode` are the PREFIX_SLACK and least-loaded rules.

A candidate is anything with a node's load, size and measured costs (`Candidate`): our nodes (`NodeState`, fed by
heartbeats) and `vllm serve` instances (router/vllm_backend.py, fed by vLLM's /metrics and KV events) are priced
by the same rules.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from common.keys import BlockKey
from router.pairing_policy import PairingPolicy

# A prefix holder is preferred while its load is at most this much above the least-loaded node's.
PREFIX_LOAD_SLACK = 0.5
# Until a node measures its store loads: a loaded block costs this fraction of computing its tokens.
LOAD_PRIOR = 0.1
# Dynamo's KvRouterConfig defaults: overlap_score_weight 1.0, temperature 0 (argmin, no sampling).
DYNAMO_OVERLAP_WEIGHT = 1.0
# SGLang's router defaults (sgl-router CacheAwarePolicy): balance_abs_threshold 32, balance_rel_threshold 1.0001,
# cache_threshold 0.5.
SGLANG_ABS_THRESHOLD = 32
SGLANG_REL_THRESHOLD = 1.0001
SGLANG_CACHE_THRESHOLD = 0.5
# Prices within this fraction of the cheapest are one price (then the less loaded node, then the turn): identical
# nodes' fitted rates differ by ~0.3% (fit noise), and ranking on that sent every prompt nobody held to the nodes
# that happened to measure fastest; in benchmarks/cluster_sim.py at 128 nodes, max/mean load 1.36, 1.18 with this.
PRICE_TIE = 0.01


class Size(Protocol):
    """A candidate's fixed size (a node's `Register`)."""

    @property
    def capacity(self) -> int: ...  # sequences it runs at once: its admission bound
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...


class Costs(Protocol):
    """A candidate's measured seconds (router/step_cost.py's `StepCost`); None: not measured yet."""

    @property
    def prefill_token_s(self) -> float | None: ...
    @property
    def step_s(self) -> float | None: ...
    @property
    def block_load_s(self) -> float | None: ...


class Candidate(Protocol):
    """What pairing reads of a prefill or decode node."""

    @property
    def node_id(self) -> str: ...
    @property
    def info(self) -> Size: ...
    @property
    def load(self) -> float: ...  # busy / capacity
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def in_flight(self) -> int: ...  # the router's requests on it now (covers its reports' lag)
    @property
    def free_blocks(self) -> int: ...
    @property
    def queued_tokens(self) -> int: ...  # prompt tokens of the router's prefills on it not answered yet
    @property
    def cost(self) -> Costs: ...

    def prefix_hit_blocks(self, keys: list[BlockKey]) -> int: ...


N = TypeVar("N", bound=Candidate)
T = TypeVar("T")


@dataclass(frozen=True)
class PrefillChoice(Generic[N]):
    node: N
    prefix_hit_blocks: int  # how many of the prompt's blocks the chosen node reported holding
    compute_tokens: int = 0  # prompt tokens it is expected to compute (after device and store hits)
    seconds: float = 0.0  # COST's price (queue ahead included); 0 for the other policies


def _held(node: Candidate, keys: Sequence[BlockKey], hits: Mapping[str, int] | None) -> int:
    if hits is not None and node.node_id in hits:
        return hits[node.node_id]
    return node.prefix_hit_blocks(list(keys))


def _least_loaded(nodes: Sequence[N]) -> N:
    return min(nodes, key=lambda n: (n.load, -n.free_blocks, n.node_id))


def _busy(node: Candidate) -> int:
    return max(node.running + node.waiting, node.in_flight)


def _within_bound(nodes: list[N]) -> list[N]:
    """The nodes below their admission bound; all of them when none is (the router's queue admitted the request)."""
    room = [n for n in nodes if _busy(n) < n.info.capacity]
    return room or nodes


@dataclass(frozen=True)
class _Rates:
    """Seconds per computed token, per step and per loaded block for each candidate, measured or filled in."""

    token_s: dict[str, float]
    step_s: dict[str, float]
    load_s: dict[str, float]

    @classmethod
    def of(cls, nodes: Sequence[Candidate]) -> _Rates:
        def fill(measured: dict[str, float | None], default: float) -> dict[str, float]:
            known = [v for v in measured.values() if v is not None]
            middle = statistics.median(known) if known else default
            return {k: v if v is not None else middle for k, v in measured.items()}

        # A node whose steps were all alike (a decode node only ever at batch 1) fits one weight and reads the other
        # as None: its whole step cost lands on one term (0.1 s a token) and it looked 50 times dearer than the
        # rest. While some node measured both, such a node counts as unmeasured.
        split = {n.node_id for n in nodes if n.cost.prefill_token_s is not None and n.cost.step_s is not None}
        whole = [n for n in nodes if not split or n.node_id in split]
        token_s = fill({n.node_id: n.cost.prefill_token_s if n in whole else None for n in nodes}, 1.0)
        step_s = fill({n.node_id: n.cost.step_s if n in whole else None for n in nodes}, 0.0)
        prior = {n.node_id: LOAD_PRIOR * n.info.block_size * token_s[n.node_id] for n in nodes}
        measured_load = {n.node_id: n.cost.block_load_s for n in nodes}
        known = [v for v in measured_load.values() if v is not None]
        load_s = {
            k: v if v is not None else (statistics.median(known) if known else prior[k])
            for k, v in measured_load.items()
        }
        return cls(token_s, step_s, load_s)


class Pairing:
    """One policy's choices; holds what a policy remembers between requests (round-robin's turn)."""

    def __init__(self, policy: PairingPolicy = PairingPolicy.COST) -> None:
        if not isinstance(policy, PairingPolicy):
            raise ValueError(f"policy must be a PairingPolicy, got {policy!r}")
        self.policy = policy
        self._turn = itertools.count()

    def prefill(
        self,
        nodes: Sequence[N],
        prompt_keys: Sequence[BlockKey],
        exclude: Collection[str] = (),
        hits: Mapping[str, int] | None = None,
        store_hits: Mapping[str, int] | None = None,
        prompt_tokens: int | None = None,
    ) -> PrefillChoice[N] | None:
        """`hits`: node id -> leading prompt blocks in its device cache (the KV event index; nodes missing answer
        from heartbeats); `store_hits`: node id -> leading blocks its store holds (loadable, not computed);
        `prompt_tokens`: the prompt's length (default: its full blocks')."""
        candidates = [n for n in nodes if n.node_id not in exclude]
        if not candidates:
            return None
        policy = self.policy
        if policy is PairingPolicy.COST:
            return self._prefill_cost(candidates, prompt_keys, hits, store_hits, prompt_tokens)
        if policy is PairingPolicy.PREFIX_SLACK:
            least = _least_loaded(candidates)
            best = PrefillChoice(least, _held(least, prompt_keys, hits))
            for node in candidates:
                here = _held(node, prompt_keys, hits)
                if here > best.prefix_hit_blocks and node.load <= least.load + PREFIX_LOAD_SLACK:
                    best = PrefillChoice(node, here)
            return best
        if policy is PairingPolicy.LEAST_LOADED:
            node = _least_loaded(candidates)
        elif policy is PairingPolicy.ROUND_ROBIN:
            node = sorted(candidates, key=lambda n: n.node_id)[next(self._turn) % len(candidates)]
        elif policy is PairingPolicy.DYNAMO:
            node = min(candidates, key=lambda n: (self._dynamo(n, prompt_keys, hits), n.node_id))
        else:
            assert policy is PairingPolicy.SGLANG, f"unhandled policy {policy}"
            node = self._sglang(candidates, prompt_keys, hits)
        return PrefillChoice(node, _held(node, prompt_keys, hits))

    def decode(
        self,
        nodes: Sequence[N],
        exclude: Collection[str] = (),
        prompt_keys: Sequence[BlockKey] = (),
        hits: Mapping[str, int] | None = None,
        max_tokens: int = 1,
        prefills_here: bool = False,
        prompt_tokens: int | None = None,
    ) -> N | None:
        """`hits`: node id -> leading prompt blocks in its device cache; `prefills_here`: no prefill node ran, the
        decode node computes the prompt too (COST then prices that as well)."""
        candidates = [n for n in nodes if n.node_id not in exclude]
        if not candidates:
            return None
        if self.policy is PairingPolicy.ROUND_ROBIN:
            return sorted(candidates, key=lambda n: n.node_id)[next(self._turn) % len(candidates)]
        if self.policy is PairingPolicy.DYNAMO:
            return min(candidates, key=lambda n: (self._dynamo(n, prompt_keys, hits), n.node_id))
        if self.policy is not PairingPolicy.COST:
            return _least_loaded(candidates)
        candidates = _within_bound(candidates)
        rates = _Rates.of(candidates)

        def price(node: N) -> float:
            nid = node.node_id
            held = _held(node, prompt_keys, hits) if prompt_keys else 0
            if prefills_here:
                return self._prefill_seconds(node, rates, len(prompt_keys), held, 0, prompt_tokens)[0]
            bring = (len(prompt_keys) - held) * rates.load_s[nid]
            per_step = rates.step_s[nid] + rates.token_s[nid] * (_busy(node) + 1)
            return bring + max(1, max_tokens) * per_step

        return self._cheapest([(price(n), n, n) for n in candidates], self._rotation(candidates))

    # ------------------------------------------------------------------ the rules

    def _prefill_cost(
        self,
        candidates: list[N],
        keys: Sequence[BlockKey],
        hits: Mapping[str, int] | None,
        store_hits: Mapping[str, int] | None,
        prompt_tokens: int | None,
    ) -> PrefillChoice[N]:
        candidates = _within_bound(candidates)
        rates = _Rates.of(candidates)
        priced: list[tuple[float, N, PrefillChoice[N]]] = []
        for node in candidates:
            device = _held(node, keys, hits)
            store = store_hits.get(node.node_id, 0) if store_hits is not None else 0
            seconds, compute = self._prefill_seconds(node, rates, len(keys), device, store, prompt_tokens)
            priced.append((seconds, node, PrefillChoice(node, device, compute, seconds)))
        return self._cheapest(priced, self._rotation(candidates))

    @staticmethod
    def _cheapest(priced: Sequence[tuple[float, Candidate, T]], turn: Mapping[str, int]) -> T:
        """Of the (price, node, item)s within `PRICE_TIE` of the lowest price, the item whose node is least loaded,
        then first in the turn."""
        low = min(price for price, _, _ in priced)
        near = [p for p in priced if p[0] <= low * (1 + PRICE_TIE)]
        return min(near, key=lambda p: (p[1].load, turn[p[1].node_id]))[2]

    def _rotation(self, candidates: Sequence[Candidate]) -> dict[str, int]:
        """Each candidate's place in a turn that moves on every request: equal prices (idle nodes, prompts nobody
        holds) go round the nodes instead of always to the first id, which would pile new conversations and their
        follow-ups on it."""
        ids = sorted(n.node_id for n in candidates)
        start = next(self._turn) % len(ids)
        return {nid: (i - start) % len(ids) for i, nid in enumerate(ids)}

    @staticmethod
    def _prefill_seconds(
        node: Candidate, rates: _Rates, blocks: int, device: int, store: int, prompt_tokens: int | None
    ) -> tuple[float, int]:
        """(price in seconds, tokens to compute) of `node` prefilling a prompt of `blocks` full blocks."""
        block = node.info.block_size
        tokens = prompt_tokens if prompt_tokens is not None else blocks * block
        reused = min(max(device, store), blocks)
        compute = max(1, tokens - reused * block)  # the last token is always computed: its logits give the first
        loaded = max(0, reused - device)
        nid = node.node_id
        seconds = (node.queued_tokens + compute) * rates.token_s[nid] + loaded * rates.load_s[nid]
        return seconds, compute

    @staticmethod
    def _dynamo(node: Candidate, keys: Sequence[BlockKey], hits: Mapping[str, int] | None) -> float:
        """Dynamo's worker logit: blocks to prefill (this prompt's new ones + those queued there) weighted by
        overlap_weight, plus the KV blocks its active sequences hold."""
        block = node.info.block_size
        prefill_blocks = len(keys) - _held(node, keys, hits) + node.queued_tokens / block
        decode_blocks = node.info.num_blocks - node.free_blocks
        return DYNAMO_OVERLAP_WEIGHT * prefill_blocks + decode_blocks

    @staticmethod
    def _sglang(candidates: list[N], keys: Sequence[BlockKey], hits: Mapping[str, int] | None) -> N:
        loads = {n.node_id: _busy(n) for n in candidates}
        low, high = min(loads.values()), max(loads.values())
        if high - low > SGLANG_ABS_THRESHOLD and high > low * SGLANG_REL_THRESHOLD:
            return min(candidates, key=lambda n: (loads[n.node_id], n.node_id))
        best = max(candidates, key=lambda n: (_held(n, keys, hits), -loads[n.node_id], n.node_id))
        if keys and _held(best, keys, hits) / len(keys) > SGLANG_CACHE_THRESHOLD:
            return best
        # SGLang sends a poorly matched prompt to the worker with the smallest radix tree (the most room to cache).
        return min(candidates, key=lambda n: (n.info.num_blocks - n.free_blocks, loads[n.node_id], n.node_id))


def pick_prefill(
    nodes: list[N],
    prompt_keys: list[BlockKey],
    exclude: Collection[str] = (),
    hits: Mapping[str, int] | None = None,
) -> PrefillChoice[N] | None:
    """PREFIX_SLACK's prefill node. `hits`: node id -> leading prompt blocks it holds, for the nodes whose KV events
    are indexed; the others answer from their heartbeat summaries."""
    return Pairing(PairingPolicy.PREFIX_SLACK).prefill(nodes, prompt_keys, exclude, hits)


def pick_decode(nodes: list[N], exclude: Collection[str] = ()) -> N | None:
    """The least-loaded decode node (fewest running + waiting per capacity), ties broken by free KV blocks."""
    return Pairing(PairingPolicy.LEAST_LOADED).decode(nodes, exclude)
