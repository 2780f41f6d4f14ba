"""Small facts about the Triton runtime that several kernels' wrappers need."""

from __future__ import annotations

import os

import torch

# fp32 operands: "ieee" keeps fp32 caches exact on GPU (the default tf32 would round to 10 mantissa bits);
# bf16/fp16 operands ignore it and take the tensor-core path.
DOT_PRECISION = "ieee"


def interpreted() -> bool:
    """True when triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1 at triton's import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should upcast tl.dot operands to fp32.

    The triton 3.9 interpreter returns garbage for tl.dot on bf16/fp16 operands, so interpreted runs (CPU CI)
    compute the dots in fp32; compiled kernels keep 16-bit operands with fp32 accumulation.
    """
    return dtype == torch.float32 or interpreted()
