# Two commands for a newcomer on a fresh machine: `make train` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install train test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel lies on disk here (a plain `torch` would pull a CUDA build).
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

train: install
	$(BIN)/marsrl train

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/store_bench.py

clean:
	rm -rf $(VENV) marsrl mlflow.db mlruns benchmarks/results
