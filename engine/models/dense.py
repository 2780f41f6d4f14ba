"""Linear layers whose weight is pre-packed for oneDNN on CPU, where the plain call re-lays it out every time.

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which it reorders into its blocked
format on every call; at decode batch sizes that reorder is a large part of the matmul. Packing once at load
time gives bit-identical results and, measured on this project's AVX-512-BF16 dev machine (1 thread),
25–45% faster matmuls at 1–32 rows and 3–8% at 512–2048 rows (`python -m benchmarks.kernels` has no row for
this; a whole run's engine CPU time, 29.9 -> 28.0 s: docs/history/benchmarks.json, "Engine throughput").

fp32 on CPU: a decode step's few rows go through a panel-packed copy of the weight (ucm_kernels/cpu/skinny_gemm.c),
which reads it once per call where the BLAS also repacks it: 2.4x faster matmuls at 8 rows on a 2-core AVX2 EPYC.
Up to how many rows is measured per weight shape on the machine (ucm_kernels/cpu/skinny_gemm.py); more rows, and
any machine where the kernel never wins or the native build is missing, keep `F.linear`. A weight that is exactly
4-bit (the embedded model's layers: its GGUF is Q4_1) is packed as 4-bit panels instead (ucm_kernels/cpu/q4_panels.py):
the same results bit for bit from a sixth of the memory reads, and a sixth of the extra memory; one that is exactly
bf16 (a bf16 checkpoint served in fp32, on a CPU without bf16 arithmetic) as bf16 panels
(ucm_kernels/cpu/bf16_panels.py): the same bits from half the reads. Past those row counts (prefill chunks; on a CPU
where oneDNN beats the kernel at few rows, decode steps too), a weight whose shape ran faster through oneDNN than
through `F.linear` here also keeps a oneDNN-reordered copy (ucm_kernels/cpu/onednn_linear.py; a [3072 x 576] matmul of
1024 rows: 106 -> 134 GFLOPS on the same EPYC), used for the row classes where it won (prefill-sized calls, and each
few-row class apart). lm_head too: on a 2-core AMD EPYC with AVX-512, where the kernel loses to oneDNN from a few rows
on, its logits of 8 rows went through F.linear (MKL) at 2.7x oneDNN's time.

Packed copies add to the weights' memory, except where a layer weight's copies take every call between them
(`takes_every_call`: always for bf16, for fp32 where oneDNN took every row class the panels leave): then no call
reads the plain weight and the model frees it (`release_if_unread`; onednn_linear.prefill_near_tie keeps a near tie
from holding both). Llama-1B on the 2-core Xeon with AMX (2 GiB of KV cache), resident: bf16 6.57 -> 4.66 GB; fp32 as
an AVX2-only host 12.7 -> 9.2 GB, every layer weight freed.

bf16 on AVX-512 BF16, a weight that is exactly Q4_1 (the embedded model's layers; the loader finds the 4-bit form
while the model is still fp32): a step's generated-token rows go through ucm_kernels/cpu/q4_bf16.c, which reads a
quarter of oneDNN's bytes, and its prompt rows through oneDNN, by the row's class rather than the call's row count,
so that a row's bits never depend on how its step was made up (engine/generated_rows.py says why). Per weight shape
only where the kernel beat oneDNN on the machine (ucm_kernels/cpu/q4_bf16.py). The lm_head where it is exactly Q8_0 (the
embedded model's tied embedding) takes its 8-bit twin for every sampled row, a prompt's last row too
(`LlamaForCausalLM.compute_logits` says why). Any bf16 weight, without AMX, likewise through bf16 panels where they
beat oneDNN (`decode_panels`): its generated rows read the weight at ~1.4x oneDNN's rate on a 2-core Zen 4, at the
cost of a second copy of the weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import current_forward_context
from engine.generated_rows import GeneratedRows
from ucm_kernels.api import silu_and_mul
from ucm_kernels.cpu import onednn_linear, q4_bf16
from ucm_kernels.cpu.amx_gemm import AmxWeight, amx_weight
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.onednn_linear import OnednnWeight
from ucm_kernels.cpu.q4_bf16 import DecodePanelsOf
from ucm_kernels.cpu.skinny_gemm import PanelWeight, panel_weight

log = logging.getLogger(__name__)


def packing_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@dataclass(frozen=True)
class F32Packed:
    """An fp32 weight's packed copies on CPU: skinny-kernel panels for few rows, oneDNN's layout for many."""

    panels: PanelWeight | None
    onednn: OnednnWeight | None


@dataclass(frozen=True)
class DecodePanels:
    """A Q4_1 or Q8_0 weight's quantized panels for generated rows, and the library that runs them."""

    lib: NativeLib
    panels: DecodePanelsOf


