"""A decode step's forward on CPU with the per-op Python taken out: the same native kernels, called directly.

A decode step of 8 rows on SmolLM2 runs ~290 us of kernels a layer, and the generic forward added ~100 us a layer
around them (module calls, `ucm_kernels.api`'s checks and dispatch per call, the matmuls' row routing, tensor views and
allocations): 2.9 of 15.3 ms a step on the 2-core Zen 5 EPYC. Here a step decides once what the generic path
decides on every call (which kernels run, the threads, the metadata as int32), allocates the activations once for
all layers, and calls each kernel's C entry point as its Python wrapper in ucm_kernels/cpu/ would, in the order
`DecoderLayer.forward` does; errors come from those wrappers' own messages. Every row gets the generic path's bits
(tests/engine/test_native_decode.py).

Where every matmul of every layer is one of our kernels (the embedded model's 4-bit layers: q4_bf16.c in bf16, as are
a bf16 checkpoint's bf16 panels without AMX; the
skinny GEMM's panels in fp32 up to their calibrated rows, a bf16 model's AMX tiles where AMX replaces oneDNN), the
layer loop itself runs in C (ucm_kernels/cpu/
decode_layers.c: the same entry points in the same order, one call a step): from Python its ~330 calls a step cost
~4 ms of one thread's time on the 2-core Xeon with AMX while the other thread waited, and a decode step of 8 rows
went from 27-31 to 22-25 ms. Other steps run the same calls from the Python loop below.

It takes only the steps where that equality is plain to keep: every row a generated token (a decode; a one-token
prompt chunk is a prompt row and goes generic), no connector hooks bound, and the CPU path running its native
kernels for the step's ops (`ucm_kernels.api.native_ops_lib`, `native_decode_lib`). Anything else runs the generic
forward. A matmul without such a kernel for generated rows (oneDNN, fp32's oneDNN copies, a bias beside fp32 panels)
goes through `dense` as the generic path does; a bias after a bf16 kernel (Qwen2's qkv) is added after it, in C too.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.attention import current_forward_context
from engine.models.dense import BF16Packed, F32Packed, Packed, add_bias, dense, dense_silu_and_mul
from ucm_kernels.api import native_decode_lib, native_ops_lib
from ucm_kernels.cpu import amx_gemm, decode_layers, elementwise, q4_bf16
from ucm_kernels.cpu import write_kv as native_write
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.paged_attention import DTYPE_CODES, attention_error
from ucm_kernels.cpu.q4_bf16 import BF16Panels, Q4BF16Panels

if TYPE_CHECKING:
    from engine.model_config import ModelConfig
    from engine.models.decoder_layer import DecoderLayer
    from engine.models.rmsnorm import RMSNorm


class DecodedModel(Protocol):
    """What this path reads of the model beside its layers (`LlamaForCausalLM` is one)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def embed_tokens(self) -> torch.Tensor: ...
    @property
    def norm(self) -> RMSNorm: ...


ANY_ROWS = 1 << 30  # a kernel that takes a step of any row count (q4_bf16 loops over its rows)


