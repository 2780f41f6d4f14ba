"""The native CPU paged-attention kernel (ucm_kernels/cpu/) against the torch oracles and dense attention; its
dispatch, the UCM_CPU_ATTENTION switch, and the fallback to torch when it cannot be built."""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucm_kernels
from ucm_kernels.cpu import native
from ucm_kernels.cpu import paged_attention as native_attention
from ucm_kernels.cpu.paged_attention import paged_attention_native, prefill_attention_native
from ucm_kernels.cpu.write_kv import write_kv_native
from ucm_kernels.reference import (
    decode_attention_chunked_torch,
    decode_attention_torch,
    prefill_attention_torch,
    write_kv_torch,
)
from ucm_kernels.testing import make_paged_case, naive_attention

ROOT = Path(__file__).resolve().parents[2]
# bf16: both sides round the output to bf16 (8 bits of mantissa) -> ~1e-2 absolute on O(1) outputs.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# (q heads, kv heads, head_dim): GQA as SmolLM2, no GQA, MQA-like with head_dim 128, and a head_dim that is
# not a multiple of 32 (the kernel's portable path).
HEADS = [(9, 3, 64), (4, 4, 64), (8, 1, 128), (6, 2, 40)]


@pytest.fixture(scope="module")
def lib(native_lib) -> native.NativeLib:
    return native_lib


@pytest.fixture
def fresh_native():
    """Forget the process's load result before and after, so a test may build from scratch."""
    native.forget()
    yield
    native.forget()