@dataclass(frozen=True)
class BF16Packed:
    """A bf16 weight on CPU: oneDNN's layout for prompt rows; quantized panels for generated rows where the weight is
    Q4_1 (the layers) or Q8_0 (the lm_head) and the kernel won here."""

    onednn: torch.Tensor | None
    decode: DecodePanels | None
    # Where oneDNN gives a row other bits in calls of other sizes (AMX): every row that is not a quantized-panel
    # generated row goes through the row-invariant AMX kernel instead (ucm_kernels/cpu/amx_gemm.py), and no oneDNN copy
    # is made (it would double the weight memory and a cached load's packing time for nothing).
    amx: AmxWeight | None = None

    def __post_init__(self) -> None:
        assert (self.onednn is None) != (self.amx is None), "exactly one copy for prompt rows: oneDNN's or AMX's"


Packed = BF16Packed | F32Packed | None  # bf16 copies, fp32 copies, or nothing


def decode_panels(weight: torch.Tensor) -> DecodePanels | None:
    """For a bf16 model: the 4-bit decode panels of `weight` (fp32, before the cast) where it is exactly Q4_1 and the
    kernel beats oneDNN at decode rows on this machine; the bf16 panels of a bf16 `weight` where that kernel beats
    oneDNN (never where the AMX kernel runs it); else None."""
    from ucm_kernels.cpu.native import load

    lib = load()
    n, k = weight.shape
    if lib is None or weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16:
        if not q4_bf16.kernel_wins(lib, k, n, kind=q4_bf16.DecodeKind.BF16):
            return None
        found: q4_bf16.DecodePanelsOf | None = q4_bf16.pack_bf16(weight)
    elif weight.dtype == torch.float32 and q4_bf16.kernel_wins(lib, k, n):
        found = q4_bf16.pack(weight)
    else:
        return None
    return DecodePanels(lib, found) if found is not None else None


def lm_head_panels(weight: torch.Tensor) -> DecodePanels | None:
    """For a bf16 model: the Q8_0 panels of its lm_head (fp32, before the cast) where it is exactly Q8_0 (the
    embedded model's tied embedding) and the kernel beats oneDNN at decode rows on this machine; a bf16 lm_head's
    bf16 panels as `decode_panels` chooses them; else None."""
    from ucm_kernels.cpu.native import load

    if weight.dtype == torch.bfloat16:
        return decode_panels(weight)
    lib = load()
    n, k = weight.shape
    if lib is None or weight.dtype != torch.float32 or not q4_bf16.kernel_wins(lib, k, n, kind=q4_bf16.DecodeKind.Q8):
        return None
    panels = q4_bf16.pack_q8(weight)
    return DecodePanels(lib, panels) if panels is not None else None


def decode_kernel_available() -> bool:
    """Whether a bf16 model here may take 4-bit decode panels (then the loader keeps fp32 until it found them)."""
    from ucm_kernels.cpu.native import load

    lib = load()
    return lib is not None and lib.has_q4_bf16 and packing_supported(torch.empty(1, 1, dtype=torch.bfloat16))


LayerCalls = Mapping[tuple[int, int], onednn_linear.OnednnCalls]  # a layer's fp32 weight shape -> its oneDNN calls


