"""The 4-bit bf16 decode matmul (ucm_kernels/cpu/q4_bf16.c) and its Q8_0 twin (the lm_head's): results within bf16 rounding of a float64 reference on
exactly-Q4_1 weights, each row's bits independent of the call around it, and its dispatch in `engine.models.dense`
by row class (generated rows through the kernel, prompt rows through oneDNN) where the calibration chose it. No
timing asserts: `measure` is replaced by fixed numbers wherever a choice is tested. Needs a CPU with AVX-512 BF16
(the others skip)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import set_forward_context
from engine.generated_rows import GeneratedRows
from engine.models import dense as dense_mod
from ucm_kernels.cpu import onednn_linear, q4_bf16
from ucm_kernels.cpu.q4_bf16 import kernel_wins, linear, pack, pack_q8
from ucm_kernels.cpu.q4_panels import random_q4_weight
from ucm_kernels.cpu.q8_panels import find_q8, random_q8_weight


@pytest.fixture
def bf16_lib(native_lib):
    if not native_lib.has_q4_bf16:
        pytest.skip("this CPU has no AVX-512 BF16: the library has no 4-bit decode kernel")
    if not onednn_linear.available():
        pytest.skip("this torch build has no oneDNN")
    return native_lib


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).bfloat16(), random_q4_weight(n, k, gen)


# m: one row, a full pass of 8, two passes; n: whole panels of 16 and tails; k: one and several Q4_1 blocks
@pytest.mark.parametrize(
    ("m", "n", "k"), [(8, 960, 576), (5, 20, 64), (1, 7, 32), (13, 33, 96), (8, 64, 1536), (40, 33, 96)]
)
def test_matches_a_float64_reference(bf16_lib, m, n, k) -> None:
    x, w = _operands(m, n, k, seed=m * n + k)
    panels = pack(w)
    assert panels is not None
    got = linear(bf16_lib, x, panels)
    want = x.double() @ w.double().T
    # exact products, fp32 sums (per block, then scaled), then one bf16 rounding (2^-8 of the result)
    bound = want.abs() * 2**-8 + 4 * k * 2**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= bound).all()


def test_a_rows_bits_do_not_depend_on_the_call(bf16_lib) -> None:
    """Alone, in any position of a batch of any size, on 1 or 2 threads: the same bits (what the engine relies on).
    37 rows: several passes of either body's rows (8 on VDPBF16PS, 16 on AMX tiles); 1-8 rows: each row count's
    pass (VDPBF16PS computes 1, 2, 4 or 8 rows)."""
    x, w = _operands(37, 70, 96, seed=3)
    panels = pack(w)
    assert panels is not None
    whole = linear(bf16_lib, x, panels)
    for i in range(x.shape[0]):
        assert torch.equal(linear(bf16_lib, x[i : i + 1], panels), whole[i : i + 1])
    for m in range(2, 9):
        assert torch.equal(linear(bf16_lib, x[9 : 9 + m], panels), whole[9 : 9 + m]), f"{m} rows"
    shuffled = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    assert torch.equal(linear(bf16_lib, x[shuffled], panels), whole[shuffled])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(bf16_lib, x[3:30], panels), whole[3:30])
    finally:
        torch.set_num_threads(threads)


def test_bad_operands(bf16_lib) -> None:
    x, w = _operands(2, 16, 64, seed=0)
    panels = pack(w)
    assert panels is not None
    with pytest.raises(ValueError, match="bf16"):
        linear(bf16_lib, x.float(), panels)
    with pytest.raises(ValueError, match="64 features"):
        linear(bf16_lib, x[:, :32], panels)
    assert pack(torch.randn(16, 64)) is None, "not exactly 4-bit: no panels"
    assert pack(w[:, :40].contiguous()) is None, "K not whole Q4_1 blocks"


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """UCM_CPU_LINEAR=auto, a fresh cache dir, no size floor, and `measure` replaced by the (kernel ms, oneDNN ms)
    rounds in the returned list; the second item collects the (k, n) measured."""
    monkeypatch.setenv("UCM_CPU_LINEAR", "auto")
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    q4_bf16.forget()
    monkeypatch.setattr(q4_bf16, "MIN_PACK_BYTES", 0)
    rounds = [(1.0, 2.0), (1.0, 2.0)]
    measured: list[tuple[int, int]] = []
    monkeypatch.setattr(q4_bf16, "measure", lambda lib, k, n, kind=None: measured.append((k, n)) or list(rounds))
    yield rounds, measured
    q4_bf16.forget()


def test_the_choice_follows_the_measurement_and_is_cached(bf16_lib, forced) -> None:
    rounds, measured = forced
    assert kernel_wins(bf16_lib, 64, 48) and measured == [(64, 48)]
    q4_bf16.forget()
    assert kernel_wins(bf16_lib, 64, 48) and measured == [(64, 48)], "read back from this machine's cache file"
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]
    assert not kernel_wins(bf16_lib, 64, 40), "lost to oneDNN: not used"
    rounds[:] = [(1.0, 2.0), (2.0, 1.0)]
    assert not kernel_wins(bf16_lib, 64, 32), "rounds disagreed: oneDNN for now"
    q4_bf16.forget()
    assert not kernel_wins(bf16_lib, 64, 32) and measured.count((64, 32)) == 1, "... stored as provisional, taken"


def test_the_environment_forces_either_way(bf16_lib, forced, monkeypatch) -> None:
    _, measured = forced
    monkeypatch.setenv("UCM_CPU_LINEAR", "torch")
    assert not kernel_wins(bf16_lib, 64, 48)
    monkeypatch.setenv("UCM_CPU_LINEAR", "native")
    assert kernel_wins(bf16_lib, 64, 48) and measured == []


def test_dense_routes_rows_by_class(bf16_lib, forced) -> None:
    """Generated rows get the kernel's bits, prompt rows oneDNN's, however the step mixes them; outside a forward
    (logits) and where the kernel lost, every row goes to oneDNN."""
    rounds, _ = forced
    x, w32 = _operands(9, 400, 64, seed=5)
    w = w32.bfloat16()
    decode = dense_mod.decode_panels(w32)
    assert decode is not None
    packed = dense_mod.pack_weight(w, decode)
    assert isinstance(packed, dense_mod.BF16Packed) and packed.decode is decode
    kernel = linear(bf16_lib, x, decode.panels)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, None, "none", [], "")
    assert (kernel != onednn).any(), "the two paths must differ somewhere for the routing to show"
    meta = object()  # the matmul reads only the generated rows from the context
    for mask in (np.ones(9, bool), np.zeros(9, bool), np.array([0, 1, 1, 0, 0, 1, 0, 0, 1], bool)):
        with set_forward_context(meta, None, GeneratedRows.from_mask(mask, torch.device("cpu"))):  # type: ignore[arg-type]
            got = dense_mod.dense(x, w, None, packed)
        want = torch.where(torch.from_numpy(mask)[:, None], kernel, onednn)
        assert torch.equal(got, want), f"rows {mask.astype(int).tolist()}"
    assert torch.equal(dense_mod.dense(x, w, None, packed), onednn), "outside a forward pass: oneDNN"
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]
    assert dense_mod.decode_panels(random_q4_weight(24, 64, torch.Generator().manual_seed(1))) is None, "lost"
    assert dense_mod.decode_panels(torch.randn(24, 64)) is None, "not 4-bit"


# Q8_0 (the embedded model's tied embedding, its lm_head): m one row to two passes; n panels and tails; k blocks
@pytest.mark.parametrize(("m", "n", "k"), [(8, 1000, 576), (1, 7, 32), (13, 33, 96), (40, 50, 64)])
def test_q8_matches_a_float64_reference_and_each_rows_bits_stand_alone(bf16_lib, m, n, k) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen).bfloat16(), random_q8_weight(n, k, gen)
    panels = pack_q8(w)
    assert panels is not None
    got = linear(bf16_lib, x, panels)
    want = x.double() @ w.double().T
    bound = want.abs() * 2**-8 + 4 * k * 2**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert got.shape == (m, n) and ((got.double() - want).abs() <= bound).all()
    for i in range(m):
        assert torch.equal(linear(bf16_lib, x[i : i + 1], panels), got[i : i + 1])


def test_find_q8_takes_the_embedded_lm_head_exactly_and_nothing_else(smollm2_fp32) -> None:
    w = smollm2_fp32.model.lm_head_weight.detach()
    found = find_q8(w)
    assert found is not None, "the GGUF's token_embd is Q8_0"
    q, d = found
    back = torch.from_numpy(q.astype(np.float32).reshape(q.shape[0], -1, 32) * d[..., None]).reshape(w.shape)
    assert torch.equal(back, w)
    assert find_q8(torch.randn(16, 64)) is None, "not exactly 8-bit"
    assert find_q8(w[:16, :40].contiguous()) is None, "K not whole Q8_0 blocks"


def test_compute_logits_sends_every_sampled_row_through_the_8bit_kernel(bf16_lib, forced) -> None:
    """The embedded model in bf16: a prompt's last row and a generated one alike through the lm_head's Q8_0 panels
    (engine/models/llama.py), the same logits for a row alone or among others. The kernel is made to win the
    calibration (which way the real race goes depends on the CPU and its moment)."""
    from engine.loader import load_model

    _, measured = forced
    model = load_model("smollm2-135m", dtype=torch.bfloat16, device="cpu").model
    packed = model.lm_head_packed
    n, k = model.lm_head_weight.shape
    assert (k, n) in measured, "the lm_head's choice was measured"
    assert isinstance(packed, dense_mod.BF16Packed) and packed.decode is not None, "the kernel won: Q8_0 panels"
    h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = linear(packed.decode.lib, h, packed.decode.panels).float()
    assert torch.equal(model.compute_logits(h), want)
    assert torch.equal(model.compute_logits(h[2:3].contiguous()), want[2:3]), "a row alone"
    bf16 = dense_mod.dense(h, model.lm_head_weight, None, packed, GeneratedRows(5, 0, None)).float()
    assert not torch.equal(want, bf16), "the two paths differ somewhere, so the routing shows"


def test_dense_routes_q8_rows_by_class(bf16_lib, forced) -> None:
    """A bf16 weight with 8-bit panels: generated rows through the kernel, prompt rows through oneDNN
    (engine/models/dense.py); where the kernel lost, both through oneDNN."""
    rounds, _ = forced
    gen = torch.Generator().manual_seed(8)
    x, w32 = torch.randn(6, 64, generator=gen).bfloat16(), random_q8_weight(300, 64, gen)
    decode = dense_mod.lm_head_panels(w32)
    assert decode is not None
    packed = dense_mod.pack_weight(w32.bfloat16(), decode)
    assert isinstance(packed, dense_mod.BF16Packed)
    kernel = linear(bf16_lib, x, decode.panels)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, None, "none", [], "")
    assert (kernel != onednn).any(), "the two paths must differ somewhere for the routing to show"
    mask = np.array([1, 0, 1, 1, 0, 0], bool)
    got = dense_mod.dense(x, w32.bfloat16(), None, packed, GeneratedRows.from_mask(mask, torch.device("cpu")))
    assert torch.equal(got, torch.where(torch.from_numpy(mask)[:, None], kernel, onednn))
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]
    assert dense_mod.lm_head_panels(random_q8_weight(24, 64, gen)) is None, "lost to oneDNN"


@pytest.mark.parametrize(("n", "k"), [(960, 576), (48, 64), (40, 64)])
def test_the_choice_is_measured_against_the_path_the_rows_would_take(bf16_lib, n, k) -> None:
    """Rows that lose the kernel go where `dense` sends them: the AMX kernel where it stands in for oneDNN (an AMX
    host whose oneDNN rows vary), else oneDNN; the calibration must time that one."""
    packed = dense_mod.pack_weight(torch.randn(n, k).bfloat16())
    assert isinstance(packed, dense_mod.BF16Packed)
    assert q4_bf16._baseline_is_amx(k, n) == (packed.amx is not None)


# ---------------------------------------------------------------- plain bf16 weights (a bf16 checkpoint, no AMX)


def _bf16_operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).bfloat16(), (torch.randn(n, k, generator=gen) * 0.05).bfloat16()


# m: 1, 2, 4 and 8-row passes and two passes; n: groups of four panels, a group's tail (n / 16 not a multiple of 4)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 7, 32), (2, 20, 64), (4, 200, 96), (8, 960, 576), (13, 70, 2048)])
def test_bf16_panels_match_a_float64_reference(bf16_lib, m, n, k) -> None:
    x, w = _bf16_operands(m, n, k, seed=m + n + k)
    panels = q4_bf16.pack_bf16(w)
    assert panels is not None and panels.wp.shape == (-(-n // 16), k // 2, 16)
    got = linear(bf16_lib, x, panels)
    want = x.double() @ w.double().T
    # exact products, fp32 sums, then one bf16 rounding
    bound = want.abs() * 2**-8 + 2 * k * 2**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= bound).all()


def test_a_rows_bits_on_bf16_panels_do_not_depend_on_the_call(bf16_lib, threads) -> None:
    """Alone or in a call of any size (each row-pass width: 1, 2, 4, 8 and past 8), on 1 or 2 threads."""
    x, w = _bf16_operands(21, 200, 96, seed=9)
    panels = q4_bf16.pack_bf16(w)
    assert panels is not None
    whole = linear(bf16_lib, x, panels)
    for size in (1, 2, 3, 4, 5, 8, 9):
        for start in range(0, x.shape[0] - size + 1, 4):
            assert torch.equal(linear(bf16_lib, x[start : start + size], panels), whole[start : start + size]), size


def test_pack_bf16_takes_whole_pairs_of_bf16_only() -> None:
    w = torch.randn(20, 64).bfloat16()
    assert q4_bf16.pack_bf16(w[:, :40].contiguous()) is None, "K not a multiple of 32"
    assert q4_bf16.pack_bf16(w.float()) is None, "fp32 takes the 4-bit or the fp32 paths"


def test_bf16_panels_never_stand_beside_the_amx_kernel(bf16_lib, forced, monkeypatch) -> None:
    """Where the AMX kernel runs a bf16 weight's rows, it reads the weight near the memory's rate already: no panels
    (they would double the weight's memory), even where UCM_CPU_LINEAR=native forces the kernels."""
    _, measured = forced
    monkeypatch.setenv("UCM_CPU_LINEAR", "native")
    assert kernel_wins(bf16_lib, 64, 48, kind=q4_bf16.DecodeKind.BF16)
    monkeypatch.setattr(q4_bf16, "_baseline_is_amx", lambda k, n: True)
    assert not kernel_wins(bf16_lib, 64, 48, kind=q4_bf16.DecodeKind.BF16)
    assert kernel_wins(bf16_lib, 64, 48), "4-bit panels still stand beside it"
    assert measured == []


def test_dense_routes_bf16_rows_by_class(bf16_lib, monkeypatch) -> None:
    """A bf16 weight with bf16 panels: generated rows get the kernel's bits, prompt rows those of the weight's own
    prompt path (oneDNN; on AMX, whose presence is set aside here, the AMX kernel)."""
    monkeypatch.setenv("UCM_CPU_LINEAR", "native")
    monkeypatch.setattr(q4_bf16, "_baseline_is_amx", lambda k, n: False)
    # oneDNN adds a wide weight's sums in another order here (at 48 outputs it often adds them as the kernel does)
    x, w = _bf16_operands(9, 2048, 2048, seed=11)
    decode = dense_mod.decode_panels(w)
    assert decode is not None and isinstance(decode.panels, q4_bf16.BF16Panels)
    kernel, prompt = linear(bf16_lib, x, decode.panels), dense_mod.dense(x, w, None, dense_mod.pack_weight(w))
    assert not torch.equal(kernel, prompt), "the two paths must differ for routing to show"
    packed = dense_mod.pack_weight(w, decode)
    for mask in (np.ones(9, bool), np.zeros(9, bool), np.array([0, 1, 1, 0, 0, 1, 0, 0, 1], bool)):
        got = dense_mod.dense(x, w, None, packed, GeneratedRows.from_mask(mask, torch.device("cpu")))
        assert torch.equal(got[mask], kernel[mask]) and torch.equal(got[~mask], prompt[~mask]), mask.tolist()
