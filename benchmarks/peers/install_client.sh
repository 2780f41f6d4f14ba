#!/usr/bin/env bash
# A client in its own venv, on demand (benchmarks/clients.py, benchmarks/capture_clients.py), at the version the
# clients table and the request fixtures were taken with. Idempotent; about a minute from scratch. Prints the
# client's command (its venv's python for the libraries).
#
#   UCM_PEERS_DIR  (default ~/.cache/ucm-peers)
set -euo pipefail
NAME=$1
declare -A PIN=([aiperf]=aiperf==0.13.0 [guidellm]=guidellm==0.8.1 [litellm]=litellm==1.110.2
                [langchain]=langchain-openai==1.8.1)
declare -A CMD=([aiperf]=aiperf [guidellm]=guidellm [litellm]=python [langchain]=python)
[ -n "${PIN[$NAME]:-}" ] || { echo "unknown client $NAME (${!PIN[*]})" >&2; exit 2; }
DIR=${UCM_PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ucm-peers}
VENV="$DIR/$NAME-venv"
DIST=${PIN[$NAME]%%==*}
VERSION=${PIN[$NAME]##*==}
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$DIST') != '$VERSION')" 2>/dev/null; then
  echo "[install_client] ${PIN[$NAME]} into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "${PIN[$NAME]}" >&2
fi
echo "$VENV/bin/${CMD[$NAME]}"