def _strided(q: torch.Tensor) -> torch.Tensor:
    """q as the engine hands it over: a view into a wider [T, Hq + extra, D] qk tensor."""
    wide = torch.zeros(q.shape[0], q.shape[1] + 3, q.shape[2], dtype=q.dtype)
    wide[:, : q.shape[1]] = q
    return wide[:, : q.shape[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,head_dim", HEADS)
def test_decode_matches_oracle(lib, dtype, hq, hkv, head_dim):
    ctx = [0, 1, 17, 16, 33, 5, 0, 250, 700] + [random.Random(hq).randint(1, 120) for _ in range(9)]
    case = make_paged_case(ctx, [1] * len(ctx), hq, hkv, head_dim, dtype=dtype, seed=hq * head_dim)
    scale = head_dim**-0.5
    q = _strided(case.q)
    got = paged_attention_native(lib, q, case.k_cache, case.v_cache, None, case.seq_lens, case.block_tables, scale)
    ref = decode_attention_torch(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    assert got.dtype == dtype and got.shape == case.q.shape
    torch.testing.assert_close(got, ref, **TOL[dtype])
    live = [i for i, n in enumerate(ctx) if n > 0]
    dense = naive_attention(
        case.q[live], [case.keys[i] for i in live], [case.values[i] for i in live], [1] * len(live), scale
    )
    torch.testing.assert_close(got[live].double(), dense, **TOL[dtype])
    assert not got[[i for i, n in enumerate(ctx) if n == 0]].any(), "padding rows (seq_len 0) must be 0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,head_dim", HEADS)
def test_varlen_matches_oracle(lib, dtype, hq, hkv, head_dim, monkeypatch):
    # (context, new tokens): whole prompt, prefix hit at a block boundary, chunk ending mid-block, decodes,
    # a long chunk over > 8 blocks, no queries at all, a padding row, a 16-token chunk, a whole prompt, and a
    # 300-token chunk over a long prefix.
    ctx = [15, 32, 17, 1, 150, 9, 40, 0, 60, 23, 530]
    new = [15, 16, 5, 1, 40, 1, 0, 1, 16, 23, 300]
    case = make_paged_case(ctx, new, hq, hkv, head_dim, dtype=dtype, seed=hq + head_dim)
    scale = head_dim**-0.5
    args = (case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, scale)
    got = paged_attention_native(lib, _strided(case.q), *args)
    ref = prefill_attention_torch(case.q, *args, case.max_query_len)
    live = [i for i, n in enumerate(ctx) if n > 0]
    rows = torch.cat([torch.arange(case.query_start_loc[i], case.query_start_loc[i + 1]) for i in live])
    torch.testing.assert_close(got[rows], ref[rows], **TOL[dtype])
    dense = naive_attention(
        case.q[rows], [case.keys[i] for i in live], [case.values[i] for i in live], [new[i] for i in live], scale
    )
    torch.testing.assert_close(got[rows].double(), dense, **TOL[dtype])
    pad = int(case.query_start_loc[7])
    assert not got[pad].any(), "the padding row (seq_len 0) must be 0"
    # With the switch on, the dispatch form sends whole prompts (15/15 and 23/23 here) to torch's SDPA.
    monkeypatch.setattr(native_attention, "WHOLE_PROMPTS_ON_TORCH", True)
    mixed = prefill_attention_native(lib, case.q, *args)
    torch.testing.assert_close(mixed[rows], ref[rows], **TOL[dtype])
    for i in (0, 9):
        lo, hi = int(case.query_start_loc[i]), int(case.query_start_loc[i + 1])
        assert torch.equal(mixed[lo:hi], ref[lo:hi]), f"whole prompt {i} must be torch's result bit for bit"
    monkeypatch.setattr(native_attention, "WHOLE_PROMPTS_ON_TORCH", False)
    assert torch.equal(prefill_attention_native(lib, case.q, *args), paged_attention_native(lib, case.q, *args))


LANES_CASES = [(torch.float32, 9, 3, 64), (torch.float32, 6, 2, 40), (torch.float32, 16, 1, 32)]
LANES_CASES += [(torch.bfloat16, 9, 3, 64), (torch.bfloat16, 6, 2, 48), (torch.bfloat16, 32, 1, 32)]


@pytest.mark.parametrize("dtype,hq,hkv,head_dim", LANES_CASES)
def test_lanes_body_around_its_threshold(lib, dtype, hq, hkv, head_dim):
    """Prefill sequences with at least the lanes rows per kv head run a body with rows in vector lanes (fp32:
    paged_attention_lanes.h on AVX2/NEON; bf16: paged_attention_dpbf16.h on AVX-512 BF16), the others the
    per-ISA one: just below, at and above the threshold, an item's unfilled tail, several softmax steps of keys,
    odd key counts and block boundaries all match the oracle, on 1 or 2 threads."""
    rows = lib.lanes_rows if dtype == torch.float32 else lib.bf16_lanes_rows
    if not rows:
        pytest.skip(f"this build ({lib.vector_path}) has no {dtype} lanes body")
    group = hq // hkv
    below, at = (rows - 1) // group, -(-rows // group)
    assert below * group < rows <= at * group
    new = [below, at, at + 1, 37, 200, 1]
    ctx = [below + 3, at, at + 50, 37, 333, 90]
    case = make_paged_case(ctx, new, hq, hkv, head_dim, dtype=dtype, seed=11)
    scale = head_dim**-0.5
    args = (case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, scale)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_native(lib, _strided(case.q), *args)
        torch.set_num_threads(2)
        two = paged_attention_native(lib, _strided(case.q), *args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two), "work items are independent: the thread count changes nothing"
    if group >= rows:  # one query fills an item: decodes, padding rows included, take the lanes body too
        dec = make_paged_case([0, 5, 40], [1, 1, 1], hq, hkv, head_dim, dtype=dtype, seed=12)
        got = paged_attention_native(lib, dec.q, dec.k_cache, dec.v_cache, None, dec.seq_lens, dec.block_tables, scale)
        want = decode_attention_torch(dec.q, dec.k_cache, dec.v_cache, dec.block_tables, dec.seq_lens, scale)
        assert not got[0].any(), "a padding row (seq_len 0) must be 0"
        torch.testing.assert_close(got[1:], want[1:], **TOL[dtype])
    torch.testing.assert_close(one, prefill_attention_torch(case.q, *args, case.max_query_len), **TOL[dtype])
    dense = naive_attention(case.q, case.keys, case.values, new, scale)
    torch.testing.assert_close(one.double(), dense, **TOL[dtype])


@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(9, 3, 64), (6, 2, 48), (32, 1, 32)])
def test_bf16_rows_equal_however_the_prompt_is_split(lib, hq, hkv, head_dim):
    """A bf16 query row gets the same bits whether it is computed in a whole prompt, in a chunk over a cached prefix
    (many rows: rows in lanes; few: columns in lanes), or as a decode: a prefix-cache or store hit and a cold run
    must continue alike (paged_attention_dpbf16.h)."""
    if not lib.bf16_lanes_rows:
        pytest.skip(f"this build ({lib.vector_path}) has no bf16 lanes bodies")
    length = 300
    case = make_paged_case([length], [length], hq, hkv, head_dim, dtype=torch.bfloat16, seed=21)
    scale = head_dim**-0.5
    seq_lens = torch.tensor([length], dtype=torch.int32)

    def last_rows(k: int) -> torch.Tensor:
        qsl = torch.tensor([0, k], dtype=torch.int32)
        q = case.q[length - k :]
        return paged_attention_native(lib, q, case.k_cache, case.v_cache, qsl, seq_lens, case.block_tables, scale)

    whole = last_rows(length)
    for k in (70, 11, 5, 2, 1):
        assert torch.equal(last_rows(k), whole[length - k :]), f"the last {k} rows differ from the whole prompt's"
    decode = paged_attention_native(
        lib, case.q[length - 1 :], case.k_cache, case.v_cache, None, seq_lens, case.block_tables, scale
    )
    assert torch.equal(decode, whole[length - 1 :]), "a decode row differs from the same row in the prompt"
    dense = naive_attention(case.q, case.keys, case.values, [length], scale)
    torch.testing.assert_close(whole.double(), dense, **TOL[torch.bfloat16])


