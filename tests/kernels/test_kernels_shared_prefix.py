"""Decodes that share a prompt prefix run as one attention item (ucm_kernels/cpu/paged_attention_shared.h): which
sequences group, and that a row's bits are what it gets on its own, with the blocks shared or copied."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ucm_kernels.cpu import native
from ucm_kernels.cpu.paged_attention import paged_attention_native, shared_prefix_groups
from ucm_kernels.reference import decode_attention_torch

HQ, HKV, D, BS = 9, 3, 64, 16
SCALE = D**-0.5
# (leading blocks shared with the common prefix, context length): four share 64 blocks (1024 keys), one all 70,
# two share 5 blocks (80 keys: one whole 64-key chunk), one 3 blocks (48 keys: no whole chunk), one is shorter
# than a chunk, one shares nothing, one is padding (length 0).
SPECS = [(64, 1100), (64, 1030), (64, 1200), (70, 1120), (5, 300), (5, 90), (3, 200), (1, 40), (0, 500), (0, 0)]
SPECS += [(64, 1024)]
CHUNK_SHARERS = [0, 1, 2, 3, 4, 5, 10]  # a whole chunk in common with another sequence
LONE = [6, 7, 8, 9]


@dataclass
class Case:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor


@pytest.fixture(scope="module")
def lib(vdpbf16_rows) -> native.NativeLib:
    native_lib = vdpbf16_rows
    if not native_lib.bf16_lanes_rows:
        pytest.skip(f"this build ({native_lib.vector_path}) has no bf16 cols body, so no groups")
    return native_lib


def _case(copied: bool) -> Case:
    """SPECS over one cache; copied: every sequence's blocks its own (the shared ones copied), the same data."""
    g = torch.Generator().manual_seed(7)
    nblocks = [(n + BS - 1) // BS for _, n in SPECS]
    total = 70 + sum(nblocks) + 1
    k_cache = torch.randn(total, BS, HKV, D, generator=g).bfloat16()
    v_cache = torch.randn(total, BS, HKV, D, generator=g).bfloat16()
    ids = iter(torch.randperm(total, generator=g).tolist())
    prefix = [next(ids) for _ in range(70)]
    rows = []
    for (shared, _), nb in zip(SPECS, nblocks, strict=True):
        own = [next(ids) for _ in range(nb)]
        table = prefix[:shared] + own[shared:]
        if copied:
            for b in range(min(shared, nb)):
                k_cache[own[b]], v_cache[own[b]] = k_cache[prefix[b]], v_cache[prefix[b]]
            table = own
        rows.append(table[:nb])
    width = max(nblocks)
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    lens = torch.tensor([n for _, n in SPECS], dtype=torch.int32)
    q = torch.randn(len(SPECS), HQ, D, generator=g).bfloat16()
    return Case(k_cache, v_cache, tables, lens, q)


def _decode(lib: native.NativeLib, c: Case, rows: slice = slice(None)) -> torch.Tensor:
    return paged_attention_native(lib, c.q[rows], c.k_cache, c.v_cache, None, c.lens[rows], c.tables[rows], SCALE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_sequences_that_share_a_whole_chunk_of_blocks_group(lib, threads):
    shared, copied = _case(copied=False), _case(copied=True)
    groups = shared_prefix_groups(lib, shared.lens, shared.tables, HQ, HKV, D, BS)
    apart = shared_prefix_groups(lib, copied.lens, copied.tables, HQ, HKV, D, BS)
    assert groups is not None and apart is not None
    assert all(groups[i] >= 0 for i in CHUNK_SHARERS), groups
    assert all(groups[i] == -1 for i in LONE), groups
    assert all(g == -1 for g in apart), "blocks with equal data but other ids are not the same blocks"


def test_a_grouped_decode_row_has_the_bits_it_has_alone(lib, threads):
    shared, copied = _case(copied=False), _case(copied=True)
    together = _decode(lib, shared)
    alone = torch.cat([_decode(lib, shared, slice(i, i + 1)) for i in range(len(SPECS))])
    in_own_blocks = _decode(lib, copied)
    assert torch.equal(_bits(together), _bits(alone))
    assert torch.equal(_bits(together), _bits(in_own_blocks))
    ref = decode_attention_torch(shared.q, shared.k_cache, shared.v_cache, shared.tables, shared.lens, SCALE)
    torch.testing.assert_close(together, ref, atol=2e-2, rtol=2e-2)
    assert not together[9].any(), "the padding sequence's rows are zeros"


def test_decodes_group_beside_a_prompt_chunk(lib):
    """A step that also computes a prompt (rows of another body) still groups its decodes, with the same bits."""
    c = _case(copied=False)
    new = 24  # sequence 8's last 24 tokens are a prompt chunk; every other sequence decodes one token
    g = torch.Generator().manual_seed(3)
    prompt_q = torch.randn(new, HQ, D, generator=g).bfloat16()
    q = torch.cat([c.q[:8], prompt_q, c.q[9:]])
    counts = [1] * 8 + [new] + [1] * (len(SPECS) - 9)
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    mixed = paged_attention_native(lib, q, c.k_cache, c.v_cache, qsl, c.lens, c.tables, SCALE)
    decodes = _decode(lib, c)
    rows = [i if i < 8 else i + new - 1 for i in range(len(SPECS)) if i != 8]
    assert torch.equal(_bits(mixed[rows]), _bits(decodes[[i for i in range(len(SPECS)) if i != 8]]))
    one = torch.tensor([0, new], dtype=torch.int32)
    prompt = paged_attention_native(lib, prompt_q, c.k_cache, c.v_cache, one, c.lens[8:9], c.tables[8:9], SCALE)
    assert torch.equal(_bits(mixed[8 : 8 + new]), _bits(prompt))


def test_too_few_decodes_to_group_for_every_thread_stay_apart(lib, threads):
    """Two decodes alone: one item would leave the second thread idle, so they group only on one thread."""
    c = _case(copied=False)
    groups = shared_prefix_groups(lib, c.lens[:2], c.tables[:2], HQ, HKV, D, BS)
    assert groups == ([0, 0] if threads == 1 else [-1, -1])
