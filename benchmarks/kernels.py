"""Kernel benchmark: paged decode attention and block gather/scatter.

CUDA: achieved memory bandwidth (bytes the kernel must move / time) as a fraction of the device's peak HBM
bandwidth (from a table by device name, else a measured large copy), with torch SDPA on already-gathered dense
K/V (and torch index_select / index_copy_ for blocks) as the baseline. Prefill attention on CUDA is compute
bound: TFLOP/s per causal pair, against torch's flash SDPA on dense K/V, with a sweep of the Triton kernel's tiles;
"dispatched (triton|torch)" is the path ucm_kernels/gpu_prefill_choice.py measured faster for the call's length, and
the last table puts it beside the better of the Triton kernel at its default tile and the torch path.
CPU: tokens/s of what `ucm_kernels` dispatches to ("dispatched (native|torch)": the path the start-up calibration,
ucm_kernels/cpu/calibration.py, measured faster for that shape class; a decode as a decode step calls it, through
`native_decode.DecodeAttention` where the native kernel won) next to the native C kernel (ucm_kernels/cpu/), the
torch path (`UCM_CPU_ATTENTION=torch`) and SDPA on pre-gathered K/V, in the same run; a last table puts each
dispatched time beside the best of native and torch. A bf16 prompt or chunk is called as the engine calls it, its
new tokens given as prompt rows: with AMX that is the AMX body ("dispatched (native AMX)"), while "native (in
place)" is the VDPBF16PS body that rows without a class take. The "cold" shape cycles through one cache per layer (30,
> the last-level cache) as the engine does, so K/V come from DRAM. "linear" rows: SmolLM2-135M's fp32 matmuls of
one step (30 layers' qkv, o, gate_up, down, then lm_head: 0.54 GB of weights, read from DRAM as in the engine) at a
few token counts as dispatched (ucm_kernels/cpu/skinny_gemm.py's calibration) for a step of that many generated rows
(`native_decode.decode_linear` into the step's buffers for the layers, `dense` for the lm_head), F.linear
("torch path") and the packed kernel ("native (in place)"); GB/s is the weight bytes over the time, against a
measured read of 256 MB (the memory's limit for a step that streams the weights). With AVX-512 BF16, the bf16 step
of 8 generated rows on exactly-Q4_1 layers and a Q8_0 lm_head: dispatched (the 4- and 8-bit decode kernels where the
calibration chose them), the kernels on every weight ("native (in place)") and oneDNN on every weight.

    .venv/bin/python -m benchmarks.kernels [--json out.json] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

if not __package__:  # run as a file, this folder is sys.path[0] and `import ucm_kernels` would find this script
    raise SystemExit("run it as a module from the repository root: python -m benchmarks.kernels")

import ucm_kernels
from engine.models.native_decode import DecodeAttention
from ucm_kernels.api import gpu_prefill_on_torch, native_decode_lib
from ucm_kernels.backend import cpu_attention
from ucm_kernels.cpu import host, native
from ucm_kernels.cpu.calibration import ShapeClass
from ucm_kernels.cpu.paged_attention import paged_attention_native
from ucm_kernels.reference import decode_attention_chunked_torch, prefill_attention_torch
from ucm_kernels.reference.paged_gather import gather_context

# Peak HBM/DRAM bandwidth in GB/s (vendor datasheets), matched by substring of torch.cuda.get_device_name().
K = TypeVar("K")
TURN_CALLS = 6  # calls of one run per turn of `time_all`, the first half not counted

PEAK_GBPS = {
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "T4": 320.0,
}


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    ctx: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    layers: int = 1  # > 1: one cache per layer, called in turn (cold caches, as in the engine)


@dataclass(frozen=True)
class Row:
    bench: str
    shape: str
    impl: str
    ms: float
    gbps: float | None
    frac_peak: float | None
    tokens_per_s: float | None
    tflops: float | None = None  # compute-bound rows (GPU prefill)


def time_ms(fn: Callable[[], object], device: torch.device, min_time_s: float) -> float:
    fn()  # warm-up (compiles Triton kernels)
    if device.type == "cuda":
        torch.cuda.synchronize()
        reps, elapsed = 1, 0.0
        while elapsed < min_time_s * 1000:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
            if elapsed < min_time_s * 1000:
                reps *= 2
        return elapsed / reps
    # CPU: best single call; on a shared 2-core box even the median swings 10x with other processes' load.
    samples, t_end = [], time.perf_counter() + min_time_s
    while time.perf_counter() < t_end or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples) * 1000


def time_all(runs: dict[K, Callable[[], object]], device: torch.device, min_time_s: float) -> dict[K, float]:
    """Each run's milliseconds. On CPU the runs take turns (best single call each), so the host's drift, which on a
    shared 2-core box moves a path's time by 10% within a minute, hits all of a shape's rows alike and their ratios
    stay true. A turn's first half of its TURN_CALLS calls is not counted: after another path's big run (SDPA on
    fp32 K/V) the next two calls of a 0.3 ms decode were 15-25% slower, the caches still full of its writes. On CUDA
    each is timed on its own (`time_ms`)."""
    if device.type == "cuda":
        return {key: time_ms(fn, device, min_time_s) for key, fn in runs.items()}
    best = dict.fromkeys(runs, float("inf"))
    passes, t_end = 0, time.perf_counter() + min_time_s * len(runs)
    while time.perf_counter() < t_end or passes < 5:
        for key, fn in runs.items():
            for call in range(TURN_CALLS):
                t0 = time.perf_counter()
                fn()
                if call >= TURN_CALLS // 2:
                    best[key] = min(best[key], time.perf_counter() - t0)
        passes += 1
    return {key: ms * 1000 for key, ms in best.items()}


def peak_gbps(device: torch.device) -> tuple[float, str]:
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps, f"table ({name})"
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    ms = time_ms(lambda: buf.clone(), device, 0.5)
    return 2 * buf.numel() / ms / 1e6, f"measured 1 GiB copy ({name})"


def paged_setup(s: Shape, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = -(-s.ctx // s.block_size)
    num_blocks = s.batch * blocks_per_seq + 1
    shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    ids = torch.randperm(num_blocks - 1, generator=gen)[: s.batch * blocks_per_seq] + 1
    tables = ids.view(s.batch, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((s.batch,), s.ctx, dtype=torch.int32, device=device)
    q = torch.randn(s.batch, s.num_q_heads, s.head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, seq_lens


def dispatched(shape_class: ShapeClass, s: Shape, dtype: torch.dtype) -> str:
    """The row name of `ucm_kernels`' own call: which CPU path it takes for this class (calibrating if it must)."""
    plan = ucm_kernels.calibrate_cpu_attention(dtype, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size)
    # None: UCM_CPU_ATTENTION forces a path (or the library did not build: torch)
    return f"dispatched ({plan[shape_class].impl if plan is not None else cpu_attention().value})"


