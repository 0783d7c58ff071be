# hyla — two commands on a fresh machine: `make test` and `make serve`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: test test-fast serve venv clean bench

venv: $(STAMP)

# Create the virtual env (with access to a system torch, e.g. the CUDA build on a GPU machine),
# install torch only if none is importable, then the package: `serve` needs only its runtime
# dependencies, `test` adds the dev extras (pytest, transformers, ...).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $(STAMP)
	@echo "hyla is installed in $(VENV): run $(VENV)/bin/hyla, or 'source $(VENV)/bin/activate' to put hyla on the PATH"

$(DEV_STAMP): $(STAMP)
	$(PIP) install -q -e ".[dev]"
	touch $(DEV_STAMP)

# One pytest worker per core (pytest-xdist; each runs one intra-op thread, tests/conftest.py): the
# tests are small single-threaded models, so two workers on 2 cores take ~0.65x the time of one.
# `make test PYTEST_WORKERS=0` runs them in this process (for pdb, or a single test).
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist worksteal

test: $(DEV_STAMP)
	$(PY) -m pytest -q --durations=20 $(XDIST) $(PYTEST_ARGS)

test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

serve: $(STAMP)
	$(PY) -m hyla.cli serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
