# Quick start: `make train` runs the main job, `make test` runs the whole suite.
# Each target creates .venv and installs what it needs on first use (torch 2.13.0 CPU build explicitly).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test lint bench

# torchtitan's own Llama 3 (tests/parallel/test_torchtitan.py) is kept out of the dev extra's resolution: torchtitan
# 0.3.0 pins datasets<4.8, which would downgrade the datasets and huggingface_hub every other test runs against. So it
# goes in without its dependencies, after only what importing its models needs: triton (its expert-parallel kernels,
# imported even on the CPU), tyro (its config manager) and spmd_types (its ParallelDims). `pip check` then reports
# torchtitan's other requirements (einops, torch-checkpointing, datasets<4.8), which importing its models never needs.
# The install runs again when this file changes, so an existing venv gets these too.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 numpy
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q triton==3.9.0 tyro==1.0.17 spmd_types==0.2.3
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0
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
