"""The C sources compile for every x86 CPU class we serve, whatever CPU this host has: each class's preprocessor path
(scalar, AVX2, AVX-512, AVX-512 BF16 without AMX as AMD Zen 4 and 5 have it, AMX) is other code, and a host only
builds its own. A helper one class defines and another calls had broken the -march=native build of every AVX-512
BF16 CPU without AMX while the AMX host's tests passed; `gcc -fsyntax-only` per class finds that in a second each."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from ucm_kernels.cpu import native, pause_probe, peak_probe

# -march values for each class; `-mno-amx-tile` leaves Sapphire Rapids' AVX-512 BF16 without AMX tiles, the set a
# Zen 4 or Zen 5 build sees (GCC 12 knows no -march=znver4).
X86_CLASSES = {
    "x86-64 baseline (scalar)": ("-march=x86-64",),
    "AVX2 + FMA": ("-march=x86-64-v3",),
    "AVX-512 without BF16": ("-march=x86-64-v4",),
    "AVX-512 BF16 without AMX": ("-march=sapphirerapids", "-mno-amx-tile"),
    "AMX": ("-march=sapphirerapids",),
}
RECIPES = {"kernels": native.KERNELS, "peak probe": peak_probe.PROBE, "pause probe": pause_probe.PROBE}


@pytest.fixture(scope="module")
def x86_gcc() -> str:
    cc = native.compiler()
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which(cc) is None:
        pytest.skip(f"needs {cc!r} targeting x86")
    version = native._compiler_version(cc)
    if "gcc" not in version.lower() and "free software foundation" not in version.lower():
        pytest.skip(f"{cc!r} is not GCC: the -march names above are GCC's")
    return cc


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
@pytest.mark.parametrize("march", X86_CLASSES.values(), ids=X86_CLASSES.keys())
def test_the_sources_compile_for_every_x86_class(x86_gcc, recipe, march):
    # The recipe's own flags with -march=native replaced (its flags come after, as UCM_CFLAGS's do), no output
    flags = [f for f in recipe.flags if f not in ("-march=native", "-shared", "-fPIC")]
    cmd = [x86_gcc, "-fsyntax-only", *flags, *march, *(str(s) for s in recipe.sources)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"`{' '.join(cmd)}` failed:\n{done.stderr[-3000:]}"
