# Two commands on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU wheel on this machine's disk; a GPU user runs e.g.
#   make setup TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
CONFIG  ?= configs/local.yaml
METRICS_PORT ?= 8080
# The image cluster/kuberay-rayservice.yaml names: specserve:<pyproject version>
IMAGE   ?= specserve:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: setup setup-run run test test-unit image clean

# Two stamps: .ready-run = what serving needs (`pip install -e .`), for `make run`;
# .ready = that plus the test extras (`.[test]`), for `make test` and development (`make setup`).
$(BIN)/.ready-run: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	touch $@

$(BIN)/.ready: $(BIN)/.ready-run
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup-run: $(BIN)/.ready-run

setup: $(BIN)/.ready

# Starts Ray with its dashboard, which writes /tmp/ray/prom_metrics_service_discovery.json
# (cluster/prometheus/prometheus.yml reads it); metrics on 127.0.0.1:$(METRICS_PORT)/metrics.
run: setup-run
	$(BIN)/python -m deployments.run_local --config $(CONFIG) --metrics-export-port $(METRICS_PORT)

test: setup
	$(BIN)/python -m pytest -q

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

# CUDA torch + this package on Ray's GPU image (Dockerfile); needs a Docker daemon.
image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) .pytest_cache
