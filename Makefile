# Two commands on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU wheel on this machine's disk; a GPU user runs e.g.
#   make setup TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
CONFIG  ?= configs/local.yaml

.PHONY: setup run test test-unit clean

$(BIN)/.ready: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/.ready

run: setup
	$(BIN)/python -m deployments.run_local --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest -q

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache
