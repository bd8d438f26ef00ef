# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv on first use and install the project into it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean venv

venv: $(STAMP)

# torch first, pinned to the CPU wheel on disk: a bare `torch` requirement would
# pull a multi-GB CUDA build. Everything else then sees torch already satisfied.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check streamflow storage workers tests
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/streamflow run configs/quickstart.yaml

lint: $(STAMP)
	$(BIN)/ruff check streamflow storage workers tests

clean:
	rm -rf $(VENV) build *.egg-info
