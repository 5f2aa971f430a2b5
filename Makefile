# Set-up and the project's main jobs. Every target creates the venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test typecheck bench bench-all gpu-check clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt pyproject.toml plugins/*/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

## The whole test suite (what CI runs). GPU tests skip without CUDA.
test: $(STAMP)
	$(BIN)/python -m pytest

## Static types of the library, the plugins and the benchmarks (CI runs it after the tests).
typecheck: $(STAMP)
	$(BIN)/python -m mypy

## The main job: a 1 GiB refit, 1 policy -> 2 rollout processes over gloo_cpu, checked bit-exact.
bench: $(STAMP)
	$(BIN)/ckpt-engine bench --size 1GiB

## Side-by-side benchmarks (results under benchmarks/results/).
bench-all: $(STAMP)
	$(BIN)/python -m benchmarks.run

## On a machine with a CUDA GPU: every gpu-marked test, and the GPU benchmarks.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info plugins/*/*.egg-info
