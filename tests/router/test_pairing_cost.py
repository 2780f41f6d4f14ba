"""Cost-based pairing (router/pairing.py) on measured step costs (router/step_cost.py), and the comparison rules."""

from __future__ import annotations

import pytest

from common.keys import KeyNamespace, block_keys, root_key
from protocol import messages as P
from router.pairing import Pairing
from router.pairing_policy import PairingPolicy
from router.registry import NodeState, Registry
from router.step_cost import StepCost

BLOCK = 4


def _cluster(*ids: str, capacity: int = 8) -> Registry:
    reg = Registry("m")
    for nid in ids:
        reg.register(P.Register(nid, P.NodeRole.PREFILL, "m", "fp", "float32", BLOCK, 1024, capacity, 100, True))
    return reg


def _keys(n_blocks: int) -> list[bytes]:
    return block_keys(root_key(KeyNamespace("fp", "float32", BLOCK), None), list(range(n_blocks * BLOCK)), BLOCK)


def _measure(node: NodeState, token_s: float, step_s: float, load_s: float | None = None) -> None:
    """Heartbeats from a node whose busy seconds are exactly token_s x tokens + step_s x steps."""
    t, tokens, steps, waited, loaded = 0.0, 0.0, 0.0, 0.0, 0.0
    for i in range(40):
        stats = {"computed_tokens": tokens, "steps": steps}
        if load_s is not None:
            stats |= {"connector_load_wait_seconds": waited, "connector_blocks_loaded": loaded}
        node.cost.observe(stats, t)
        d_tokens, d_steps = float(100 + 37 * (i % 5)), float(3 + i % 4)  # steps of varied sizes: both weights show
        tokens, steps = tokens + d_tokens, steps + d_steps
        waited, loaded = waited + 8 * (load_s or 0.0), loaded + 8
        t += token_s * d_tokens + step_s * d_steps


def test_step_cost_recovers_both_weights_and_the_load_cost() -> None:
    node = _cluster("p0").nodes["p0"]
    assert node.cost.prefill_token_s is None and node.cost.step_s is None  # nothing measured: no number
    _measure(node, token_s=0.002, step_s=0.03, load_s=0.004)
    assert node.cost.prefill_token_s == pytest.approx(0.002, rel=1e-6)
    assert node.cost.step_s == pytest.approx(0.03, rel=1e-6)
    assert node.cost.block_load_s == pytest.approx(0.004, rel=1e-6)


def test_step_cost_ignores_idle_intervals_and_counters_that_go_back() -> None:
    cost = StepCost()
    cost.observe({"computed_tokens": 0, "steps": 0}, 0.0)
    cost.observe({"computed_tokens": 0, "steps": 0}, 100.0)  # idle: no steps, no busy time
    cost.observe({"computed_tokens": 10, "steps": 5}, 100.2)
    assert cost.prefill_token_s is None  # 0.2 busy seconds: below the noise floor
    cost.observe({"computed_tokens": 0, "steps": 0}, 101.0)  # went back: not an interval
    assert cost.prefill_token_s is None
    with pytest.raises(ValueError):
        StepCost(half_life_s=0)


def test_step_cost_divides_by_the_nodes_own_busy_seconds() -> None:
    """A node idle for most of each heartbeat interval still reads at its speed: its steps' wall time counts."""
    cost = StepCost()
    for i in range(10):
        cost.observe({"computed_tokens": 100.0 * i, "steps": 2.0 * i, "jobs_busy_seconds": 0.1 * i}, 5.0 * i)
    assert cost.prefill_token_s == pytest.approx(0.001, rel=1e-6)  # 0.1 s per 100 tokens, not 5 s


def test_cost_prefers_the_holder_until_its_queue_costs_more_than_the_compute() -> None:
    reg = _cluster("p0", "p1")
    p0, p1 = reg.nodes["p0"], reg.nodes["p1"]
    for node in (p0, p1):
        _measure(node, token_s=0.002, step_s=0.01)
    keys = _keys(10)
    hits = {"p0": 8, "p1": 0}
    pairing = Pairing(PairingPolicy.COST)
    choice = pairing.prefill([p0, p1], keys, hits=hits)
    assert choice is not None and choice.node is p0
    assert choice.compute_tokens == 2 * BLOCK and choice.prefix_hit_blocks == 8
    assert choice.seconds == pytest.approx(2 * BLOCK * 0.002)
    # A queue on the holder longer than the prompt's missing tokens: computing it all on p1 is sooner.
    p0.queued_tokens = 9 * BLOCK
    choice = pairing.prefill([p0, p1], keys, hits=hits)
    assert choice is not None and choice.node is p1 and choice.compute_tokens == 10 * BLOCK


