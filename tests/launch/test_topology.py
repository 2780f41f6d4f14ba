"""`ucm-serve up --topology`: what auto picks from the host, and explicit choices."""

import pytest

from launch.topology import DISAGG_MIN_CORES, Topology, choose_topology


def test_auto_on_a_small_cpu_host_is_one_engine_with_every_core() -> None:
    choice = choose_topology(Topology.AUTO, None, None, cores=2)
    assert (choice.topology, choice.prefill, choice.decode, choice.colocated) == (Topology.COLOCATED, 0, 0, 1)
    assert "2 cores" in choice.reason


def test_auto_disaggregates_on_a_big_host_or_with_a_gpu() -> None:
    for choice in (
        choose_topology(Topology.AUTO, None, None, cores=DISAGG_MIN_CORES),
        choose_topology(Topology.AUTO, None, None, cores=2, cuda=True),
    ):
        assert (choice.topology, choice.prefill, choice.decode, choice.colocated) == (Topology.DISAGG, 1, 1, 0)


def test_node_counts_mean_disagg() -> None:
    choice = choose_topology(Topology.AUTO, 2, None, cores=2)
    assert (choice.topology, choice.prefill, choice.decode) == (Topology.DISAGG, 2, 1)
    assert choose_topology(Topology.COLOCATED, None, None, cores=64).colocated == 1


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="decode"):
        choose_topology(Topology.DISAGG, 1, 0, cores=2)
    with pytest.raises(ValueError, match=">= 0"):
        choose_topology(Topology.DISAGG, -1, 1, cores=2)