def decode_attention_triton(*args, **kwargs):
    from ucm_kernels.triton_decode_attention import decode_attention_triton as fn  # CUDA only: imports triton

    return fn(*args, **kwargs)


def engine_decode_attention(
    q: torch.Tensor,
    cache_like: tuple[torch.Tensor, torch.Tensor],
    layer: Iterator[tuple[torch.Tensor, torch.Tensor]],
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
) -> Callable[[], object]:
    """A layer's decode attention as a decode step runs it: where `ucm_kernels` dispatches decodes to the native kernel,
    the step's `DecodeAttention` (metadata checked and converted once a step); else `ucm_kernels.decode_attention`,
    as the generic forward calls it."""
    lib = native_decode_lib(q, *cache_like)
    if lib is None:
        return lambda: ucm_kernels.decode_attention(q, *next(layer), tables, seq_lens, scale, max_seq_len)
    attention, out, threads = (
        DecodeAttention(lib, seq_lens, tables, cache_like[0]),
        torch.empty_like(q),
        torch.get_num_threads(),
    )
    q_ptr, q_row_stride = q.data_ptr(), q.stride(0)

    def run() -> torch.Tensor:
        attention.run(q_ptr, q_row_stride, *next(layer), out, scale, threads)
        return out

    return run


def cpu_paged_runs(
    q: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
) -> dict[str, Callable[[], object]]:
    """The CPU decode paths over the paged caches, each call on the next cache in turn."""
    layer = itertools.cycle(caches)
    s = Shape("", q.shape[0], max_seq_len, q.shape[1], caches[0][0].shape[2], q.shape[2], caches[0][0].shape[1])
    runs = {
        dispatched(ShapeClass.DECODE, s, q.dtype): engine_decode_attention(
            q, caches[0], layer, tables, seq_lens, scale, max_seq_len
        ),
        "torch path": lambda: decode_attention_chunked_torch(q, *next(layer), tables, seq_lens, scale, max_seq_len),
    }
    lib = native.load()
    if lib is not None:
        runs["native (in place)"] = lambda: paged_attention_native(lib, q, *next(layer), None, seq_lens, tables, scale)
    return runs