class DecodeAttention:
    """A decode step's attention, one call a layer: the native kernel's entry point over the step's metadata,
    decided and converted once (what `ucm_kernels.decode_attention` would check and convert on every call)."""

    def __init__(self, lib: NativeLib, seq_lens: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor):
        self.lib = lib
        self.seq_lens = seq_lens.to(torch.int32).contiguous()
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.num_blocks, self.block_size, self.num_kv_heads = k_cache.shape[:3]
        self.dtype_code = DTYPE_CODES[k_cache.dtype]
        self._err_seq, self._skipped = ctypes.c_int32(-1), ctypes.c_int32(0)
        self._err_ref, self._skipped_ref = ctypes.byref(self._err_seq), ctypes.byref(self._skipped)

    def run(
        self, q_ptr: int, q_row_stride: int, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
        scale: float, threads: int,
    ) -> None:  # fmt: skip
        """One layer: the step's rows' queries (row r's heads contiguous at q_ptr + r * q_row_stride elements) over
        this layer's paged caches, into out [rows, Hq, D]."""
        rows, hq, d = out.shape
        tables = self.block_tables
        # prompt_queries None: this path takes only steps whose rows are all generated tokens (`NativeDecode.plan`).
        rc = self.lib.paged_attention(
            q_ptr, q_row_stride, d, k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), None,
            self.seq_lens.data_ptr(), tables.data_ptr(), tables.stride(0), tables.shape[1], self.num_blocks, rows,
            rows, hq, self.num_kv_heads, d, self.block_size, self.dtype_code, scale, 0, None, threads, self._err_ref,
            self._skipped_ref,
        )  # fmt: skip
        if rc:
            raise attention_error(rc, self._err_seq.value)


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step's layers share: the attention (and its library), the slots in the kernels' type."""

    attention: DecodeAttention
    slot_mapping: torch.Tensor  # int64


class NativeDecode:
    """The decode-step forward of one `LlamaForCausalLM` (built with its packed weights; see the module doc)."""

    def __init__(self, model: DecodedModel, layers: list[DecoderLayer]) -> None:
        self.model = model
        self.layers = layers  # model.layers, typed
        self.steps = 0  # decode steps run here (tests check that this path ran)
        self.native_steps = 0  # ... of which the layers ran in one native call (decode_layers.c)
        # Every matmul through a kernel of ours up to `native_rows` rows: the layers' loop runs in C (None: never).
        self.native_layers, self.native_rows = native_layer_operands(layers)
        self._table: tuple[object, decode_layers.NativeLayers] | None = None  # (the kv_caches it is over, it)

    @classmethod
    def build(cls, model: DecodedModel, layers: list[DecoderLayer]) -> NativeDecode | None:
        """For a CPU model whose norm weights the elementwise kernels take as they are; else None (generic)."""
        dtype = model.embed_tokens.dtype
        norms = [model.norm, *(n for layer in layers for n in (layer.input_norm, layer.post_attn_norm))]
        if model.embed_tokens.device.type != "cpu" or dtype not in elementwise.NATIVE_DTYPES or not layers:
            return None
        if any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
            return None
        return cls(model, layers)

    def plan(self, num_tokens: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodeStep | None:
        """This step's shared operands, or None when it takes the generic forward."""
        context = current_forward_context()
        if context is None or context.layer_hooks is not None:
            return None
        rows, md = context.generated_rows, context.attn_metadata
        if rows is None or rows.count != rows.total or not md.is_decode_only or md.num_seqs != num_tokens:
            return None
        config = self.model.config
        k_cache, v_cache = kv_caches[0]
        dtype = self.model.embed_tokens.dtype
        if k_cache.device.type != "cpu" or native_ops_lib() is None:
            return None
        q_like = torch.empty((1, config.num_heads, config.head_dim), dtype=dtype)
        kv_like = torch.empty((1, config.num_kv_heads, config.head_dim), dtype=dtype)
        lib = native_decode_lib(q_like, k_cache, v_cache)
        if lib is None or not native_write.supports(kv_like, kv_like, k_cache, v_cache):
            return None
        attention = DecodeAttention(lib, md.seq_lens, md.block_tables, k_cache)
        return DecodeStep(attention, md.slot_mapping.to(torch.int64).contiguous())

    def forward(
        self,
        step: DecodeStep,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """`LlamaForCausalLM.forward` after the embedding and RoPE tables, for a step `plan` accepted: each kernel's C
        entry point called as its Python wrapper calls it (ucm_kernels/cpu/), into activations the layers share."""
        model, lib, config = self.model, step.attention.lib, self.model.config
        tokens, hidden, dtype = h.shape[0], config.hidden_size, h.dtype
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.q_size, config.kv_size
        inter = self.layers[0].mlp.intermediate_size
        esize, threads = h.element_size(), torch.get_num_threads()
        norm, add_norm = elementwise.entry(lib, "rms_norm", dtype), elementwise.entry(lib, "fused_add_rms_norm", dtype)
        silu, rope = elementwise.entry(lib, "silu_and_mul", dtype), elementwise.entry(lib, "rotary_embedding", dtype)
        # The step's activations, reused layer after layer (a matmul that goes through `dense` returns its own).
        x, o_out, down_out = (torch.empty((tokens, hidden), dtype=dtype) for _ in range(3))
        qkv_out = torch.empty((tokens, q_size + 2 * kv_size), dtype=dtype)
        att = torch.empty((tokens, hq, d), dtype=dtype)
        gate_up_out = torch.empty((tokens, 2 * inter), dtype=dtype)
        act = torch.empty((tokens, inter), dtype=dtype)
        num_blocks, block_size = kv_caches[0][0].shape[:2]
        num_slots, slots, attention = num_blocks * block_size, step.slot_mapping, step.attention
        assert cos.is_contiguous() and sin.is_contiguous(), "RoPE tables as the rope kernel reads them"
        if self.native_layers is not None and tokens <= self.native_rows:
            out = torch.empty_like(x)
            pad = amx_gemm.scratch(threads, max(hidden, inter, q_size))  # alive until the call returns
            args = decode_layers.CStep(
                tokens, hidden, inter, hq, hkv, d, DTYPE_CODES[dtype], h.data_ptr(), x.data_ptr(), qkv_out.data_ptr(),
                att.data_ptr(), o_out.data_ptr(), gate_up_out.data_ptr(), act.data_ptr(), down_out.data_ptr(),
                out.data_ptr(), cos.data_ptr(), sin.data_ptr(), model.norm.weight.data_ptr(), model.norm.eps,
                slots.data_ptr(), attention.seq_lens.data_ptr(), attention.block_tables.data_ptr(), num_slots,
                attention.block_tables.stride(0), attention.block_tables.shape[1], num_blocks, block_size, threads,
                pad.data_ptr(),
            )  # fmt: skip
            self._layer_table(lib, kv_caches).run(args, slots)
            self.steps += 1
            self.native_steps += 1
            return out
        residual = h  # the residual stream, updated in place by every fused add-norm; h names each layer's output
        rp, xp = residual.data_ptr(), x.data_ptr()
        first = self.layers[0].input_norm
        norm(h.data_ptr(), first.weight.data_ptr(), xp, tokens, hidden, hidden, first.eps, threads)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i:  # the previous MLP's output joins the residual here
                pre = layer.input_norm
                add_norm(h.data_ptr(), rp, pre.weight.data_ptr(), xp, tokens, hidden, hidden, pre.eps, threads)
            attn = layer.attn
            qkv = decode_linear(x, attn.qkv_weight, attn.qkv_bias, attn.qkv_packed, qkv_out, threads)
            qkvp, stride = qkv.data_ptr(), qkv.stride(0)
            rope(qkvp, stride, tokens, hq + hkv, d, cos.data_ptr(), sin.data_ptr(), threads)  # q and k, in place
            kp = qkvp + q_size * esize
            kcp, vcp = k_cache.data_ptr(), v_cache.data_ptr()
            bad = lib.write_kv(
                kp, stride * esize, kp + kv_size * esize, stride * esize, kcp, vcp, slots.data_ptr(), tokens,
                num_slots, kv_size * esize, threads,
            )  # fmt: skip
            if bad:
                raise native_write.slot_error(slots, bad, num_slots)
            attention.run(qkvp, stride, k_cache, v_cache, att, attn.scale, threads)
            o = decode_linear(att.view(tokens, q_size), attn.o_weight, attn.o_bias, attn.o_packed, o_out, threads)
            post = layer.post_attn_norm
            add_norm(o.data_ptr(), rp, post.weight.data_ptr(), xp, tokens, hidden, hidden, post.eps, threads)
            mlp = layer.mlp
            gate_up = _decode_kernel(x, mlp.gate_up_bias, mlp.gate_up_packed, gate_up_out, threads)
            if gate_up is None:  # dense's path, the SiLU in the AMX epilogue where it takes it (as gate_up_act in C)
                a = dense_silu_and_mul(x, mlp.gate_up_weight, mlp.gate_up_bias, mlp.gate_up_packed)
            else:
                silu(gate_up.data_ptr(), act.data_ptr(), tokens, inter, threads)
                a = act
            h = decode_linear(a, mlp.down_weight, mlp.down_bias, mlp.down_packed, down_out, threads)
        out = torch.empty_like(x)
        final = model.norm
        add_norm(h.data_ptr(), rp, final.weight.data_ptr(), out.data_ptr(), tokens, hidden, hidden, final.eps, threads)
        self.steps += 1
        return out

    def _layer_table(
        self, lib: NativeLib, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> decode_layers.NativeLayers:
        """The layers over these caches in C, built on their first step (the runner keeps one list for its life)."""
        assert self.native_layers is not None, "only for a model whose layers run natively"
        table = self._table  # read once: a model shared by two engines' threads may swap it meanwhile
        if table is None or table[0] is not kv_caches or table[1].lib is not lib:
            table = self._table = (kv_caches, decode_layers.NativeLayers(lib, self.native_layers, kv_caches))
        return table[1]


def native_layer_operands(layers: list[DecoderLayer]) -> tuple[list[decode_layers.Layer] | None, int]:
    """Each layer's operands for decode_layers.c, and up to how many rows all its matmuls run there; (None, 0) where
    some matmul does not take a kernel of ours (oneDNN, F.linear) or has a bias the C loop does not add (beside
    anything but an unpaired AMX weight): those steps keep the Python loop."""
    out, rows = [], ANY_ROWS
    for layer in layers:
        attn, mlp = layer.attn, layer.mlp
        calls = [
            _native_linear(packed, bias)
            for bias, packed in (
                (attn.qkv_bias, attn.qkv_packed),
                (attn.o_bias, attn.o_packed),
                (mlp.gate_up_bias, mlp.gate_up_packed),
                (mlp.down_bias, mlp.down_packed),
            )
        ]
        found = [call for call in calls if call is not None]
        if len(found) < len(calls):
            return None, 0
        rows = min(rows, *(call_rows for _, call_rows in found))
        pre, post = layer.input_norm, layer.post_attn_norm
        linears = tuple(linear for linear, _ in found)
        out.append(decode_layers.Layer(pre.weight, pre.eps, post.weight, post.eps, linears, attn.scale))
    return (out, rows) if out else (None, 0)


def _native_linear(packed: Packed, bias: torch.Tensor | None) -> tuple[decode_layers.Linear, int] | None:
    """A matmul's operands for decode_layers.c and up to how many rows `decode_linear` sends it to that kernel. A
    bias (Qwen2's qkv) only after a kernel with a bf16 output (an unpaired AMX weight, bf16 or 4-bit panels), which
    the Python path runs as the kernel, then `add_`."""
    found = _bf16_linear(packed)
    if found is not None:
        if bias is None:
            return found, ANY_ROWS
        adds = found.format in decode_layers.BIASED_FORMATS and bias.dtype == torch.bfloat16 and bias.dim() == 1
        return (dataclasses.replace(found, bias=bias.contiguous()), ANY_ROWS) if adds else None
    if bias is not None:
        return None
    if isinstance(packed, F32Packed) and packed.panels is not None:
        pw = packed.panels
        q, scales, panel_format = pw.operands()
        linear = decode_layers.Linear(
            q, scales, pw.out_features, pw.in_features, decode_layers.SKINNY_FORMATS[panel_format]
        )
        return linear, pw.max_rows
    return None


def _bf16_linear(packed: Packed) -> decode_layers.Linear | None:
    """A bf16 weight's operands for decode_layers.c, without a bias: its quantized or bf16 panels where it has them,
    else its AMX tiles; None where oneDNN runs it."""
    fmt = decode_layers.LinearFormat
    if not isinstance(packed, BF16Packed):
        return None
    if packed.decode is not None and isinstance(packed.decode.panels, Q4BF16Panels):
        p = packed.decode.panels
        return decode_layers.Linear(p.qp, p.dm, p.n, p.k, fmt.Q4_BF16, p)
    if packed.decode is not None and isinstance(packed.decode.panels, BF16Panels):
        b = packed.decode.panels
        return decode_layers.Linear(b.wp, None, b.n, b.k, fmt.BF16_BF16, b)
    if packed.decode is None and packed.amx is not None:
        amx = packed.amx
        kind = fmt.AMX_BF16_PAIRS if amx.paired else fmt.AMX_BF16
        return decode_layers.Linear(amx.packed.data, None, amx.out_features, amx.in_features, kind)
    return None


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    packed: Packed,
    out: torch.Tensor,
    threads: int,
) -> torch.Tensor:
    """What `dense` gives a decode step's rows (all generated), into `out` where a kernel of ours runs it: bf16's
    kernel where the weight has its 4-bit or bf16 panels, fp32's skinny kernel (4-bit, 8-bit, bf16 or fp32 panels) up to its
    rows; else `dense` itself (oneDNN, the AMX kernel, a bias)."""
    y = _decode_kernel(x, bias, packed, out, threads)
    return dense(x, weight, bias, packed) if y is None else y


def _decode_kernel(
    x: torch.Tensor, bias: torch.Tensor | None, packed: Packed, out: torch.Tensor, threads: int
) -> torch.Tensor | None:
    """`decode_linear` into `out` where one of its kernels takes the rows; None where `dense` runs them."""
    if isinstance(packed, F32Packed):
        pw = packed.panels
        if pw is None or bias is not None or x.shape[0] > pw.max_rows:
            return None
        return pw.linear(x, None, out)
    decode = packed.decode if isinstance(packed, BF16Packed) else None
    if decode is not None and isinstance(decode.panels, Q4BF16Panels | BF16Panels):
        p = decode.panels
        assert x.shape[1] == p.k and out.shape == (x.shape[0], p.n), "a step buffer of the weight's shape"
        y = q4_bf16.linear_into(decode.lib, x, p, out, threads)
        return add_bias(y, bias)
    return None
