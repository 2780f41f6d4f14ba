"""`ucm-serve generate` streams text to stdout; bad input is a clear error, not a traceback."""

from __future__ import annotations

from launch.cli import main
from tests.engine_helpers import single_thread


def test_generate_cli_streams(capsys):
    with single_thread():
        rc = main(
            [
                "generate",
                "The capital of France is",
                "--max-tokens",
                "4",
                "--dtype",
                "float32",
                "--kv-cache-memory",
                "16MiB",
            ]
        )
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_cli_bad_args(capsys):
    assert main(["generate", "hi", "--top-p", "3", "--dtype", "float32"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_engine_exports_are_lazy():
    import subprocess
    import sys

    code = (
        "import sys, engine, engine.tokenizer\n"
        "from engine import SamplingParams, EngineConfig\n"
        "assert 'torch' not in sys.modules, 'import engine pulled in torch'\n"
        "from engine import LLM, EngineCore\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
