"""Count the calls into one entry point of the loaded C library (the dispatch tests of the elementwise kernels)."""

from __future__ import annotations

from ucm_kernels.cpu import native


def spy(monkeypatch, lib: native.NativeLib, name: str) -> list[int]:
    """Count calls into one entry point of the library."""
    calls: list[int] = []
    real = getattr(lib, name)

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(native, "load", lambda: _Lib(lib, name, counting))
    return calls


class _Lib:
    """The loaded library with one entry point wrapped (the real one is a frozen dataclass)."""

    def __init__(self, lib: native.NativeLib, name: str, fn) -> None:
        self._lib, self._name, self._fn = lib, name, fn

    def __getattr__(self, attr: str):
        return self._fn if attr == self._name else getattr(self._lib, attr)
