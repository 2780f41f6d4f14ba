"""Build the C kernels beside this file into one shared library on first use and load it with ctypes.

The library is cached under `<ucm-serve cache dir>/kernels/`, named by a hash of everything that changes
the machine code: the sources, the flags, the compiler's version and the CPU (`-march=native` output only runs
on a CPU with the same features). Concurrent first uses (a test starting several nodes at once) each compile
into a temporary file and `os.replace` it into place, so a reader sees either no library or a whole one.

If the compiler is missing or the build fails, one warning is logged and `load()` returns None: callers keep
the pure-torch path.

OpenMP: the library is built with -fopenmp. The torch wheel ships its own `libgomp.so.1`; ours is loaded after
torch, so the dynamic linker resolves our `libgomp.so.1` dependency to torch's copy (one OpenMP runtime and
one thread pool per process; `tests/kernels/test_kernels_native.py` checks this).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm_kernels.cache_dir import cache_dir  # stdlib-only: ucm_kernels/ stays clear of engine/

# A ctypes foreign function with argtypes set; each returns an int32 status.
CFunction = Callable[..., int]

log = logging.getLogger(__name__)

# One library, one compiler run: the sources share no symbols (their helpers are static), and a single load
# keeps one build-or-fallback decision per process.
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.c",
        "elementwise.c",
        "elementwise_f32.c",
        "skinny_gemm.c",
        "q4_bf16.c",
        "amx_gemm.c",
        "decode_layers.c",
    )
)
# Included by the sources: not compiled on their own, but part of what the library hash covers.
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "bf16.h",
        "row_loop.h",
        "paged_attention_common.h",
        "paged_attention_avx512.h",
        "paged_attention_vec.h",
        "paged_attention_lanes.h",
        "paged_attention_dpbf16.h",
        "paged_attention_amx.h",
        "paged_attention_amx_rows.h",
        "paged_attention_shared.h",
        "amx_tiles.h",
        "silu_bf16.h",
        "entry_points.h",
    )
)
LIBRARY_STEM = "ucm_kernels"
# A call to an undeclared function is an error, not a warning, as GCC 14 and clang make it: a helper defined only in
# one build's #ifdef (AMX, AVX-512) would otherwise compile on another with a guessed signature.
FLAGS = (
    "-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-fopenmp", "-Werror=implicit-function-declaration",
)  # fmt: skip
LIBS = ("-lm",)


@dataclass(frozen=True)
class Recipe:
    """A shared library built from C sources beside this file, cached by a hash of what changes its machine code."""

    stem: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]  # included, not compiled alone: part of the hash
    flags: tuple[str, ...]
    libs: tuple[str, ...] = ()


KERNELS = Recipe(LIBRARY_STEM, SOURCES, HEADERS, FLAGS, LIBS)
# Not $CC: a clang there would link its own OpenMP runtime beside torch's libgomp.
COMPILER_ENV = "UCM_CC"
# Flags after FLAGS, so they win: `-march=x86-64-v3` builds the AVX2 library an AVX2-only host would get (a fleet's
# common ISA, or its paths measured and tested on an AVX-512 host). Part of the library's hash.
EXTRA_FLAGS_ENV = "UCM_CFLAGS"
DEFAULT_COMPILER = "gcc"
BUILD_TIMEOUT_S = 120

_c_int32_p = ctypes.POINTER(ctypes.c_int32)


class BuildError(RuntimeError):
    """The compiler is missing or rejected the source."""


@dataclass(frozen=True)
class NativeLib:
    """The loaded library and its entry points (argtypes set, so ctypes checks each call's arguments)."""

    path: Path
    cdll: ctypes.CDLL
    paged_attention: CFunction  # see ucm_paged_attention in paged_attention.c
    write_kv: CFunction  # ucm_write_kv
    rms_norm: CFunction  # ucm_rms_norm in elementwise.c
    fused_add_rms_norm: CFunction  # ucm_fused_add_rms_norm
    silu_and_mul: CFunction  # ucm_silu_and_mul
    rotary_embedding: CFunction  # ucm_rotary_embedding
    rms_norm_f32: CFunction  # ucm_rms_norm_f32 in elementwise_f32.c (same arguments, fp32 data)
    fused_add_rms_norm_f32: CFunction  # ucm_fused_add_rms_norm_f32
    silu_and_mul_f32: CFunction  # ucm_silu_and_mul_f32
    rotary_embedding_f32: CFunction  # ucm_rotary_embedding_f32
    pack_panels: CFunction  # ucm_pack_panels in skinny_gemm.c
    skinny_gemm: CFunction  # ucm_skinny_gemm
    skinny_gemm_q4: CFunction  # ucm_skinny_gemm_q4 (4-bit panels: ucm_kernels/cpu/q4_panels.py)
    skinny_gemm_q8: CFunction  # ucm_skinny_gemm_q8 (8-bit panels: ucm_kernels/cpu/q8_panels.py)
    pack_panels_bf16: CFunction  # ucm_pack_panels_bf16 (bf16 panels: ucm_kernels/cpu/bf16_panels.py)
    skinny_gemm_bf16: CFunction  # ucm_skinny_gemm_bf16
    q4_bf16: CFunction  # ucm_q4_bf16 in q4_bf16.c (a decode step's generated rows over 4-bit weights, AVX-512 BF16)
    q8_bf16: CFunction  # ucm_q8_bf16, its twin over Q8_0 weights (the embedded model's lm_head)
    bf16_dp: CFunction  # ucm_bf16_dp, its twin over plain bf16 weights (a bf16 checkpoint without AMX)
    has_q4_bf16: bool  # whether this build has it (-1 from every call otherwise)
    has_avx512: bool
    has_openmp: bool
    vector_path: str  # what head_dims that are multiples of 16 run: "avx512", "avx2", "neon" or "scalar"
    lanes_rows: int  # fp32 prefill rows per item of the lanes body (paged_attention_lanes.h); 0: not in this build
    bf16_lanes_rows: int  # rows per item of the bf16 bodies on AVX-512 BF16, which take every bf16 row (dpbf16.h)
    cols_products: CFunction  # ucm_cols_products: the bf16 decode body's product form (1 VDPBF16PS, 2 FMA; -1 none)
    amx_rows: CFunction  # ucm_amx_rows: whether generated bf16 rows take AMX tiles (0 off, 1 on, -1 leave -> state)
    amx_gemm: CFunction  # ucm_amx_gemm in amx_gemm.c (bf16 prompt rows on AMX, row-invariant)
    amx_layout_chunk: CFunction  # ucm_amx_layout_chunk: k blocks a chunk of its packed W's layout takes (amx_gemm.py)
    has_amx: bool  # whether this build has it and the OS lets the process use AMX (1 from every call otherwise)
    has_amx_attention: bool  # whether bf16 prompt rows given as such take AMX tiles (paged_attention_amx.h)


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        self.lib: NativeLib | None = None
        self.error: str | None = None


_state = _State()


def compiler() -> str:
    """The C compiler command: `$UCM_CC` if set, else gcc."""
    return os.environ.get(COMPILER_ENV, "").strip() or DEFAULT_COMPILER


def extra_flags() -> tuple[str, ...]:
    """`$UCM_CFLAGS`, split as a shell would."""
    return tuple(shlex.split(os.environ.get(EXTRA_FLAGS_ENV, "")))


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"C compiler {cc!r} is not usable: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"`{cc} --version` failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def library_path(cc: str, cache_root: Path, extra: tuple[str, ...] = (), recipe: Recipe = KERNELS) -> Path:
    """Where the library for these sources, compiler, flags and CPU lives (built or not)."""
    h = hashlib.sha256()
    inputs = recipe.sources + recipe.headers
    parts = [src.name.encode() for src in inputs] + [src.read_bytes() for src in inputs]
    parts += [
        " ".join(recipe.flags + extra + recipe.libs).encode(),
        cc.encode(),  # the command too: a wrapper (other flags) reports the version of the compiler it wraps
        _compiler_version(cc).encode(),
        platform.machine().encode(),
        _cpu_signature().encode(),
    ]
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return cache_root / "kernels" / f"{recipe.stem}-{h.hexdigest()[:20]}.so"


def built(recipe: Recipe, cache_root: Path, extra: tuple[str, ...] = ()) -> Path:
    """The recipe's library for this machine, compiled unless cached (BuildError if it cannot be)."""
    cc = compiler()
    path = library_path(cc, cache_root, extra, recipe)
    if not path.exists():
        # First use on this CPU / compiler / source: seconds of gcc the operator should see, not a silent stall.
        shown = " ".join((cc, *extra))
        log.info("building %s for this machine (%s, once) into %s", recipe.stem, shown, path.parent)
        t0 = time.perf_counter()
        _compile(cc, path, extra, recipe)
        log.info("%s built in %.1f s", recipe.stem, time.perf_counter() - t0)
    return path


def probe_function(
    recipe: Recipe, symbol: str, argtypes: list[type], restype: type, what: str, cache_root: Path | None = None
) -> Callable[..., Any] | None:
    """`symbol` of a small probe library (built unless cached, under the cache dir), its types set; None, with one
    warning that it could not measure `what`, where it cannot be built or loaded."""
    try:
        path = built(recipe, cache_root if cache_root is not None else cache_dir())
        fn = getattr(ctypes.CDLL(str(path)), symbol)
    except (BuildError, OSError, AttributeError) as e:
        log.warning("could not measure %s: %s", what, e)
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _compile(cc: str, target: Path, extra: tuple[str, ...], recipe: Recipe) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *recipe.flags, *extra, *(str(src) for src in recipe.sources), "-o", tmp, *recipe.libs]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"`{' '.join(cmd)}` could not run: {e}") from e
        if done.returncode != 0:
            raise BuildError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(path: Path) -> NativeLib:
    cdll = ctypes.CDLL(str(path))
    fn = cdll.ucm_paged_attention
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr,
        i64,
        i64,  # q, q token stride, q head stride (elements)
        ptr,
        ptr,
        ptr,  # k_cache, v_cache, out
        ptr,
        ptr,
        ptr,
        i64,
        i32,
        i64,  # query_start_loc (NULL: decode), seq_lens, block_tables, row stride, width, N
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,  # num_seqs, num_tokens, Hq, Hkv, head_dim, block_size
        i32,
        ctypes.c_float,
        i32,
        ptr,
        i32,  # dtype, scale, skip_whole_prompts, prompt_queries (NULL: none), num_threads
        _c_int32_p,
        _c_int32_p,  # err_seq, num_skipped (out)
    ]
    fn.restype = i32
    write = cdll.ucm_write_kv
    # key, key token stride (bytes), value, value token stride, k_cache, v_cache, slots, T, num slots, row bytes,
    # threads
    write.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    write.restype = i64
    f32 = ctypes.c_float
    elementwise = {
        # x, weight, out, rows, hidden, out's row stride, eps, num_threads
        "rms_norm": [ptr, ptr, ptr, i64, i64, i64, f32, i32],
        "fused_add_rms_norm": [ptr, ptr, ptr, ptr, i64, i64, i64, f32, i32],  # x, residual, weight, out, rows, ...
        "silu_and_mul": [ptr, ptr, i64, i64, i32],  # gate_up, out, rows, intermediate, num_threads
        "rotary_embedding": [ptr, i64, i64, i32, i32, ptr, ptr, i32],  # qk, token stride, rows, heads, head_dim, ..
    }
    ops = {}
    for name, argtypes in elementwise.items():
        for suffix in ("", "_f32"):  # the bf16 op and its fp32 twin take the same arguments
            op = getattr(cdll, f"ucm_{name}{suffix}")
            op.argtypes = argtypes
            op.restype = None
            ops[name + suffix] = op
    pack = cdll.ucm_pack_panels
    pack.argtypes = [ptr, ptr, i64, i64]  # w, packed out, N, K
    pack.restype = None
    skinny = cdll.ucm_skinny_gemm
    skinny.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i32]  # x, M, K, packed w, N, bias (or NULL), y, threads
    skinny.restype = None
    skinny_q4 = cdll.ucm_skinny_gemm_q4
    skinny_q4.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i32]  # x, M, K, q panels, d|m, N, bias, y, threads
    skinny_q4.restype = i32
    skinny_q8 = cdll.ucm_skinny_gemm_q8
    skinny_q8.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i32]  # x, M, K, q panels, d, N, bias, y, threads
    skinny_q8.restype = i32
    pack_bf16 = cdll.ucm_pack_panels_bf16
    pack_bf16.argtypes = [ptr, ptr, i64, i64]  # w, bf16 panels out, N, K
    pack_bf16.restype = i32
    skinny_bf16 = cdll.ucm_skinny_gemm_bf16
    skinny_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i32]  # x, M, K, bf16 panels, N, bias, y, threads
    skinny_bf16.restype = i32
    q4_bf16 = cdll.ucm_q4_bf16
    q4_bf16.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32]  # x, M, K, q panels, d|m, N, y, threads
    q4_bf16.restype = i32
    q8_bf16 = cdll.ucm_q8_bf16
    q8_bf16.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32]  # x, M, K, q panels, d, N, y, threads
    q8_bf16.restype = i32
    bf16_dp = cdll.ucm_bf16_dp
    bf16_dp.argtypes = [ptr, i64, i64, ptr, i64, ptr, i32]  # x, M, K, bf16 panels, N, y, threads
    bf16_dp.restype = i32
    amx = cdll.ucm_amx_gemm
    # x, M, K, x's row stride, packed W, N, y, y's row stride, pad, threads, epilogue
    amx.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, i32, i32]
    amx.restype = i32
    layout_chunk = cdll.ucm_amx_layout_chunk
    layout_chunk.argtypes, layout_chunk.restype = [i64], i64  # K -> k blocks (of 32) a chunk
    cdll.ucm_amx_available.restype = i32
    cdll.ucm_amx_attention_available.restype = i32
    cdll.ucm_q4_bf16_available.restype = i32
    cdll.ucm_has_avx512.restype = i32
    cdll.ucm_has_openmp.restype = i32
    cdll.ucm_vector_path.restype = ctypes.c_char_p
    cdll.ucm_lanes_rows.restype = i32
    cdll.ucm_bf16_lanes_rows.restype = i32
    cols_products = cdll.ucm_cols_products
    cols_products.argtypes, cols_products.restype = [i32], i32  # set (-1: leave) -> the form in force
    amx_rows = cdll.ucm_amx_rows
    amx_rows.argtypes, amx_rows.restype = [i32], i32  # set (-1: leave) -> 1 on, 0 off, -1 not in this build
    return NativeLib(
        path,
        cdll,
        fn,
        write,
        ops["rms_norm"],
        ops["fused_add_rms_norm"],
        ops["silu_and_mul"],
        ops["rotary_embedding"],
        ops["rms_norm_f32"],
        ops["fused_add_rms_norm_f32"],
        ops["silu_and_mul_f32"],
        ops["rotary_embedding_f32"],
        pack,
        skinny,
        skinny_q4,
        skinny_q8,
        pack_bf16,
        skinny_bf16,
        q4_bf16,
        q8_bf16,
        bf16_dp,
        bool(cdll.ucm_q4_bf16_available()),
        bool(cdll.ucm_has_avx512()),
        bool(cdll.ucm_has_openmp()),
        cdll.ucm_vector_path().decode(),
        int(cdll.ucm_lanes_rows()),
        int(cdll.ucm_bf16_lanes_rows()),
        cols_products,
        amx_rows,
        amx,
        layout_chunk,
        bool(cdll.ucm_amx_available()),
        bool(cdll.ucm_amx_attention_available()),
    )


def build(cache_root: Path | None = None, extra: tuple[str, ...] | None = None) -> NativeLib:
    """Compile (unless cached) and load the library, with `extra` flags (default `$UCM_CFLAGS`); raises BuildError
    when that is impossible."""
    if cache_root is None:
        cache_root = cache_dir()
    if extra is None:
        extra = extra_flags()
    path = built(KERNELS, cache_root, extra)
    try:
        return _bind(path)
    except OSError as e:
        raise BuildError(f"built {path} but could not load it: {e}") from e


def load() -> NativeLib | None:
    """The library, built on the first call in this process; None (and one logged warning) if it cannot be."""
    if _state.tried:
        return _state.lib
    with _state.lock:
        if not _state.tried:
            try:
                _state.lib = build()
            except BuildError as e:
                _state.error = str(e)
                log.warning("native CPU attention unavailable, using the torch path: %s", e)
            _state.tried = True
    return _state.lib


def load_error() -> str | None:
    """Why `load()` returned None, if it did."""
    return _state.error


def forget() -> None:
    """Drop this process's load result so the next `load()` builds or loads again (tests change $UCM_CC)."""
    with _state.lock:
        _state.tried, _state.lib, _state.error = False, None, None
