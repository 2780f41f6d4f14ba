"""The library an aarch64 host builds: every kernel source cross-compiled for aarch64 Linux with zig's clang (the
`ziglang` wheel, a dev dependency), warnings as errors, and the attention's NEON vector bodies in it.

No aarch64 machine or emulator is at hand, so the build is compiled and inspected, not run: the NEON bodies share
their algorithm and every vector-extension line with the AVX2 ones, which test_kernels_avx2_build.py runs against the
oracles here; what this adds is that the NEON-only lines (arm_neon.h helpers, 16-byte vectors) compile, link into one
shared library that exports what kernels/cpu/native.py binds, and are the bodies its preprocessor picks."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import native

ZIG_CC = (sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu")
# The host build's flags less what names the host (-march=native) or needs a runtime zig has no aarch64 build of
# (OpenMP: its pragmas then compile out, as with a compiler without it, and num_threads goes unused).
HOST_ONLY = {"-march=native", "-fopenmp"}
EM_AARCH64 = 183  # ELF e_machine


def dynamic_symbols(elf: bytes) -> set[str]:
    """The names in an ELF64 little-endian file's dynamic symbol table (.dynsym, its strings in .dynstr)."""
    assert elf[:4] == b"\x7fELF" and elf[4] == 2 and elf[5] == 1, "ELF64, little-endian"
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    SHT_DYNSYM = 11
    dynsym = next(s for s in sections if s[1] == SHT_DYNSYM)
    strtab = sections[dynsym[6]]  # sh_link: the string table of these names
    names = set()
    for off in range(dynsym[4], dynsym[4] + dynsym[5], dynsym[9]):  # sh_offset, sh_size, sh_entsize
        (name_at,) = struct.unpack_from("<I", elf, off)
        start = strtab[4] + name_at
        names.add(elf[start : elf.index(b"\0", start)].decode())
    return names


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
def aarch64_lib(tmp_path_factory) -> bytes:
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
    return out.read_bytes()


def test_every_source_builds_for_aarch64_without_a_warning(aarch64_lib):
    (machine,) = struct.unpack_from("<H", aarch64_lib, 0x12)
    assert machine == EM_AARCH64, f"e_machine {machine}: not an aarch64 library"


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
