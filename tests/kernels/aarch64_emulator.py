"""A static aarch64 Linux executable run in the unicorn CPU emulator (the `unicorn` wheel, the `cross` extra), so an
x86 test machine can call the kernels' aarch64 build: the executable is loaded, musl's start-up runs until `main`
(its heap and thread pointer are then set up), and then its functions are called directly, arguments placed as
the AArch64 procedure call standard places them.

Only what musl's start-up and malloc ask of the kernel is answered: anonymous mmap from a bump region, a brk that
never grows (malloc then maps), and no-ops for the calls that only set state.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import torch
from elftools.elf.elffile import ELFFile
from unicorn import UC_ARCH_ARM64, UC_HOOK_INTR, UC_MODE_ARM, UC_PROT_ALL, Uc
from unicorn.arm64_const import (
    UC_ARM64_REG_CPACR_EL1,
    UC_ARM64_REG_LR,
    UC_ARM64_REG_S0,
    UC_ARM64_REG_SP,
    UC_ARM64_REG_X0,
    UC_ARM64_REG_X8,
)

PAGE = 0x1000
STACK_TOP, STACK_SIZE = 0x7F00_0000, 8 << 20
HEAP_BASE, HEAP_SIZE = 0x4000_0000, 512 << 20  # the emulated system's mmap answers come from here
DATA_BASE, DATA_SIZE = 0x2000_0000, 256 << 20  # the caller's arrays
RETURN_ADDR = 0x7FFF_0000  # a call "returns" here, where the emulation stops
ENOSYS, ENOTTY, ENOMEM = 38, 25, 12


class Syscall(IntEnum):
    """The aarch64 Linux system calls musl's start-up and malloc make (numbers from asm-generic/unistd.h)."""

    IOCTL = 29
    WRITEV = 66
    EXIT = 93
    EXIT_GROUP = 94
    SET_TID_ADDRESS = 96
    RT_SIGPROCMASK = 135
    BRK = 214
    MUNMAP = 215
    MREMAP = 216
    MMAP = 222
    MPROTECT = 226
    MADVISE = 233


def page_up(n: int) -> int:
    return (n + PAGE - 1) & ~(PAGE - 1)


@dataclass
class Bump:
    """Addresses handed out from [next, end), page-aligned where asked."""

    next: int
    end: int

    def take(self, size: int, align: int = 16) -> int:
        at = (self.next + align - 1) & ~(align - 1)
        if at + size > self.end:
            raise MemoryError(f"emulated region full ({size} bytes asked)")
        self.next = at + size
        return at