def bench_decode(s: Shape, dtype: torch.dtype, device: torch.device, peak: float | None, min_s: float) -> list[Row]:
    q, k_cache, v_cache, tables, seq_lens = paged_setup(s, dtype, device)
    scale = s.head_dim**-0.5
    nb = tables.shape[1]
    if s.layers > 1:
        assert device.type == "cpu", "cold-cache shapes are a CPU benchmark"
        caches = [(k_cache, v_cache)] + [paged_setup(s, dtype, device)[1:3] for _ in range(s.layers - 1)]
        kv_bytes = 2 * s.batch * s.ctx * s.num_kv_heads * s.head_dim * k_cache.element_size()
        rows = []
        for impl, ms in time_all(cpu_paged_runs(q, caches, tables, seq_lens, scale, s.ctx), device, min_s).items():
            rows.append(
                Row("decode", f"{s.name} {dtype_name(dtype)}", impl, ms, kv_bytes / ms / 1e6, None, s.batch / ms * 1e3)
            )
        return rows
    # clone: on CPU gather_context returns a scratch view that the paged path reuses.
    k_dense = gather_context(k_cache, tables, nb)[:, :, : s.ctx].clone(memory_format=torch.contiguous_format)
    v_dense = gather_context(v_cache, tables, nb, slot="v")[:, :, : s.ctx].clone(memory_format=torch.contiguous_format)
    gqa = s.num_q_heads != s.num_kv_heads
    kv_bytes = 2 * k_dense.numel() * k_dense.element_size() + 2 * q.numel() * q.element_size()
    runs = {
        ("paged (dispatch)" if device.type == "cuda" else dispatched(ShapeClass.DECODE, s, dtype)): lambda: (
            ucm_kernels.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, s.ctx)
        ),
        "SDPA pre-gathered": lambda: F.scaled_dot_product_attention(
            q.unsqueeze(2), k_dense, v_dense, scale=scale, enable_gqa=gqa
        ),
    }
    if device.type == "cpu":
        runs.update(cpu_paged_runs(q, [(k_cache, v_cache)], tables, seq_lens, scale, s.ctx))
    if device.type == "cuda":
        # Tuning sweep of the Triton kernel itself (the dispatch row above uses its defaults): tile, warps,
        # stages, and the split count as the heuristic picks it (x) and 2x / 4x / 8x that.
        from ucm_kernels.triton_decode_attention import _num_sms, choose_num_splits

        auto = choose_num_splits(s.batch, s.num_kv_heads, s.ctx, _num_sms(device.index or 0))
        sweep = [(bn, w, st, auto) for bn, w, st in ((32, 4, 2), (64, 4, 2), (64, 8, 3), (128, 8, 2))]
        sweep += [(bn, w, st, auto * m) for bn, w, st in ((64, 4, 2), (128, 8, 2)) for m in (2, 4, 8)]
        for bn, warps, stages, splits in sweep:
            runs[f"triton bn{bn} w{warps} s{stages} x{splits}"] = functools.partial(
                decode_attention_triton,
                q,
                k_cache,
                v_cache,
                tables,
                seq_lens,
                scale,
                s.ctx,
                num_splits=splits,
                block_n=bn,
                num_warps=warps,
                num_stages=stages,
            )
    if device.type == "cpu" and dtype != torch.float32:
        k32, v32 = k_dense.float(), v_dense.float()
        runs["SDPA pre-gathered fp32"] = lambda: F.scaled_dot_product_attention(
            q.unsqueeze(2).float(), k32, v32, scale=scale, enable_gqa=gqa
        )
    rows = []
    for impl, ms in time_all(runs, device, min_s).items():
        gbps = kv_bytes / ms / 1e6
        frac = gbps / peak if peak else None
        rows.append(Row("decode", f"{s.name} {dtype_name(dtype)}", impl, ms, gbps, frac, s.batch / ms * 1e3))
    return rows


