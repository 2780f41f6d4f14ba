"""Linear layers whose weight is pre-packed for oneDNN on CPU, where the plain call re-lays it out every time.

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which it reorders into its blocked
format on every call; at decode batch sizes that reorder is a large part of the matmul. Packing once at load
time gives bit-identical results and, measured on this project's AVX-512-BF16 dev machine (1 thread),
25–45% faster matmuls at 1–32 rows and 3–8% at 512–2048 rows (`python -m benchmarks.kernels` has no row for
this; see docs/benchmarks.md). fp32 is left alone: the HF-equality tests run fp32 and its plain path is MKL.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def packing_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of `weight` [out, in], or None where packing does not apply (then use F.linear)."""
    if not packing_supported(weight):
        return None
    try:
        # The batch-size hint only picks among equivalent blocked layouts; measured flat from 1 to 2048 rows.
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError as e:  # a torch build without this private op: the plain path is still correct
        log.warning("oneDNN weight packing unavailable (%s); using plain linear layers", e)
        return None


def dense(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