@dataclass
class Aarch64Process:
    path: Path
    uc: Uc = field(init=False)
    symbols: dict[str, int] = field(init=False)
    data: Bump = field(default_factory=lambda: Bump(DATA_BASE, DATA_BASE + DATA_SIZE))
    heap: Bump = field(default_factory=lambda: Bump(HEAP_BASE, HEAP_BASE + HEAP_SIZE))

    def __post_init__(self) -> None:
        self.uc = Uc(UC_ARCH_ARM64, UC_MODE_ARM)
        self.uc.reg_write(UC_ARM64_REG_CPACR_EL1, 0x300000)  # FPEN: FP and SIMD instructions do not trap
        with open(self.path, "rb") as f:
            elf = ELFFile(f)
            assert elf["e_machine"] == "EM_AARCH64" and elf["e_type"] == "ET_EXEC", "a static aarch64 executable"
            phdr, phnum, entry = 0, elf["e_phnum"], elf["e_entry"]
            for seg in elf.iter_segments():
                if seg["p_type"] == "PT_PHDR":
                    phdr = seg["p_vaddr"]
                if seg["p_type"] != "PT_LOAD":
                    continue
                lo = seg["p_vaddr"] & ~(PAGE - 1)
                self.uc.mem_map(lo, page_up(seg["p_vaddr"] + seg["p_memsz"]) - lo, UC_PROT_ALL)
                self.uc.mem_write(seg["p_vaddr"], seg.data())
            symtab = elf.get_section_by_name(".symtab")
            assert symtab is not None, "the executable keeps its symbol table"
            self.symbols = {s.name: s["st_value"] for s in symtab.iter_symbols() if s.name}
        for base, size in ((STACK_TOP - STACK_SIZE, STACK_SIZE), (HEAP_BASE, HEAP_SIZE), (DATA_BASE, DATA_SIZE)):
            self.uc.mem_map(base, size, UC_PROT_ALL)
        self.uc.mem_map(RETURN_ADDR, PAGE, UC_PROT_ALL)
        self.uc.hook_add(UC_HOOK_INTR, self._syscall)
        self._start(entry, phdr, phnum)

    def _start(self, entry: int, phdr: int, phnum: int) -> None:
        """musl's _start with an empty argv and environment and the aux vector its start-up reads, until main."""
        sp = (STACK_TOP - 0x1000) & ~0xF
        random16 = sp + 0x800  # AT_RANDOM's 16 bytes (the stack canary's seed), above what the start-up uses
        self.uc.mem_write(random16, bytes(range(16)))
        AT_PHDR, AT_PHENT, AT_PHNUM, AT_PAGESZ, AT_RANDOM = 3, 4, 5, 6, 25
        aux = [AT_PHDR, phdr, AT_PHENT, 56, AT_PHNUM, phnum, AT_PAGESZ, PAGE, AT_RANDOM, random16, 0, 0]
        words = [0, 0, 0, *aux]  # argc 0, argv's NULL, envp's NULL, then the aux vector
        self.uc.mem_write(sp, struct.pack(f"<{len(words)}Q", *words))
        self.uc.reg_write(UC_ARM64_REG_SP, sp)
        self.uc.emu_start(entry, self.symbols["main"])

    def _syscall(self, uc: Uc, intno: int, _user: object) -> None:
        assert intno == 2, f"CPU exception {intno} in the emulated program"  # 2: svc, a system call
        nr = uc.reg_read(UC_ARM64_REG_X8)
        args = [uc.reg_read(UC_ARM64_REG_X0 + i) for i in range(6)]
        match nr:
            case Syscall.MMAP:
                ret = self.heap.take(page_up(args[1]), PAGE) if args[0] == 0 else -ENOMEM
            case Syscall.BRK:
                ret = HEAP_BASE + HEAP_SIZE  # never grows: malloc falls back to mmap
            case Syscall.WRITEV:  # every byte written (to nowhere: nothing here prints)
                ret = sum(struct.unpack_from("<QQ", uc.mem_read(args[1] + 16 * i, 16))[1] for i in range(args[2]))
            case Syscall.EXIT | Syscall.EXIT_GROUP:
                uc.emu_stop()
                ret = 0
            case Syscall.SET_TID_ADDRESS:
                ret = 1  # the thread id
            case Syscall.MUNMAP | Syscall.MPROTECT | Syscall.MADVISE | Syscall.RT_SIGPROCMASK:
                ret = 0  # the bump region is never reused, and every page stays readable and writable
            case Syscall.IOCTL:
                ret = -ENOTTY
            case Syscall.MREMAP:
                ret = -ENOMEM  # malloc then maps anew and copies
            case _:
                ret = -ENOSYS
        uc.reg_write(UC_ARM64_REG_X0, ret & (2**64 - 1))

    def alloc(self, data: bytes) -> int:
        """Copy data into the emulated memory; its address (valid until the next `call`)."""
        at = self.data.take(max(len(data), 1), 64)
        self.uc.mem_write(at, data)
        return at

    def read(self, at: int, size: int) -> bytes:
        return bytes(self.uc.mem_read(at, size))

    def call(self, name: str, args: Sequence[int | torch.Tensor], floats: tuple[float, ...] = ()) -> int:
        """Call a function: integer and pointer arguments in order (x0-x7, then 8-byte stack slots), float ones in
        s0, s1, ...; its 64-bit x0 after it returns. A tensor argument is passed as a pointer to a copy of it, which
        is copied back afterwards, so what the function writes there lands in the tensor."""
        assert len(floats) <= 8, "float arguments past s7 are not placed"
        self.data.next = DATA_BASE  # the last call's copies are dead
        tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        ints = [self.alloc(as_bytes(tensors[i])) if i in tensors else int(a) for i, a in enumerate(args)]
        sp = (STACK_TOP - 0x10000) & ~0xF
        for i, v in enumerate(ints[:8]):
            self.uc.reg_write(UC_ARM64_REG_X0 + i, v & (2**64 - 1))
        rest = ints[8:]
        if rest:
            self.uc.mem_write(sp, struct.pack(f"<{len(rest)}Q", *(v & (2**64 - 1) for v in rest)))
        for i, x in enumerate(floats):
            self.uc.reg_write(UC_ARM64_REG_S0 + i, struct.unpack("<I", struct.pack("<f", x))[0])
        self.uc.reg_write(UC_ARM64_REG_SP, sp)
        self.uc.reg_write(UC_ARM64_REG_LR, RETURN_ADDR)
        self.uc.emu_start(self.symbols[name], RETURN_ADDR)
        for i, t in tensors.items():
            raw = bytearray(self.read(ints[i], t.numel() * t.element_size()))
            t.view(torch.uint8).view(-1).copy_(torch.frombuffer(raw, dtype=torch.uint8))
        return int(self.uc.reg_read(UC_ARM64_REG_X0))


def as_bytes(t: torch.Tensor) -> bytes:
    assert t.is_contiguous(), "a tensor argument is passed as its contiguous bytes"
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def int32(x0: int) -> int:
    """A function's int32 result from the 64-bit x0 `call` returns (the upper half is not the callee's)."""
    low = x0 & 0xFFFFFFFF
    return low - (1 << 32) if low & 0x80000000 else low
