"""`checked_dump`: a dump request's blocks, admitted only if every field is consistent.

Two stages, so that a shape error is reported as such even for a client that has not opened a namespace:

1. structure (no layout needed): one payload per block and layer, 16-byte keys, token ids in [0, 2**32),
   distinct layers in 0..num_layers-1, and each key chains: key == `common.keys.chain_key(parent, token_ids)`. A chain's
   first block is checked the same way (its parent is the root the client derived from its namespace and
   cache_salt; the store never sees the salt, so the root itself cannot be recomputed here).
2. layout: num_layers, every payload's size and every block's token count equal the namespace's layout.

Checked here, before the store copies a byte, so a forged or mis-shaped block never becomes pending, and a
commit (which only publishes pending blocks with every layer present) never makes one visible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.keys import KEY_NBYTES, chain_key
from ucm.api import BlockRef
from ucm.refusal import Refused
from ucm.store_wire import Dump, ErrorCode, Layout

LayoutLookup = Callable[[str], Layout]  # namespace name -> its layout, or Refused(NO_NAMESPACE)


def _bad(message: str) -> Refused:
    return Refused(ErrorCode.BAD_REQUEST, f"dump: {message}")


def check_structure(req: Dump, payload_sizes: Sequence[int]) -> list[BlockRef]:
    if len(payload_sizes) != len(req.blocks) * len(req.layers):
        raise _bad(f"{len(req.blocks)} blocks x {len(req.layers)} layers came with {len(payload_sizes)} payloads")
    if len(set(req.layers)) != len(req.layers) or not all(0 <= layer < req.num_layers for layer in req.layers):
        raise _bad(f"layers {req.layers[:8]} are not distinct layers of 0..{req.num_layers - 1}")
    refs = []
    for i, block in enumerate(req.blocks):
        if len(block.key) != KEY_NBYTES or len(block.parent) != KEY_NBYTES:
            raise _bad(f"block {i}: keys and parents must be {KEY_NBYTES} bytes")
        if block.token_ids and not 0 <= min(block.token_ids) <= max(block.token_ids) < 1 << 32:
            raise _bad(f"block {i}: token ids must be in [0, 2**32)")
        if chain_key(block.parent, block.token_ids) != block.key:
            raise _bad(
                f"block {i}: key {block.key.hex()} is not H(parent ‖ token ids); refusing forged or mis-keyed KV"
            )
        refs.append(block.ref())
    return refs


def check_layout_match(req: Dump, payload_sizes: Sequence[int], layout: Layout) -> None:
    if req.num_layers != layout.num_layers:
        raise _bad(f"num_layers {req.num_layers} != {layout.num_layers} declared for namespace {req.namespace!r}")
    width = len(req.layers)
    for i, block in enumerate(req.blocks):
        for size in payload_sizes[i * width : (i + 1) * width]:
            if size != layout.layer_nbytes:
                raise _bad(
                    f"block {i}: payload of {size} bytes, namespace {req.namespace!r} declared {layout.layer_nbytes}"
                )
        if len(block.token_ids) != layout.block_tokens:
            raise _bad(
                f"block {i}: {len(block.token_ids)} token ids, namespace {req.namespace!r} declared {layout.block_tokens}"
            )


def checked_dump(req: Dump, payload_sizes: Sequence[int], layout_of: LayoutLookup) -> list[BlockRef]:
    """The blocks as `BlockRef`s, or Refused naming the first inconsistency."""
    refs = check_structure(req, payload_sizes)
    check_layout_match(req, payload_sizes, layout_of(req.namespace))
    return refs
