"""Ports picked for children to bind later (launch/ports.py): below the kernel's ephemeral range, every port of a
block free, a taken one passed over."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from launch.ports import DEFAULT_EPHEMERAL, bindable, ephemeral_range, free_port


def test_a_picked_port_lies_below_the_ephemeral_range_and_binds():
    lo, _ = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert port < lo, f"{port} is one bind(0) or an outgoing connection may take (range from {lo})"
        with socket.socket() as s:
            s.bind(("", port))  # a child binding it on every interface, as vLLM's tcp://*:P
        with socket.socket() as s:  # a bind(0) never lands on it
            s.bind(("127.0.0.1", 0))
            assert s.getsockname()[1] >= lo


def test_a_block_is_free_at_every_offset_and_a_taken_port_is_passed_over():
    offsets = (0, 1, 2, 10, 11, 12)
    picked = free_port(offsets, rng=random.Random(7))  # a seeded generator: the same candidates in the same order
    assert all(bindable(picked + o) for o in offsets)
    with socket.socket() as held:
        held.bind(("127.0.0.1", picked + 11))
        held.listen()
        assert not bindable(picked + 11), "a listening socket's port must read as taken"
        again = free_port(offsets, rng=random.Random(7))  # the same first candidate, now with a port taken
        assert again != picked, "the block with a taken port was handed out"
        assert all(bindable(again + o) for o in offsets)


def test_the_range_is_read_from_the_kernel_else_linux_default(tmp_path: Path):
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == (40000, 50000)
    assert ephemeral_range(tmp_path / "absent") == DEFAULT_EPHEMERAL


def test_bad_offsets_are_refused():
    with pytest.raises(ValueError, match="offsets"):
        free_port(())
    with pytest.raises(ValueError, match="offsets"):
        free_port((0, -1))
