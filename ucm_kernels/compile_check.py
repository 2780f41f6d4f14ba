"""Ahead-of-time compile every Triton kernel for a CUDA arch, no GPU needed (catches what the interpreter cannot:
type errors in the compiled path, bf16 tl.dot lowering, constexpr branches).

    python -m ucm_kernels.compile_check [--arch 90] [--arch 80]

Must run with TRITON_INTERPRET unset (the interpreter replaces @triton.jit functions).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: str  # "module:function"
    types: tuple[str, ...]  # triton types of the non-constexpr arguments, in order
    constexprs: dict


def variants() -> list[Variant]:
    out: list[Variant] = []
    i32, f32 = "i32", "fp32"
    for dt in ("*bf16", "*fp16", "*fp32"):
        for group, head_dim, splits in ((1, 64, 1), (3, 64, 4), (8, 128, 1), (4, 128, 8)):
            out.append(
                Variant(
                    f"decode {dt[1:]} g{group} d{head_dim} s{splits}",
                    "ucm_kernels.triton_decode_attention:_decode_kernel",
                    (dt, dt, dt, "*i32", "*i32", dt, "*fp32", "*fp32", f32) + (i32,) * 9,
                    dict(
                        GROUP=group,
                        NUM_SPLITS=splits,
                        HEAD_DIM=head_dim,
                        BLOCK_G=16,
                        BLOCK_D=head_dim,
                        BLOCK_N=32,
                        DOT_F32=dt == "*fp32",
                        DOT_PRECISION="ieee",
                    ),
                )
            )
        for block_n in (64, 128):  # the larger tiles benchmarks/kernels.py sweeps
            out.append(
                Variant(
                    f"decode {dt[1:]} g4 d128 s1 bn{block_n}",
                    "ucm_kernels.triton_decode_attention:_decode_kernel",
                    (dt, dt, dt, "*i32", "*i32", dt, "*fp32", "*fp32", f32) + (i32,) * 9,
                    dict(
                        GROUP=4,
                        NUM_SPLITS=1,
                        HEAD_DIM=128,
                        BLOCK_G=16,
                        BLOCK_D=128,
                        BLOCK_N=block_n,
                        DOT_F32=dt == "*fp32",
                        DOT_PRECISION="ieee",
                    ),
                )
            )
        out.append(
            Variant(
                f"merge {dt[1:]}",
                "ucm_kernels.triton_decode_attention:_merge_splits_kernel",
                ("*fp32", "*fp32", dt, i32, i32),
                dict(NUM_SPLITS=8, HEAD_DIM=128, BLOCK_S=8, BLOCK_D=128),
            )
        )
        for group, head_dim in ((1, 64), (3, 64), (4, 128)):
            out.append(
                Variant(
                    f"prefill {dt[1:]} g{group} d{head_dim}",
                    "ucm_kernels.triton_prefill_attention:_prefill_kernel",
                    (dt, dt, dt, "*i32", "*i32", "*i32", dt, f32) + (i32,) * 9,
                    dict(
                        GROUP=group,
                        HEAD_DIM=head_dim,
                        BLOCK_M=32,
                        BLOCK_N=32,
                        BLOCK_D=head_dim,
                        DOT_F32=dt == "*fp32",
                        DOT_PRECISION="ieee",
                    ),
                )
            )
        out.append(
            Variant(
                f"write_kv {dt[1:]}",
                "ucm_kernels.triton_write_kv:_write_kv_kernel",
                (dt, dt, dt, dt, "*i64") + (i32,) * 8,
                dict(NUM_HEADS=3, HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64),
            )
        )
        for to_staging in (True, False):
            out.append(
                Variant(
                    f"block_transfer {dt[1:]} to_staging={to_staging}",
                    "ucm_kernels.triton_block_transfer:_block_transfer_kernel",
                    (dt, dt, "*i64", i32),
                    dict(BLOCK_ELEMS=16 * 8 * 128, CHUNK=1024, TO_STAGING=to_staging),
                )
            )
        out.append(
            Variant(
                f"block_copy {dt[1:]}",
                "ucm_kernels.triton_block_copy:_block_copy_kernel",
                (dt, dt, "*i64", "*i64", i32),
                dict(BLOCK_ELEMS=16 * 3 * 64, CHUNK=1024),
            )
        )
    return out


def compile_variant(v: Variant, arch: int):
    """Compile one variant for sm_<arch>; returns triton's CompiledKernel (asm["ptx"] etc.)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, func = v.kernel.split(":")
    fn = getattr(importlib.import_module(module), func)
    types = iter(v.types)
    signature = {n: "constexpr" if n in v.constexprs else next(types) for n in fn.arg_names}
    assert next(types, None) is None, f"{v.name}: more types than arguments"
    constexprs = {(fn.arg_names.index(k),): val for k, val in v.constexprs.items()}
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, action="append", help="SM version, e.g. 80 or 90 (repeatable; default 90)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], action="append", help="only these (default all)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_check: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    failed = 0
    for arch in args.arch or [90]:
        for v in variants():
            if args.dtype and not any(f" {d}" in v.name for d in args.dtype):
                continue
            try:
                kernel = compile_variant(v, arch)
                print(f"ok    sm_{arch} {v.name} (shared {kernel.metadata.shared} B)", flush=True)
            except Exception as exc:  # report every failing variant, not just the first
                failed += 1
                print(f"FAIL  sm_{arch} {v.name}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
