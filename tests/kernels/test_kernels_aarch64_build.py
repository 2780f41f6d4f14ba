"""The kernels an aarch64 host builds, built and run on this x86 machine: every source cross-compiled for aarch64 Linux
with zig's clang (the `ziglang` wheel, the `cross` extra that `make cross-check` installs; no gcc here targets aarch64), warnings as errors.

- As the shared library native.py would load there: it links, exports every entry point native.py binds, and its
  preprocessor picks the attention's NEON vector and lanes bodies.
- As a static musl executable (aarch64_main.c) run in the unicorn CPU emulator (aarch64_emulator.py): its paged
  attention, decode and prompt rows, fp32 and bf16, through the NEON bodies, equals the float64 oracle as the host
  build's does (test_kernels_native.py's tolerances); its norms, SiLU-and-mul, rotary embedding, skinny GEMM (fp32,
  4-bit, 8-bit and bf16 panels) and KV writes equal the host build's or the oracle. One thread: OpenMP has no aarch64
  runtime here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# The cross toolchain and the emulator are `make cross-check`'s (the `cross` extra, ~470 MB), not every install's.
for _module in ("ziglang", "unicorn", "elftools"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: `make cross-check` installs the cross extra")

import torch
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from tests.kernels.aarch64_emulator import Aarch64Process, int32
from tests.kernels.test_kernels_avx2_build import assert_builds_agree
from tests.kernels.test_kernels_elementwise import _norm_inputs, _qkv_case
from tests.kernels.test_kernels_native import TOL
from ucm_kernels.cpu import elementwise as ew
from ucm_kernels.cpu import native
from ucm_kernels.cpu.bf16_panels import random_bf16_weight
from ucm_kernels.cpu.paged_attention import DTYPE_CODES, attention_error
from ucm_kernels.cpu.q4_panels import pack_q4, random_q4_weight
from ucm_kernels.cpu.q8_panels import pack_q8, random_q8_weight
from ucm_kernels.cpu.skinny_gemm import NR
from ucm_kernels.reference import write_kv_torch
from ucm_kernels.testing import PagedCase, make_paged_case, naive_attention

GNU, MUSL = "aarch64-linux-gnu", "aarch64-linux-musl"  # the shared library's target; the emulated executable's
# The host build's flags less what names the host (-march=native) or needs a runtime zig has no aarch64 build of
# (OpenMP: its pragmas then compile out, as with a compiler without it, and num_threads goes unused).
HOST_ONLY = {"-march=native", "-fopenmp"}
WARNINGS = ("-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror")


def zig_cc(target: str, *args: str) -> str:
    """zig's clang for `target` on args; its stdout (it must succeed)."""
    cmd = [sys.executable, "-m", "ziglang", "cc", "-target", target, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"zig cc -target {target} failed:\n{done.stderr[-4000:]}"
    return done.stdout


def cross_flags(shared: bool) -> list[str]:
    """The host build's flags for aarch64: a shared library's, or an executable's (no -shared, no -fPIC)."""
    drop = HOST_ONLY if shared else HOST_ONLY | {"-shared", "-fPIC"}
    return [f for f in native.KERNELS.flags if f not in drop]


def kernel_sources() -> list[str]:
    return [str(src) for src in native.KERNELS.sources]


def dynamic_symbols(path: Path) -> set[str]:
    """The names an ELF file exports (its dynamic symbol table)."""
    with open(path, "rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        assert dynsym is not None and isinstance(dynsym, SymbolTableSection), "a shared library has one"
        return {sym.name for sym in dynsym.iter_symbols() if sym.name}


def bound_entry_points() -> set[str]:
    """Every `ucm_*` function native.py binds by name (cdll.ucm_x, and the elementwise ops it builds names of)."""
    src = Path(native.__file__).read_text()
    names = set(re.findall(r"cdll\.(ucm_\w+)", src))
    elementwise = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
    names.update(f"ucm_{op}{suffix}" for op in elementwise for suffix in ("", "_f32"))
    return names


@pytest.fixture(scope="module")
def aarch64_lib(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("aarch64") / "libucm_kernels.so"
    zig_cc(GNU, *cross_flags(shared=True), "-s", *WARNINGS, *kernel_sources(), "-o", str(out), *native.KERNELS.libs)
    return out


def test_every_source_builds_for_aarch64_without_a_warning(aarch64_lib):
    with open(aarch64_lib, "rb") as f:
        elf = ELFFile(f)
        assert (elf["e_machine"], elf["e_type"]) == ("EM_AARCH64", "ET_DYN"), "an aarch64 shared library"


def test_it_exports_what_native_binds(aarch64_lib):
    wanted = bound_entry_points()
    assert {"ucm_paged_attention", "ucm_vector_path", "ucm_skinny_gemm_q4"} <= wanted, "the name scan found them"
    missing = wanted - dynamic_symbols(aarch64_lib)
    assert not missing, f"not exported by the aarch64 build: {sorted(missing)}"


def test_its_attention_takes_the_neon_bodies():
    """What paged_attention.c's preprocessor picks with the build's flags: the vector and lanes bodies, in NEON."""
    source = Path(native.__file__).with_name("paged_attention.c")
    defined = zig_cc(GNU, *cross_flags(shared=False), "-dM", "-E", str(source))
    macros = dict(line.split(" ", 2)[1:] for line in defined.splitlines() if line.count(" ") >= 2)
    assert macros.get("__ARM_NEON") == "1", "the target has NEON"
    assert macros.get("UCM_HAS_VEC") == "1" and macros.get("VEC_NAME") == '"neon"', "the vector body is NEON's"
    assert macros.get("UCM_HAS_LANES") == "1", "the fp32 prefill body with rows in lanes is in"
    assert "__AVX2__" not in macros and "__AVX512F__" not in macros


def build_static(out: Path) -> Path:
    """The kernels and aarch64_main.c as one static aarch64 musl executable (not PIE: loaded where it was linked)."""
    main = str(Path(__file__).with_name("aarch64_main.c"))
    static = ["-static", "-fno-pie", "-no-pie", "-Wl,--no-gc-sections"]
    zig_cc(
        MUSL,
        *static,
        *cross_flags(shared=False),
        *WARNINGS,
        main,
        *kernel_sources(),
        "-o",
        str(out),
        *native.KERNELS.libs,
    )
    return out


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> Aarch64Process:
    return Aarch64Process(build_static(tmp_path_factory.mktemp("aarch64") / "kernels"))


def emulated_attention(proc: Aarch64Process, case: PagedCase, decode: bool, scale: float) -> torch.Tensor:
    """ucm_paged_attention in the emulator, with the arguments native's _call gives it (decode: no query starts)."""
    num_tokens, hq, d = case.q.shape
    num_blocks, block_size, hkv, _ = case.k_cache.shape
    out = torch.zeros_like(case.q)
    err_seq, skipped = torch.tensor([-1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    tables = case.block_tables.contiguous()
    rc = int32(proc.call(
        "ucm_paged_attention",
        [
            case.q.contiguous(), hq * d, d, case.k_cache, case.v_cache, out,
            0 if decode else case.query_start_loc, case.seq_lens,
            tables, tables.stride(0), tables.shape[1], num_blocks,
            case.seq_lens.shape[0], num_tokens, hq, hkv, d, block_size,
            DTYPE_CODES[case.q.dtype], 0, 0, 1, err_seq, skipped,
        ],
        (scale,),
    ))  # fmt: skip
    assert rc == 0, f"the kernel returned {rc}: {attention_error(rc, int(err_seq))}"
    return out


def test_the_emulated_build_reports_the_neon_path(emulated):
    assert emulated.read(emulated.call("ucm_vector_path", []), 5) == b"neon\0"
    assert emulated.call("ucm_lanes_rows", []) > 0, "the fp32 lanes body is in this build"


# (context, new tokens): whole prompts above and below the lanes threshold, a prefix hit at a block boundary, a chunk
# ending mid-block, a decode, a padding row, a chunk over a longer context.
PROMPTS = ([15, 32, 17, 1, 9, 0, 150], [15, 16, 5, 1, 9, 1, 40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prompt"])
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (4, 4, 32)])
def test_emulated_neon_attention_equals_the_oracle(emulated, dtype, decode, hq, hkv, head_dim):
    ctx, new = ([0, 1, 17, 16, 33, 70], [1] * 6) if decode else PROMPTS
    case = make_paged_case(ctx, new, hq, hkv, head_dim, dtype=dtype, seed=hq + head_dim + decode)
    scale = head_dim**-0.5
    got = emulated_attention(emulated, case, decode, scale)
    live = [i for i, n in enumerate(ctx) if n > 0]
    rows = torch.cat([torch.arange(case.query_start_loc[i], case.query_start_loc[i + 1]) for i in live])
    want = naive_attention(
        case.q[rows], [case.keys[i] for i in live], [case.values[i] for i in live], [new[i] for i in live], scale
    )
    torch.testing.assert_close(got[rows].double(), want, **TOL[dtype])
    padding = [int(case.query_start_loc[i]) for i, n in enumerate(ctx) if n == 0]
    assert not got[padding].any(), "padding rows (seq_len 0) are 0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 100), (3, 7)])
def test_emulated_norms_and_silu_equal_the_host_build(emulated, native_lib, dtype, rows, hidden):
    x, weight, residual = (t.to(dtype) for t in _norm_inputs(rows, hidden, seed=rows + hidden))
    f32 = "_f32" if dtype == torch.float32 else ""
    out = torch.zeros_like(x)
    emulated.call(f"ucm_rms_norm{f32}", [x, weight, out, rows, hidden, hidden, 1], (1e-5,))  # out's row stride
    assert_builds_agree(out, ew.rms_norm_native(native_lib, x, weight, 1e-5))
    res_emulated, res_host = residual.clone(), residual.clone()
    emulated.call(f"ucm_fused_add_rms_norm{f32}", [x, res_emulated, weight, out, rows, hidden, hidden, 1], (1e-5,))
    assert_builds_agree(out, ew.fused_add_rms_norm_native(native_lib, x, res_host, weight, 1e-5))
    assert torch.equal(res_emulated, res_host), "the residual sum is one add per element"
    gate_up = torch.cat([x, residual], dim=-1)
    act = torch.zeros_like(x)
    emulated.call(f"ucm_silu_and_mul{f32}", [gate_up, act, rows, hidden, 1])
    assert_builds_agree(act, ew.silu_and_mul_native(native_lib, gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hq,hkv,d", [(33, 9, 3, 64), (3, 2, 1, 8)])
def test_emulated_rotary_embedding_equals_the_host_build(emulated, native_lib, dtype, tokens, hq, hkv, d):
    _, qk, cos, sin = _qkv_case(tokens, hq, hkv, d, seed=tokens + d)
    qk, cos, sin = qk.to(dtype).contiguous(), cos.to(dtype).contiguous(), sin.to(dtype).contiguous()
    host, emu = qk.clone(), qk.clone()
    f32 = "_f32" if dtype == torch.float32 else ""
    emulated.call(f"ucm_rotary_embedding{f32}", [emu, emu.stride(0), tokens, emu.shape[1], d, cos, sin, 1])
    ew.rotary_embedding_native(native_lib, host, cos, sin)
    assert torch.equal(emu, host)


@pytest.mark.parametrize(("fmt", "k", "n"), [("fp32", 100, 37), ("q4", 576, 40), ("q8", 576, 24), ("bf16", 100, 37)])
def test_emulated_skinny_gemm_equals_the_oracle(emulated, fmt, k, n):
    """The skinny GEMM over fp32 panels (packed by the emulated build) within fp32 rounding of float64, each row what
    a call of that row alone gives, in the few-row tiles (5 rows) and the blocked loop (30); over 4-bit and 8-bit
    panels of an exactly-quantized weight (packed here: the layout is the format's, not the CPU's) and bf16 panels of
    a bf16 weight (packed by the emulated build), bit for bit what the fp32 panels of the same weight give, as on the
    host."""
    gen = torch.Generator().manual_seed(k + n)
    random_weight = {"q4": random_q4_weight, "q8": random_q8_weight, "bf16": random_bf16_weight}.get(fmt)
    w = torch.randn(n, k, generator=gen) if random_weight is None else random_weight(n, k, gen)
    x, bias = torch.randn(30, k, generator=gen), torch.randn(n, generator=gen)
    panels = torch.zeros(-(-n // NR) * k * NR)
    emulated.call("ucm_pack_panels", [w, panels, n, k])
    quantized: tuple[str, list[torch.Tensor]] | None = None
    if fmt == "q4":
        q4 = pack_q4(w)
        assert q4 is not None, "a random 4-bit weight packs as 4-bit"
        quantized = "ucm_skinny_gemm_q4", [q4.qp, q4.dm]
    elif fmt == "q8":
        q8 = pack_q8(w)
        assert q8 is not None, "a random Q8_0 weight packs as 8-bit"
        quantized = "ucm_skinny_gemm_q8", [q8.qp, q8.d]
    elif fmt == "bf16":
        bp = torch.zeros(-(-n // NR) * k * NR, dtype=torch.int16)
        assert int32(emulated.call("ucm_pack_panels_bf16", [w, bp, n, k])) == 0, "bf16 values pack as bf16"
        quantized = "ucm_skinny_gemm_bf16", [bp]

    def run(entry: str, operands: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(rows.shape[0], n)
        rc = int32(emulated.call(entry, [rows.contiguous(), rows.shape[0], k, *operands, n, bias, y, 1]))
        assert entry == "ucm_skinny_gemm" or rc == 0, f"{entry} returned {rc}"
        return y

    for m in (5, 30):
        got = run("ucm_skinny_gemm", [panels], x[:m])
        alone = torch.cat([run("ucm_skinny_gemm", [panels], x[i : i + 1]) for i in range(m)])
        assert torch.equal(got, alone), f"{m} rows: not row-invariant"
        want = x[:m].double() @ w.double().T + bias.double()
        bound = 4 * k * torch.finfo(torch.float32).eps * (x[:m].abs() @ w.abs().T).max()
        assert (got.double() - want).abs().max() <= bound
        if quantized is not None:
            entry, operands = quantized
            assert torch.equal(run(entry, operands, x[:m]), got), f"{m} rows: {fmt} panels"


def test_emulated_write_kv_places_every_slot(emulated):
    gen = torch.Generator().manual_seed(5)
    blocks, block_size, hkv, d = 6, 16, 3, 64
    key, value = torch.randn(20, hkv, d, generator=gen).bfloat16(), torch.randn(20, hkv, d, generator=gen).bfloat16()
    slots = torch.randperm(blocks * block_size, generator=gen)[:20].to(torch.int64)
    slots[3] = -1  # skipped
    k_cache, v_cache = (
        torch.zeros(blocks, block_size, hkv, d).bfloat16(),
        torch.zeros(blocks, block_size, hkv, d).bfloat16(),
    )
    row = hkv * d * 2
    bad = emulated.call(
        "ucm_write_kv",
        [key, row, value, row, k_cache, v_cache, slots, 20, blocks * block_size, row, 1],
    )
    assert bad == 0
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv_torch(key, value, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
