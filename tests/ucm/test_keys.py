"""Block keys: deterministic across processes, chained, namespaced."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.keys import KEY_NBYTES, KeyNamespace, block_keys, chain_key, root_key

_SCRIPT = """
from common.keys import KeyNamespace, block_keys, root_key
root = root_key(KeyNamespace("fp-123", "bfloat16", 4), "tenant-a")
print(",".join(k.hex() for k in block_keys(root, list(range(1000, 1010)), 4)))
"""


def _keys_here() -> list[str]:
    root = root_key(KeyNamespace("fp-123", "bfloat16", 4), "tenant-a")
    return [k.hex() for k in block_keys(root, list(range(1000, 1010)), 4)]


def test_keys_identical_in_two_fresh_processes() -> None:
    # Different PYTHONHASHSEEDs: a key must not depend on Python's per-process hash randomisation.
    outs = []
    for seed in ("1", "2"):
        run = subprocess.run(
            [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        )
        outs.append(run.stdout.strip().split(","))
    assert outs[0] == outs[1] == _keys_here()
    assert len(outs[0]) == 2  # 10 tokens, block size 4: two full blocks, the partial one has no key


def test_chain_property() -> None:
    ns = KeyNamespace("fp", "float16", 4)
    root = root_key(ns)
    ids = list(range(12))
    keys = block_keys(root, ids, 4)
    assert keys[0] == chain_key(root, ids[0:4])
    assert keys[2] == chain_key(keys[1], ids[8:12])
    assert all(len(k) == KEY_NBYTES for k in keys)
    # A shared prefix gives shared keys; a change in block 1 changes every later key.
    other = block_keys(root, ids[:4] + [99] + ids[5:], 4)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]
    # Same tokens of block 2 under a different history: different key.
    assert chain_key(root, ids[8:12]) != keys[2]


def test_namespace_and_salt_isolate() -> None:
    base = root_key(KeyNamespace("fp", "float16", 16))
    assert base != root_key(KeyNamespace("fp", "bfloat16", 16))
    assert base != root_key(KeyNamespace("fp", "float16", 32))
    assert base != root_key(KeyNamespace("fp2", "float16", 16))
    assert base != root_key(KeyNamespace("fp", "float16", 16, layout_version=2))
    assert base != root_key(KeyNamespace("fp", "float16", 16), "salt")
    assert base == root_key(KeyNamespace("fp", "float16", 16), None) == root_key(KeyNamespace("fp", "float16", 16), "")


def test_bad_namespace_rejected() -> None:
    with pytest.raises(ValueError):
        KeyNamespace("fp", "float16", 0)
    with pytest.raises(ValueError):
        chain_key(b"short", [1, 2])