def test_cost_prices_store_hits_as_loads_and_a_slow_node_by_its_rate() -> None:
    reg = _cluster("p0", "p1", "p2")
    p0, p1, p2 = (reg.nodes[n] for n in ("p0", "p1", "p2"))
    _measure(p0, token_s=0.002, step_s=0.01, load_s=0.0001)
    _measure(p1, token_s=0.002, step_s=0.01, load_s=0.0001)
    _measure(p2, token_s=0.0002, step_s=0.01, load_s=0.0001)  # ten times faster per token
    keys = _keys(10)
    pairing = Pairing(PairingPolicy.COST)
    # p1's store holds 6 blocks (loaded cheaply), p0's device 3: p1 computes less. p2 computes all 40 tokens at a
    # tenth of the cost: 0.008 s against p1's 16 x 0.002 + 6 x 0.0001 = 0.0326 s.
    choice = pairing.prefill([p0, p1, p2], keys, hits={"p0": 3, "p1": 0, "p2": 0}, store_hits={"p1": 6})
    assert choice is not None and choice.node is p2
    choice = pairing.prefill([p0, p1], keys, hits={"p0": 3, "p1": 0}, store_hits={"p1": 6})
    assert choice is not None and choice.node is p1 and choice.compute_tokens == 4 * BLOCK


def test_cost_never_passes_the_admission_bound_while_another_node_has_room() -> None:
    reg = _cluster("p0", "p1", capacity=2)
    p0, p1 = reg.nodes["p0"], reg.nodes["p1"]
    p0.inflight |= {"a", "b"}  # at its bound
    pairing = Pairing(PairingPolicy.COST)
    choice = pairing.prefill([p0, p1], _keys(10), hits={"p0": 10, "p1": 0})
    assert choice is not None and choice.node is p1
    assert pairing.decode([p0, p1], prompt_keys=_keys(10), hits={"p0": 10, "p1": 0}) is p1
    p1.inflight |= {"c", "d"}  # both full: the router's queue admitted it, the cheapest still takes it
    choice = pairing.prefill([p0, p1], _keys(10), hits={"p0": 10, "p1": 0})
    assert choice is not None and choice.node is p0


def test_cost_decode_goes_where_the_kv_is_unless_that_node_is_much_busier() -> None:
    reg = _cluster("d0", "d1", capacity=16)
    d0, d1 = reg.nodes["d0"], reg.nodes["d1"]
    for node in (d0, d1):
        _measure(node, token_s=0.001, step_s=0.02, load_s=0.01)
    keys = _keys(20)
    pairing = Pairing(PairingPolicy.COST)
    # d0 holds the prompt: bringing 20 blocks to d1 (0.2 s) costs more than one more sequence in d0's batch.
    d0.running = 3
    assert pairing.decode([d0, d1], prompt_keys=keys, hits={"d0": 20}, max_tokens=32) is d0
    # ... but not over a long output: 32 x 14 more sequences x 0.001 s > 0.2 s.
    d0.running = 15
    assert pairing.decode([d0, d1], prompt_keys=keys, hits={"d0": 20}, max_tokens=32) is d1
    # With no prefill node, the decode node computes the prompt: the holder saves that compute.
    assert pairing.decode([d0, d1], prompt_keys=keys, hits={"d0": 20}, prefills_here=True) is d0


