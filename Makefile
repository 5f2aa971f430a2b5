# Set-up and the project's main jobs. Every target creates the venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv lock test lint format typecheck bench bench-all gpu-check clean

venv: $(STAMP)

$(STAMP): requirements-lock.txt requirements-dev.txt requirements-nodeps.txt pyproject.toml plugins/*/pyproject.toml integrations/*/pyproject.toml
	bash scripts/venv.sh build $(PYTHON) $(VENV)
	touch $(STAMP)

## Re-pin requirements-lock.txt (what `venv` installs) after changing requirements-dev.txt or a
## pyproject.toml's dependencies; tests/repository/test_lock.py fails on a lock that no longer covers them.
lock:
	bash scripts/venv.sh lock $(PYTHON)

## The whole test suite (what CI runs), with its 25 slowest steps listed. GPU tests skip
## without CUDA. Test modules run side by side in TEST_WORKERS processes (pytest-xdist; a
## module's tests stay in one process, sharing its fixtures), then the tests marked `alone`
## (latency bounds, which need the machine to themselves) run by themselves. Three workers on
## 2 cores: the vLLM tests wait much of their time (servers starting, peers, deadlines), and
## with the vllm serve tests pytest took 809 s against 987 s with two (one machine, one after
## the other; with 2 the cores were busy 58% of the time).
## Scopes go out in collection order (--no-loadscope-reorder; xdist's default sends the
## scopes with most tests first), which puts vLLM's minutes-long ones first: see
## integrations/vllm/tests/conftest.py. Left last, they ran alone for two minutes.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not alone" --durations=25
	$(BIN)/python -m pytest -m alone --durations=5

## Lint and format check (ruff, configured in pyproject.toml; CI runs it after the tests).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## Apply the formatter and the safe lint fixes.
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## Static types of the library, plugins, benchmarks and every test folder (CI runs it too).
typecheck: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/typecheck.sh

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
	rm -rf $(VENV) build *.egg-info plugins/*/*.egg-info integrations/*/*.egg-info