def test_multithreaded_equals_single_thread(lib):
    """Work items are independent, so threads change nothing; one libgomp (torch's) serves both."""
    ctx = [random.Random(3).randint(1, 300) for _ in range(24)]
    new = [1] * 20 + [7, 16, 33, 2]
    case = make_paged_case(ctx, new, 9, 3, 64, dtype=torch.bfloat16, seed=5)
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_native(lib, *args)
        torch.set_num_threads(3)
        three = paged_attention_native(lib, *args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)
    maps = Path("/proc/self/maps")
    if lib.has_openmp and maps.exists():
        gomp = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
        assert len(gomp) == 1, f"two OpenMP runtimes loaded: {gomp}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (14, 2), (9, 3)])
def test_a_lone_decode_cut_by_kv_heads_keeps_its_bits(each_build, dtype, hq, hkv):
    """A decode alone in a call is cut by kv heads over the threads (one item per share, not one item for every
    head on one thread): the bits of one thread; a bf16 row on the VDPBF16PS bodies also those of the same row
    computed in its prompt (other bodies compute a prompt's rows in their own order)."""
    lib, length = each_build, 300
    case = make_paged_case([length], [length], hq, hkv, 64, dtype=dtype, seed=11)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    qsl = torch.tensor([0, length], dtype=torch.int32)
    whole = paged_attention_native(lib, case.q, case.k_cache, case.v_cache, qsl, seq_lens, case.block_tables, 0.125)
    threads, q = torch.get_num_threads(), case.q[length - 1 :]
    decodes = {}
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            decodes[n] = paged_attention_native(
                lib, q, case.k_cache, case.v_cache, None, seq_lens, case.block_tables, 0.125
            )
    finally:
        torch.set_num_threads(threads)
    for n, got in decodes.items():
        assert torch.equal(got, decodes[1]), f"{n} threads: the decode row differs from one thread's"
    if dtype == torch.bfloat16 and lib.bf16_lanes_rows:
        assert torch.equal(decodes[1], whole[length - 1 :]), "the decode row differs from its prompt row"


