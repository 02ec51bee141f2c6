# The README's two commands: `make quickstart` (the main job on the built-in corpus) and
# `make test`. Both create .venv on first use. torch is pinned here to the CPU wheel that CI
# installs from local disk; the package itself accepts a range (see pyproject.toml).
PYTHON ?= python3
VENV := .venv
TORCH_PIN ?= torch==2.13.0
# test files run on this many pytest-xdist workers, a file to a worker (its module fixtures run once);
# much of the suite waits on process start-up and gloo, so 2 workers suit even a 2-core machine
TEST_WORKERS ?= 2

.PHONY: setup quickstart test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet "$(TORCH_PIN)"
	$(VENV)/bin/pip install --quiet -e ".[test]"
	touch $@

quickstart: setup
	$(VENV)/bin/ultratron quickstart

test: setup
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
