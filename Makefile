# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0        # CPU wheel first: pip must never pull a CUDA build
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m datastore.demo

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python benchmarks/stage.py

clean:
	rm -rf $(VENV) build *.egg-info