def test_bad_batches_raise(lib):
    case = make_paged_case([4, 20], [1, 1], 2, 2, 64)
    args = (case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="sequence 0 has more query tokens than context"):
        qsl = torch.tensor([0, 5, 6], dtype=torch.int32)
        q = torch.randn(6, 2, 64)
        paged_attention_native(lib, q, *args, qsl, case.seq_lens, case.block_tables, 0.125)
    with pytest.raises(ValueError, match="sequence 1 has a block id outside the cache"):
        tables = case.block_tables.clone()
        tables[1, 1] = case.k_cache.shape[0]
        paged_attention_native(lib, case.q, *args, None, case.seq_lens, tables, 0.125)
    with pytest.raises(ValueError, match="sequence 1 needs more blocks"):
        paged_attention_native(lib, case.q, *args, None, case.seq_lens, case.block_tables[:, :1], 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(lib, dtype):
    t, hkv, d, blocks, bs = 7, 3, 64, 6, 16
    gen = torch.Generator().manual_seed(1)
    # k and v as the model hands them over: token rows of a wider fused qkv tensor.
    qkv = torch.randn(t, 9 * d + 2 * hkv * d, generator=gen).to(dtype)
    key = qkv[:, 9 * d : 9 * d + hkv * d].view(t, hkv, d)
    value = qkv[:, 9 * d + hkv * d :].view(t, hkv, d)
    slots = torch.tensor([17, -1, 0, 95, 40, -1, 3])
    caches = [torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    write_kv_native(lib, key, value, *caches, slots)
    write_kv_torch(key, value, *want, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(ValueError, match="token 1 has slot 96"):
        write_kv_native(lib, key[:2], value[:2], *caches, torch.tensor([5, blocks * bs]))
    assert torch.equal(caches[0], want[0]), "a bad batch writes nothing"


def _spy(monkeypatch, lib: native.NativeLib) -> list[int]:
    """Record calls into the C library made through kernels' dispatch: 1 attention, 2 write_kv."""
    calls: list[int] = []

    def counted(*a):
        calls.append(1)
        return lib.paged_attention(*a)

    def counted_write(*a):
        calls.append(2)
        return lib.write_kv(*a)

    spy = dataclasses.replace(lib, paged_attention=counted, write_kv=counted_write)
    monkeypatch.setattr(native, "load", lambda: spy)
    return calls


def test_dispatch_and_switch(lib, monkeypatch):
    ctx, new = [40, 3, 70], [1, 1, 1]
    case = make_paged_case(ctx, new, 9, 3, 64, dtype=torch.bfloat16, seed=11)
    decode_args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    calls = _spy(monkeypatch, lib)
    monkeypatch.setenv("UCM_CPU_ATTENTION", "native")  # the default (auto) is tests/kernels/test_kernel_dispatch.py's
    assert ucm_kernels.select_backend(torch.device("cpu")) is ucm_kernels.AttentionBackend.TORCH  # the CPU path
    native_out = ucm_kernels.decode_attention(*decode_args)
    assert len(calls) == 1, "UCM_CPU_ATTENTION=native runs the library"
    ucm_kernels.write_kv(case.keys[0][:2], case.values[0][:2], case.k_cache, case.v_cache, torch.tensor([-1, -1]))
    assert calls == [1, 2]
    monkeypatch.setenv("UCM_CPU_ATTENTION", "torch")
    torch_out = ucm_kernels.decode_attention(*decode_args)
    ucm_kernels.write_kv(case.keys[0][:2], case.values[0][:2], case.k_cache, case.v_cache, torch.tensor([-1, -1]))
    assert len(calls) == 2, "UCM_CPU_ATTENTION=torch must keep the library out"
    assert torch.equal(torch_out, decode_attention_chunked_torch(*decode_args))
    torch.testing.assert_close(native_out, torch_out, **TOL[torch.bfloat16])
    monkeypatch.setenv("UCM_CPU_ATTENTION", "native")
    ucm_kernels.prefill_attention(
        case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, 0.125, 1
    )
    assert calls == [1, 2, 1]
    monkeypatch.setenv("UCM_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="UCM_CPU_ATTENTION='fast' is not one of: auto, native, torch"):
        ucm_kernels.decode_attention(*decode_args)


def test_unsupported_dtype_takes_the_torch_path(lib, monkeypatch):
    calls = _spy(monkeypatch, lib)
    case = make_paged_case([20, 7], [1, 1], 4, 2, 64, dtype=torch.float16, seed=2)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    out = ucm_kernels.decode_attention(*args)
    assert not calls
    assert torch.equal(out, decode_attention_chunked_torch(*args))


def test_failed_build_falls_back_to_torch(fresh_native, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("UCM_CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("UCM_CPU_ATTENTION", raising=False)
    case = make_paged_case([40, 3, 0], [1, 1, 1], 9, 3, 64, dtype=torch.bfloat16, seed=4)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        first = ucm_kernels.decode_attention(*args)
        second = ucm_kernels.decode_attention(*args)
    assert native.load() is None and "no-such-cc" in (native.load_error() or "")
    warnings = [r for r in caplog.records if "native CPU attention unavailable" in r.getMessage()]
    assert len(warnings) == 1, "one warning per process, not per call"
    expect = decode_attention_chunked_torch(*args)
    assert torch.equal(first, expect) and torch.equal(second, expect)


def test_concurrent_builds_share_one_library(lib, tmp_path):
    """Processes starting together each compile, then atomically rename: all load, one library, no temp files."""
    code = "import sys; from pathlib import Path; from ucm_kernels.cpu.native import build; print(build(Path(sys.argv[1])).path)"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    built = sorted((tmp_path / "kernels").iterdir())
    assert [str(b) for b in built] == sorted(paths) and len(built) == 1, built


def test_library_hash_covers_the_shared_header(monkeypatch, tmp_path):
    """An edit to an included header (bf16.h) must name a new library, or a stale build would be loaded."""
    monkeypatch.setattr(native, "_compiler_version", lambda cc: "cc 1.0")
    header = tmp_path / "bf16.h"
    header.write_text("/* v1 */\n")
    recipe = dataclasses.replace(native.KERNELS, headers=(header,))
    before = native.library_path("cc", tmp_path, (), recipe)
    header.write_text("/* v2 */\n")
    assert native.library_path("cc", tmp_path, (), recipe) != before


def test_library_hash_covers_the_compiler_command(monkeypatch, tmp_path):
    """Two compiler commands that report one version (a wrapper that changes the flags, another install) name two
    libraries: one built by the other must never be loaded (UCM_CC)."""
    monkeypatch.setattr(native, "_compiler_version", lambda cc: "gcc 12.2.0")
    assert native.library_path("gcc", tmp_path) != native.library_path("/opt/wrappers/gcc-avx2", tmp_path)


def test_sources_include_the_shipped_headers():
    """Every header the sources or the headers include is listed in HEADERS (hashed) and lives beside them
    (shipped as *.h)."""
    import re

    included = {
        name
        for src in native.SOURCES + native.HEADERS
        for name in re.findall(r'#include "([^"]+)"', src.read_text(encoding="utf-8"))
    }
    assert included == {h.name for h in native.HEADERS} and included
    assert all(h.parent == native.SOURCES[0].parent and h.suffix == ".h" for h in native.HEADERS)


def test_a_call_to_an_undeclared_function_fails_the_build(tmp_path):
    """The library's flags make an implicit declaration an error on every compiler version (GCC 14's default): a
    helper defined only inside one ISA's #ifdef must not compile elsewhere with a guessed signature."""
    if shutil.which(native.compiler()) is None:
        pytest.skip(f"no C compiler {native.compiler()!r}")
    src = tmp_path / "calls_undeclared.c"
    src.write_text("int ucm_probe(void) { return helper_of_another_build(3); }\n", encoding="utf-8")
    recipe = native.Recipe("ucm_undeclared", (src,), (), native.FLAGS)
    with pytest.raises(native.BuildError, match="implicit"):
        native.built(recipe, tmp_path / "cache", ())
