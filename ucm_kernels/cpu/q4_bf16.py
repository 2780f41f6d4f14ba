"""Python side of the 4-bit bf16 decode matmul (`q4_bf16.c`, AVX-512 BF16): packing, the call, and whether it wins;
and of its Q8_0 twin for the embedded model's lm_head (its tied embedding is Q8_0 in the GGUF): 1.27 -> 0.79 ms for
its 8 generated rows' logits on the 2-core Zen 5 EPYC, where oneDNN streams the 56.6 MB bf16 matrix.

The engine sends a step's generated-token rows through this kernel and its prompt rows through oneDNN
(engine/models/dense.py). Each gives a row the same bits however many rows the call has, so a token's hidden state
does not depend on how its prompt was chunked or whether a prefix came from the cache: the cache-hit oracle needs
that in bf16, where a last-bit difference flips greedy tokens (tests/engine/test_bf16_cache_hit.py). Routing by
row count would not give it: the 4 rows left after a 496-token prefix hit would take the kernel where the cold
run's 500-row prefill took oneDNN.

A plain bf16 weight (a bf16 checkpoint) takes the same library's loop over bf16 panels (`pack_bf16`: the weight's
own pairs, no scales, one fp32 sum a row and output) on a CPU without AMX, where oneDNN's bf16 matmul streams the
weight at half the memory's rate at decode rows (Llama-1B's layers on a 2-core Zen 4: 19-30 GB/s at 1-8 rows against
a 36-58 GB/s read; the panels 28-43); where AMX runs the prompt rows, its kernel reads the weight near the memory's
rate at those rows already.

The weight must be exactly Q4_1 in fp32 (`q4_panels.find_q4`: the embedded model's layers; the loader derives the
panels before it casts the model to bf16). The kernel computes x . w with w = d * q + m exactly (not w rounded to
bf16, as oneDNN's rows see it), so a generated row differs from what oneDNN would give it by about bf16 rounding.

`UCM_CPU_LINEAR=auto` (the default) measures once per machine, per weight shape, the kernel against what those rows
would run instead (oneDNN on a reordered bf16 weight, or the AMX kernel where it stands in for oneDNN: amx_gemm.py)
at `DECODE_ROWS` rows over a stack of weights larger than the caches, and uses it only where it won every round
(logged, cached beside the other linear choices: ucm_kernels/cpu/calibration_store.py). `native` uses it wherever the
build has it, `torch` never.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ucm_kernels.cpu import amx_gemm
from ucm_kernels.cpu.linear_choice import WinMemo, measured_win
from ucm_kernels.cpu.linear_mode import MIN_PACK_BYTES, STACK_BYTES, CpuLinear, cpu_linear_mode
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.q4_panels import QB, find_q4_padded, random_q4_weight
from ucm_kernels.cpu.q8_panels import find_q8_padded, random_q8_weight
from ucm_kernels.cpu.timing import two_way_rounds

log = logging.getLogger(__name__)

NR = 16  # outputs per panel (q4_bf16.c)
DECODE_ROWS = 8  # the decode batch the choice is measured at (vllm bench serve's concurrency in issue 10)
MAX_STACK = 32
REPS = 3

Timings = tuple[float, float]  # (kernel ms, oneDNN ms), best of REPS


@dataclass(frozen=True)
class Q4BF16Panels:
    """qp [panels, K / 2, 16] uint8 (output o's q at k = 2j and 2j + 1 in byte o of pair j), dm [panels, K / 32, 2,
    16] fp32 (d, then m, of each output's block), for an [n, k] weight."""

    qp: torch.Tensor
    dm: torch.Tensor
    n: int
    k: int


def pack(weight: torch.Tensor) -> Q4BF16Panels | None:
    """`weight` [N, K] fp32 as this kernel's panels, or None where it is not exactly Q4_1."""
    found = find_q4_padded(weight, NR)
    if found is None:
        return None
    q, d, m = found
    n, k = weight.shape
    panels = q.shape[0] // NR
    pairs = q.reshape(panels, NR, k // 2, 2)
    qp = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(0, 2, 1)  # [P, K/2, 16]
    dm = np.stack([x.reshape(panels, NR, k // QB).transpose(0, 2, 1) for x in (d, m)], axis=2)  # [P, K/32, 2, 16]
    return Q4BF16Panels(torch.from_numpy(np.ascontiguousarray(qp)), torch.from_numpy(np.ascontiguousarray(dm)), n, k)


@dataclass(frozen=True)
class Q8BF16Panels:
    """The Q8_0 form: qp [panels, K / 2, 2, 16] int8 (pair j: the 16 outputs' q at k = 2j, then at 2j + 1),
    d [panels, K / 32, 16] fp32 (each output's block scale), for an [n, k] weight."""

    qp: torch.Tensor
    d: torch.Tensor
    n: int
    k: int


@dataclass(frozen=True)
class BF16Panels:
    """A plain bf16 weight's panels: wp [panels, K / 2, 16] int32, lane o of pair j output o's (w[2j], w[2j + 1])
    (n padded to panels of 16 with zeros), for an [n, k] weight."""

    wp: torch.Tensor
    n: int
    k: int


DecodePanelsOf = Q4BF16Panels | Q8BF16Panels | BF16Panels  # what `linear` takes


class DecodeKind(enum.Enum):
    """The weight formats the kernel reads."""

    Q4 = 4  # exactly Q4_1 (the embedded model's layers)
    Q8 = 8  # exactly Q8_0 (its tied embedding, the lm_head)
    BF16 = 16  # any bf16 weight (a bf16 checkpoint, where the AMX kernel does not stand in for oneDNN)


def pack_bf16(weight: torch.Tensor) -> BF16Panels | None:
    """`weight` [N, K] bf16 as the kernel's bf16 panels, or None where K is not a multiple of 32."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % QB:
        return None
    padded = -(-n // NR) * NR
    w = torch.zeros(padded, k, dtype=torch.bfloat16)
    w[:n] = weight.detach()
    pairs = w.view(torch.int32).reshape(padded // NR, NR, k // 2)  # a (w[2j], w[2j + 1]) pair is one int32
    return BF16Panels(pairs.transpose(1, 2).contiguous(), n, k)


def pack_q8(weight: torch.Tensor) -> Q8BF16Panels | None:
    """`weight` [N, K] fp32 as the kernel's Q8_0 panels, or None where it is not exactly Q8_0."""
    found = find_q8_padded(weight, NR)  # outputs past n: q = 0, d = 0 (never stored)
    if found is None:
        return None
    q, d = found
    n, k = weight.shape
    panels = q.shape[0] // NR
    qp = q.reshape(panels, NR, k // 2, 2).transpose(0, 2, 3, 1)  # [P, K/2, 2, 16]
    dp = d.reshape(panels, NR, k // QB).transpose(0, 2, 1)  # [P, K/32, 16]
    return Q8BF16Panels(torch.from_numpy(np.ascontiguousarray(qp)), torch.from_numpy(np.ascontiguousarray(dp)), n, k)


def linear(lib: NativeLib, x: torch.Tensor, panels: DecodePanelsOf) -> torch.Tensor:
    """x [M, K] bf16 @ W.T -> [M, N] bf16; each output row's bits depend on its own x row only."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != panels.k:
        raise ValueError(f"q4_bf16.linear takes a 2-D bf16 x of {panels.k} features, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty((x.shape[0], panels.n), dtype=torch.bfloat16)
    return linear_into(lib, x, panels, y, torch.get_num_threads())


def linear_into(lib: NativeLib, x: torch.Tensor, panels: DecodePanelsOf, y: torch.Tensor, threads: int) -> torch.Tensor:
    """`linear` without its checks, into `y` [M, N] bf16 (contiguous, as x [M, K] must be) on `threads` threads: the
    one call of each panel format's entry point (engine/models/native_decode.py's step buffers too)."""
    if isinstance(panels, BF16Panels):
        status = lib.bf16_dp(x.data_ptr(), x.shape[0], panels.k, panels.wp.data_ptr(), panels.n, y.data_ptr(), threads)
    else:
        fn, scales = (lib.q8_bf16, panels.d) if isinstance(panels, Q8BF16Panels) else (lib.q4_bf16, panels.dm)
        status = fn(
            x.data_ptr(), x.shape[0], panels.k, panels.qp.data_ptr(), scales.data_ptr(), panels.n, y.data_ptr(),
            threads,
        )  # fmt: skip
    if status:
        raise status_error(lib, status, x.shape[0], panels)
    return y


def status_error(lib: NativeLib, status: int, rows: int, panels: DecodePanelsOf) -> RuntimeError:
    """The error for the kernel's non-zero `status` on `rows` rows."""
    if status == -1:
        return RuntimeError(f"{lib.path.name} was built without AVX-512 BF16: q4_bf16 is not in it")
    return RuntimeError(f"q4_bf16 failed ({status}) on {rows} rows of {panels.k}, weight {panels.n}x{panels.k}")


def _baseline_is_amx(k: int, n: int) -> bool:
    """Whether a bf16 [n, k] weight's rows that do not take this kernel go through the AMX kernel here
    (engine/models/dense.py), not oneDNN: the baseline the kernel must beat."""
    return amx_gemm.takes_shape(n, k) and amx_gemm.needed_and_available() is not None


def measure(lib: NativeLib, k: int, n: int, kind: DecodeKind = DecodeKind.Q4) -> list[Timings]:
    """One (kernel, baseline) pair per round (tests replace this to force a result), the kernel on `kind`'s
    panels. The baseline is what the engine would run instead: the AMX kernel where it stands in for oneDNN, else
    oneDNN."""
    gen = torch.Generator().manual_seed(0)
    count = min(MAX_STACK, max(2, -(-STACK_BYTES // (2 * n * k))))
    if kind is DecodeKind.BF16:
        weights = [(torch.randn(n, k, generator=gen) * 0.02).bfloat16().float() for _ in range(count)]
    else:
        weights = [(random_q8_weight if kind is DecodeKind.Q8 else random_q4_weight)(n, k, gen) for _ in range(count)]
    packer = {DecodeKind.Q4: pack, DecodeKind.Q8: pack_q8, DecodeKind.BF16: lambda w: pack_bf16(w.bfloat16())}[kind]
    panels = [packer(w) for w in weights]
    assert all(p is not None for p in panels), "the random weights are exactly 4-bit, 8-bit or bf16"
    x = torch.randn(DECODE_ROWS, k, generator=gen).bfloat16()
    if _baseline_is_amx(k, n):
        amx = [amx_gemm.amx_weight(w.bfloat16()) for w in weights]
        baseline = lambda: [a.linear(x) for a in amx if a is not None]  # noqa: E731
    else:
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in weights]
        baseline = lambda: [torch.ops.mkldnn._linear_pointwise(x, r, None, "none", [], "") for r in reordered]  # noqa: E731
    runs = [lambda: [linear(lib, x, p) for p in panels if p is not None], baseline]
    return two_way_rounds(runs, REPS)


_memo = WinMemo()


def kernel_wins(lib: NativeLib, k: int, n: int, root: Path | None = None, kind: DecodeKind = DecodeKind.Q4) -> bool:
    """Whether a [n, k] weight of `kind`'s format has its generated rows go through the kernel on this machine (see
    the module doc). A plain bf16 weight never where the AMX kernel stands in for oneDNN: that kernel reads it at
    ~85% of the memory's rate already, and its panels would double the weight's memory."""
    mode = cpu_linear_mode()
    if mode is CpuLinear.TORCH or not lib.has_q4_bf16 or k % QB:
        return False
    amx = _baseline_is_amx(k, n)
    if kind is DecodeKind.BF16 and amx:
        return False
    if mode is CpuLinear.NATIVE:
        return True
    if 4 * k * n < MIN_PACK_BYTES:
        return False  # the tests' tiny models: cache-sized, and measuring them would be noise
    # The names the Q4_1 and Q8_0 choices have always had in the cache file
    name, field, path = {
        DecodeKind.Q4: ("decode q4 bf16", "q4_decode_kernel", "the 4-bit kernel"),
        DecodeKind.Q8: ("decode q8 bf16", "q8_decode_kernel", "the 8-bit kernel"),
        DecodeKind.BF16: ("decode bf16 panels", "bf16_decode_kernel", "the kernel on bf16 panels"),
    }[kind]
    return measured_win(
        _memo, lib, root, f"{name} {n}x{k}{' vs AMX' if amx else ''}", field, lambda: measure(lib, k, n, kind),
        (path, "the AMX kernel" if amx else "oneDNN"), "generated rows", f"{DECODE_ROWS} rows", log,
    )  # fmt: skip


def forget() -> None:
    """Drop this process's memoised choices (tests)."""
    _memo.clear()
