"""The kernels an aarch64 host builds, built and run on this x86 machine: every source cross-compiled for aarch64 Linux
with zig's clang (the `ziglang` wheel, a dev dependency; no gcc here targets aarch64), warnings as errors.

- As the shared library native.py would load there: it links, exports every entry point native.py binds, and its
  preprocessor picks the attention's NEON vector and lanes bodies.
- As a static musl executable (aarch64_main.c) run in the unicorn CPU emulator (aarch64_emulator.py): its paged
  attention, decode and prompt rows, fp32 and bf16, through the NEON bodies, equals the float64 oracle as the host
  build's does (test_kernels_native.py's tolerances). One thread: OpenMP has no aarch64 runtime here."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from kernels.cpu import native
from kernels.cpu.paged_attention import DTYPE_CODES, attention_error
from kernels.testing import PagedCase, make_paged_case, naive_attention
from tests.kernels.aarch64_emulator import Aarch64Process
from tests.kernels.test_kernels_native import TOL

ZIG_CC = (sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu")
# The host build's flags less what names the host (-march=native) or needs a runtime zig has no aarch64 build of
# (OpenMP: its pragmas then compile out, as with a compiler without it, and num_threads goes unused).
HOST_ONLY = {"-march=native", "-fopenmp"}


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


def cross_flags() -> list[str]:
    return [f for f in native.KERNELS.flags if f not in HOST_ONLY]


@pytest.fixture(scope="module")
def aarch64_lib(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("aarch64") / "libucm_kernels.so"
    cmd = [
        *ZIG_CC,
        *cross_flags(),
        "-s",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        "-Werror",
        *map(str, native.KERNELS.sources),
        "-o",
        str(out),
    ]
    done = subprocess.run([*cmd, *native.KERNELS.libs], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"aarch64 build failed:\n{done.stderr[-4000:]}"
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
    flags = [f for f in cross_flags() if f not in ("-shared", "-fPIC")]
    source = Path(native.__file__).with_name("paged_attention.c")
    done = subprocess.run([*ZIG_CC, *flags, "-dM", "-E", str(source)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    macros = dict(line.split(" ", 2)[1:] for line in done.stdout.splitlines() if line.count(" ") >= 2)
    assert macros.get("__ARM_NEON") == "1", "the target has NEON"
    assert macros.get("UCM_HAS_VEC") == "1" and macros.get("VEC_NAME") == '"neon"', "the vector body is NEON's"
    assert macros.get("UCM_HAS_LANES") == "1", "the fp32 prefill body with rows in lanes is in"
    assert "__AVX2__" not in macros and "__AVX512F__" not in macros


def build_static(out: Path) -> Path:
    """The kernels and aarch64_main.c as one static aarch64 musl executable (not PIE: loaded where it was linked)."""
    main = Path(__file__).with_name("aarch64_main.c")
    here = Path(native.__file__).parent
    flags = [f for f in cross_flags() if f not in ("-shared", "-fPIC")]
    target = [*ZIG_CC[:-1], "aarch64-linux-musl", "-static", "-fno-pie", "-no-pie", f"-I{here}"]
    cmd = [*target, *flags, "-Wall", "-Werror", str(main), *map(str, native.KERNELS.sources), "-o", str(out)]
    done = subprocess.run([*cmd, *native.KERNELS.libs], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"aarch64 executable build failed:\n{done.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> Aarch64Process:
    return Aarch64Process(build_static(tmp_path_factory.mktemp("aarch64") / "kernels"))


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def emulated_attention(proc: Aarch64Process, case: PagedCase, decode: bool, scale: float) -> torch.Tensor:
    """ucm_paged_attention in the emulator, with the arguments native's _call gives it (decode: no query starts)."""
    num_tokens, hq, d = case.q.shape
    num_blocks, block_size, hkv, _ = case.k_cache.shape
    dtype = case.q.dtype
    out = proc.alloc(bytes(case.q.numel() * case.q.element_size()))
    err_seq, skipped = proc.alloc(struct.pack("<i", -1)), proc.alloc(struct.pack("<i", 0))
    tables = case.block_tables.contiguous()
    rc = proc.call(
        "ucm_paged_attention",
        [
            proc.alloc(tensor_bytes(case.q)), hq * d, d,
            proc.alloc(tensor_bytes(case.k_cache)), proc.alloc(tensor_bytes(case.v_cache)), out,
            0 if decode else proc.alloc(tensor_bytes(case.query_start_loc)), proc.alloc(tensor_bytes(case.seq_lens)),
            proc.alloc(tensor_bytes(tables)), tables.stride(0), tables.shape[1], num_blocks,
            case.seq_lens.shape[0], num_tokens, hq, hkv, d, block_size,
            DTYPE_CODES[dtype], 0, 0, 1, err_seq, skipped,
        ],
        (scale,),
    )  # fmt: skip
    assert rc & 0xFFFFFFFF == 0, (
        f"the kernel returned {rc}: {attention_error(rc, struct.unpack('<i', proc.read(err_seq, 4))[0])}"
    )
    raw = proc.read(out, case.q.numel() * case.q.element_size())
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return (flat.view(torch.bfloat16) if dtype == torch.bfloat16 else flat).view(num_tokens, hq, d)


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
