"""Fixtures shared by the kernel tests (the repository's conftest builds `native_lib`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def native_mode(monkeypatch):
    """The default dispatch: native kernels where they apply (no UCM_CPU_ATTENTION=torch from the environment)."""
    monkeypatch.delenv("UCM_CPU_ATTENTION", raising=False)
