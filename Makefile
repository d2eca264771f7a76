# The set-up commands of the README: `make demo`, `make test`, `make test-quick`; `make bench`
# runs every benchmark and regenerates the generated blocks of docs/benchmarks.md and README.md
# and the plots
# (`make bench BENCH_ARGS=--quick` for smoke-test sizes, `BENCH_ARGS=--skip-run` to redraw only).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
BENCH_ARGS ?=
TORCH_INDEX ?=   # e.g. https://download.pytorch.org/whl/cpu: where torch comes from (default: pip's)

.PHONY: demo test test-quick lint bench clean protos

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))  # first: see README
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m datastore.demo

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest

# The suite without the tests marked slow or mpi (real mpiexec jobs): a quick check while working.
test-quick: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -m "not slow and not mpi"

lint: $(STAMP)
	$(BIN)/ruff check .

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python benchmarks/report.py $(BENCH_ARGS)

# The generated code of protos/datastore/v1/*.proto, into datastore/service/_pb/v1/ (committed).
# The include path maps protos/datastore/v1 to the package datastore.service._pb.v1, so the
# generated imports are absolute within this package; tests/test_service_basic.py regenerates
# into a temporary PROTO_OUT and fails if the committed files differ.
PROTO_OUT ?= .
protos:
	$(BIN)/python -m grpc_tools.protoc \
	    --proto_path=datastore/service/_pb/v1=protos/datastore/v1 \
	    --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
	    protos/datastore/v1/datastore.proto

clean:
	rm -rf $(VENV) build *.egg-info
