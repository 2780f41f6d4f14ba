"""Node registry (register, heartbeat, expiry, re-registration) and the pairing policy, without processes."""

from __future__ import annotations

from common.keys import KeyNamespace, block_keys, root_key
from protocol import messages as P
from router.pairing import pick_decode, pick_prefill
from router.registry import Registry


def _reg(node_id: str, role: P.NodeRole, instance: str = "a", model: str = "m", fp: str = "fp") -> P.Register:
    return P.Register(node_id, role, model, fp, "float32", 4, 1024, 8, 100, True, instance=instance)


def _keys(ids: list[int], salt: str | None = None) -> list[bytes]:
    return block_keys(root_key(KeyNamespace("fp", "float32", 4), salt), ids, 4)


def test_register_heartbeat_expire_and_return() -> None:
    reg = Registry("m", timeout_s=1.0)
    welcome, lost = reg.register(_reg("p0", P.NodeRole.PREFILL), now=10.0)
    assert welcome.accepted and lost is None
    assert reg.heartbeat(P.Heartbeat("p0", 2, 1, 50), now=10.5) is None
    assert reg.nodes["p0"].running == 2 and reg.nodes["p0"].free_blocks == 50
    assert reg.expire(now=11.0) == []
    assert [n.node_id for n in reg.expire(now=11.6)] == ["p0"]
    # A heartbeat after the drop asks the node to register again; it is then re-added.
    answer = reg.heartbeat(P.Heartbeat("p0", 0, 0, 100), now=12.0)
    assert answer is not None and not answer.accepted and answer.reason.startswith("unknown")
    assert reg.register(_reg("p0", P.NodeRole.PREFILL), now=12.0)[0].accepted
    assert reg.alive(P.NodeRole.PREFILL)[0].node_id == "p0"


def test_restarted_node_is_a_new_incarnation() -> None:
    reg = Registry("m")
    reg.register(_reg("p0", P.NodeRole.PREFILL, instance="a"))
    reg.nodes["p0"].inflight.add("r1")
    same = reg.register(_reg("p0", P.NodeRole.PREFILL, instance="a"))[1]
    assert same is None and reg.nodes["p0"].inflight == {"r1"}
    lost = reg.register(_reg("p0", P.NodeRole.PREFILL, instance="b"))[1]
    assert lost is not None and lost.inflight == {"r1"} and reg.nodes["p0"].inflight == set()


def test_refuses_other_model_or_namespace() -> None:
    reg = Registry("m")
    assert not reg.register(_reg("x", P.NodeRole.DECODE, model="other"))[0].accepted
    assert reg.register(_reg("d0", P.NodeRole.DECODE))[0].accepted
    welcome = reg.register(_reg("d1", P.NodeRole.DECODE, fp="different"))[0]
    assert not welcome.accepted and "fingerprint" in welcome.reason


def test_pairing_prefers_prefix_holder_then_least_loaded() -> None:
    reg = Registry("m")
    for nid in ("p0", "p1", "p2"):
        reg.register(_reg(nid, P.NodeRole.PREFILL))
    prompt = list(range(12))  # 3 full blocks of 4
    keys = _keys(prompt)
    reg.heartbeat(P.Heartbeat("p1", 1, 0, 90, cached_keys=keys[:2]))
    reg.heartbeat(P.Heartbeat("p2", 0, 0, 90, cached_keys=keys[:1]))
    choice = pick_prefill(reg.alive(P.NodeRole.PREFILL), keys)
    assert choice is not None and (choice.node.node_id, choice.prefix_hit_blocks) == ("p1", 2)
    # Another tenant's salt changes every key: no prefix holder, so the least loaded wins.
    other = pick_prefill(reg.alive(P.NodeRole.PREFILL), _keys(prompt, "tenant"))
    assert other is not None and other.prefix_hit_blocks == 0 and other.node.node_id in ("p0", "p2")
    # A prefix holder that is far busier than the least-loaded node loses.
    reg.heartbeat(P.Heartbeat("p1", 8, 4, 90))
    busy = pick_prefill(reg.alive(P.NodeRole.PREFILL), keys)
    assert busy is not None and busy.node.node_id == "p2"
    assert pick_prefill(reg.alive(P.NodeRole.PREFILL), keys, exclude={"p0", "p1", "p2"}) is None


def test_decode_pairing_counts_router_inflight() -> None:
    reg = Registry("m")
    reg.register(_reg("d0", P.NodeRole.DECODE))
    reg.register(_reg("d1", P.NodeRole.DECODE))
    reg.nodes["d0"].inflight.update({"a", "b"})  # assigned but not yet in a heartbeat
    node = pick_decode(reg.alive(P.NodeRole.DECODE))
    assert node is not None and node.node_id == "d1"
    assert reg.prompt_keys(list(range(8)), None) == _keys(list(range(8)))