def test_comparison_rules() -> None:
    reg = _cluster("p0", "p1", "p2")
    nodes = list(reg.nodes.values())
    keys = _keys(10)
    rr = Pairing(PairingPolicy.ROUND_ROBIN)
    picks = [rr.prefill(nodes, keys) for _ in range(4)]
    assert [c.node.node_id for c in picks if c is not None] == ["p0", "p1", "p2", "p0"]
    # Dynamo: overlap_weight x (new + queued prefill blocks) + the blocks its active sequences hold.
    reg.nodes["p1"].free_blocks = 100 - 5  # 5 blocks held by running sequences
    dynamo = Pairing(PairingPolicy.DYNAMO).prefill(nodes, keys, hits={"p0": 2, "p1": 8, "p2": 0})
    assert dynamo is not None and dynamo.node.node_id == "p1"  # 2 + 5 < 8 + 0
    reg.nodes["p1"].free_blocks = 100 - 7  # 2 + 7 > 8
    dynamo = Pairing(PairingPolicy.DYNAMO).prefill(nodes, keys, hits={"p0": 2, "p1": 8, "p2": 0})
    assert dynamo is not None and dynamo.node.node_id == "p0"
    # SGLang: the best match over half the prompt; under it, the node caching least; imbalanced: shortest queue.
    sg = Pairing(PairingPolicy.SGLANG)
    choice = sg.prefill(nodes, keys, hits={"p0": 6, "p1": 8, "p2": 0})
    assert choice is not None and choice.node.node_id == "p1"
    choice = sg.prefill(nodes, keys, hits={"p0": 4, "p1": 5, "p2": 0})
    assert choice is not None and choice.node.node_id in ("p0", "p2")  # p1 holds 7 blocks of running sequences
    reg.nodes["p1"].running = 40
    choice = sg.prefill(nodes, keys, hits={"p0": 6, "p1": 8, "p2": 0})
    assert choice is not None and choice.node.node_id == "p0"
    with pytest.raises(ValueError):
        Pairing("cost")  # type: ignore[arg-type]


def test_cost_spreads_equal_prices_round_the_nodes() -> None:
    """Idle nodes and a prompt nobody holds price the same everywhere: the turn moves on, not always the first id."""
    reg = _cluster("p0", "p1", "p2")
    nodes = list(reg.nodes.values())
    pairing = Pairing(PairingPolicy.COST)
    picks = [pairing.prefill(nodes, _keys(4)) for _ in range(3)]
    assert sorted(c.node.node_id for c in picks if c is not None) == ["p0", "p1", "p2"]
    decodes = [pairing.decode(nodes, prompt_keys=_keys(4)) for _ in range(3)]
    assert sorted(n.node_id for n in decodes if n is not None) == ["p0", "p1", "p2"]


def test_cost_treats_prices_within_the_fit_noise_as_equal() -> None:
    """Identical nodes measure rates a few tenths of a percent apart: prompts nobody holds still go round them all,
    while a node cheaper by more than `PRICE_TIE` (a block it holds) still wins."""
    reg = _cluster("p0", "p1", "p2")
    nodes = list(reg.nodes.values())
    for node, token_s in zip(nodes, (0.002, 0.002006, 0.002003), strict=True):
        _measure(node, token_s=token_s, step_s=0.01)
    pairing = Pairing(PairingPolicy.COST)
    picks = [pairing.prefill(nodes, _keys(40)) for _ in range(3)]
    assert sorted(c.node.node_id for c in picks if c is not None) == ["p0", "p1", "p2"]
    for _ in range(3):  # 1 of 40 blocks held: 2.5% cheaper there, past the tie
        choice = pairing.prefill(nodes, _keys(40), hits={"p0": 0, "p1": 0, "p2": 1})
        assert choice is not None and choice.node.node_id == "p2"


def test_a_node_whose_steps_were_all_alike_is_priced_like_the_measured_ones() -> None:
    """A decode node that only ever ran one sequence a step fits its whole step cost to tokens (0.1 s a token): it
    counts as unmeasured while others measured both weights, so it is not priced 50 times dearer than it is."""
    reg = _cluster("d0", "d1", capacity=16)
    d0, d1 = reg.nodes["d0"], reg.nodes["d1"]
    t = 0.0
    for i in range(40):  # one token a step: tokens and steps move together
        d0.cost.observe({"computed_tokens": float(3 * i), "steps": float(3 * i)}, t)
        t += 3 * (0.1 + 0.002)
    assert d0.cost.step_s is None and d0.cost.prefill_token_s == pytest.approx(0.102)
    _measure(d1, token_s=0.002, step_s=0.1)
    d1.running = 3
    assert Pairing(PairingPolicy.COST).decode([d0, d1], prompt_keys=_keys(4), max_tokens=64) is d0  # the idle one