def pack_weight(
    weight: torch.Tensor, decode: DecodePanels | None = None, gate_up: bool = False, layer: LayerCalls | None = None
) -> Packed:
    """The packed copies of `weight` [out, in] for this machine, or None where none applies (F.linear).
    `decode`: its quantized panels for generated rows (bf16 only; `decode_panels` or `lm_head_panels` made them from
    the fp32 weight). gate_up: a SwiGLU gate_up weight, which `dense_silu_and_mul` takes. layer: its layer's
    choice of oneDNN calls (`f32_layer_choice`; fp32 only), else the weight's own."""
    if _f32_cpu(weight):
        return _f32_packed(weight, None if layer is None else layer.get((weight.shape[0], weight.shape[1])))
    if not packing_supported(weight):
        return None
    assert decode is None or (decode.panels.n, decode.panels.k) == tuple(weight.shape), "panels of another weight"
    amx = amx_weight(weight.detach(), paired=gate_up)
    return BF16Packed(None, decode, amx) if amx is not None else onednn_packed(weight, decode)


def onednn_packed(weight: torch.Tensor, decode: DecodePanels | None = None) -> BF16Packed | None:
    """A bf16 weight's oneDNN copy for prompt rows, whether or not this machine would take the AMX kernel instead
    (`pack_weight` chooses; tests and benchmarks compare the two); None where torch lacks the op."""
    try:
        # The batch-size hint only picks among equivalent blocked layouts; measured flat from 1 to 2048 rows.
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError as e:  # a torch build without this private op: the plain path is still correct
        log.warning("oneDNN weight packing unavailable (%s); using plain linear layers", e)
        return None
    return BF16Packed(onednn, decode)


def f32_layer_choice(weights: Sequence[torch.Tensor]) -> LayerCalls | None:
    """For a layer's weights in call order, where they are fp32 on CPU: which of their calls take oneDNN, chosen
    for the layer as a whole (`onednn_linear.layer_few_rows`, `layer_many_rows`); else None."""
    from ucm_kernels.cpu.native import load

    lib = load()
    if lib is None or not all(_f32_cpu(w) for w in weights):
        return None
    shapes = [(w.shape[0], w.shape[1]) for w in weights]
    few, many = onednn_linear.layer_few_rows(lib, shapes), onednn_linear.layer_many_rows(lib, shapes)
    return {s: onednn_linear.OnednnCalls(f, m) for s, f, m in zip(shapes, few, many, strict=True)}


