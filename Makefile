# edgefuse: `make run` runs the main job, `make test` runs the tests. Both set up
# everything they need first (a virtualenv in .venv, CPU torch, edgefuse, models).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The offline data mirror: ../shared/data when it exists, else datasets loads from the hub.
EDGEFUSE_DATA_MIRROR ?= $(if $(wildcard ../shared/data/dolly),$(abspath ../shared/data),)
export EDGEFUSE_DATA_MIRROR
# Hydra overrides for `make run`, e.g. make run ARGS="experiment=smoke training.lr=1e-4"
ARGS ?=

.PHONY: install run smoke test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: 2.13.0 is a local CPU build here; other specs pull CUDA wheels.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

run: install
	$(BIN)/edgefuse run $(ARGS)

smoke: install
	$(BIN)/edgefuse run experiment=smoke $(ARGS)

test: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -rs

test-fast: install
	$(BIN)/python -m pytest -q -m "not integration"

bench: install
	$(BIN)/python bench/bench_main.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
