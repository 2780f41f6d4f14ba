"""Fixtures shared by the kernel tests (the repository's conftest builds `native_lib`)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def native_mode(monkeypatch):
    """The default dispatch: native kernels where they apply (no UCM_CPU_ATTENTION=torch from the environment)."""
    monkeypatch.delenv("UCM_CPU_ATTENTION", raising=False)


REAL_OTHERS_MAX_CORES = 0.25  # calibration_store's rule, for the test of the rule itself


@pytest.fixture(autouse=True)
def measurements_are_stored_whatever_else_runs(monkeypatch):
    """A measurement is stored only while no other process takes cores (calibration_store.OTHERS_MAX_CORES); these
    tests check what is measured and stored, so their outcome must not depend on what else the CI box runs meanwhile
    (a cluster test's nodes still stopping). The test of that rule sets it back (REAL_OTHERS_MAX_CORES)."""
    from ucm_kernels.cpu import calibration_store

    assert calibration_store.OTHERS_MAX_CORES == REAL_OTHERS_MAX_CORES, "the rule changed: update the test's copy"
    monkeypatch.setattr(calibration_store, "OTHERS_MAX_CORES", float("inf"))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's thread count, the kernels' (items, shared-prefix groups and partitions depend on it), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def vdpbf16_rows(native_lib):
    """The library with generated bf16 rows on the VDPBF16PS bodies (attend_dpbf16_cols, the shared-prefix groups)
    where this host would put them on AMX tiles (paged_attention_amx_rows.h): the tests of those bodies reach them on
    every CPU. The switch is restored after the module."""
    before = native_lib.amx_rows(-1)
    if before == 1:
        assert native_lib.amx_rows(0) == 0
    yield native_lib
    if before == 1:
        native_lib.amx_rows(1)
