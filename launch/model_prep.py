"""`--model` spec → a ready model folder, before any server starts: the router takes a folder, never a spec.

Torch-free: resolving an alias or a .gguf that is not converted yet runs the conversion in a child process (it
needs torch), whose progress (transformers' per-tensor bar and our stage lines) goes to this process's stderr.
A spec that names nothing (a typo, a missing path) is a `BadModel` with one line saying why.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from protocol import defaults

# The child prints the folder, or one line "error: ..." (no traceback) for a spec that names no usable model.
_RESOLVE = """
import sys
from engine.model_source import resolve_model_dir
try:
    print(resolve_model_dir(sys.argv[1]))
except (FileNotFoundError, ValueError) as e:
    print("error:", e)
    sys.exit(2)
"""


class BadModel(ValueError):
    """The spec names no usable model; the message is one line for the user."""


def check_model_spec(spec: str) -> None:
    """Fail fast, without converting anything: an alias must be known, a path must exist and be a folder or a
    .gguf file. Folder contents are checked by `model_folder`."""
    from engine.model_source import ALIASES

    if spec in ALIASES:
        return
    path = Path(spec).expanduser()
    if not spec:
        raise BadModel("empty --model")
    if not path.exists():
        raise BadModel(
            f"model {spec!r} not found: not a known alias ({', '.join(sorted(ALIASES))}) and no such file or "
            f"folder {path}"
        )
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise BadModel(f"model {spec!r}: {path} is a file but not a .gguf (pass a Hugging Face folder or a .gguf)")


def model_folder(spec: str) -> Path:
    """The Hugging Face folder for `spec`, converting a GGUF once (cached). BadModel when it cannot be had."""
    check_model_spec(spec)
    # Resolved in a child: converting imports torch, and an already converted model costs one short process.
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, spec], stdout=subprocess.PIPE, text=True, check=False)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode == 2 and last.startswith("error: "):
        raise BadModel(last.removeprefix("error: "))
    if proc.returncode != 0:
        raise BadModel(f"model {spec!r} could not be prepared (exit {proc.returncode}; its output is above)")
    return Path(last)


def router_main(argv: list[str]) -> int:
    """`ucm-serve router`: the router takes a model folder; a spec given here (alias, .gguf) is resolved first and
    stays the served name, so `ucm-serve router --model smollm2-135m` serves "smollm2-135m"."""
    from router import cli

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=defaults.MODEL)
    p.add_argument("--served-model-name", default=None)
    known, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        return cli.main(argv)
    try:
        folder = model_folder(known.model)
    except BadModel as e:
        print(f"ucm-serve router: error: {e}", file=sys.stderr, flush=True)
        return 2
    return cli.main([*rest, "--model", str(folder), "--served-model-name", known.served_model_name or known.model])
