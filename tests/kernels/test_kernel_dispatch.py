"""CPU attention dispatch by calibration (ucm_kernels/cpu/calibration.py): the path the calibrated plan names is the one
that runs, per shape class; the plan's cache file round-trips and is keyed by what may change the answer; the
vector path of the native kernel against the torch oracle; dtype "auto" (engine/config.py). No timing asserts:
`calibration.measure` is replaced by fixed numbers wherever a choice is tested."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

import ucm_kernels
from engine import config as engine_config
from ucm_kernels import api
from ucm_kernels.cpu import calibration, calibration_store, host, native
from ucm_kernels.cpu import paged_attention as native_attention
from ucm_kernels.cpu.calibration import Geometry, ShapeClass
from ucm_kernels.cpu.choice_threads import choice_threads
from ucm_kernels.cpu.paged_attention import paged_attention_native
from ucm_kernels.reference import decode_attention_torch, prefill_attention_torch
from ucm_kernels.testing import make_paged_case, naive_attention

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
FAST, SLOW = {"native": 1.0, "torch": 2.0}, {"native": 2.0, "torch": 1.0}


@pytest.fixture
def lib(native_lib) -> native.NativeLib:
    return native_lib


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """UCM_CPU_ATTENTION=auto with a fresh cache dir and no memoised plans; returns `force(class -> times)`,
    which makes the next calibration measure again (no memo, no stored plans) and report those times (default:
    native faster), and returns the list of classes measured from then on."""
    monkeypatch.setenv("UCM_CPU_ATTENTION", "auto")
    cache = tmp_path / "cache"
    monkeypatch.setenv("UCM_CACHE_DIR", str(cache))
    calibration.forget()
    forced: dict[ShapeClass, dict[str, float]] = {}
    measured: list[ShapeClass] = []

    def fake_measure(lib, g, shape_class):
        measured.append(shape_class)
        return [forced.get(shape_class, FAST)]

    monkeypatch.setattr(calibration, "measure", fake_measure)

    def force(times: dict[ShapeClass, dict[str, float]], keep_files: bool = False) -> list[ShapeClass]:
        calibration.forget()
        for stored in [] if keep_files else cache.glob("kernels/calibration-*.json"):
            stored.unlink()
        forced.clear()
        forced.update(times)
        measured.clear()
        return measured

    yield force
    calibration.forget()


@pytest.fixture
def spies(lib, monkeypatch):
    """Counts of calls into the native library and into each torch path the dispatcher can take."""
    calls = {"native": 0, "torch decode": 0, "torch prefill": 0, "torch prompts (beside native)": 0}

    def counting(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapper

    spy = dataclasses.replace(lib, paged_attention=counting("native", lib.paged_attention))
    monkeypatch.setattr(native, "load", lambda: spy)
    monkeypatch.setattr(
        api, "decode_attention_chunked_torch", counting("torch decode", api.decode_attention_chunked_torch)
    )
    monkeypatch.setattr(api, "prefill_attention_torch", counting("torch prefill", api.prefill_attention_torch))
    monkeypatch.setattr(
        native_attention,
        "prefill_attention_torch",
        counting("torch prompts (beside native)", native_attention.prefill_attention_torch),
    )
    return calls


def _ran(calls: dict[str, int]) -> dict[str, int]:
    ran = {k: v for k, v in calls.items() if v}
    for k in calls:
        calls[k] = 0
    return ran


def test_decode_follows_the_plan(auto, spies):
    case = make_paged_case([40, 3, 70, 0], [1] * 4, 9, 3, 64, dtype=torch.float32, seed=11)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    auto({ShapeClass.DECODE: SLOW})
    on_torch = ucm_kernels.decode_attention(*args)
    assert _ran(spies) == {"torch decode": 1}, "decode measured faster on torch must run torch"
    auto({ShapeClass.DECODE: FAST})
    on_native = ucm_kernels.decode_attention(*args)
    assert _ran(spies) == {"native": 1}, "decode measured faster native must run native"
    torch.testing.assert_close(on_native, on_torch, **TOL[torch.float32])
    torch.testing.assert_close(on_native, decode_attention_torch(*args), **TOL[torch.float32])


def test_prefill_follows_the_plan_per_class(auto, spies):
    # A mixed batch: whole prompts (20/20, 33/33), a chunk over a prefix (16 new of 50), a decode row. fp32: bf16
    # runs native for every class whatever was measured (the next test).
    mixed = make_paged_case([20, 50, 33, 9], [20, 16, 33, 1], 4, 2, 64, dtype=torch.float32, seed=3)
    prompts = make_paged_case([20, 33], [20, 33], 4, 2, 64, dtype=torch.float32, seed=4)

    def run(case):
        args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, 0.125)
        return ucm_kernels.prefill_attention(*args, case.max_query_len), prefill_attention_torch(
            *args, case.max_query_len
        )

    auto({ShapeClass.CHUNK: FAST, ShapeClass.PROMPT: FAST})
    got, ref = run(mixed)
    assert _ran(spies) == {"native": 1}, "both classes native: one kernel call, nothing on torch"
    torch.testing.assert_close(got, ref, **TOL[torch.float32])

    auto({ShapeClass.CHUNK: FAST, ShapeClass.PROMPT: SLOW})
    got, ref = run(mixed)
    assert _ran(spies) == {"native": 1, "torch prompts (beside native)": 2}, (
        "chunks native, prompts torch: the kernel skips the 2 whole prompts and torch runs each"
    )
    for i in (0, 2):
        lo, hi = int(mixed.query_start_loc[i]), int(mixed.query_start_loc[i + 1])
        assert torch.equal(got[lo:hi], ref[lo:hi]), f"whole prompt {i} must be torch's result bit for bit"
    torch.testing.assert_close(got, ref, **TOL[torch.float32])

    auto({ShapeClass.CHUNK: SLOW, ShapeClass.PROMPT: FAST})
    got, ref = run(mixed)
    assert _ran(spies) == {"torch prefill": 1}, "chunks torch: a mixed batch runs on torch whole"
    assert torch.equal(got, ref)
    got, ref = run(prompts)
    assert _ran(spies) == {"native": 1}, "a batch of whole prompts only follows the prompt class"
    torch.testing.assert_close(got, ref, **TOL[torch.float32])

    auto({ShapeClass.CHUNK: SLOW, ShapeClass.PROMPT: SLOW})
    run(mixed)
    run(prompts)
    assert _ran(spies) == {"torch prefill": 2}


def test_bf16_runs_native_for_every_class_whatever_was_measured(auto, spies):
    """A row's bits must not depend on how its prompt was split (the bf16 cache-hit oracle): torch measured faster
    for chunks and prompts still leaves every bf16 row to the kernel."""
    mixed = make_paged_case([20, 50, 33, 9], [20, 16, 33, 1], 4, 2, 64, dtype=torch.bfloat16, seed=3)
    args = (mixed.q, mixed.k_cache, mixed.v_cache, mixed.query_start_loc, mixed.seq_lens, mixed.block_tables, 0.125)
    auto({ShapeClass.CHUNK: SLOW, ShapeClass.PROMPT: SLOW})
    got = ucm_kernels.prefill_attention(*args, mixed.max_query_len)
    assert _ran(spies) == {"native": 1}, "bf16: native for chunks and prompts though torch measured faster"
    torch.testing.assert_close(got, prefill_attention_torch(*args, mixed.max_query_len), **TOL[torch.bfloat16])


def test_forced_switch_beats_the_plan(auto, spies, monkeypatch):
    case = make_paged_case([40, 3], [1, 1], 9, 3, 64, dtype=torch.float32, seed=2)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    measured = auto({ShapeClass.DECODE: SLOW})
    monkeypatch.setenv("UCM_CPU_ATTENTION", "native")
    ucm_kernels.decode_attention(*args)
    assert _ran(spies) == {"native": 1} and not measured, "a forced path neither measures nor asks the plan"
    assert ucm_kernels.calibrate_cpu_attention(torch.float32, 9, 3, 64, 16) is None
    monkeypatch.setenv("UCM_CPU_ATTENTION", "auto")
    assert ucm_kernels.calibrate_cpu_attention(torch.float16, 9, 3, 64, 16) is None, "fp16: the kernel never runs"
    planned = ucm_kernels.calibrate_cpu_attention(torch.float32, 9, 3, 64, 16)
    assert planned is not None and planned[ShapeClass.DECODE].impl == "torch"
    assert sorted(measured) == sorted(ShapeClass), "one calibration measures every class once"
    ucm_kernels.decode_attention(*args)
    ucm_kernels.decode_attention(*args)
    assert _ran(spies) == {"torch decode": 2} and len(measured) == 3, "calibrated once, not per call"


def test_cache_file_round_trip_and_key(lib, auto, tmp_path, caplog, monkeypatch):
    g = Geometry("float32", 9, 3, 64, 16)
    measured = auto({ShapeClass.CHUNK: SLOW})
    with caplog.at_level(logging.INFO, logger=calibration.__name__):
        first = calibration.plan(lib, g)
    assert len(measured) == 3
    assert any("calibrated" in r.getMessage() and "chunk torch" in r.getMessage() for r in caplog.records)
    files = list((tmp_path / "cache" / "kernels").glob("calibration-*.json"))
    assert len(files) == 1, files
    data = json.loads(files[0].read_text())
    assert data["key"] == calibration_store.calibration_key(lib, choice_threads())
    assert data["entries"][g.label()]["chunk"]["impl"] == "torch"

    measured = auto({}, keep_files=True)  # forget the memo: the next plan must come from the file
    assert calibration.plan(lib, g) == first and not measured, "the stored plan is read back, not measured"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # a process (or a step) on fewer threads than the host has takes the host's plan
        auto({}, keep_files=True)
        assert calibration.plan(lib, g) == first and not measured, "one plan per host, whatever the thread count"
    finally:
        torch.set_num_threads(threads)
    # Each part of the key invalidates: another host thread count, library, torch version or CPU names another file.
    cpus = choice_threads()
    with monkeypatch.context() as m:
        m.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus + 1)))
        calibration.plan(lib, g)
    assert len(measured) == 3, "another host thread count must measure again"
    for patch in (
        lambda: calibration.plan(dataclasses.replace(lib, path=Path("/x/ucm_kernels-other.so")), g),
        lambda: (monkeypatch.setattr(torch, "__version__", "0.0-test"), calibration.plan(lib, g)),
    ):
        measured = auto({}, keep_files=True)
        patch()
        assert len(measured) == 3, "a changed key must measure again"
    assert len(list((tmp_path / "cache" / "kernels").glob("calibration-*.json"))) == 4
    # Another geometry in the same file is its own entry; a damaged file is measured again and rewritten.
    monkeypatch.undo()
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "measure", lambda *a: [FAST])
    calibration.forget()
    calibration.plan(lib, Geometry("bfloat16", 9, 3, 64, 16))
    assert set(json.loads(files[0].read_text())["entries"]) == {g.label(), "bfloat16 9/3 heads x 64 bs16"}
    files[0].write_text("{not json")
    calibration.forget()
    assert calibration.plan(lib, g)[ShapeClass.CHUNK].impl == "native"
    assert json.loads(files[0].read_text())["entries"][g.label()]["chunk"]["impl"] == "native"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_calibration_picks_a_path_per_class(lib, monkeypatch, tmp_path, dtype):
    """The measurement itself runs (its choice is the machine's; only its shape is asserted): fp32 takes the faster
    path per class, bf16 native whatever was faster (calibration.BF16_NATIVE_WHY)."""
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path))
    calibration.forget()
    try:
        plan = calibration.plan(lib, Geometry(dtype, 4, 2, 64, 16))
    finally:
        calibration.forget()
    assert set(plan) == set(ShapeClass)
    for pick in plan.values():
        assert pick.impl in ("native", "torch") and pick.native_ms > 0 and pick.torch_ms > 0
        faster = "native" if pick.native_ms <= pick.torch_ms else "torch"
        assert pick.impl == ("native" if dtype == "bfloat16" else faster)


# ---------------------------------------------------------------- the kernel's vector path against the oracle


def test_vector_path_matches_the_build_flags(lib):
    flags = set(host.cpu_info()[1].split())
    if "avx512f" in flags:
        want = "avx512"
    elif {"avx2", "fma"} <= flags:
        want = "avx2"
    elif "asimd" in flags:
        want = "neon"
    else:
        want = "scalar"
    assert lib.vector_path == want, f"-march=native on a CPU with {sorted(flags & {'avx2', 'avx512f', 'asimd'})}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (16, 2, 128), (8, 8, 128), (14, 1, 64), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_kernel_vector_path_matches_oracle(each_build, dtype, hq, hkv, head_dim, block_size):
    """Decodes, chunks over a prefix and whole prompts in one batch, GQA up to 14 rows per kv head (several
    register blocks), head_dim 64/80/128, blocks shorter than a 16-key chunk (8) and longer (32); on this host's
    build and on the AVX2 one."""
    ctx = [1, 17, 64, 150, 40, 0, 90, 33]
    new = [1, 1, 30, 70, 40, 1, 90, 5]
    case = make_paged_case(ctx, new, hq, hkv, head_dim, block_size=block_size, dtype=dtype, seed=hq + head_dim)
    scale = head_dim**-0.5
    args = (case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, scale)
    got = paged_attention_native(each_build, case.q, *args)
    live = [i for i, n in enumerate(ctx) if n > 0]
    rows = torch.cat([torch.arange(case.query_start_loc[i], case.query_start_loc[i + 1]) for i in live])
    torch.testing.assert_close(
        got[rows], prefill_attention_torch(case.q, *args, case.max_query_len)[rows], **TOL[dtype]
    )
    dense = naive_attention(
        case.q[rows], [case.keys[i] for i in live], [case.values[i] for i in live], [new[i] for i in live], scale
    )
    torch.testing.assert_close(got[rows].double(), dense, **TOL[dtype])
    pad = int(case.query_start_loc[5])
    assert not got[pad].any(), "the padding row (seq_len 0) must be 0"


# ---------------------------------------------------------------- dtype "auto"


@pytest.fixture
def fresh_dtype(monkeypatch, tmp_path):
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path))
    engine_config.auto_cpu_dtype.cache_clear()
    yield
    engine_config.auto_cpu_dtype.cache_clear()


def _flags(monkeypatch, *flags: str) -> None:
    monkeypatch.setattr(engine_config, "cpu_flags", lambda: frozenset(flags))


def test_dtype_auto_without_native_bf16_is_fp32(fresh_dtype, monkeypatch, caplog):
    _flags(monkeypatch, "avx", "avx2", "fma")
    monkeypatch.setattr(calibration, "measure_matmul", lambda: pytest.fail("no bf16 flags: nothing to measure"))
    with caplog.at_level(logging.INFO, logger=engine_config.__name__):
        assert engine_config.resolve_dtype_name("auto", "cpu") == "float32"
        assert engine_config.resolve_dtype_name("auto", "cpu") == "float32"
    said = [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]
    assert said == ["dtype auto -> float32: CPU has no native bf16 (avx2)"], "logged once, with the reason"
    assert engine_config.resolve_dtype_name("auto", "cuda:0") == "bfloat16"
    assert engine_config.resolve_dtype_name("bfloat16", "cpu") == "bfloat16"


@pytest.mark.parametrize("bf16_ms,want", [(1.0, "bfloat16"), (3.0, "float32")])
def test_dtype_auto_with_native_bf16_follows_the_matmul(fresh_dtype, monkeypatch, caplog, tmp_path, bf16_ms, want):
    _flags(monkeypatch, "avx2", "avx512f", "avx512_bf16")
    monkeypatch.setattr(calibration, "measure_matmul", lambda: {"bfloat16": bf16_ms, "float32": 2.0})
    with caplog.at_level(logging.INFO, logger=engine_config.__name__):
        assert engine_config.resolve_dtype_name("auto", "cpu") == want
    assert any(f"dtype auto -> {want}" in r.getMessage() and "avx512_bf16" in r.getMessage() for r in caplog.records)
    # Cached per CPU: a new process (cache cleared) reads the file instead of measuring.
    engine_config.auto_cpu_dtype.cache_clear()
    monkeypatch.setattr(calibration, "measure_matmul", lambda: pytest.fail("the cached matmul timing must be used"))
    assert engine_config.resolve_dtype_name("auto", "cpu") == want
    assert len(list((tmp_path / "kernels").glob("dtype-*.json"))) == 1


def test_rounds_that_disagree_are_used_but_not_stored(lib, auto, tmp_path, monkeypatch):
    """A busy machine can flip one round: the overall fastest is used in this process, and the next process
    measures again instead of reading a choice made under load."""
    auto({})
    flipped = [FAST, {"native": 1.5, "torch": 0.5}]  # native wins round 1, torch round 2 (and overall)
    monkeypatch.setattr(calibration, "measure", lambda *a: flipped)
    g = Geometry("float32", 9, 3, 64, 16)
    picked = calibration.plan(lib, g)
    assert picked[ShapeClass.DECODE] == calibration.Pick("torch", 1.0, 0.5)
    stored = [
        calibration_store.read_sections(f, json.loads(f.read_text())["key"]).entries
        for f in (tmp_path / "cache").rglob("calibration-*.json")
    ]
    assert not any(stored), "a disputed plan must not be stored, only kept as provisional"
    assert calibration.plan(lib, g) is picked, "memoised for the process all the same"


def _stored(lib, root, measure_fn, name: str = "probe") -> tuple[str, calibration_store.Source]:
    return calibration_store.stored_or_measured(
        "linear", name, lib, 1, root, lambda v: v if isinstance(v, str) else None, measure_fn, lambda v: v
    )


def test_a_measurement_while_another_process_runs_is_stored_as_provisional(lib, tmp_path, monkeypatch):
    """Two nodes starting together, or a test's cluster beside a calibration: timings taken while another process
    holds a core say more about the sharing than the kernels, so they are stored as provisional: every later process
    takes them as they are (the same kernel, the same bits), until the file is deleted."""
    import subprocess
    import sys
    import threading

    from tests.kernels.conftest import REAL_OTHERS_MAX_CORES

    monkeypatch.setattr(calibration_store, "OTHERS_MAX_CORES", REAL_OTHERS_MAX_CORES)  # the rule under test

    hog = subprocess.Popen(
        [sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout.readline().strip() == "spinning"
        # This process idles through the "measurement" while the other one spins on a core.
        value, source = _stored(lib, tmp_path, lambda: (threading.Event().wait(0.3), ("kernel", []))[1])
    finally:
        hog.kill()
        hog.wait()
    assert value == "kernel" and source.measured and source.provisional
    assert source.under_load and "other processes took" in source.under_load[0], source
    (file,) = tmp_path.rglob("linear-*.json")
    key = json.loads(file.read_text())["key"]
    assert not calibration_store.read_sections(file, key).entries, "not stored as measured"
    assert calibration_store.read_sections(file, key).provisional == {"probe": "kernel"}
    value, source = _stored(lib, tmp_path, lambda: pytest.fail("a provisional choice is taken, not measured again"))
    assert value == "kernel" and not source.measured and source.provisional
    assert f"delete {file} to measure again" in str(source)
    file.unlink()
    value, source = _stored(lib, tmp_path, lambda: ("oneDNN", []))
    assert value == "oneDNN" and source.measured and not source.provisional, "measured again, and stored this time"
    assert _stored(lib, tmp_path, lambda: ("never", []))[0] == "oneDNN", "read back from the file"


def test_processes_measuring_under_load_all_take_the_first_ones_choice(lib, tmp_path):
    """Kernels differ in their order of operations: processes that start on a loaded host must not each run what
    their own timing picked, nor one measure again and pick otherwise while another serves the first choice (CI saw a
    served node's greedy text differ from an in-process engine's)."""
    value, source = _stored(lib, tmp_path, lambda: ("kernel", ["rounds"]))  # rounds that disagree: a loaded host
    assert value == "kernel" and source.measured and source.provisional, source
    for quiet in (False, True):  # the next processes, on a loaded host or a quiet one
        value, source = _stored(lib, tmp_path, lambda: ("oneDNN", [] if quiet else ["rounds"]))  # noqa: B023
        assert value == "kernel" and not source.measured and source.provisional, f"quiet {quiet}: the first choice"


def test_processes_measure_one_at_a_time_and_the_next_reads_the_result(lib, tmp_path, monkeypatch):
    """Two callers that miss the file together: the lock lets one measure; the other reads what it stored."""
    import threading

    measured: list[str] = []
    start = threading.Barrier(2)

    def measure() -> tuple[str, list[str]]:
        measured.append(threading.current_thread().name)
        end = time.perf_counter() + 0.3  # busy, as a real measurement: this process's own CPU time
        while time.perf_counter() < end:
            pass
        return "kernel", []

    results: dict[str, tuple[str, bool]] = {}

    def call() -> None:
        start.wait()
        value, source = _stored(lib, tmp_path, measure)
        results[threading.current_thread().name] = (value, source.measured)

    threads = [threading.Thread(target=call, name=f"node-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(measured) == 1, f"both measured at once: {measured}"
    assert sorted(results.values()) == [("kernel", False), ("kernel", True)], results


def test_other_cores_are_the_machine_busy_time_less_this_process(lib):
    clock = calibration_store.CpuClock
    assert clock(1.0, 2.0, 2.2).others_cores_since(clock(0.0, 0.0, 0.0)) == pytest.approx(0.2)
    assert clock(1.0, 2.0, 1.9).others_cores_since(clock(0.0, 0.0, 0.0)) == 0.0, "tick rounding is not load"
    assert clock(0.01, 0.0, 5.0).others_cores_since(clock(0.0, 0.0, 0.0)) is None, "too short to judge"
    assert clock(1.0, 0.0, None).others_cores_since(clock(0.0, 0.0, 0.0)) is None, "no /proc/stat"


def test_a_capped_torch_isa_names_another_cache_file(lib, monkeypatch):
    """Timings taken with oneDNN capped below the CPU (ONEDNN_MAX_CPU_ISA, an AVX2 host's view) are not read uncapped
    and the other way round."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    uncapped = calibration_store.calibration_key(lib, 2)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = calibration_store.calibration_key(lib, 2)
    assert capped["torch_isa"].endswith("oneDNN <= AVX2") and capped != uncapped
    assert calibration_store.key_file("linear", capped, None) != calibration_store.key_file("linear", uncapped, None)


def test_the_calibration_times_prompt_rows_named_as_the_engine_names_them(lib, monkeypatch):
    """The native path's prompt classes are timed with their rows named prompt rows (AttentionMetadata.prompt_queries,
    which the model runner always passes), so where AMX takes those the calibration times that body, not the
    generated rows' one; a decode batch names none."""
    seen: list[object] = []
    monkeypatch.setattr(calibration, "paged_attention_native", lambda *args: seen.append(args[8:]))
    g = Geometry("bfloat16", 9, 3, 64, 16)
    for cls in (ShapeClass.CHUNK, ShapeClass.PROMPT):
        calibration._runs(lib, g, cls)[calibration.NATIVE]()
        (prompts,) = seen.pop()
        pb = calibration.PROBLEMS[cls]
        assert torch.equal(prompts, torch.full((pb.batch,), pb.new, dtype=torch.int32)), cls
    calibration._runs(lib, g, ShapeClass.DECODE)[calibration.NATIVE]()
    assert seen.pop() == (), "a decode's rows are generated rows"
