# Quick start: `make train` runs the main job, `make test` runs the whole suite.
# Each target creates .venv and installs what it needs on first use (torch 2.13.0 CPU build explicitly).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 numpy
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/plait train

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests bench

# Two pytest workers, each taking whole test files (module fixtures and spawned groups stay in one worker): most
# tests wait on processes, timeouts and rendezvous, and one worker alone kept 2 cores ~35% busy. Tests that compare
# the wall time of runs (marked timing) run after them, alone: a neighbour's work would decide their outcome.
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30 -m "not timing"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --durations=5 -m timing

bench: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) bench/dp.py
