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
# pytest-xdist workers of `make test`, `test-quick` and `test-openmpi`; each takes whole test
# modules (--dist loadfile: a module's fixtures, such as test_slurm.py's cluster, are set up
# once), the longest first (tests/conftest.py). 3 on the 2-core CI machine: most tests wait on
# subprocesses, timeouts and peers, so a worker keeps well under a core busy (the suite was
# written to pass under load: it passed whole at a load average of 12). TEST_WORKERS=0: one
# process.
TEST_WORKERS ?= 3
XDIST  := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: demo test test-quick test-openmpi openmpi-venv lint bench clean protos

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))  # first: see README
	$(BIN)/pip install -q -e '.[dev,mpich]'
	touch $(STAMP)

# The sources byte-compiled before the suite or the demo runs: where PYTHONDONTWRITEBYTECODE is
# set, every process the suite starts (about a thousand) compiled each module it imported
# again, about 0.4 s of CPU per process importing the service, the loader and the trainer.
PYC = $(BIN)/python -m compileall -q -j 0 datastore trainer staging benchmarks tests > /dev/null

demo: $(STAMP)
	$(PYC)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m datastore.demo

test: $(STAMP)
	$(PYC)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest $(XDIST)

# The suite without the tests marked slow or mpi (real mpiexec jobs): a quick check while working.
test-quick: $(STAMP)
	$(PYC)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest $(XDIST) -m "not slow and not mpi"

# The MPI tests that matter, one or two per mechanism (the exchange, staging, the trainer grid,
# the ranks' agreement and timeouts, MPI-peered services, check_mpi, a launcher of another
# MPI) again under a site's Open MPI: a second venv, $(OPENMPI_VENV), holds
# mpi4py built from source with OPENMPI_MPICC (once; -O0: built for the tests in about a
# minute; CFLAGS puts Open MPI's mpi.h before the mpich wheel's in $(VENV)/include) and sees the
# rest of $(VENV) after it; its python runs the tests, so every child process (sys.executable)
# loads Open MPI whatever PYTHONPATH a test sets, and Open MPI's mpiexec starts every job
# (tests/helpers.py adds what it needs as root and on few cores). Skipped, exit 0, where
# OPENMPI_MPICC is not Open MPI's.
OPENMPI_MPICC ?= /usr/bin/mpicc
OPENMPI_VENV  := $(VENV)/openmpi
OPENMPI_TESTS := tests/test_site_mpi.py tests/test_loader_traps_mpi.py \
    tests/test_loader_stops_mpi.py::test_6_a_peer_slow_to_send_gives_a_timeout_and_a_clean_exit \
    tests/test_loader_stops_mpi.py::test_6_a_peer_that_stops_answering_gives_a_timeout_within_seconds \
    tests/test_stage_mpi.py tests/test_loader.py::test_spatial_blocks_over_mpi_exchange \
    tests/test_world.py tests/test_peer_tags.py tests/test_peer_lent.py tests/test_service_nodes.py \
    tests/test_trainer_hybrid.py::test_grid_losses_follow_one_process \
    tests/test_trainer_hybrid.py::test_the_data_ranks_share_the_dataset_through_the_exchange \
    tests/test_deploy.py::test_check_mpi_reports_the_library_loaded_here
SITE_PACKAGES = $(1)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))'

$(OPENMPI_VENV)/.built: $(STAMP)
	rm -rf $(OPENMPI_VENV)
	$(BIN)/python -m venv --without-pip $(OPENMPI_VENV)
	MPICC=$(OPENMPI_MPICC) CFLAGS="$$($(OPENMPI_MPICC) -showme:compile) -O0 -g0" \
	    $(BIN)/pip install -q --no-cache-dir --no-deps --no-binary=mpi4py \
	    --target "$$($(call SITE_PACKAGES,$(OPENMPI_VENV)))" \
	    "mpi4py==$$($(BIN)/python -c 'import mpi4py; print(mpi4py.__version__)')"
	echo "import site; site.addsitedir('$$($(call SITE_PACKAGES,$(CURDIR)/$(VENV)))')" \
	    > "$$($(call SITE_PACKAGES,$(OPENMPI_VENV)))/zz-datastore-venv.pth"
	touch $@

IS_OPENMPI = $(OPENMPI_MPICC) -showme:version 2>/dev/null | grep -q "Open MPI"

# Open MPI's venv alone (.ci/run builds it beside `make test`); nothing where there is no Open MPI
openmpi-venv: $(STAMP)
	@if $(IS_OPENMPI); then $(MAKE) --no-print-directory $(OPENMPI_VENV)/.built; fi

test-openmpi: $(STAMP)
	@if ! $(IS_OPENMPI); then \
	    echo "test-openmpi: skipped: $(OPENMPI_MPICC) is not Open MPI's (Debian: apt-get install openmpi-bin libopenmpi-dev)"; \
	    exit 0; \
	fi; \
	$(MAKE) --no-print-directory $(OPENMPI_VENV)/.built && \
	$(PYC) && \
	DATASTORE_TEST_MPIEXEC=$(dir $(OPENMPI_MPICC))mpiexec DATASTORE_TEST_MPI4PY=source \
	PATH=$(dir $(OPENMPI_MPICC)):$(CURDIR)/$(BIN):$$PATH \
	    $(OPENMPI_VENV)/bin/python -m pytest $(XDIST) -m mpi $(OPENMPI_TESTS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,mpich,bench]'
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
