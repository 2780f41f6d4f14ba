"""bf16 matmuls of prompt rows through the AMX kernel (amx_gemm.c) where oneDNN's would give a row other bits in
calls of other sizes (`calibration.bf16_linear_rows_invariant`): the cache-hit oracle needs a row's bits to depend
on the row alone. The weight is packed once into AMX's VNNI tile order; the kernel takes K and N multiples of 32
(every weight of the embedded model)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ucm_kernels.cpu.native import NativeLib

TILE_K, TILE_N = 32, 16  # k per tile row block, outputs per tile


class Epilogue(enum.IntEnum):
    """What the kernel writes (entry_points.h's EPI_*); PAIRS and SILU take a weight packed with paired=True."""

    PLAIN = 0  # y = x @ W^T
    PAIRS = 1  # the same y, from a gate_up weight packed with its gate and up panels alternating
    SILU = 2  # silu(gate) * up [M, N / 2], as ucm_kernels.api.silu_and_mul gives on the PAIRS y


def takes_shape(n: int, k: int) -> bool:
    """Whether the kernel takes an [n, k] weight (K and N multiples of 32)."""
    return k % 32 == 0 and n % 32 == 0


def takes(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and takes_shape(*weight.shape)


@dataclass(frozen=True)
class TilePacked:
    """A weight [N, K] as the kernel reads it: 16-output panels of 32-k VNNI blocks ([16 k pairs][16 outputs][2]),
    chunk after chunk of layout_chunk(k) k blocks (amx_gemm.c decides), every panel's blocks of a chunk in turn."""

    data: torch.Tensor  # [N / 16 * K / 32, 16, 16, 2] bf16 in that order
    n: int
    k: int


def layout_chunk(k: int) -> int:
    """k blocks (of 32) a chunk of the kernel's W layout takes for in-features k (amx_gemm.c decides: one source)."""
    from ucm_kernels.cpu import native

    lib = native.load()
    if lib is None or not lib.has_amx:
        raise RuntimeError(f"the AMX kernel is not available here: {native.load_error() or 'no AMX'}")
    return int(lib.amx_layout_chunk(k))


def pack(weight: torch.Tensor, paired: bool = False) -> TilePacked:
    """W [N, K] bf16 -> the kernel's layout (TilePacked). paired: W is a gate_up weight (gate rows, then as many up
    rows), packed with its 16-output panels alternating gate and up, so that one 32-output block of the kernel holds
    both halves of 16 SwiGLU outputs (Epilogue)."""
    if not takes(weight):
        raise ValueError(f"the AMX kernel takes a bf16 CPU weight with K and N multiples of 32, got "
                         f"{weight.dtype} {tuple(weight.shape)}")  # fmt: skip
    n, k = weight.shape
    if paired:
        weight = weight.detach().reshape(2, n // 2 // TILE_N, TILE_N, k).transpose(0, 1).reshape(n, k)
    # A k pair moves as one int32: the permute then copies 4-byte elements, 6x faster than 2-byte ones
    # (0.15 vs 0.93 ms for 1536 x 576 on the Xeon with AMX), which is most of a cached model load's packing.
    pairs = weight.detach().contiguous().view(torch.int32).reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K // 2)
    panels = pairs.permute(0, 2, 3, 1)  # [N / 16][K / 32][16 pairs][16 outputs] int32, a view
    chunk, blocks = layout_chunk(k), k // TILE_K
    data = torch.empty(n // TILE_N * blocks, 16, 16, dtype=torch.int32)
    for c in range(0, blocks, chunk):  # each chunk's panels in turn, copied once from the view
        part = panels[:, c : c + chunk]
        data[c * (n // TILE_N) : (c + part.shape[1]) * (n // TILE_N)].view(part.shape).copy_(part)
    return TilePacked(data.view(torch.bfloat16).view(-1, 16, 16, 2), n, k)


def linear(lib: NativeLib, x: torch.Tensor, packed: TilePacked, epilogue: Epilogue = Epilogue.PLAIN) -> torch.Tensor:
    """x [M, K] bf16 (rows any stride apart) @ W^T -> [M, N] bf16 (Epilogue.SILU: [M, N / 2], rows `padded_rows`
    apart: the down projection's x), W as `pack` left it."""
    n, k = packed.n, packed.k
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be [M, {k}] bf16, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    m = x.shape[0]
    width = n // 2 if epilogue == Epilogue.SILU else n
    y = padded_rows(m, width) if epilogue == Epilogue.SILU else torch.empty(m, width, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    pad = scratch(threads, k)
    status = lib.amx_gemm(
        x.data_ptr(), m, k, x.stride(0), packed.data.data_ptr(), n, y.data_ptr(), y.stride(0), pad.data_ptr(), threads,
        int(epilogue),
    )  # fmt: skip
    if status != 0:
        raise status_error(status)
    return y


ALIASED_STRIDE = 4096  # bytes: rows this far apart (or a multiple) fall in one L1 set
PAD_MIN_ROWS = 64  # fewer rows (decode, a prompt's tail) read W from memory once: x's placement does not matter


def padded_rows(m: int, width: int) -> torch.Tensor:
    """An empty bf16 [m, width] whose rows, where they would be a multiple of 4 KB apart (Llama-1B's 2048 and 8192
    in-features), are 64 bytes further apart. A tile load takes 16 rows of x; 4 KB apart they fall in one L1 set of
    12 ways, so a row slice's x could not stay in L1 across the slice's output blocks. On the 2-core Xeon with AMX,
    1536 rows over 16 layers' weights (from memory), contiguous and padded x alternated: 3072x2048 2.35-2.41 ->
    2.59 TFLOP/s, 2048x8192 2.03-2.07 -> 2.13-2.24; Llama-1B's 1536-token prompt step, padding on and off alternated
    in one engine (medians of 8): 1672-1751 -> 1590-1639 ms (gate_up 725-778 -> 662-706, down 481-488 -> 460-474);
    at 512 tokens a tie. The same products in the same order: the same bits."""
    if m < PAD_MIN_ROWS or (width * 2) % ALIASED_STRIDE:
        return torch.empty(m, width, dtype=torch.bfloat16)
    return torch.empty(m, width + 32, dtype=torch.bfloat16)[:, :width]


def status_error(status: int) -> RuntimeError:
    """What a non-zero return of ucm_amx_gemm means."""
    return RuntimeError(
        f"ucm_amx_gemm returned {status} (1: no AMX in this build or process, 2: shape, strides or epilogue, 3: out of "
        "memory)"
    )


def scratch(threads: int, k: int) -> torch.Tensor:
    """The kernel's scratch for calls of up to `k` in-features on `threads` threads (a last slice's padded rows)."""
    return torch.empty(threads * 32 * k, dtype=torch.bfloat16)


@dataclass(frozen=True)
class AmxWeight:
    """A weight packed for the kernel, and the library that runs it."""

    lib: NativeLib
    packed: TilePacked
    paired: bool = False  # a gate_up weight packed with paired=True: silu_and_mul is there too

    @property
    def out_features(self) -> int:
        return self.packed.n

    @property
    def in_features(self) -> int:
        return self.packed.k

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        flat = x.reshape(-1, x.shape[-1])
        epilogue = Epilogue.PAIRS if self.paired else Epilogue.PLAIN
        return linear(self.lib, flat, self.packed, epilogue).view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """ucm_kernels.api.silu_and_mul(self.linear(x)) [..., N / 2], bit for bit, with no [..., N] intermediate."""
        assert self.paired, "the SiLU epilogue needs the gate and up panels paired"
        flat = x.reshape(-1, x.shape[-1])
        y = linear(self.lib, flat, self.packed, Epilogue.SILU)
        return y.view(*x.shape[:-1], self.out_features // 2)


def needed_and_available() -> NativeLib | None:
    """The library when this machine needs the kernel (oneDNN's bf16 rows are not row-invariant here) and has it."""
    from ucm_kernels.cpu import native
    from ucm_kernels.cpu.calibration import bf16_linear_rows_invariant

    if bf16_linear_rows_invariant():
        return None
    lib = native.load()
    return lib if lib is not None and lib.has_amx else None


def engine_bf16_rows_invariant() -> bool:
    """Whether the engine's bf16 matmuls give a row the same bits in any call here: oneDNN's are, or the kernel
    stands in for them. False on an AMX host whose library has no AMX kernel (a compiler without AMX)."""
    from ucm_kernels.cpu.calibration import bf16_linear_rows_invariant

    return bf16_linear_rows_invariant() or needed_and_available() is not None


def amx_weight(weight: torch.Tensor, paired: bool = False) -> AmxWeight | None:
    """The packed weight where this machine needs it (oneDNN's bf16 rows are not row-invariant here, and the
    library has the kernel) and the kernel takes the shape; else None (oneDNN). paired: a gate_up weight (`pack`)."""
    lib = needed_and_available() if takes(weight) else None
    return AmxWeight(lib, pack(weight, paired), paired) if lib is not None else None