def _f32_cpu(weight: torch.Tensor) -> bool:
    """A 2-D fp32 CPU weight: what `F32Packed` copies are made for."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def _f32_packed(weight: torch.Tensor, calls: onednn_linear.OnednnCalls | None = None) -> F32Packed | None:
    from ucm_kernels.cpu.native import load

    lib = load()
    if lib is None:
        return None
    panels = panel_weight(lib, weight)
    onednn = onednn_linear.onednn_weight(lib, weight, calls, panels.max_rows if panels is not None else 0)
    return F32Packed(panels, onednn) if panels is not None or onednn is not None else None


def takes_every_call(packed: Packed) -> bool:
    """Whether `dense` runs every call on `packed`'s copies and never reads the plain weight beside them: a bf16
    weight's (the AMX kernel or oneDNN takes every prompt row), an fp32 weight's where oneDNN took every row class the
    panels leave (on the 2-core Xeon as an AVX2-only host, Llama-1B's layers in fp32: 3.9 GB of weights that no call
    read, beside 3.9 GB of oneDNN copies and 1.95 GB of bf16 panels)."""
    if isinstance(packed, BF16Packed):
        return True
    if not isinstance(packed, F32Packed) or packed.onednn is None:
        return False
    panel_rows = packed.panels.max_rows if packed.panels is not None else 0
    # A row count for each class past the panels' rows (every count in a class takes its path), then one past them all
    past_panels = [c for c in onednn_linear.FEW_ROWS if c > panel_rows] + [onednn_linear.FEW_ROWS[-1] + 1]
    return all(packed.onednn.takes(rows) for rows in past_panels)


def release_if_unread(module: nn.Module, name: str, packed: Packed) -> None:
    """Free `module`'s weight `name` where `packed` takes every call (`takes_every_call`): the parameter becomes None,
    so a read that should not happen fails at once (a meta tensor would not: matmuls with one return uninitialised
    CPU tensors, and its data pointer is 0). A weight something else reads (a tied embedding) must not be named."""
    assert isinstance(getattr(module, name), nn.Parameter), f"{name} is a parameter of {type(module).__name__}"
    if takes_every_call(packed):
        setattr(module, name, None)


def dense(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    packed: Packed,
    rows: GeneratedRows | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, through the packed copy that suits x's rows when there is one (fp32: by their count;
    bf16: by each row's class, generated or prompt: `rows`, else the forward context's)."""
    if packed is None:
        assert weight is not None, "a freed weight has packed copies"
        return F.linear(x, weight, bias)
    if isinstance(packed, F32Packed):
        if x.dim() != 2:  # rows counted the way `takes_every_call` counts them
            return dense(x.reshape(-1, x.shape[-1]), weight, bias, packed, rows).view(*x.shape[:-1], -1)
        if packed.panels is not None and x.shape[0] <= packed.panels.max_rows:
            return packed.panels.linear(x, bias)
        if packed.onednn is not None and packed.onednn.takes(x.numel() // x.shape[-1]):
            return onednn_linear.linear(x, packed.onednn.reordered, bias)
        assert weight is not None, "a weight is freed only where its copies take every call (release_if_unread)"
        return F.linear(x, weight, bias)
    return _bf16_by_class(x, packed, rows, lambda y: add_bias(y, bias), lambda p: _bf16(p, packed, bias))


def dense_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    packed: Packed,
    rows: GeneratedRows | None = None,
) -> torch.Tensor:
    """silu_and_mul(dense(x, weight, bias, packed, rows)) for a gate_up weight packed with gate_up=True, bit for bit.
    Rows that take the AMX kernel get the SiLU in its epilogue: on a 2048-token prompt that spares writing and
    reading back the [T, 2I] product (SmolLM2: 12 MB a layer), and the separate pass."""
    if not isinstance(packed, BF16Packed) or packed.amx is None or bias is not None:
        return silu_and_mul(dense(x, weight, bias, packed, rows))
    amx = packed.amx
    return _bf16_by_class(x, packed, rows, silu_and_mul, amx.silu_and_mul)


def _bf16_by_class(
    x: torch.Tensor,
    packed: BF16Packed,
    rows: GeneratedRows | None,
    after_panels: Callable[[torch.Tensor], torch.Tensor],
    prompt_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each row of x through its class's path: a generated row through the quantized panels where the weight has
    them (then `after_panels`: a bias, an activation), every other row through `prompt_fn`. `rows`: the rows' classes,
    else the forward context's."""
    decode = packed.decode
    if rows is None and decode is not None:
        context = current_forward_context()
        rows = context.generated_rows if context is not None else None
    if decode is None or rows is None or x.dim() != 2 or x.shape[0] != rows.total:
        return prompt_fn(x)
    return rows.apply(x, lambda g: after_panels(q4_bf16.linear(decode.lib, g, decode.panels)), prompt_fn)


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y + bias after a kernel without a bias epilogue: per element, so a row's bits still stand alone (native_decode
    and decode_layers.c add it the same way)."""
    return y.add_(bias) if bias is not None else y


def _bf16(x: torch.Tensor, packed: BF16Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """Rows that do not take quantized panels: the AMX kernel where this machine needs it, else oneDNN."""
    if packed.amx is not None:
        return add_bias(packed.amx.linear(x), bias)
    assert packed.onednn is not None, "BF16Packed holds one of the two copies"
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