def bench_prefill_cpu(s: Shape, dtype: torch.dtype, min_s: float) -> list[Row]:
    """One sequence of s.ctx tokens whose last half is new (a prefix hit on the first half), and a whole prompt
    of s.ctx // 2 tokens (dispatch sends whole prompts to torch's SDPA: ucm_kernels/cpu/paged_attention.py)."""
    device = torch.device("cpu")
    one = Shape(s.name, 1, s.ctx, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size)
    _, k_cache, v_cache, tables, _seq_lens = paged_setup(one, dtype, device)
    new = s.ctx // 2
    q = torch.randn(new, s.num_q_heads, s.head_dim, dtype=dtype)
    qsl = torch.tensor([0, new], dtype=torch.int32)
    scale = s.head_dim**-0.5
    lib = native.load()
    rows = []
    for ctx, what, cls in (
        (s.ctx, f"{new} new/{s.ctx}", ShapeClass.CHUNK),
        (new, f"{new} whole prompt", ShapeClass.PROMPT),
    ):
        lens = torch.tensor([ctx], dtype=torch.int32)
        label = dispatched(cls, one, dtype)
        if label == "dispatched (native)" and lib is not None and lib.has_amx_attention and dtype == torch.bfloat16:
            label = "dispatched (native AMX)"
        runs = {
            # Every new token a prompt token, as the engine's model runner says of a prompt chunk.
            label: lambda: ucm_kernels.prefill_attention(
                q,
                k_cache,
                v_cache,
                qsl,
                lens,
                tables,
                scale,
                new,
                prompt_queries=torch.tensor([new], dtype=torch.int32),
            ),
            "torch path": lambda: prefill_attention_torch(q, k_cache, v_cache, qsl, lens, tables, scale, new),
        }
        if lib is not None:  # no row classes: the VDPBF16PS body for bf16, as before the AMX one
            runs["native (in place)"] = lambda: paged_attention_native(
                lib, q, k_cache, v_cache, qsl, lens, tables, scale
            )
        for impl, ms in time_all(runs, device, min_s).items():
            rows.append(Row("prefill", f"{s.name} {dtype_name(dtype)} {what}", impl, ms, None, None, new / ms * 1e3))
    return rows


def causal_pairs(ctx: int, new: int) -> int:
    """(query, key) pairs a causal attention of `new` last tokens over a context of `ctx` computes."""
    return new * (ctx - new) + new * (new + 1) // 2


def bench_prefill_gpu(s: Shape, dtype: torch.dtype, device: torch.device, min_s: float) -> list[Row]:
    """One sequence of s.ctx tokens: a whole prompt, and its last half new over a cached first half. Compute
    bound, so the figure is TFLOP/s (4 * heads * head_dim per causal pair) against
    torch's fused SDPA on pre-gathered dense K/V (flash on whole prompts: the physical best of no paging)."""
    one = Shape(s.name, 1, s.ctx, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size)
    _, k_cache, v_cache, tables, _ = paged_setup(one, dtype, device)
    nb = tables.shape[1]
    k_dense = gather_context(k_cache, tables, nb)[:, :, : s.ctx].contiguous()
    v_dense = gather_context(v_cache, tables, nb, slot="v")[:, :, : s.ctx].contiguous()
    scale = s.head_dim**-0.5
    gqa = s.num_q_heads != s.num_kv_heads
    from ucm_kernels.triton_prefill_attention import prefill_attention_triton

    chosen = ucm_kernels.calibrate_gpu_prefill(dtype, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, device)
    print(f"  {s.name} prefill choice: {chosen.describe() if chosen is not None else 'forced'}", flush=True)
    rows = []
    for new, what in ((s.ctx, "whole prompt"), (s.ctx // 2, "half new")):
        q = torch.randn(new, s.num_q_heads, s.head_dim, dtype=dtype, device=device)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=device)
        lens = torch.tensor([s.ctx], dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, qsl, lens, tables, scale, new)
        on_torch = gpu_prefill_on_torch(q, k_cache, qsl, lens, s.ctx)
        runs: dict[str, Callable[[], object]] = {
            f"dispatched ({'torch' if on_torch else 'triton'})": lambda args=args: ucm_kernels.prefill_attention(
                *args,
                context_tokens=s.ctx,  # as the engine calls it: the sum of seq_lens from the host
            ),
            "torch path": lambda args=args: prefill_attention_torch(*args),
            "triton (default tile)": lambda args=args: prefill_attention_triton(*args),
        }
        if new == s.ctx:  # is_causal aligns top-left, right only when queries and keys are the same positions
            qd = q.transpose(0, 1).unsqueeze(0)
            runs["SDPA pre-gathered (causal)"] = lambda qd=qd: F.scaled_dot_product_attention(
                qd, k_dense, v_dense, scale=scale, is_causal=True, enable_gqa=gqa
            )
        for bm, bn, warps, stages in ((32, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
                                      (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                      (128, 128, 8, 2), (128, 128, 8, 3)):  # fmt: skip
            runs[f"triton m{bm} n{bn} w{warps} s{stages}"] = functools.partial(
                prefill_attention_triton, *args, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages
            )
        flop = 4 * s.num_q_heads * s.head_dim * causal_pairs(s.ctx, new)
        for impl, fn in runs.items():
            try:
                ms = time_ms(fn, device, min_s)
            except Exception as e:  # a tile that does not fit the device's shared memory: say so, go on
                print(f"  {s.name} {what} {impl}: {type(e).__name__}: {str(e)[:120]}")
                continue
            name = f"{s.name} {dtype_name(dtype)} {what}"
            rows.append(Row("prefill", name, impl, ms, None, None, new / ms * 1e3, flop / ms / 1e9))
    return rows


def bench_blocks(s: Shape, num_blocks: int, dtype: torch.dtype, device: torch.device, peak: float | None, min_s: float):
    cache = torch.randn(2 * num_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    ids = torch.randperm(2 * num_blocks, device=device)[:num_blocks]
    staged = torch.empty((num_blocks, *cache.shape[1:]), dtype=dtype, device=device)
    moved = 2 * staged.numel() * staged.element_size()  # read + write
    runs = {
        ("gather", "ucm_kernels.gather_blocks"): lambda: ucm_kernels.gather_blocks(cache, ids, out=staged),
        ("gather", "torch index_select"): lambda: torch.index_select(cache, 0, ids, out=staged),
        ("scatter", "ucm_kernels.scatter_blocks"): lambda: ucm_kernels.scatter_blocks(staged, cache, ids),
        ("scatter", "torch index_copy_"): lambda: cache.index_copy_(0, ids, staged),
    }
    rows = []
    for (bench, impl), ms in time_all(runs, device, min_s).items():
        gbps = moved / ms / 1e6
        frac = gbps / peak if peak else None
        rows.append(Row(bench, f"{num_blocks} blk {s.name} {dtype_name(dtype)}", impl, ms, gbps, frac, None))
    return rows


SMOLLM2_MATMULS = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # [out, in] per call


def read_gbps() -> float:
    """The host's memory read rate: the best of a few sums over 256 MB."""
    big = torch.ones(64 << 20)
    return 256 / 1024 / (time_ms(big.sum, torch.device("cpu"), 0.3) / 1000)


def _linear_path(d: object, rows: int) -> str:
    """Which path `engine.models.dense` takes for a weight packed as `d` at `rows` rows."""
    from engine.models.dense import F32Packed

    if isinstance(d, F32Packed):
        if d.panels is not None and rows <= d.panels.max_rows:
            return "native"
        if d.onednn is not None and d.onednn.takes(rows):
            return "oneDNN"
    return "torch"


def bench_linear_cpu(token_counts: list[int], min_s: float) -> list[Row]:
    from engine.models.dense import dense, f32_layer_choice, pack_weight
    from engine.models.native_decode import decode_linear
    from ucm_kernels.cpu import onednn_linear
    from ucm_kernels.cpu.skinny_gemm import pack_panels, skinny_linear

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for n, k in SMOLLM2_MATMULS]
    # As the engine packs them: the layers' weights with their layer's choice (switching libraries between a layer's
    # matmuls costs time), the last weight, lm_head, which never sees a prefill's rows, alone.
    layer_calls = f32_layer_choice(weights[:4])
    dispatch = [pack_weight(w, layer=layer_calls) for w in weights[:-1]] + [pack_weight(weights[-1])]
    lib = native.load()
    panels = [pack_panels(lib, w) for w in weights] if lib is not None else []
    reordered = [onednn_linear.reorder(w) for w in weights] if onednn_linear.available() else []
    nbytes = sum(w.numel() * 4 for w in weights)
    threads = torch.get_num_threads()
    rows = []
    for t in token_counts:
        xs = {k: torch.randn(t, k, generator=gen) for k in {k for _, k in SMOLLM2_MATMULS}}
        paths = {_linear_path(d, t) for d in dispatch}
        label = f"dispatched ({paths.pop() if len(paths) == 1 else 'mixed'})"
        outs = [torch.empty(t, w.shape[0]) for w in weights[:-1]]  # a decode step's buffers, one per layer matmul
        runs = {
            label: lambda: [
                *(decode_linear(xs[w.shape[1]], w, None, d, o, threads) for w, d, o in zip(weights, dispatch, outs)),
                dense(xs[weights[-1].shape[1]], weights[-1], None, dispatch[-1]),
            ],
            "torch path": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
        }
        if lib is not None:
            runs["native (in place)"] = lambda: [
                skinny_linear(lib, xs[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, panels)
            ]
        if reordered:
            runs["oneDNN (reordered)"] = lambda: [
                onednn_linear.linear(xs[w.shape[1]], r, None) for w, r in zip(weights, reordered)
            ]
        for impl, ms in time_all(runs, torch.device("cpu"), min_s).items():
            rows.append(
                Row("linear", f"smollm2 fp32 step of {t} tokens", impl, ms, nbytes / ms / 1e6, None, t / ms * 1e3)
            )
    return rows


def bench_linear_bf16(min_s: float, tokens: int = 8) -> list[Row]:
    """SmolLM2's bf16 step for a decode of `tokens` generated rows, on exactly-Q4_1 layers and a Q8_0 lm_head as the
    embedded model has: dispatched (what a decode step runs: `native_decode.decode_linear` into the step's buffers
    for the layers and `dense` with every row generated for the lm_head; the 4- and 8-bit kernels where this
    machine's calibration chose them, oneDNN elsewhere), the kernels on every weight ("native (in place)") and oneDNN
    on every weight. Needs AVX-512 BF16 (else no rows)."""
    from engine.generated_rows import GeneratedRows
    from engine.models.dense import BF16Packed, decode_panels, dense, lm_head_panels, onednn_packed, pack_weight
    from engine.models.native_decode import decode_linear
    from ucm_kernels.cpu import onednn_linear, q4_bf16
    from ucm_kernels.cpu.q4_panels import random_q4_weight
    from ucm_kernels.cpu.q8_panels import random_q8_weight

    lib = native.load()
    if lib is None or not lib.has_q4_bf16 or not onednn_linear.available():
        return []
    gen = torch.Generator().manual_seed(0)
    *layers, (vocab, hidden) = SMOLLM2_MATMULS
    w32 = [random_q4_weight(n, k, gen) for n, k in layers] + [random_q8_weight(vocab, hidden, gen)]
    chosen = [decode_panels(w) for w in w32[:-1]] + [lm_head_panels(w32[-1])]
    weights = [w.bfloat16() for w in w32]
    packed = [pack_weight(w, d) for w, d in zip(weights, chosen, strict=True)]
    assert all(isinstance(p, BF16Packed) for p in packed), "oneDNN packs bf16 weights here"
    reordered = [onednn_packed(w) for w in weights]  # the baseline even where AMX stands in for prompt rows
    panels = [q4_bf16.pack(w) for w in w32[:-1]] + [q4_bf16.pack_q8(w32[-1])]
    del w32
    xs = {k: torch.randn(tokens, k, generator=gen).bfloat16() for k in {k for _, k in SMOLLM2_MATMULS}}
    every = GeneratedRows(tokens, tokens, None)
    step_buffers = [torch.empty(tokens, w.shape[0], dtype=torch.bfloat16) for w in weights[:-1]]
    threads = torch.get_num_threads()

    def dispatched() -> list[torch.Tensor]:
        layers = zip(weights[:-1], packed[:-1], step_buffers, strict=True)
        outs = [decode_linear(xs[w.shape[1]], w, None, p, out, threads) for w, p, out in layers]
        return [*outs, dense(xs[hidden], weights[-1], None, packed[-1], every)]

    label = f"dispatched ({sum(d is not None for d in chosen)}/{len(chosen)} kernel)"
    runs = {
        label: dispatched,
        "native (in place)": lambda: [
            q4_bf16.linear(lib, xs[w.shape[1]], p) for w, p in zip(weights, panels, strict=True) if p is not None
        ],
        "oneDNN (reordered)": lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p.onednn, None, "none", [], "")
            for w, p in zip(weights, reordered, strict=True)
            if p is not None and p.onednn is not None
        ],
    }
    nbytes = sum(w.numel() * 2 for w in weights)
    rows = []
    for impl, ms in time_all(runs, torch.device("cpu"), min_s).items():
        shape = f"smollm2 bf16 step of {tokens} generated"
        rows.append(Row("linear", shape, impl, ms, nbytes / ms / 1e6, None, tokens / ms * 1e3))
    return rows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def print_table(rows: list[Row]) -> None:
    print(f"{'bench':8} {'shape':40} {'impl':24} {'ms':>9} {'GB/s|TFLOPS':>11} {'%peak':>6} {'tok/s':>11}")
    for r in rows:
        rate = r.gbps if r.gbps is not None else r.tflops
        gb = f"{rate:11.1f}" if rate is not None else f"{'-':>11}"
        fr = f"{100 * r.frac_peak:5.1f}%" if r.frac_peak is not None else f"{'-':>6}"
        tk = f"{r.tokens_per_s:11.0f}" if r.tokens_per_s is not None else f"{'-':>11}"
        print(f"{r.bench:8} {r.shape:40} {r.impl:24} {r.ms:9.3f} {gb} {fr} {tk}")


# What a dispatch chooses among: the native kernel or the torch path (CPU attention), oneDNN on reordered weights
# (CPU linear rows), the Triton kernel at its default tile or the torch path (GPU prefill).
ALTERNATIVES = ("native (in place)", "torch path", "oneDNN (reordered)", "triton (default tile)")


def dispatch_check(rows: list[Row]) -> list[dict]:
    """Per shape: the dispatched time beside the best of the `ALTERNATIVES` it chooses among."""
    out = []
    for shape in dict.fromkeys(r.shape for r in rows if r.impl.startswith("dispatched")):
        by = {r.impl: r.ms for r in rows if r.shape == shape}
        disp = next(ms for impl, ms in by.items() if impl.startswith("dispatched"))
        alts = {impl: by[impl] for impl in ALTERNATIVES if impl in by}
        if not alts:  # e.g. a GPU decode: Triton is all it dispatches to
            continue
        best = min(alts, key=alts.get)
        out.append({"shape": shape, "dispatched_ms": disp, "best": best, "best_ms": alts[best],
                    "ratio": disp / alts[best]})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="shorter timing loops and smaller CPU shapes")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    min_s = 0.2 if args.quick else 1.0
    peak, peak_src = peak_gbps(device) if cuda else (None, "n/a (CPU)")
    if cuda:
        shapes = [
            Shape("llama8b b64x2k", 64, 2048, 32, 8, 128),
            Shape("smollm2 b64x2k", 64, 2048, 9, 3, 64),
            Shape("llama8b b4x32k", 4, 32768, 32, 8, 128),
            Shape("smollm2 b8x4k", 8, 4096, 9, 3, 64),
        ]
        dtypes = [torch.bfloat16]
    else:
        ctx = 512 if args.quick else 2048
        shapes = [
            Shape(f"smollm2 b8x{ctx}", 8, ctx, 9, 3, 64),
            Shape("smollm2 b32x512 cold", 32, 512, 9, 3, 64, layers=30),
        ]
        dtypes = [torch.float32, torch.bfloat16]
    lib = None if cuda else native.load()  # the C kernels serve the CPU only
    cpu = {"model": host.cpu_info()[0], "flags": host.vector_flags(),
           "kernel_path": lib.vector_path if lib is not None else "not built"}  # fmt: skip
    what = torch.cuda.get_device_name(device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    peak_txt = f"{peak_src} = {peak:.0f} GB/s" if peak else peak_src
    print(
        f"device: {device} ({what}); backend: {ucm_kernels.select_backend(device).value}; peak: {peak_txt}", flush=True
    )
    print(f"cpu: {cpu['model']}; flags: {' '.join(cpu['flags']) or '-'}; native kernel path: {cpu['kernel_path']}")
    rows: list[Row] = []
    for dtype in dtypes:
        for s in shapes:
            rows += bench_decode(s, dtype, device, peak, min_s)
            if not cuda and s.layers == 1:
                rows += bench_prefill_cpu(s, dtype, min_s)
        if cuda:
            for s in (Shape("llama8b 8k", 1, 8192, 32, 8, 128), Shape("smollm2 4k", 1, 4096, 9, 3, 64)):
                rows += bench_prefill_gpu(s, dtype, device, min_s)
        rows += bench_blocks(shapes[0], 4096 if cuda else 256, dtype, device, peak, min_s)
    if not cuda:
        mem = read_gbps()
        print(f"memory read: {mem:.1f} GB/s (256 MB sum); a linear step's floor: {0.538 / mem * 1000:.1f} ms")
        rows += bench_linear_cpu([1, 8, 32] if args.quick else [1, 8, 32, 128, 512], min_s)
        rows += bench_linear_bf16(min_s)
    print_table(rows)
    check = dispatch_check(rows)
    if check:
        print(f"\n{'shape':40} {'dispatched ms':>13} {'best alternative':>28} {'ratio':>6}")
        for c in check:
            best = f"{c['best']} {c['best_ms']:.3f}"
            print(f"{c['shape']:40} {c['dispatched_ms']:13.3f} {best:>28} {c['ratio']:6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "cpu": cpu, "threads": torch.get_num_threads(),
                                         "peak_source": peak_src, "peak_gbps": peak, "rows": [asdict(r) for r in rows],
                                         "dispatch_check": check}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
